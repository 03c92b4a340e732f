"""The meta backend: shapes and dtypes only, at any size (``dtorch.Graph(backend="meta")``).

A handle holds no data, only a token for its storage (so copy-on-write and aliases behave as on a real
backend). Every op still plans and dispatches as usual: placements, redistributions, the CommLog (the
one executor records it, as for every backend) and the memory accounting (``Graph.track_memory``: each
handle's bytes per device, freed when it dies) are those of a real run, at any mesh size, because nothing
here loops over devices: a kernel "runs" by returning one handle per output spec of its plan.

What a real run's local autograd graphs would save is learnt once per plan: the kernel runs on meta
tensors shaped as the in-process backend's stacked grids (``runtime/tapes.py``, the in-process backend's
own steps), so the inputs it releases, the outputs it keeps and the bytes it holds match that backend's
accounting. ``to_global`` (``to_torch()``, ``.item()``) raises ``MetaBackendError``.

``on_kernel``: when set (the planner, ``dtorch.plan``), every kernel run, in place write and local VJP is
reported to it as a ``KernelCall``, in program order (the collectives are in the CommLog).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from .._lru import LRU
from ..errors import MetaBackendError
from ..spec import DTensorSpec
from .devices import DeviceConfig
from .interface import Executable, Runtime
from .kernels import Kernel, broadcast_shape, varying
from .tapes import RELEASE_NUMEL, as_views, drop_values, saved_tensors


class _Storage:
    """Identity of one block storage; ``users``: the live handles on it (copy-on-write asks)."""

    __slots__ = ("users",)

    def __init__(self):
        self.users = 0


class MetaHandle:
    """A tensor's storage on the meta backend: no data, a storage token shared by aliases."""

    __slots__ = ("storage", "__weakref__")

    def __init__(self, storage: _Storage | None = None):
        self.storage = storage = storage if storage is not None else _Storage()
        storage.users += 1

    def __del__(self):
        self.storage.users -= 1

    def __repr__(self):
        return "MetaHandle()"


@dataclass(frozen=True)
class KernelCall:
    """One local computation on every device of a mesh, as the planner sees it. ``kind``: "forward" (a
    kernel run), "write" (an in-place kernel), "backward" (the VJP of a kernel whose local graph was kept;
    ``kernel`` is the forward's, ``diff`` its differentiated inputs). A recomputing VJP is a forward of the
    derived kernel ``vjp:<name>``."""
    kind: str
    kernel: Kernel
    in_specs: tuple
    out_specs: tuple
    kwargs: dict
    device_args: Any = None
    diff: tuple = ()


def _new(n: int) -> list:
    return [MetaHandle() for _ in range(n)]


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

    # -- placement -----------------------------------------------------------------------------
    def from_global(self, full: torch.Tensor, spec: DTensorSpec) -> MetaHandle:
        return MetaHandle()

    def from_blocks(self, blocks, spec: DTensorSpec) -> MetaHandle:
        return MetaHandle()

    def zeros(self, spec: DTensorSpec) -> MetaHandle:
        return MetaHandle()

    def from_files(self, reads, spec: DTensorSpec) -> MetaHandle:
        return MetaHandle()  # (nothing is read: the shapes were checked against the files' headers)

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
        return _private(target)

    def alias(self, handle: MetaHandle, spec: DTensorSpec) -> MetaHandle:
        return MetaHandle(handle.storage)

    # -- redistribution primitives: a new storage each (the CommLog is the executor's) -----------
    def all_gather(self, h, before, after, mesh_dim):
        return MetaHandle()

    def all_reduce(self, h, before, after, mesh_dim):
        return MetaHandle()

    def reduce_scatter(self, h, before, after, mesh_dim):
        return MetaHandle()

    def all_to_all(self, h, before, after, mesh_dim):
        return MetaHandle()

    def local_slice(self, h, before, after, mesh_dim):
        return MetaHandle()

    def to_partial(self, h, before, after, mesh_dim):
        return MetaHandle()

    def move(self, h, before, after, same_layout):
        return MetaHandle()

    def move_into(self, moves) -> list:
        return [_private(target) for _, _, target, _ in moves]

    def ring_shift(self, h, spec, mesh_dim, shift=1):
        return MetaHandle()

    def empty_cache(self) -> None:
        self._exec_cache.clear()


def _private(target: MetaHandle) -> MetaHandle:
    """Copy-on-write: the target itself when no other handle shares its storage, else a fresh one."""
    return target if target.storage.users <= 1 else MetaHandle()


class _MetaTape:
    """What a kept local graph would hold (``_MetaExecutable.run_tracked``): the input positions it does
    not hold, the outputs it saved and the bytes per device it saves besides inputs and outputs."""

    __slots__ = ("released", "saved_outputs", "extra_bytes")

    def __init__(self, released: tuple, saved_outputs: tuple, extra_bytes: int):
        self.released, self.saved_outputs, self.extra_bytes = released, saved_outputs, extra_bytes


