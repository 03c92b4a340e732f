"""Graph: the controller. Default mesh and dtype, the runtime, sync and memory statistics."""
from __future__ import annotations

import contextlib
import itertools
import os
import threading

import numpy as np
import torch

from .errors import MeshError, OpError
from .mesh import DeviceMesh
from .runtime.devices import mesh_problems

BACKEND_VAR = "DTORCH_BACKEND"
_BACKENDS = ("inprocess", "process")
_NUMBERS = itertools.count(1)


def make_runtime(backend: str):
    if backend == "inprocess":
        from .runtime.inprocess import InProcessRuntime

        return InProcessRuntime()
    if backend == "process":
        from .runtime.process import ProcessRuntime  # noqa: F401  (scale-out backend)

        return ProcessRuntime()
    raise ValueError(f"unknown dtorch backend {backend!r}; choose one of {_BACKENDS} (env {BACKEND_VAR})")


class Graph:
    """The controller: default mesh and dtype, the runtime (backend), sync and memory statistics.

    Tensors are created in the current thread's default Graph. A new Graph becomes the default
    inside ``with graph:`` (restored after), or from now on with ``Graph.set_default_graph(graph)``;
    tensors keep their Graph for life.
    """

    _local = threading.local()

    def __init__(self, backend: str | None = None, *, track_memory: bool = False):
        backend = backend or os.environ.get(BACKEND_VAR, "inprocess") or "inprocess"
        if backend not in _BACKENDS:
            raise ValueError(f"unknown dtorch backend {backend!r}; choose one of {_BACKENDS} (env {BACKEND_VAR})")
        self.backend = backend
        # for error messages that must tell two graphs apart
        self.name = f"Graph #{next(_NUMBERS)} (backend {backend!r}, made in thread {threading.current_thread().name!r})"
        self.runtime = make_runtime(backend)
        self._mesh_stack: list[DeviceMesh] = []
        self._dtype_stack: list[torch.dtype] = []
        self._default_mesh = DeviceMesh("cpu")
        # Per-tensor bookkeeping costs about a microsecond per op, so it is on only when needed:
        # peak-memory tracking, or a backend that frees worker buffers when a tensor dies.
        self._track_memory = False
        self.tracks_tensors = False
        self._live: dict = {}  # mesh -> logical bytes per device (scalar when all equal, else vector)
        self._peak: dict = {}
        self._set_tracking(track_memory, release=getattr(self.runtime, "needs_release", False))

    # -- the per-thread default ----------------------------------------------------------------------
    @classmethod
    def default_graph(cls) -> "Graph":
        g = getattr(cls._local, "graph", None)
        if g is None:
            g = cls._local.graph = Graph()
        return g

    @classmethod
    def set_default_graph(cls, graph: "Graph") -> None:
        cls._local.graph = graph

    def __enter__(self) -> "Graph":
        """``with dtorch.Graph(backend="process") as g:``: tensors created inside (this thread) live in ``g``."""
        stack = getattr(self._local, "entered", None)
        if stack is None:
            stack = self._local.entered = []
        stack.append(getattr(self._local, "graph", None))
        self._local.graph = self
        return self

    def __exit__(self, *exc) -> None:
        self._local.graph = self._local.entered.pop()  # None: the next default_graph() makes a fresh one

    def __repr__(self) -> str:
        return f"<dtorch.{self.name}>"

    # -- guards ---------------------------------------------------------------------------------
    @property
    def default_device_mesh(self) -> DeviceMesh:
        return self._mesh_stack[-1] if self._mesh_stack else self._default_mesh

    @property
    def default_dtype(self) -> torch.dtype:
        return self._dtype_stack[-1] if self._dtype_stack else torch.get_default_dtype()

    @contextlib.contextmanager
    def device_mesh_guard(self, mesh: DeviceMesh):
        if not isinstance(mesh, DeviceMesh):
            raise MeshError(f"device_mesh_guard needs a DeviceMesh, got {type(mesh).__name__}")
        self._mesh_stack.append(mesh)
        try:
            yield mesh
        finally:
            self._mesh_stack.pop()

    @contextlib.contextmanager
    def dtype_guard(self, dtype: torch.dtype):
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype_guard needs a torch.dtype, got {dtype!r}")
        self._dtype_stack.append(dtype)
        try:
            yield dtype
        finally:
            self._dtype_stack.pop()

    # -- devices --------------------------------------------------------------------------------
    def satisfy(self, mesh: DeviceMesh) -> bool:
        """Does this machine have every device ``mesh`` names?"""
        cfg = getattr(self.runtime, "config", None)
        if cfg is None:
            from .runtime.devices import read_device_config

            cfg = read_device_config()
        return mesh_problems(mesh, cfg) is None

    def sync(self) -> None:
        self.runtime.sync()

    def sync_future(self):
        from .future import TensorFuture

        self.runtime.sync()
        return TensorFuture.completed(None)

    def empty_cache(self) -> None:
        self.runtime.empty_cache()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- memory accounting ---------------------------------------------------------------------
    def track_memory(self, enabled: bool = True) -> None:
        """Record peak bytes per device from now on (off by default: it costs ~1 us per op)."""
        self._set_tracking(enabled, release=getattr(self.runtime, "needs_release", False))
        if enabled:
            self._live = self._scan_live()
            self.reset_peak_memory_stats()

    def _set_tracking(self, memory: bool, release: bool) -> None:
        from .tensor import Tensor

        self._track_memory = memory
        self.tracks_tensors = memory or release
        if self.tracks_tensors:
            Tensor.__del__ = Tensor._finalize

    def _on_create(self, t) -> None:
        t._tracked = True
        if self._track_memory:
            self._account(t._spec, +1)

    def _on_delete(self, t) -> None:
        if self._track_memory:
            self._account(t._spec, -1)
        self.runtime.release(t._h)

    def _account(self, spec, sign: int) -> None:
        mesh = spec.mesh
        per_device = _device_bytes(spec)
        live = self._live.get(mesh, 0) + sign * per_device
        self._live[mesh] = live
        if sign > 0:
            peak = self._peak.get(mesh, 0)
            self._peak[mesh] = np.maximum(peak, live) if isinstance(live, np.ndarray) else max(peak, live)

    def _scan_live(self) -> dict:
        """Logical bytes per device of every live tensor of this graph (walks the garbage collector's objects)."""
        import gc

        from .tensor import Tensor

        live: dict = {}
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads obj.__class__, which warns on deprecated torch objects
            if issubclass(type(obj), Tensor) and getattr(obj, "_graph", None) is self:
                spec = obj._spec
                live[spec.mesh] = live.get(spec.mesh, 0) + _device_bytes(spec)
        return live

    def get_memory_stats(self, device_mesh: DeviceMesh | None = None) -> dict:
        """Logical bytes each device holds: ``{(device_type, id): {"allocated": n, "peak": n}}``.

        "allocated" counts every live tensor now. "peak" is tracked after ``track_memory()`` (else it
        equals "allocated"); a device's peak is the sum of the peaks of the meshes it belongs to (an
        upper bound when several meshes share devices).
        """
        live = self._live if self._track_memory else self._scan_live()
        peak = self._peak if self._track_memory else live
        out: dict = {}
        for table, field in ((live, "allocated"), (peak, "peak")):
            for mesh, val in table.items():
                vec = val if isinstance(val, np.ndarray) else np.full(mesh.size(), val)
                for dev_id, b in zip(mesh.device_ids, vec):
                    key = (mesh.device_type, dev_id)
                    out.setdefault(key, {"allocated": 0, "peak": 0})[field] += int(b)
        if device_mesh is not None:
            wanted = {(device_mesh.device_type, i) for i in device_mesh.device_ids}
            out = {k: v for k, v in out.items() if k in wanted}
            for k in wanted:
                out.setdefault(k, {"allocated": 0, "peak": 0})
        return dict(sorted(out.items()))

    def reset_peak_memory_stats(self) -> None:
        self._peak = {m: (v.copy() if isinstance(v, np.ndarray) else v) for m, v in self._live.items()}


