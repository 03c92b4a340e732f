"""The reference backend: plain per-device blocks in a loop, every block checked after every operation.

It is the proof of the runtime seam (docs/internals.md): a complete backend written only against
``runtime/interface.py``, the pure block arithmetic of ``runtime/blocks.py`` and the spec's
``local_box``, with none of the in-process backend's speed tricks:

* storage: a handle holds one torch tensor per device, in mesh order; every device, replicas
  included, has a tensor of its own (no stacked grid, no shared replica objects);
* compute: a kernel runs once per device on that device's blocks (``lead=0``);
* redistribution: each primitive is a loop over the devices of every group along the mesh dim, each
  device building its own result from the blocks it receives;
* checks: after every operation each block must have the shape ``spec.local_box`` gives its device,
  the spec's dtype and its device's torch device, and replicas (devices that differ only on
  Replicate mesh dims) must hold equal values; a violation raises ``RuntimeBackendError`` naming the
  operation, the device and both shapes;
* in place: ``write`` runs the kernel on the handle's own blocks, copying them first when another
  live handle shares their storage (the backend counts the handles per storage: copy-on-write).

It is slow by design; tests run the redistribution and op sweeps on it (``--backend reference``).
"""
from __future__ import annotations

import inspect

import numpy as np
import torch

from ..errors import RuntimeBackendError
from ..placement import Partial, Replicate, Shard
from ..spec import DTensorSpec, move_transfers
from .blocks import assemble, cut_global, cut_shard, dim_groups, reduce_list
from .devices import DeviceConfig, read_device_config, torch_devices
from .interface import Executable, Runtime
from .kernels import Kernel


def _storage_key(b: torch.Tensor):
    """What identifies ``b``'s memory: views of one tensor share it. None for empty blocks (no memory to share)."""
    if b.numel() == 0:
        return None
    return (b.device, b.untyped_storage().data_ptr())


class _Users:
    """How many live handles hold each storage (copy-on-write asks before writing in place)."""

    def __init__(self):
        self.count: dict = {}

    def acquire(self, keys) -> None:
        for k in keys:
            self.count[k] = self.count.get(k, 0) + 1

    def release(self, keys) -> None:
        for k in keys:
            n = self.count.get(k, 0) - 1
            if n > 0:
                self.count[k] = n
            else:
                self.count.pop(k, None)

    def shared(self, keys) -> bool:
        return any(self.count.get(k, 0) > 1 for k in keys)


class Blocks:
    """A handle: one block per device (mesh order). ``sources``: for a ring-shifted handle, the coordinate
    whose block each device holds now (None: its own)."""

    __slots__ = ("blocks", "sources", "_keys", "_users", "__weakref__")

    def __init__(self, blocks: list, users: _Users, sources=None):
        seen: set = set()
        own = []
        for b in blocks:
            k = _storage_key(b)
            if k is not None and k in seen:  # two devices never share memory (in-place kernels run per device)
                b = b.clone()
                k = _storage_key(b)
            if k is not None:
                seen.add(k)
            own.append(b)
        self.blocks = own
        self.sources = sources
        self._keys = tuple(seen)
        self._users = users
        users.acquire(self._keys)

    def __del__(self):
        try:
            self._users.release(self._keys)
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def __repr__(self):
        return f"Blocks({[tuple(b.shape) for b in self.blocks]})"


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN too (replicas computed the same way hold the same bits)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    return bool((a.eq(b) | (a.ne(a) & b.ne(b))).all())


