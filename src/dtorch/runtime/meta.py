"""The meta backend: shapes and dtypes only, at any size (``dtorch.Graph(backend="meta")``).

A handle holds no data. Every op still plans and dispatches as usual, so the placements, the
redistributions, the CommLog (the one executor records it, as for every backend) and the memory accounting
(``Graph.track_memory``: each handle's bytes per device, freed when it dies) are those of a real run, at any
mesh size: nothing here loops over devices. Where the in-process backend stacks every device's block into one
grid (even layouts), a handle holds that grid as a meta tensor (``runtime/grids.py``: the same shapes and
strides, no data) and kernels run on it, so views, copy-on-write and what the local autograd graphs save
(``runtime/tapes.py``) are that backend's; torch's attention on meta tensors takes the kernel it would take
on the CPU (``_AttentionAsOnCpu``). Uneven layouts hold a storage token. ``to_global`` (``to_torch()``,
``.item()``) raises ``MetaBackendError``.

``on_kernel``: when set (the planner, ``dtorch.plan``), every kernel run, in-place write and kept-graph VJP is
reported to it as a ``KernelCall``, in program order (the collectives are in the CommLog).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._lru import LRU
from ..errors import MetaBackendError
from ..spec import DTensorSpec
from .devices import DeviceConfig
from .interface import Executable, Runtime
from .blocks import reduce_dim
from .box import box_plan
from .cow import private_copy, writable
from .grids import global_to_grid, grid_gather, grid_slice, to_partial_grid
from .kernels import Kernel, broadcast_shape, varying
from .tapes import Leaves, as_views, drop_output_values, run_keeping_graph, saved_tensors


class _Storage:
    """Identity of the storage of a handle without a grid (an uneven layout); ``users``: the live handles on it
    (copy-on-write asks)."""

    __slots__ = ("users",)

    def __init__(self):
        self.users = 0


class MetaHandle:
    """A tensor's storage on the meta backend, no data. An even layout holds ``grid``: a meta tensor shaped and
    strided as the in-process backend's stacked grid (``runtime/grids.py``), so views, aliases, copy-on-write and
    what local autograd graphs save follow that backend; an uneven one holds a storage token shared by aliases."""

    __slots__ = ("grid", "storage", "__weakref__")

    def __init__(self, grid: torch.Tensor | None = None, storage: _Storage | None = None):
        self.grid = grid
        self.storage = storage
        if grid is None:
            self.storage = storage = storage if storage is not None else _Storage()
            storage.users += 1

    def __del__(self):
        if self.grid is None:
            self.storage.users -= 1

    def __repr__(self):
        return "MetaHandle()" if self.grid is None else f"MetaHandle(grid={tuple(self.grid.shape)})"


@dataclass(frozen=True)
class KernelCall:
    """One local computation on every device of a mesh, as the planner sees it. ``kind``: "forward" (a
    kernel run), "write" (an in-place kernel), "backward" (the VJP of a kernel whose local graph was kept;
    ``kernel`` is the forward's, ``diff`` the outputs with a cotangent). A recomputing VJP is a forward of the
    derived kernel ``vjp:<name>``."""
    kind: str
    kernel: Kernel
    in_specs: tuple
    out_specs: tuple
    kwargs: dict
    device_args: Any = None
    diff: tuple = ()


def _empty_grid(spec: DTensorSpec) -> torch.Tensor:
    return torch.empty(spec.grid_shape() + spec.even_local_shape(), dtype=spec.dtype, device="meta")


def _handle(spec: DTensorSpec, grid: torch.Tensor | None = None) -> MetaHandle:
    """A new handle laid out as ``spec``: ``grid`` (a fresh contiguous one if None) when the layout is even."""
    if not spec.is_even():
        return MetaHandle()
    return MetaHandle(_empty_grid(spec) if grid is None else grid)


class MetaRuntime(Runtime):
    name = "meta"
    handles_in_process = False  # its handles hold no data: tensors of other Graphs never mix with them
    holds_values = False

    def __init__(self, device_config: DeviceConfig | None = None):
        # any mesh is available: "cuda" ids are as virtual as "cpu" ones here
        self.config = device_config or DeviceConfig(same_device=True, num_simulated_gpus=1 << 40)
        self._exec_cache = LRU("meta.executables", 4096)
        self.on_kernel: Callable[[KernelCall], None] | None = None

    def devices(self, mesh) -> tuple[torch.device, ...]:
        return (torch.device("meta"),) * mesh.size()

    def as_grid(self, h: MetaHandle, spec: DTensorSpec) -> torch.Tensor:
        return h.grid if h.grid is not None else _empty_grid(spec)

    # -- placement -----------------------------------------------------------------------------
    def from_global(self, full: torch.Tensor, spec: DTensorSpec) -> MetaHandle:
        if not spec.is_even():
            return MetaHandle()
        return MetaHandle(global_to_grid(full.to("meta"), spec))

    def from_blocks(self, blocks, spec: DTensorSpec) -> MetaHandle:
        return _handle(spec)

    def zeros(self, spec: DTensorSpec) -> MetaHandle:
        return self.from_global(torch.zeros(spec.shape, dtype=spec.dtype, device="meta"), spec)

    def from_files(self, reads, spec: DTensorSpec) -> MetaHandle:
        return _handle(spec)  # (nothing is read)

    def to_global(self, handle, spec: DTensorSpec) -> torch.Tensor:
        raise MetaBackendError(
            f"the meta backend holds shapes and dtypes only: there is no value to fetch for this {spec} tensor "
            "(to_torch(), item(), tolist(), printing, a Python branch on a value). Run the program on a backend "
            "with data (dtorch.Graph(backend='inprocess') or 'process') to get values; on 'meta' read shapes, "
            "placements, dtorch.CommLog and Graph.get_memory_stats instead")

    def local_blocks(self, handle, spec: DTensorSpec) -> list[torch.Tensor]:
        """Each device's block as a meta tensor of its shape (no values)."""
        return [torch.empty(spec.local_shape(c), dtype=spec.dtype, device="meta") for c in spec.mesh.coordinates()]

    # -- compute -------------------------------------------------------------------------------
    def executable(self, kernel: Kernel, in_specs, out_specs) -> "_MetaExecutable":
        key = (kernel.name, tuple(in_specs), tuple(out_specs))
        ex = self._exec_cache.get(key)
        if ex is None:
            ex = self._exec_cache[key] = _MetaExecutable(self, kernel, key[1], key[2])
        return ex

    def write(self, kernel: Kernel, target: MetaHandle, target_spec: DTensorSpec, inputs, in_specs, kwargs,
              device_args=None) -> MetaHandle:
        if self.on_kernel is not None:
            self.on_kernel(KernelCall("write", kernel, (target_spec,) + tuple(in_specs), (target_spec,), kwargs,
                                      device_args))
        if target.grid is not None:
            if not writable(target.grid):  # copy-on-write, as the in-process backend decides it
                return MetaHandle(private_copy(target.grid))
            return target
        return target if target.storage.users <= 1 else MetaHandle()

    def alias(self, handle: MetaHandle, spec: DTensorSpec) -> MetaHandle:
        if handle.grid is not None:
            return MetaHandle(handle.grid.view(handle.grid.shape))
        return MetaHandle(storage=handle.storage)

    # -- redistribution primitives: the grid arithmetic on meta grids (the CommLog is the executor's) --
    def _grids(self, h, before, after):
        if before.is_even() and after.is_even():
            return self.as_grid(h, before)
        return None

    def all_gather(self, h, before, after, mesh_dim):
        x = self._grids(h, before, after)
        if x is None:
            return _handle(after)
        return MetaHandle(grid_gather(x, mesh_dim, before.placements[mesh_dim].dim, before.mesh.ndim))

    def all_reduce(self, h, before, after, mesh_dim):
        x = self._grids(h, before, after)
        if x is None:
            return _handle(after)
        return MetaHandle(reduce_dim(before.placements[mesh_dim].reduce_op, x, mesh_dim))

    def reduce_scatter(self, h, before, after, mesh_dim):
        x = self._grids(h, before, after)
        if x is None:
            return _handle(after)
        m, k = before.mesh.shape[mesh_dim], after.placements[mesh_dim].dim
        x = reduce_dim(before.placements[mesh_dim].reduce_op, x, mesh_dim)
        return MetaHandle(grid_slice(x, mesh_dim, k, before.mesh.ndim, m))

    def all_to_all(self, h, before, after, mesh_dim):
        x = self._grids(h, before, after)
        if x is None:
            return _handle(after)
        nd, m = before.mesh.ndim, before.mesh.shape[mesh_dim]
        src, dst = before.placements[mesh_dim].dim, after.placements[mesh_dim].dim
        return MetaHandle(grid_slice(grid_gather(x, mesh_dim, src, nd), mesh_dim, dst, nd, m))

    def local_slice(self, h, before, after, mesh_dim):
        x = self._grids(h, before, after)
        if x is None:
            return _handle(after)
        m, k = before.mesh.shape[mesh_dim], after.placements[mesh_dim].dim
        return MetaHandle(grid_slice(x, mesh_dim, k, before.mesh.ndim, m))

    def to_partial(self, h, before, after, mesh_dim):
        x = self._grids(h, before, after)
        if x is None:
            return _handle(after)
        op, m = after.placements[mesh_dim].reduce_op, before.mesh.shape[mesh_dim]
        return MetaHandle(to_partial_grid(x, mesh_dim, m, op))

    def move(self, h, before, after, same_layout):
        if same_layout and h.grid is not None:
            return MetaHandle(h.grid)  # (one grid object, as the in-process backend's .to(the same device))
        return _handle(after)

    def move_into(self, moves) -> list:
        out = []
        for _, _, target, after in moves:
            if target.grid is not None:
                if not writable(target.grid):
                    target = MetaHandle(torch.empty_like(target.grid, memory_format=torch.contiguous_format))
            elif target.storage.users > 1:
                target = MetaHandle()
            out.append(target)
        return out

    def ring_shift(self, h, spec, mesh_dim, shift=1):
        if h.grid is not None:
            return MetaHandle(torch.roll(h.grid, shifts=shift, dims=mesh_dim))
        return MetaHandle()

    def empty_cache(self) -> None:
        self._exec_cache.clear()


class _MetaTape:
    """A kept local graph on meta tensors (``_MetaExecutable.run_tracked``): the in-process backend's tape."""

    __slots__ = ("leaves", "outs", "grid", "released", "measured", "call")

    def __init__(self, leaves, outs, grid, released, measured, call=None):
        self.leaves, self.outs, self.grid, self.released, self.measured = leaves, outs, grid, released, measured
        self.call = call  # (kwargs, device_args) of the forward, for the backward's report to ``on_kernel``


class _MetaExecutable(Executable):
    """A kernel on one combination of specs, run on meta grids where the in-process backend stacks every
    device's block into one grid (every spec even): the outputs' shapes and strides, and with autograd the
    local graph, are that backend's. Elsewhere (uneven layouts) a run returns fresh handles."""

    def __init__(self, rt: MetaRuntime, kernel: Kernel, in_specs: tuple, out_specs: tuple):
        self.rt, self.kernel, self.in_specs, self.out_specs = rt, kernel, in_specs, out_specs
        self.mesh = mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh
        self.nd = mesh.ndim
        self.grid = all(s.is_even() for s in in_specs + out_specs)
        # uneven with idle devices: the in-process backend runs the busy devices' box (runtime/box.py)
        self.box = None if self.grid else box_plan(mesh, in_specs, out_specs, kernel.name)
        self.sums_over_devices = self.grid or self.box is not None
        self.wants_lead = "lead" in inspect.signature(kernel.fn).parameters
        self.in_reshape = None
        if self.grid and kernel.align:
            r = max((len(s.shape) for s in in_specs), default=0)
            self.in_reshape = [(tuple(s.grid_shape()) + (1,) * (r - len(s.shape)) + s.even_local_shape())
                               if len(s.shape) < r else None for s in in_specs]
        self.out_fix = [(s.grid_shape(), s.even_local_shape()) for s in out_specs] if self.grid else None

    def _report(self, kind, kwargs, device_args, diff=()) -> None:
        self.rt.on_kernel(KernelCall(kind, self.kernel, self.in_specs, self.out_specs, kwargs, device_args, diff))

    def _inputs(self, handles, kwargs, device_args, leaf=None, vary=False):
        """The kernel's meta grid inputs and keyword arguments, as the in-process backend builds them."""
        rt = self.rt
        xs = [rt.as_grid(h, s) for h, s in zip(handles, self.in_specs)]
        if leaf is not None:
            xs = [leaf(i, x) for i, x in enumerate(xs)]
        if self.in_reshape is not None:
            xs = [x if shp is None else x.reshape(shp) for x, shp in zip(xs, self.in_reshape)]
        kw = dict(kwargs)
        if device_args:
            for k, v in device_args.items():
                v = torch.as_tensor(np.asarray(v)).reshape(self.mesh.shape)
                kw[k] = (varying(v) if vary else v).to("meta")
        if self.wants_lead:
            kw["lead"] = self.nd
        return xs, {k: v.to("meta") if isinstance(v, torch.Tensor) and v.ndim and v.device.type != "meta" else v
                    for k, v in kw.items()}

    def _box_inputs(self, kwargs, device_args, leaf):
        """The in-process backend's box grids (``_Executable._box_inputs``) as meta tensors."""
        box = self.box
        busy = box.coords[box.busy.index(True)]
        xs = [leaf(i, torch.empty(box.grid_shape(s) + s.local_shape(busy), dtype=s.dtype, device="meta"))
              for i, s in enumerate(self.in_specs)]
        if self.kernel.align:
            r = max(len(s.shape) for s in self.in_specs)
            xs = [x if len(s.shape) == r else x.reshape(tuple(x.shape[: self.nd]) + (1,) * (r - len(s.shape))
                                                        + tuple(x.shape[self.nd:]))
                  for x, s in zip(xs, self.in_specs)]
        kw = dict(kwargs)
        if device_args:
            kw.update({k: varying(v).to("meta") for k, v in box.device_args(device_args, "cpu").items()})
        if self.wants_lead:
            kw["lead"] = self.nd
        return xs, kw

    def _fit(self, y: torch.Tensor, g, local) -> torch.Tensor:
        """A grid result laid out as an output of grid shape ``g`` (the in-process backend's ``_fit``)."""
        nd = self.nd
        if tuple(y.shape[nd:]) != local:
            return torch.empty(tuple(g) + tuple(local), dtype=y.dtype, device="meta")
        for d in range(nd):
            if y.shape[d] != g[d] and g[d] == 1:
                y = y.narrow(d, 0, 1)
        if tuple(y.shape[:nd]) != tuple(g):
            y = y.expand(tuple(g) + tuple(y.shape[nd:]))
        return y

    def _outputs(self, out) -> list:
        outs = out if isinstance(out, tuple) else (out,)
        return [MetaHandle(self._fit(y.detach(), g, local)) for y, (g, local) in zip(outs, self.out_fix)]

    def run(self, handles, kwargs, device_args=None) -> list:
        if self.rt.on_kernel is not None:
            self._report("forward", kwargs, device_args)
        if not self.grid:
            return [_handle(s) for s in self.out_specs]
        try:
            xs, kw = self._inputs(handles, kwargs, device_args)
            with _AttentionAsOnCpu():
                out = self.kernel.fn(*xs, **kw)
            return self._outputs(out)
        except Exception:  # noqa: BLE001  (a kernel meta tensors cannot run: its shapes depend on values)
            return [_handle(s) for s in self.out_specs]

    def run_tracked(self, handles, kwargs, device_args, diff, refetch=()):
        """The in-process backend's ``run_tracked`` on meta grids: the same graph, so the same inputs released,
        the same outputs and bytes saved (``runtime/tapes.py``), the ``refetch`` inputs saved as places."""
        box = self.box
        if not self.grid and (box is None or not box.trackable):
            return None
        if self.rt.on_kernel is not None:
            self._report("forward", kwargs, device_args)
        leaf = Leaves(diff, refetch)

        try:
            with torch.enable_grad(), _AttentionAsOnCpu():
                if box is None:
                    xs, kw = self._inputs(handles, kwargs, device_args, leaf, vary=True)
                else:
                    xs, kw = self._box_inputs(kwargs, device_args, leaf)
                views = as_views(xs)
                out, _ = run_keeping_graph(self.kernel.fn, xs, kw, refetch)
        except Exception:  # noqa: BLE001  (as in run: the backward then recomputes, keeping the inputs)
            return None
        outs = out if isinstance(out, tuple) else (out,)
        res = self._outputs(outs) if box is None else [_handle(s) for s in self.out_specs]
        nd = self.nd
        grid = broadcast_shape([x.shape[:nd] for x in leaf.all + xs]
                               + [v.shape for v in kw.values() if isinstance(v, torch.Tensor) and v.ndim == nd])
        measured = None
        if self.rt.measure_tapes:
            measured = ({_storage(t) for t in xs}, tuple(_storage(y) for y in outs))
        del xs, out
        leaf.release()
        drop_output_values(outs)
        released = tuple(i for i, ref in views if ref() is None)
        call = (kwargs, device_args) if self.rt.on_kernel is not None else None
        return res, _MetaTape(leaf.all, outs, grid, released, measured, call)

    def vjp_tracked(self, tape, cotangents, ct_specs, has_ct, grad_specs, refetched=None) -> list:
        if self.rt.on_kernel is not None:
            kwargs, device_args = tape.call or ({}, None)
            self._report("backward", kwargs, device_args, tuple(has_ct))
        return [_handle(s) for s in grad_specs]

    def tape_released(self, tape) -> tuple:
        return tape.released

    def tape_saved_outputs(self, tape) -> tuple:
        if tape.measured is None:
            return ()
        saved = {_storage(t) for t in saved_tensors(tape.outs)}
        return tuple(k for k, s in enumerate(tape.measured[1]) if s in saved)

    def tape_bytes(self, tape) -> int:
        if tape.measured is None:
            return 0
        known = tape.measured[0] | set(tape.measured[1])
        extra = {}
        for t in saved_tensors(tape.outs):
            s = _storage(t)
            if s not in known:
                extra[s] = t.untyped_storage().nbytes()
        cells = int(np.prod(tape.grid)) if tape.grid else 1
        return sum(extra.values()) // max(cells, 1)


class _AttentionAsOnCpu(TorchFunctionMode):
    """torch picks its fused attention by device: on meta tensors it takes the math path, which saves the
    attention weights; the in-process backend's CPU (and a GPU) take a flash kernel, which saves the
    log-sum-exp. Inside, ``scaled_dot_product_attention`` on meta tensors runs the kernel torch picks for CPU
    tensors of those shapes, so the saved bytes are that backend's."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and args and args[0].device.type == "meta":
            return _sdpa_as_on_cpu(*args, **kwargs)
        return func(*args, **kwargs)


def _sdpa_as_on_cpu(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    def probe(t):  # a CPU tensor of t's shape and dtype holding one row (its dims broadcast)
        return None if t is None else torch.empty(t.shape[-1:], dtype=t.dtype).expand(t.shape)

    choice = torch._fused_sdp_choice(probe(q), probe(k), probe(v), probe(attn_mask), dropout_p, is_causal,
                                     scale=scale, enable_gqa=enable_gqa)
    if choice == _FLASH:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


_FLASH = 1  # torch's SDPBackend.flash_attention


def _storage(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (meta tensors have no data pointers: the storage object's address)."""
    return t.untyped_storage()._cdata
