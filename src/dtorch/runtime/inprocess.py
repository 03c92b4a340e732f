"""The in-process backend: every device of a mesh lives in this process.

Storage of one DTensor takes one of two forms:

* grid: when every device holds a block of the same shape and the mesh maps to one torch device,
  the blocks are stacked into one tensor ``[*grid_shape, *local_shape]``. ``grid_shape`` has the
  mesh size on mesh dims where devices differ (Shard, Partial) and 1 where they agree (Replicate),
  so replicas are stored once. A kernel then runs once for all simulated devices, and collectives
  are reshapes and reductions of that tensor.
* blocks: a list of per-device tensors in mesh order (uneven shards, or one GPU per device).
  Replicas may share one tensor object: blocks are never written in place.

Both forms give every device exactly the block ``DTensorSpec.local_box`` defines.
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import numpy as np
import torch

from .. import commlog
from ..errors import RuntimeBackendError
from ..placement import Partial, Replicate, Shard
from ..redistribute.planner import Step
from ..spec import DTensorSpec, shard_range
from .devices import DeviceConfig, read_device_config, torch_devices
from .interface import Runtime
from .kernels import Kernel


class Shards:
    __slots__ = ("grid", "blocks", "__weakref__")  # weakly referenced: Runtime.observe (memory accounting)

    def __init__(self, grid: torch.Tensor | None = None, blocks: list | None = None):
        self.grid = grid
        self.blocks = blocks

    def __repr__(self):
        if self.grid is not None:
            return f"Shards(grid={tuple(self.grid.shape)})"
        return f"Shards(blocks={[tuple(b.shape) for b in self.blocks]})"


def _reduce_dim(op: str, x: torch.Tensor, d: int) -> torch.Tensor:
    """Reduce partial terms along dim ``d`` (kept, size 1), staying in ``x``'s dtype like a collective."""
    if op == "max":
        return x.amax(d, keepdim=True)
    if op == "min":
        return x.amin(d, keepdim=True)
    if op == "avg" and (x.is_floating_point() or x.is_complex()):
        return x.mean(d, keepdim=True)
    if op == "avg":  # integers and bools: floor of the mean
        return x.sum(d, keepdim=True).div(x.shape[d], rounding_mode="floor").to(x.dtype)
    return x.sum(d, keepdim=True, dtype=x.dtype)


_REDUCE = {op: (lambda x, d, op=op: _reduce_dim(op, x, d)) for op in ("sum", "avg", "max", "min")}