class ReferenceRuntime(Runtime):
    name = "reference"
    handles_in_process = False  # its handles are not the in-process backend's: tensors of two Graphs never mix

    def __init__(self, device_config: DeviceConfig | None = None):
        self.config = device_config or read_device_config()
        self._users = _Users()

    def devices(self, mesh) -> tuple[torch.device, ...]:
        return torch_devices(mesh, self.config)

    # -- handles and their checks ------------------------------------------------------------------
    def _new(self, blocks: list, spec: DTensorSpec, what: str, sources=None) -> Blocks:
        h = Blocks(blocks, self._users, sources)
        self._check(h, spec, what)
        return h

    def _check(self, h: Blocks, spec: DTensorSpec, what: str) -> None:
        """Every block has the shape ``spec.local_box`` gives its device (or the device it came from), the
        spec's dtype and its device's torch device; replicas hold equal values."""
        mesh = spec.mesh
        coords = mesh.coordinates()
        if not isinstance(h, Blocks) or len(h.blocks) != len(coords):
            got = f"{len(h.blocks)} blocks" if isinstance(h, Blocks) else type(h).__name__
            raise RuntimeBackendError(f"reference backend, {what}: {got} for the {len(coords)} devices of {mesh} ({spec})")
        devs = self.devices(mesh)
        for n, (b, coord) in enumerate(zip(h.blocks, coords)):
            src = coord if h.sources is None else h.sources[n]
            want = spec.local_shape(src)
            if not isinstance(b, torch.Tensor) or tuple(b.shape) != want or b.dtype != spec.dtype or b.device != devs[n]:
                got = (f"{list(b.shape)} {b.dtype} on {b.device}" if isinstance(b, torch.Tensor) else type(b).__name__)
                raise RuntimeBackendError(
                    f"reference backend, {what}: device {mesh.device_ids[n]} (coordinate {coord}) holds {got}, but "
                    f"{spec} puts a {list(want)} {spec.dtype} block on {devs[n]} there (local_box {spec.local_box(src)})")
        if h.sources is not None:
            return
        first: dict = {}  # replicas: devices whose coordinates agree off the Replicate mesh dims
        rep = [isinstance(p, Replicate) for p in spec.placements]
        for n, coord in enumerate(coords):
            key = tuple(0 if r else c for c, r in zip(coord, rep))
            m = first.setdefault(key, n)
            if m != n and not _same_values(h.blocks[m], h.blocks[n]):
                raise RuntimeBackendError(
                    f"reference backend, {what}: replicas differ: device {mesh.device_ids[n]} (coordinate {coord}) and "
                    f"device {mesh.device_ids[m]} hold different values, but {spec} replicates them")

    def _blocks(self, h: Blocks, spec: DTensorSpec, what: str) -> list:
        self._check(h, spec, what)
        return h.blocks

    # -- placement ---------------------------------------------------------------------------------
    def from_global(self, full: torch.Tensor, spec: DTensorSpec) -> Blocks:
        devs = self.devices(spec.mesh)
        blocks = []
        for n, (b, coord) in enumerate(zip(cut_global(full, spec), spec.mesh.coordinates())):
            if b is None:  # a sum Partial's other terms
                blocks.append(torch.zeros(spec.local_shape(coord), dtype=spec.dtype, device=devs[n]))
            else:
                blocks.append(b.to(devs[n], copy=True))
        return self._new(blocks, spec, "from_global")

    def from_blocks(self, blocks, spec: DTensorSpec) -> Blocks:
        devs = self.devices(spec.mesh)
        return self._new([b.detach().to(d, copy=True) for b, d in zip(blocks, devs)], spec, "from_blocks")

    def to_global(self, h: Blocks, spec: DTensorSpec) -> torch.Tensor:
        blocks = self._blocks(h, spec, "to_global")
        return assemble(blocks, spec, self.devices(spec.mesh)[0])  # a new tensor

    def local_blocks(self, h: Blocks, spec: DTensorSpec) -> list[torch.Tensor]:
        return [b.clone() for b in self._blocks(h, spec, "local_blocks")]

    # -- compute -----------------------------------------------------------------------------------
    def executable(self, kernel: Kernel, in_specs, out_specs) -> Executable:
        return _PerDevice(self, kernel, tuple(in_specs), tuple(out_specs))

    def write(self, kernel: Kernel, target: Blocks, target_spec: DTensorSpec, inputs, in_specs, kwargs,
              device_args=None) -> Blocks:
        what = f"write {kernel.name}"
        self._check(target, target_spec, what)
        if self._users.shared(target._keys):  # copy-on-write: another handle sees this storage
            target = Blocks([b.clone() for b in target.blocks], self._users)
        ins = [self._blocks(h, s, what) for h, s in zip(inputs, in_specs)]
        for n, kw in enumerate(_per_device_kwargs(kernel, target_spec.mesh, kwargs, device_args)):
            kernel.fn(target.blocks[n], *[b[n] for b in ins], **kw)
        self._check(target, target_spec, what)
        return target

    def alias(self, h: Blocks, spec: DTensorSpec) -> Blocks:
        # a second handle on the same tensors: the storage counts two users, so a write to either copies
        return self._new(list(self._blocks(h, spec, "alias")), spec, "alias")

    # -- redistribution primitives -------------------------------------------------------------------
    def _each_group(self, h: Blocks, before: DTensorSpec, after: DTensorSpec, mesh_dim: int, what: str, src_type,
                    dst_type, fn) -> Blocks:
        """Run ``fn(j, received blocks, device)`` for every device ``j`` of every group along ``mesh_dim``."""
        src, dst = before.placements[mesh_dim], after.placements[mesh_dim]
        if not isinstance(src, src_type) or not isinstance(dst, dst_type):
            raise RuntimeBackendError(f"reference backend: {what} on mesh dim {mesh_dim} cannot take {src} to {dst}")
        if before.placements[:mesh_dim] + before.placements[mesh_dim + 1:] != \
                after.placements[:mesh_dim] + after.placements[mesh_dim + 1:] or before.mesh != after.mesh:
            raise RuntimeBackendError(f"reference backend: {what} on mesh dim {mesh_dim} may change that mesh dim "
                                      f"only, got {before} -> {after}")
        blocks = self._blocks(h, before, what)
        devs = self.devices(before.mesh)
        out = [None] * len(blocks)
        for group in dim_groups(before.mesh.shape, mesh_dim):
            for j, n in enumerate(group):
                out[n] = fn(j, [blocks[g].to(devs[n]) for g in group], src, dst)
        return self._new(out, after, f"{what} on mesh dim {mesh_dim}")

    def all_gather(self, h, before, after, mesh_dim):
        return self._each_group(h, before, after, mesh_dim, "all_gather", Shard, Replicate,
                                lambda j, got, src, dst: torch.cat(got, dim=src.dim))

    def all_reduce(self, h, before, after, mesh_dim):
        return self._each_group(h, before, after, mesh_dim, "all_reduce", Partial, Replicate,
                                lambda j, got, src, dst: reduce_list(src.reduce_op, got))

    def reduce_scatter(self, h, before, after, mesh_dim):
        def piece(j, got, src, dst):
            return cut_shard(reduce_list(src.reduce_op, got), dst.dim, len(got), j).clone()

        return self._each_group(h, before, after, mesh_dim, "reduce_scatter", Partial, Shard, piece)

    def all_to_all(self, h, before, after, mesh_dim):
        def piece(j, got, src, dst):
            return cut_shard(torch.cat(got, dim=src.dim), dst.dim, len(got), j).clone()

        return self._each_group(h, before, after, mesh_dim, "all_to_all", Shard, Shard, piece)

    def local_slice(self, h, before, after, mesh_dim):
        return self._each_group(h, before, after, mesh_dim, "local_slice", Replicate, Shard,
                                lambda j, got, src, dst: cut_shard(got[j], dst.dim, len(got), j))

    def to_partial(self, h, before, after, mesh_dim):
        def term(j, got, src, dst):
            return torch.zeros_like(got[j]) if dst.reduce_op == "sum" and j != 0 else got[j]

        return self._each_group(h, before, after, mesh_dim, "to_partial", Replicate, Partial, term)

    def move(self, h, before: DTensorSpec, after: DTensorSpec, same_layout: bool):
        blocks = self._blocks(h, before, "move")
        devs = self.devices(after.mesh)
        if same_layout:  # device k of the source sends its block to device k of the target
            if before.mesh.shape != after.mesh.shape or before.placements != after.placements:
                raise RuntimeBackendError(f"reference backend: move block to block needs one layout, got {before} -> {after}")
            return self._new([b.to(d, copy=True) for b, d in zip(blocks, devs)], after, "move (block to block)")
        if before.partial_dims() or after.partial_dims():
            raise RuntimeBackendError(f"reference backend: move by regions takes no partials, got {before} -> {after}")
        # every target device copies the parts of its box that each source device (one replica each) holds
        sources = [(b, before.local_box(c)) for b, c in zip(blocks, before.mesh.coordinates())
                   if all(x == 0 or isinstance(p, Shard) for x, p in zip(c, before.placements))]
        out = []
        for n, coord in enumerate(after.mesh.coordinates()):
            box = after.local_box(coord)
            block = torch.empty(tuple(s for _, s in box), dtype=after.dtype, device=devs[n])
            for b, sbox in sources:
                lo = [max(o, so) for (o, _), (so, _) in zip(box, sbox)]
                hi = [min(o + s, so + ss) for (o, s), (so, ss) in zip(box, sbox)]
                if all(a < z for a, z in zip(lo, hi)):  # they overlap (a 0-d tensor: always)
                    dst_idx = tuple(slice(a - o, z - o) for a, z, (o, _) in zip(lo, hi, box))
                    src_idx = tuple(slice(a - o, z - o) for a, z, (o, _) in zip(lo, hi, sbox))
                    block[dst_idx] = b[src_idx].to(devs[n])
            out.append(block)
        return self._new(out, after, "move (regions)")

    def move_into(self, moves) -> list:
        out = []
        for src, before, target, after in moves:
            what = "move_into"
            if before.partial_dims() or after.partial_dims() or before.shape != after.shape:
                raise RuntimeBackendError(f"reference backend: move_into takes one shape and no partials, got "
                                          f"{before} -> {after}")
            blocks = self._blocks(src, before, what)
            self._check(target, after, what)
            if self._users.shared(target._keys):  # copy-on-write: every element is written, so fresh storage
                target = Blocks([torch.empty_like(b) for b in target.blocks], self._users)
            index = {d: n for n, d in enumerate(before.mesh.device_ids)}
            position = {d: n for n, d in enumerate(after.mesh.device_ids)}
            filled = [0] * len(target.blocks)
            for s_id, d_id, s_sl, d_sl, shape in move_transfers(before, after):
                dst = target.blocks[position[d_id]]
                dst[d_sl].copy_(blocks[index[s_id]][s_sl].to(dst.device))
                filled[position[d_id]] += int(np.prod(shape, dtype=np.int64))
            for n, b in enumerate(target.blocks):  # the regions tile every block exactly
                if filled[n] != b.numel():
                    raise RuntimeBackendError(f"reference backend, move_into: device {after.mesh.device_ids[n]} received "
                                              f"{filled[n]} of its {b.numel()} elements ({before} -> {after})")
            self._check(target, after, what)
            out.append(target)
        return out

    def ring_shift(self, h: Blocks, spec: DTensorSpec, mesh_dim: int, shift: int = 1) -> Blocks:
        mesh = spec.mesh
        self._check(h, spec, "ring_shift")
        coords = mesh.coordinates()
        flat = {c: n for n, c in enumerate(coords)}
        devs = self.devices(mesh)
        m = mesh.shape[mesh_dim]
        out, sources = [], []
        for n, coord in enumerate(coords):
            src = list(coord)
            src[mesh_dim] = (coord[mesh_dim] - shift) % m
            k = flat[tuple(src)]
            out.append(h.blocks[k].to(devs[n]))
            sources.append(coords[k] if h.sources is None else h.sources[k])
        return self._new(out, spec, f"ring_shift on mesh dim {mesh_dim}", sources=tuple(sources))


