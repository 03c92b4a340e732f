"""Graph: the controller. The runtime (backend), sync, memory statistics; the default mesh/dtype guards.

The default mesh and dtype live in ``dtorch.context`` (per thread); a Graph's guards are those. The
backend comes from ``dtorch.runtime.registry``. Memory accounting is an observer: while a Graph
tracks memory, it counts a storage handle's bytes when a tensor first shows it and asks the runtime
(``Runtime.observe``) to call back when that handle dies.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import os
import threading
import weakref

import numpy as np
import torch

from . import _collector, context
from .errors import OpError
from .mesh import DeviceMesh
from .runtime.devices import mesh_problems, read_device_config
from .runtime.registry import check_backend, make_runtime  # noqa: F401  (make_runtime: the old import path)

BACKEND_VAR = "DTORCH_BACKEND"
_NUMBERS = itertools.count(1)
# The tensor classes whose objects the memory scan counts; tensor.py registers dtorch.Tensor (graph.py
# may not import tensor.py: the layers point down).
_TENSOR_TYPES: list[type] = []
# each registered class's ``_h`` slot, read as it lies: a subclass may put a property in front of it (a view's
# computes its value), and a view whose value was never computed holds no storage of its own
_HANDLE_SLOTS: dict = {}
# What the accounted bytes are, as FSDP2's memory tracker splits them: the parameters (sharded, as held),
# their gradients, the optimizer states, fsdp-gathered copies of parameters (and their mixed-precision
# casts), and everything else (activations: what the forward keeps for the backward, and the temporaries
# of the moment). A handle is an activation unless labelled (``Graph.label_memory`` / ``memory_kind``).
MEMORY_KINDS = ("params", "grads", "optimizer", "gathered", "activations")


def register_tensor_type(cls: type) -> type:
    """Objects of ``cls`` (with ``_spec``, ``_h``, ``_graph`` slots) count in ``get_memory_stats``."""
    if cls not in _TENSOR_TYPES:
        _TENSOR_TYPES.append(cls)
        _HANDLE_SLOTS[cls] = cls.__dict__["_h"].__get__
    return cls


class GraphOption:
    """How a Graph runs (the original DTorch's ``dtorch.graph.GraphOption``), passed as ``Graph(option)``.

    ``per_device_per_process=True``: one worker process per device (the process backend); None (the
    default, as in the original) or False: the default backend (in-process, unless ``DTORCH_BACKEND``
    says otherwise)."""

    def __init__(self, per_device_per_process: bool | None = None):
        self.per_device_per_process = None if per_device_per_process is None else bool(per_device_per_process)

    @property
    def backend(self) -> str | None:
        return "process" if self.per_device_per_process else None

    def __repr__(self):
        return f"GraphOption(per_device_per_process={self.per_device_per_process})"


class Graph:
    """The controller: the runtime (backend), the default mesh/dtype guards, sync and memory statistics.

    Tensors are created in the current thread's default Graph. A new Graph becomes the default
    inside ``with graph:`` (restored after), or from now on with ``Graph.set_default_graph(graph)``;
    tensors keep their Graph for life.
    """

    _local = threading.local()

    def __init__(self, backend: "str | GraphOption | None" = None, *, track_memory: bool = False):
        if isinstance(backend, GraphOption):
            backend = backend.backend
        backend = backend or os.environ.get(BACKEND_VAR, "inprocess") or "inprocess"
        check_backend(backend, f" (argument backend= or env {BACKEND_VAR})")
        self.backend = backend
        # for error messages that must tell two graphs apart
        self.name = f"Graph #{next(_NUMBERS)} (backend {backend!r}, made in thread {threading.current_thread().name!r})"
        self.runtime = make_runtime(backend)
        # Memory accounting costs a finalizer per storage handle, so it is on only after track_memory().
        # Tensor._make/_init call _on_handle while it is on.
        self.tracks_memory = False
        self._held: dict = {}  # token -> [mesh, bytes per device, kind, id(handle)] of each observed live handle
        self._tokens = itertools.count()
        self._live: dict = {}  # mesh -> logical bytes per device (scalar when all equal, else vector)
        self._peak: dict = {}
        self._kind_live: dict = {}  # (kind, mesh) -> logical bytes per device
        self._kind_peak: dict = {}  # (kind, mesh) -> the most this kind held
        self._at_peak: dict = {}  # mesh -> {kind: bytes} when the mesh's total peaked
        self._token_of: dict = {}  # id(handle) -> token (relabelling)
        self._labels = weakref.WeakKeyDictionary()  # handle -> kind, labelled while not tracking
        self._kind_now = "activations"  # the kind of handles born now (``memory_kind``)
        if track_memory:
            self.track_memory()

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

    # -- guards (per thread, shared by every Graph of the thread: dtorch.context) ------------------------
    @property
    def default_device_mesh(self) -> DeviceMesh:
        return context.default_device_mesh()

    @property
    def default_dtype(self) -> torch.dtype:
        return context.default_dtype()

    def device_mesh_guard(self, mesh: DeviceMesh):
        return context.device_mesh_guard(mesh)

    def dtype_guard(self, dtype: torch.dtype):
        return context.dtype_guard(dtype)

    # -- devices --------------------------------------------------------------------------------
    def satisfy(self, mesh: DeviceMesh) -> bool:
        """Does this machine have every device ``mesh`` names?"""
        cfg = getattr(self.runtime, "config", None)
        return mesh_problems(mesh, cfg if cfg is not None else read_device_config()) is None

    def sync(self) -> None:
        self.runtime.sync()

    def worker_pids(self) -> dict:
        """Device id -> the process id of the worker holding that device's blocks (process and ray backends;
        {} while no worker runs, and on backends whose devices live in this process)."""
        return self.runtime.worker_pids()

    def sync_future(self):
        """``sync()`` as a future (``dtorch.VoidFutureCollect``: ``get/wait/is_ready/await``)."""
        from .future import VoidFutureCollect

        self.runtime.sync()
        return VoidFutureCollect.completed()

    def empty_cache(self) -> None:
        self.runtime.empty_cache()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- memory accounting ---------------------------------------------------------------------
    def track_memory(self, enabled: bool = True) -> None:
        """Record peak bytes per device from now on (off by default: it costs a finalizer per tensor)."""
        self.tracks_memory = bool(enabled)
        self.runtime.measure_tapes = self.tracks_memory
        if enabled:
            _collector.measuring.add(self)
        else:
            _collector.measuring.discard(self)
        if enabled:
            # handles born while tracking was off: observe them now, so each live one is counted once
            # and subtracted when it dies
            for h, spec in self._live_handles().values():
                self._observe(h, spec)
            live: dict = {}
            kind_live: dict = {}
            for mesh, b, kind, _ in list(self._held.values()):
                live[mesh] = live.get(mesh, 0) + b
                kind_live[(kind, mesh)] = kind_live.get((kind, mesh), 0) + b
            self._live, self._kind_live = live, kind_live
            self.reset_peak_memory_stats()

    def _on_handle(self, handle, spec) -> None:
        """A tensor shows ``handle`` (laid out as ``spec``): count it, the first time, until it dies."""
        token = self._observe(handle, spec, self._kind_now)
        if token is not None and self.tracks_memory:
            mesh, per_device, kind, _ = self._held[token]
            self._add(mesh, kind, per_device)

    def _add(self, mesh, kind, per_device) -> None:
        live = self._live.get(mesh, 0)
        if isinstance(live, np.ndarray) or isinstance(per_device, np.ndarray):
            self._snapshot_peak(mesh)  # (the vector form below keeps a breakdown per device)
        live = live + per_device
        self._live[mesh] = live
        key = (kind, mesh)
        k_live = self._kind_live.get(key, 0) + per_device
        self._kind_live[key] = k_live
        k_peak = self._kind_peak.get(key, 0)
        self._kind_peak[key] = np.maximum(k_peak, k_live) if isinstance(k_live, np.ndarray) else max(k_peak, k_live)
        peak = self._peak.get(mesh, 0)
        if isinstance(live, np.ndarray) or isinstance(peak, np.ndarray):
            higher = np.asarray(live > peak)
            if higher.any():
                self._peak[mesh] = np.maximum(peak, live)
                old = self._at_peak.get(mesh, {})
                self._at_peak[mesh] = {k: np.where(higher, self._kind_live.get((k, mesh), 0), old.get(k, 0))
                                       for k in MEMORY_KINDS}
        elif live > peak:
            self._peak[mesh] = live
            self._at_peak[mesh] = None  # (taken lazily: a snapshot on every new peak would cost a dict per op)

    def _observe(self, handle, spec, kind="activations"):
        """Ask the runtime to report ``handle``'s death; its token, or None if already observed."""
        token = next(self._tokens)
        self._held[token] = [spec.mesh, _device_bytes(spec), self._labels.get(handle, kind), id(handle)]
        if not self.runtime.observe(handle, functools.partial(_handle_freed, weakref.ref(self), token)):
            del self._held[token]
            return None
        self._token_of[id(handle)] = token
        return token

    def _on_free(self, token) -> None:
        entry = self._held.pop(token, None)
        if entry is None:
            return
        mesh, per_device, kind, hid = entry
        if self._token_of.get(hid) == token:
            del self._token_of[hid]
        if self.tracks_memory:
            self._snapshot_peak(mesh)
            self._live[mesh] = self._live.get(mesh, 0) - per_device
            self._kind_live[(kind, mesh)] = self._kind_live.get((kind, mesh), 0) - per_device

    def _snapshot_peak(self, mesh) -> None:
        """Take the breakdown of a scalar peak before the live bytes fall below it (the peak was the state
        just before the first free that follows it)."""
        if mesh in self._at_peak and self._at_peak[mesh] is None:
            self._at_peak[mesh] = {k: self._kind_live.get((k, mesh), 0) for k in MEMORY_KINDS}

    # -- what the bytes are --------------------------------------------------------------------------
    def label_memory(self, handle, kind: str) -> None:
        """Count ``handle``'s bytes as ``kind`` (one of ``MEMORY_KINDS``) from now on (a gradient stored in
        ``.grad``, an optimizer state, a parameter); remembered for when tracking starts later."""
        token = self._token_of.get(id(handle))
        entry = None if token is None else self._held.get(token)
        if not self.tracks_memory or entry is None:
            self._labels[handle] = kind
            if entry is not None:  # observed in an earlier tracking period
                entry[2] = kind
            return
        if entry[2] == kind:
            return
        mesh, per_device, old, _ = entry
        self._snapshot_peak(mesh)
        self._kind_live[(old, mesh)] = self._kind_live.get((old, mesh), 0) - per_device
        entry[2] = kind
        self._live[mesh] = self._live.get(mesh, 0) - per_device
        self._add(mesh, kind, per_device)

    def _rehandle(self, t, new) -> None:
        """Tensor ``t``'s storage moves to handle ``new`` (a copy-on-write write); it keeps its kind."""
        old = t._h
        token = self._token_of.get(id(old))
        entry = None if token is None else self._held.get(token)
        kind = entry[2] if entry is not None else self._labels.get(old)
        t._h = new
        del old, entry  # (the old storage may die here, before the new one is counted)
        if self.tracks_memory:
            before, self._kind_now = self._kind_now, kind or self._kind_now
            try:
                self._on_handle(new, t._spec)
            finally:
                self._kind_now = before
        elif kind is not None:
            self._labels[new] = kind

    @contextlib.contextmanager
    def memory_kind(self, kind: str):
        """Handles born inside count as ``kind`` (while tracking; a no-op otherwise)."""
        before, self._kind_now = self._kind_now, kind
        try:
            yield
        finally:
            self._kind_now = before

    def count_memory(self, owner, mesh, per_device, kind: str = "activations"):
        """Count ``per_device`` bytes on ``mesh`` that no handle shows (a local autograd graph's saved
        tensors) until ``owner`` dies or ``uncount_memory(token)``; returns the token (None if not tracking)."""
        if not self.tracks_memory or not np.any(per_device):
            return None
        token = next(self._tokens)
        self._held[token] = [mesh, per_device, kind, None]
        weakref.finalize(owner, _handle_freed, weakref.ref(self), token)
        self._add(mesh, kind, per_device)
        return token

    def uncount_memory(self, token) -> None:
        if token is not None:
            self._on_free(token)

    def _live_handles(self) -> dict:
        """id(handle) -> (handle, spec) of every live tensor of this graph (walks the garbage collector's objects).

        Tensors that share a handle (clone, detach, Parameter) share storage: it counts once.
        """
        types = tuple(_TENSOR_TYPES)
        out: dict = {}
        if not types:
            return out
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads obj.__class__, which warns on deprecated torch objects
            if issubclass(type(obj), types) and getattr(obj, "_graph", None) is self:
                slot = next(get for cls, get in _HANDLE_SLOTS.items() if isinstance(obj, cls))
                try:
                    h = slot(obj)
                except AttributeError:  # a view not computed yet
                    continue
                out.setdefault(id(h), (h, obj._spec))
        return out

    def _scan_live(self) -> dict:
        live: dict = {}
        for _, spec in self._live_handles().values():
            live[spec.mesh] = live.get(spec.mesh, 0) + _device_bytes(spec)
        return live

    def get_memory_stats(self, device_mesh: DeviceMesh | None = None) -> dict:
        """Logical bytes each device holds: ``{(device_type, id): {"allocated": n, "peak": n}}``.

        "allocated" counts every live tensor now (tensors sharing storage, such as a clone, once).
        "peak" is tracked after ``track_memory()`` (else it equals "allocated"); a device's peak is the
        sum of the peaks of the meshes it belongs to (an upper bound when several meshes share devices).
        """
        live = self._live if self.tracks_memory else self._scan_live()
        peak = self._peak if self.tracks_memory else live
        out: dict = {}
        for table, field in ((live, "allocated"), (peak, "peak")):
            for mesh, val in list(table.items()):
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

    def get_memory_breakdown(self, device_mesh: DeviceMesh | None = None) -> dict:
        """What each device's accounted bytes are (tracked after ``track_memory()``):
        ``{(device_type, id): {kind: {"allocated": n, "peak": n, "at_peak": n}}}`` for each kind of
        ``MEMORY_KINDS``. "peak" is the most that kind held at any time; "at_peak" what it held when the
        device's total peaked (the kinds' "at_peak" add up to ``get_memory_stats()``'s "peak")."""
        tables = [(self._kind_live, "allocated"), (self._kind_peak, "peak")]
        at_peak = {}
        for mesh, kinds in self._at_peak.items():
            if kinds is None:  # the peak is now: nothing was freed since
                kinds = {k: self._kind_live.get((k, mesh), 0) for k in MEMORY_KINDS}
            at_peak.update({(k, mesh): v for k, v in kinds.items()})
        tables.append((at_peak, "at_peak"))
        out: dict = {}
        meshes = {mesh for table, _ in tables for (_, mesh) in table}
        for mesh in meshes:
            for dev_id in mesh.device_ids:
                out.setdefault((mesh.device_type, dev_id), {k: {"allocated": 0, "peak": 0, "at_peak": 0}
                                                            for k in MEMORY_KINDS})
        for table, field in tables:
            for (kind, mesh), val in list(table.items()):
                vec = val if isinstance(val, np.ndarray) else np.full(mesh.size(), val)
                for dev_id, b in zip(mesh.device_ids, vec):
                    out[(mesh.device_type, dev_id)][kind][field] += int(b)
        if device_mesh is not None:
            wanted = {(device_mesh.device_type, i) for i in device_mesh.device_ids}
            out = {k: v for k, v in out.items() if k in wanted}
            for k in wanted:
                out.setdefault(k, {kind: {"allocated": 0, "peak": 0, "at_peak": 0} for kind in MEMORY_KINDS})
        return dict(sorted(out.items()))

    def reset_peak_memory_stats(self) -> None:
        self._peak = {m: (v.copy() if isinstance(v, np.ndarray) else v) for m, v in self._live.items()}
        self._kind_peak = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in self._kind_live.items()}
        self._at_peak = {m: None for m in self._live}