def _device_bytes(spec):
    """Bytes each device of ``spec``'s mesh holds: an int when all equal, else a vector (cached on the spec)."""
    try:
        return spec._device_bytes
    except AttributeError:
        from .runtime.inprocess import per_device_bytes

        vec = per_device_bytes(spec)
        val = int(vec[0]) if spec.is_even() else vec
        object.__setattr__(spec, "_device_bytes", val)
        return val


def default_graph() -> Graph:
    return Graph.default_graph()


def check_one_graph(op: str, tensors) -> None:
    """Raise OpError when ``tensors`` (inputs of one op) belong to Graphs that cannot share blocks.

    Each Graph owns its devices' blocks (a process Graph: its own worker processes), so an op over
    tensors of two Graphs would read one Graph's handles in the other. In-process Graphs are the
    exception: their blocks are torch tensors of this process, readable by any in-process runtime
    (e.g. a model built in one thread and used from another, each with its thread's default Graph).
    Callers test ``t._graph is graph`` first and call this only on a mismatch (it costs nothing then).
    """
    first = tensors[0]._graph
    for n, t in enumerate(tensors):
        g = t._graph
        if g is first or (first.runtime.handles_in_process and g.runtime.handles_in_process):
            continue
        raise OpError(
            f"dtorch.{op}: input #0 belongs to {first.name} but input #{n} to {g.name}. Each Graph owns "
            "its devices' data (a process Graph its own worker processes), so tensors of two Graphs cannot "
            "meet in one op. Create all tensors under one Graph (`with g:` or `dtorch.Graph.set_default_graph(g)`; "
            "in a thread, set the Graph the other tensors use), or copy one tensor over with the other Graph as "
            "the default: `y = dtorch.Tensor(y.to_torch(), device_mesh=y.device_mesh, placements=y.placements)`"
        )