def _per_device_kwargs(kernel: Kernel, mesh, kwargs: dict, device_args: dict | None):
    """The keyword arguments of each device's call, in mesh order: per-device values as python numbers, lead=0."""
    lead = "lead" in inspect.signature(kernel.fn).parameters
    for coord in mesh.coordinates():
        kw = dict(kwargs)
        if device_args:
            kw.update({k: np.asarray(v)[coord].item() for k, v in device_args.items()})
        if lead:
            kw["lead"] = 0
        yield kw


class _PerDevice(Executable):
    """A kernel run once per device on that device's blocks."""

    def __init__(self, rt: ReferenceRuntime, kernel: Kernel, in_specs: tuple, out_specs: tuple):
        self.rt, self.kernel, self.in_specs, self.out_specs = rt, kernel, in_specs, out_specs
        self.mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh

    def run(self, handles, kwargs, device_args=None) -> list:
        rt, name = self.rt, f"kernel {self.kernel.name}"
        if len(handles) != len(self.in_specs):
            raise RuntimeBackendError(f"reference backend, {name}: {len(handles)} inputs for {len(self.in_specs)} specs")
        ins = [rt._blocks(h, s, f"{name} input #{i}") for i, (h, s) in enumerate(zip(handles, self.in_specs))]
        outs: list = [[] for _ in self.out_specs]
        for n, kw in enumerate(_per_device_kwargs(self.kernel, self.mesh, kwargs, device_args)):
            res = self.kernel.fn(*[b[n] for b in ins], **kw)
            res = res if isinstance(res, tuple) else (res,)
            if len(res) != len(outs):
                raise RuntimeBackendError(f"reference backend, {name}: {len(res)} outputs for {len(outs)} specs")
            for j, y in enumerate(res):
                outs[j].append(y)
        return [rt._new(blocks, s, f"{name} output #{j}") for j, (blocks, s) in enumerate(zip(outs, self.out_specs))]