def _handle_freed(graph_ref, token) -> None:
    """The runtime's callback when an observed handle dies (holds the Graph weakly: handles may outlive it)."""
    g = graph_ref()
    if g is not None:
        g._on_free(token)


def _device_bytes(spec):
    """Bytes each device of ``spec``'s mesh holds: an int when all equal, else a vector (cached on the spec)."""
    try:
        return spec._device_bytes
    except AttributeError:
        vec = spec.device_bytes()
        val = int(vec[0]) if spec.is_even() else vec
        object.__setattr__(spec, "_device_bytes", val)
        return val


class _DefaultGraph:
    """``dtorch.default_graph``: this thread's default Graph, as an object (``dtorch.default_graph.sync()``,
    the original DTorch's spelling) and when called (``dtorch.default_graph()``, returning the Graph itself).
    Every attribute is the current default Graph's, looked up at each use, so it follows ``with graph:``
    and ``Graph.set_default_graph``."""

    __slots__ = ()

    def __call__(self) -> Graph:
        return Graph.default_graph()

    def __getattr__(self, name):
        return getattr(Graph.default_graph(), name)

    def __setattr__(self, name, value):
        setattr(Graph.default_graph(), name, value)

    def __enter__(self) -> Graph:
        return Graph.default_graph().__enter__()

    def __exit__(self, *exc) -> None:
        Graph._local.graph.__exit__(*exc)

    def __eq__(self, other):
        return other is self or other is Graph.default_graph()

    def __hash__(self):
        return hash(Graph.default_graph())

    def __repr__(self) -> str:
        return repr(Graph.default_graph())


default_graph = _DefaultGraph()


def resolve_graph(graph) -> Graph:
    """The Graph a ``graph=`` argument names: a Graph, ``dtorch.default_graph`` (the object), or None (the
    default)."""
    if graph is None or isinstance(graph, _DefaultGraph):
        return Graph.default_graph()
    if not isinstance(graph, Graph):
        raise TypeError(f"graph= must be a dtorch.Graph (e.g. dtorch.default_graph()), got {type(graph).__name__}")
    return graph


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