def _reduce_list(op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    if len(tensors) == 1:
        return tensors[0]
    return _reduce_dim(op, torch.stack(tensors), 0).squeeze(0)


@lru_cache(maxsize=65536)
def spec_total_bytes(spec: DTensorSpec) -> int:
    """Sum over devices of their block sizes in bytes."""
    if spec.is_even():
        n = 1
        for s in spec.even_local_shape():
            n *= s
        return n * spec.dtype.itemsize * spec.mesh.size()
    total = 0
    for c in spec.mesh.coordinates():
        n = 1
        for s in spec.local_shape(c):
            n *= s
        total += n
    return total * spec.dtype.itemsize


@lru_cache(maxsize=65536)
def per_device_bytes(spec: DTensorSpec) -> np.ndarray:
    """Bytes each device holds for ``spec``, in mesh order."""
    item = spec.dtype.itemsize
    if spec.is_even():
        return np.full(spec.mesh.size(), int(np.prod(spec.even_local_shape(), dtype=np.int64)) * item, dtype=np.int64)
    return np.array([int(np.prod(spec.local_shape(c), dtype=np.int64)) * item for c in spec.mesh.coordinates()], dtype=np.int64)


# ------------------------------------------------------------------------------------------------
# grid form: global <-> stacked blocks (even specs only)


def _shard_factors(spec: DTensorSpec):
    """For each tensor dim, the mesh dims sharding it (outer to inner) and its local size."""
    M = spec.mesh.shape
    local = list(spec.shape)
    factors = [[] for _ in spec.shape]
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            factors[p.dim].append(i)
            local[p.dim] //= M[i]
    return factors, local


def global_to_grid(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    M = spec.mesh.shape
    factors, local = _shard_factors(spec)
    split_shape, factor_pos, local_pos = [], {}, []
    for k in range(len(spec.shape)):
        for i in factors[k]:
            factor_pos[i] = len(split_shape)
            split_shape.append(M[i])
        local_pos.append(len(split_shape))
        split_shape.append(local[k])
    x = full.reshape(split_shape)
    shard_dims = sorted(factor_pos)
    x = x.permute([factor_pos[i] for i in shard_dims] + local_pos)
    x = x.reshape(tuple(M[i] if isinstance(p, Shard) else 1 for i, p in enumerate(spec.placements)) + tuple(local))
    for i, p in enumerate(spec.placements):
        if isinstance(p, Partial):
            x = _to_partial_grid(x, i, M[i], p.reduce_op)
    return x


def grid_to_global(x: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    M = spec.mesh.shape
    for i, p in enumerate(spec.placements):
        if isinstance(p, Partial):
            x = _REDUCE[p.reduce_op](x, i)
        elif isinstance(p, Replicate) and x.shape[i] != 1:
            x = x.narrow(i, 0, 1)
    factors, local = _shard_factors(spec)
    shard_dims = [i for i, p in enumerate(spec.placements) if isinstance(p, Shard)]
    # drop non-shard grid dims, then move each mesh factor next to its tensor dim
    x = x.reshape(tuple(M[i] for i in shard_dims) + tuple(local))
    pos_of = {i: n for n, i in enumerate(shard_dims)}
    ns = len(shard_dims)
    perm = []
    for k in range(len(spec.shape)):
        perm += [pos_of[i] for i in factors[k]]
        perm.append(ns + k)
    return x.permute(perm).reshape(spec.shape)


def _to_partial_grid(x: torch.Tensor, i: int, m: int, op: str) -> torch.Tensor:
    """Replicated (size 1 on grid dim i) -> Partial terms whose reduction is the value."""
    if op == "sum":
        if m == 1:
            return x
        zeros = torch.zeros_like(x).expand(*x.shape[:i], m - 1, *x.shape[i + 1:])
        return torch.cat([x, zeros], dim=i)
    return x.expand(*x.shape[:i], m, *x.shape[i + 1:])


def _grid_gather(x: torch.Tensor, i: int, k: int, nd: int) -> torch.Tensor:
    pos = nd + k
    x = x.movedim(i, pos - 1)
    s = list(x.shape)
    x = x.reshape(s[: pos - 1] + [s[pos - 1] * s[pos]] + s[pos + 1:])
    return x.unsqueeze(i)


def _grid_slice(x: torch.Tensor, i: int, k: int, nd: int, m: int) -> torch.Tensor:
    x = x.squeeze(i) if x.shape[i] == 1 else x.narrow(i, 0, 1).squeeze(i)
    pos = nd - 1 + k
    s = list(x.shape)
    x = x.reshape(s[:pos] + [m, s[pos] // m] + s[pos + 1:])
    return x.movedim(pos, i)


# ------------------------------------------------------------------------------------------------


class InProcessRuntime(Runtime):
    name = "inprocess"
    handles_in_process = True

    def __init__(self, device_config: DeviceConfig | None = None):
        self.config = device_config or read_device_config()
        self._exec_cache: dict = {}

    # -- devices ---------------------------------------------------------------------------------
    def devices(self, mesh) -> tuple[torch.device, ...]:
        return torch_devices(mesh, self.config)

    def grid_device(self, mesh) -> torch.device | None:
        """The one torch device all of ``mesh`` runs on, else None."""
        return _grid_device(torch_devices(mesh, self.config))

    def use_grid(self, spec: DTensorSpec) -> bool:
        return spec.is_even() and self.grid_device(spec.mesh) is not None

    # -- conversions -----------------------------------------------------------------------------
    def as_grid(self, h: Shards, spec: DTensorSpec) -> torch.Tensor:
        if h.grid is not None:
            return h.grid
        g = spec.grid_shape()
        coords = spec.mesh.coordinates()
        flat = {c: n for n, c in enumerate(coords)}
        picks = []
        for c in np.ndindex(*g):
            picks.append(h.blocks[flat[tuple(c)]])  # c has 0 on replicated dims
        x = torch.stack(picks) if picks else torch.empty(0)
        return x.reshape(tuple(g) + spec.even_local_shape())

    def local_blocks(self, h: Shards, spec: DTensorSpec) -> list[torch.Tensor]:
        if h.blocks is not None:
            return h.blocks
        x = h.grid
        g = x.shape[: spec.mesh.ndim]
        return [x[tuple(c if n > 1 else 0 for c, n in zip(coord, g))] for coord in spec.mesh.coordinates()]

    def _make(self, spec: DTensorSpec, grid=None, blocks=None) -> Shards:
        """Store a result in the form its spec calls for."""
        if self.use_grid(spec):
            if grid is None:
                return Shards(grid=self.as_grid(Shards(blocks=blocks), spec))
            return Shards(grid=grid)
        if blocks is None:
            blocks = self.local_blocks(Shards(grid=grid), spec)
        return Shards(blocks=blocks)

    # -- placement of global values ---------------------------------------------------------------
    def from_global(self, full: torch.Tensor, spec: DTensorSpec) -> Shards:
        dev = self.grid_device(spec.mesh)
        if dev is not None and spec.is_even():
            return Shards(grid=global_to_grid(full.to(dev), spec))
        devs = self.devices(spec.mesh)
        blocks = []
        for n, coord in enumerate(spec.mesh.coordinates()):
            box = spec.local_box(coord)
            b = full[tuple(slice(o, o + s) for o, s in box)]
            zero = any(isinstance(p, Partial) and p.reduce_op == "sum" and coord[i] != 0
                       for i, p in enumerate(spec.placements))
            b = torch.zeros_like(b) if zero else b
            blocks.append(b.to(devs[n]))
        return Shards(blocks=blocks)

    def from_blocks(self, blocks, spec: DTensorSpec) -> Shards:
        devs = self.devices(spec.mesh)
        return self._make(spec, blocks=[b.detach().to(d) for b, d in zip(blocks, devs)])

    def to_global(self, h: Shards, spec: DTensorSpec) -> torch.Tensor:
        if h.grid is not None:
            out = grid_to_global(h.grid, spec)
            # reshapes of the grid may be views of it: the caller gets a tensor of its own
            return out.clone() if out.untyped_storage().data_ptr() == h.grid.untyped_storage().data_ptr() else out
        # Partial terms reduce in mesh-dim order, exactly as the planner's all_reduce steps (and the
        # grid form) do: with mixed reduce ops the order is part of the meaning.
        blocks = h.blocks
        for i in spec.partial_dims():
            after = spec.with_placements(spec.placements[:i] + (Replicate(),) + spec.placements[i + 1:])
            blocks = self._blocks_step(Step("all_reduce", i, spec.placements[i], Replicate()), blocks, spec, after)
            spec = after
        out_dev = self.devices(spec.mesh)[0]
        out = torch.empty(spec.shape, dtype=spec.dtype, device=out_dev)
        for block, coord in zip(blocks, spec.mesh.coordinates()):
            if all(c == 0 or isinstance(p, Shard) for c, p in zip(coord, spec.placements)):  # one replica each
                out[tuple(slice(o, o + n) for o, n in spec.local_box(coord))] = block.to(out_dev)
        return out

    # -- local kernels ---------------------------------------------------------------------------
    def run_local(self, kernel: Kernel, inputs, in_specs, out_specs, kwargs, device_args=None):
        key = (kernel.name, tuple(in_specs), tuple(out_specs))
        ex = self._exec_cache.get(key)
        if ex is None:
            ex = self._exec_cache[key] = _ExecPlan(self, kernel, in_specs, out_specs)
        return ex.run(self, inputs, kwargs, device_args)

    def grid_direct(self, kernel: Kernel, in_specs, out_specs) -> bool:
        """Can callers run this kernel straight on the grid tensors (no reshapes, no output fixes)?

        True once a first run showed the outputs come out in exactly their specs' grid shapes.
        """
        ex = self._exec_cache.get((kernel.name, tuple(in_specs), tuple(out_specs)))
        return bool(ex is not None and ex.grid and ex.exact and ex.in_reshape is None and not ex.wants_lead)

    # -- redistribution ---------------------------------------------------------------------------
    def redistribute_step(self, step, h: Shards, before: DTensorSpec, after: DTensorSpec) -> Shards:
        if step.kind == "move":
            return self._move(step, h, before, after)
        mesh = before.mesh
        i = step.mesh_dim
        label = mesh.dim_label(i)
        if step.is_collective:
            commlog.record(step.kind, label, spec_total_bytes(before), mesh.device_ids)
        grid = self.use_grid(before) and self.use_grid(after)
        if grid:
            x = self.as_grid(h, before)
            nd = mesh.ndim
            m = mesh.shape[i]
            kind = step.kind
            if kind == "all_gather":
                x = _grid_gather(x, i, step.src.dim, nd)
            elif kind == "all_reduce":
                x = _REDUCE[step.src.reduce_op](x, i)
            elif kind == "reduce_scatter":
                x = _grid_slice(_REDUCE[step.src.reduce_op](x, i), i, step.dst.dim, nd, m)
            elif kind == "all_to_all":
                x = _grid_slice(_grid_gather(x, i, step.src.dim, nd), i, step.dst.dim, nd, m)
            elif kind == "slice":
                x = _grid_slice(x, i, step.dst.dim, nd, m)
            elif kind == "to_partial":
                x = _to_partial_grid(x, i, m, step.dst.reduce_op)
            else:
                raise RuntimeBackendError(f"unknown redistribute step {step}")
            return Shards(grid=x)
        return self._make(after, blocks=self._blocks_step(step, self.local_blocks(h, before), before, after))

    def _blocks_step(self, step, blocks, before: DTensorSpec, after: DTensorSpec) -> list:
        mesh = before.mesh
        i = step.mesh_dim
        m = mesh.shape[i]
        devs = self.devices(mesh)
        coords = mesh.coordinates()
        out = list(blocks)
        stride = int(np.prod(mesh.shape[i + 1:], dtype=np.int64))
        for n, coord in enumerate(coords):
            if coord[i] != 0:
                continue
            members = [n + j * stride for j in range(m)]
            dev = devs[n]
            group = [blocks[g].to(dev) for g in members]
            kind = step.kind
            if kind == "all_gather":
                whole = torch.cat(group, dim=step.src.dim)
                new = [whole] * m
            elif kind == "all_reduce":
                whole = _reduce_list(step.src.reduce_op, group)
                new = [whole] * m
            elif kind == "reduce_scatter":
                whole = _reduce_list(step.src.reduce_op, group)
                new = [cut_shard(whole, step.dst.dim, m, j) for j in range(m)]
            elif kind == "all_to_all":
                whole = torch.cat(group, dim=step.src.dim)
                new = [cut_shard(whole, step.dst.dim, m, j) for j in range(m)]
            elif kind == "slice":
                new = [cut_shard(group[j], step.dst.dim, m, j) for j in range(m)]
            elif kind == "to_partial":
                zero_rest = step.dst.reduce_op == "sum"
                new = [group[j] if (j == 0 or not zero_rest) else torch.zeros_like(group[j]) for j in range(m)]
            else:
                raise RuntimeBackendError(f"unknown redistribute step {step}")
            for j, g in enumerate(members):
                out[g] = new[j].to(devs[g])
        return out

    def ring_shift(self, h: Shards, spec: DTensorSpec, mesh_dim: int, shift: int = 1) -> Shards:
        mesh = spec.mesh
        commlog.record("send_recv", mesh.dim_label(mesh_dim), spec_total_bytes(spec), mesh.device_ids)
        if h.grid is not None:
            return Shards(grid=torch.roll(h.grid, shifts=shift, dims=mesh_dim))
        m = mesh.shape[mesh_dim]
        stride = int(np.prod(mesh.shape[mesh_dim + 1:], dtype=np.int64))
        devs = self.devices(mesh)
        out = [None] * len(h.blocks)
        for n, coord in enumerate(mesh.coordinates()):
            src = n + (((coord[mesh_dim] - shift) % m) - coord[mesh_dim]) * stride
            out[n] = h.blocks[src].to(devs[n])
        return Shards(blocks=out)

    def _move(self, step, h: Shards, before: DTensorSpec, after: DTensorSpec) -> Shards:
        commlog.record("send_recv", before.mesh.parent_dim_between(after.mesh), spec_total_bytes(after),
                       tuple(before.mesh.device_ids) + tuple(after.mesh.device_ids))
        if step.same_layout:
            dst_dev = self.grid_device(after.mesh)
            if h.grid is not None and dst_dev is not None:
                return Shards(grid=h.grid.to(dst_dev))
            devs = self.devices(after.mesh)
            return self._make(after, blocks=[b.to(d) for b, d in zip(self.local_blocks(h, before), devs)])
        return self.from_global(self.to_global(h, before), after)


def cut_shard(x: torch.Tensor, dim: int, m: int, j: int) -> torch.Tensor:
    """Shard ``j`` of ``m`` of ``x`` along ``dim`` (torch.chunk sizes; may be empty)."""
    off, n = shard_range(x.shape[dim], m, j)
    return x.narrow(dim, off, n)


@lru_cache(maxsize=4096)
def _grid_device(devs: tuple) -> torch.device | None:
    first = devs[0]
    return first if all(d == first for d in devs) else None


class _ExecPlan:
    """How to run one kernel on one combination of input/output specs (cached)."""

    __slots__ = ("kernel", "grid", "nd", "in_reshape", "out_fix", "mesh", "coords", "wants_lead", "grid_dev",
                 "in_specs", "out_specs", "exact", "grid_args")

    def __init__(self, rt: InProcessRuntime, kernel: Kernel, in_specs, out_specs):
        self.kernel = kernel
        self.exact = None  # outputs needed no reshaping on every run so far (grid mode)
        self.grid_args = (None, None)  # (the plan's device_args, as grid-shaped tensors)
        self.in_specs = tuple(in_specs)
        self.out_specs = tuple(out_specs)
        mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh
        self.mesh = mesh
        self.nd = mesh.ndim
        self.grid_dev = rt.grid_device(mesh)
        self.grid = self.grid_dev is not None and all(s.is_even() for s in list(in_specs) + list(out_specs))
        self.wants_lead = "lead" in inspect.signature(kernel.fn).parameters
        self.coords = mesh.coordinates()
        self.in_reshape = None
        if self.grid and kernel.align:
            r = max((len(s.shape) for s in in_specs), default=0)
            self.in_reshape = [
                (tuple(s.grid_shape()) + (1,) * (r - len(s.shape)) + s.even_local_shape()) if len(s.shape) < r else None
                for s in in_specs
            ]
            if all(r is None for r in self.in_reshape):
                self.in_reshape = None
        # each output's expected (grid shape, local shape)
        self.out_fix = [(s.grid_shape(), s.even_local_shape()) for s in out_specs] if self.grid else None

    def run(self, rt: InProcessRuntime, inputs, kwargs, device_args):
        kernel = self.kernel
        if self.grid:
            xs = [h.grid if h.grid is not None else rt.as_grid(h, s) for h, s in zip(inputs, self.in_specs)]
            if self.in_reshape is not None:
                xs = [x if shp is None else x.reshape(shp) for x, shp in zip(xs, self.in_reshape)]
            if device_args:
                if self.grid_args[0] is not device_args:  # plans keep their device_args: convert once
                    self.grid_args = (device_args, {k: torch.as_tensor(v, device=self.grid_dev).reshape(self.mesh.shape)
                                                    for k, v in device_args.items()})
                kwargs = dict(kwargs, **self.grid_args[1])
            if self.wants_lead:
                kwargs = dict(kwargs, lead=self.nd)
            out = kernel.fn(*xs, **kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            res = []
            exact = not device_args
            for y, (g, local) in zip(outs, self.out_fix):
                if tuple(y.shape[self.nd:]) != local:
                    raise RuntimeBackendError(
                        f"kernel {kernel.name} produced local shape {tuple(y.shape[self.nd:])}, expected {local}")
                yg = y.shape[: self.nd]
                if tuple(yg) != g:
                    exact = False
                    for d in range(self.nd):
                        if yg[d] != g[d] and g[d] == 1:
                            y = y.narrow(d, 0, 1)
                    if tuple(y.shape[: self.nd]) != g:
                        y = y.expand(tuple(g) + tuple(y.shape[self.nd:]))
                res.append(Shards(grid=y))
            self.exact = exact if self.exact is None else (self.exact and exact)
            return res
        # one call per device
        per_dev = []
        blocks_in = [rt.local_blocks(h, s) for h, s in zip(inputs, self.in_specs)]
        for n, coord in enumerate(self.coords):
            kw = kwargs
            if device_args:
                kw = dict(kw, **{k: np.asarray(v)[coord].item() for k, v in device_args.items()})
            if self.wants_lead:
                kw = dict(kw, lead=0)
            out = kernel.fn(*[b[n] for b in blocks_in], **kw)
            per_dev.append(out if isinstance(out, tuple) else (out,))
        return [rt._make(s, blocks=[d[j] for d in per_dev]) for j, s in enumerate(self.out_specs)]