class _MetaExecutable(Executable):
    """A kernel on one combination of specs: runs return one fresh handle per output spec. Where the
    in-process backend would stack every device's block into one grid (every spec even), it keeps the
    local autograd graph too, so ``run_tracked`` answers as that backend would (``_MetaTape``)."""

    def __init__(self, rt: MetaRuntime, kernel: Kernel, in_specs: tuple, out_specs: tuple):
        self.rt, self.kernel, self.in_specs, self.out_specs = rt, kernel, in_specs, out_specs
        self.mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh
        self.grid = all(s.is_even() for s in in_specs + out_specs)
        self.sums_over_devices = self.grid
        self._tapes = LRU("meta.tapes", 64)

    def _report(self, kind, kwargs, device_args, diff=()) -> None:
        self.rt.on_kernel(KernelCall(kind, self.kernel, self.in_specs, self.out_specs, kwargs, device_args, diff))

    def run(self, handles, kwargs, device_args=None) -> list:
        if self.rt.on_kernel is not None:
            self._report("forward", kwargs, device_args)
        return _new(len(self.out_specs))

    def run_tracked(self, handles, kwargs, device_args, diff):
        if not self.grid:
            return None  # (the in-process backend runs such plans device by device: the VJP recomputes)
        if self.rt.on_kernel is not None:
            self._report("forward", kwargs, device_args)
        measure = self.rt.measure_tapes
        key = _frozen((kwargs, None if device_args is None else sorted(device_args), diff, measure))
        tape = None if key is None else self._tapes.get(key)
        if tape is None:
            tape = self._analyse(kwargs, device_args, diff, measure)
            if key is not None:
                self._tapes[key] = tape
        return _new(len(self.out_specs)), tape

    def vjp_tracked(self, tape, cotangents, ct_specs, has_ct, grad_specs) -> list:
        if self.rt.on_kernel is not None:
            self._report("backward", {}, None, tuple(has_ct))
        return _new(len(grad_specs))

    def tape_released(self, tape) -> tuple:
        return tape.released

    def tape_saved_outputs(self, tape) -> tuple:
        return tape.saved_outputs

    def tape_bytes(self, tape) -> int:
        return tape.extra_bytes

    def _analyse(self, kwargs, device_args, diff, measure: bool) -> _MetaTape:
        """The in-process backend's ``run_tracked`` on meta grids: what its tape would hold."""
        nd = self.mesh.ndim
        xs = [torch.empty(s.grid_shape() + s.even_local_shape(), dtype=s.dtype, device="meta")
              for s in self.in_specs]
        try:
            return _tape_of(self.kernel, self.in_specs, xs, kwargs, device_args, diff, nd, self.mesh, measure)
        except Exception:  # noqa: BLE001  (a kernel meta tensors cannot run, e.g. one whose shapes depend on values)
            # the conservative answer: the graph holds every input and nothing else
            return _MetaTape((), (), 0)


def _tape_of(kernel: Kernel, in_specs, xs, kwargs, device_args, diff, nd, mesh, measure) -> _MetaTape:
    leaves = []
    with torch.enable_grad():
        for i in range(len(xs)):
            if diff[i]:
                xs[i] = xs[i].requires_grad_()
                leaves.append(xs[i])
        if kernel.align:  # local ranks padded to one length after the grid dims (the in-process reshape)
            r = max((len(s.shape) for s in in_specs), default=0)
            xs = [x if len(s.shape) == r else x.reshape(tuple(s.grid_shape()) + (1,) * (r - len(s.shape))
                                                         + s.even_local_shape()) for x, s in zip(xs, in_specs)]
        kw = dict(kwargs)
        if device_args:
            kw.update({k: varying(torch.as_tensor(np.asarray(v)).reshape(mesh.shape)).to("meta")
                       for k, v in device_args.items()})
        if "lead" in inspect.signature(kernel.fn).parameters:
            kw["lead"] = nd
        kw = {k: v.to("meta") if isinstance(v, torch.Tensor) and v.ndim else v for k, v in kw.items()}
        views = as_views(xs)
        out = kernel.fn(*xs, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    grid = broadcast_shape([x.shape[:nd] for x in leaves + xs]
                           + [v.shape for v in kw.values() if isinstance(v, torch.Tensor) and v.ndim == nd])
    inputs = {_storage(t) for t in xs}
    outputs = tuple(_storage(y) for y in outs)
    del xs, out
    for t in leaves:
        if t.numel() >= RELEASE_NUMEL:
            drop_values(t)
    for y in outs:
        if y.grad_fn is not None and y.numel() >= RELEASE_NUMEL:
            drop_values(y)
    released = tuple(i for i, ref in views if ref() is None)
    if not measure:
        return _MetaTape(released, (), 0)
    saved = list(saved_tensors(outs))
    kept = {_storage(t) for t in saved}
    saved_outputs = tuple(k for k, s in enumerate(outputs) if s in kept)
    extra = {}
    for t in saved:
        s = _storage(t)
        if s not in inputs and s not in outputs:
            extra[s] = t.untyped_storage().nbytes()
    cells = int(np.prod(grid)) if grid else 1
    return _MetaTape(released, saved_outputs, sum(extra.values()) // max(cells, 1))


def _storage(t: torch.Tensor) -> int:
    """The identity of ``t``'s storage (meta tensors have no data pointers: the storage object's address)."""
    return t.untyped_storage()._cdata


def _frozen(value):
    """A hashable stand-in for kernel arguments (tensors by shape and dtype); None when one is not."""
    try:
        return _freeze(value)
    except TypeError:
        return None


def _freeze(v):
    if isinstance(v, dict):
        return tuple((k, _freeze(x)) for k, x in sorted(v.items()))
    if isinstance(v, (tuple, list)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.tolist() if v.numel() <= 16 and v.device.type != "meta" else None)
    if isinstance(v, np.ndarray):
        return ("array", v.shape, str(v.dtype))
    hash(v)
    return v
