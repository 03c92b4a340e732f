"""``dtorch.compile``: trace a step once, replay it (../shared/API.md section 15, docs/compile.md).

    step = dtorch.compile(train_step)      # or @dtorch.compile
    loss = step(model, opt, ids)           # 1st call: eager, traced; later calls with the same guards: replayed

The first call of a guard key runs ``fn`` eagerly with the Graph's runtime recording (compile/record.py). The
record is checked (every handle it used found on a tensor the step reaches, nothing read back to Python, the Python
state it changed understood) and turned into one straight-line function (compile/replay.py). A later call whose
guards hold runs that function on the new inputs and then does to Python objects what eager did: parameters and
optimizer states that took a new handle, ``.grad`` set or dropped, new output tensors. No rule, no plan look-up,
no Tensor object for an intermediate.

Guards: the arguments (dtorch tensors by spec, torch tensors by shape and dtype, Python scalars by value, other
objects by identity), grad mode and the Graph (the key); then, per trace, the specs of the tensors it found, which
``.grad`` were None, the modules' ``training`` flags, the optimizers' options and state count, the scalars of the
closure and globals, and the values Python read from the torch inputs. A miss traces again (at most
``max_traces`` traces per function, least recently used dropped). A step that reads a device value back to Python,
or that the library says it cannot follow (``dtorch.capture.refuse``), runs eagerly every time; ``explain``
prints why.

``backend="inductor"`` (in-process backend only): the replay's local calls that record no autograd run as segments
compiled by ``torch.compile`` (compile/inductor.py); values within torch.compile's tolerance of eager's.
"""
from __future__ import annotations

import functools

import torch

from .. import capture, commlog
from .._collector import collector_paused
from .._lru import LRU
from ..autograd.mode import is_grad_enabled
from ..graph import Graph
from ..tensor import Tensor
from .host import HostTracker
from .inductor import Inductor
from .record import Recorder, RecordingRuntime
from .replay import Miss, Unreplayable, build
from .state import arg_leaves, hooks_of, roots, walk, writes
from .trace import Trace, TraceError, settle

__all__ = ["compile", "explain", "Compiled"]

_WARMUPS = 3  # traces in a row that make new state (an optimizer's first step) before the step is run eagerly


class Compiled:
    """A compiled step: call it as the function (module doc)."""

    def __init__(self, fn, backend: str = "eager", max_traces: int = 8):
        if backend not in ("eager", "inductor"):
            raise ValueError(f"dtorch.compile: backend must be 'eager' or 'inductor', got {backend!r}")
        if not callable(fn):
            raise TypeError(f"dtorch.compile expects a function, got {type(fn).__name__}")
        if isinstance(max_traces, bool) or not isinstance(max_traces, int) or max_traces < 1:
            raise ValueError(f"dtorch.compile: max_traces must be a positive int, got {max_traces!r}")
        self.fn = fn
        self.backend = backend
        self._traces = LRU(f"dtorch.compile({getattr(fn, '__qualname__', fn)})", max(2, max_traces))  # (the LRU's least)
        self._warmups = LRU("dtorch.compile warm-ups", 2 * max_traces)  # key -> warm-up traces in a row
        self.stats = {"traces": 0, "replays": 0, "eager": 0, "misses": 0}
        # backend="inductor": the compiled segments of the replays and the reasons some run eagerly
        self.inductor = Inductor() if backend == "inductor" else None
        self.last_reason: str | None = None
        functools.update_wrapper(self, fn)

    @collector_paused
    def __call__(self, *args, **kwargs):
        if capture.active() is not None:  # inside another trace: that one records what this runs
            return self.fn(*args, **kwargs)
        graph = _graph_of(args, kwargs)
        if graph is None or graph.tracks_memory or not graph.runtime.holds_values:
            self.stats["eager"] += 1
            return self.fn(*args, **kwargs)
        if self.inductor is not None and not graph.runtime.handles_in_process:
            raise ValueError(f"dtorch.compile(backend='inductor') runs on the in-process backend only for now; this "
                             f"step's Graph runs on {graph.runtime.name!r}: use backend='eager' there")
        key = _key(graph, args, kwargs)
        trace = self._traces.get(key)
        if trace is not None:
            if trace.eager_reason is not None:
                self.stats["eager"] += 1
                return self.fn(*args, **kwargs)
            if trace.holds(args, kwargs):
                try:
                    out = trace.replay(graph, args, kwargs)
                except Miss as miss:
                    self.last_reason = str(miss)
                else:
                    self.stats["replays"] += 1
                    return out
            self.stats["misses"] += 1
        return self._trace(graph, key, args, kwargs)

    def _trace(self, graph, key, args, kwargs):
        self.stats["traces"] += 1
        found = walk((args, kwargs), roots(self.fn))
        before = {i: (t, t._h, writes(t), None if t._ag is None else t._ag.grad) for i, (t, _) in found.tensors.items()}
        rec = Recorder(graph.runtime)
        host = HostTracker(rec)
        torch_inputs = [(host.track(t), path) for path, t in found.torch_args]
        real_runtime, real_log = graph.runtime, commlog.record

        def log(*a, **kw):
            if not rec.passthrough:
                rec.note_log(a, kw)
            return real_log(*a, **kw)

        graph.runtime = RecordingRuntime(rec)
        commlog.record = log
        capture.set_active(rec)
        try:
            with host:
                out = self.fn(*args, **kwargs)
                # a view's storage is made when first read (from its base): read it while the trace records
                for _, leaf in arg_leaves(out):
                    if isinstance(leaf, Tensor):
                        leaf._h  # noqa: B018
        finally:
            capture.set_active(None)
            commlog.record = real_log
            graph.runtime = real_runtime
        try:
            trace = settle(rec, found, before, torch_inputs, out, args, kwargs, self.fn)
            hooks = hooks_of(found)
            if hooks is not None:
                raise TraceError(hooks)
            if trace is not None:
                trace.program = build(rec.entries, trace.inputs, trace.results)
                trace.entries = rec.entries
                trace.fuse = None if self.inductor is None else self.inductor.fuse
        except (TraceError, Unreplayable) as exc:
            trace = Trace.eager(str(exc))
        finally:
            rec.drop()
        if trace is None:  # a warm-up: new state was made (an optimizer's first step)
            n = self._warmups[key] = self._warmups.get(key, 0) + 1
            if n < _WARMUPS:
                return out
            trace = Trace.eager(f"every call made new state ({n} traces in a row): the step is not steady")
        self._warmups[key] = 0
        self.last_reason = trace.eager_reason
        self._traces[key] = trace
        return out

    def explain(self, *args, **kwargs) -> str:
        """Trace ``fn(*args, **kwargs)`` (running it once) and say what a replay would do or why it cannot."""
        graph = _graph_of(args, kwargs)
        if graph is None:
            return "no dtorch tensor, module or default Graph found: the function runs eagerly"
        key = _key(graph, args, kwargs)
        self._trace(graph, key, args, kwargs)
        trace = self._traces.get(key)
        if trace is None:
            return "the call made new state (a warm-up, e.g. an optimizer's first step): call explain again"
        text = trace.describe()
        return text if self.inductor is None else text + "\n" + self.inductor.describe()


def compile(fn=None, *, backend: str = "eager", max_traces: int = 8):
    """``dtorch.compile(fn)`` or ``@dtorch.compile`` / ``@dtorch.compile(backend=...)``: a ``Compiled`` step."""
    if fn is None:
        return lambda f: Compiled(f, backend=backend, max_traces=max_traces)
    return Compiled(fn, backend=backend, max_traces=max_traces)


def explain(fn, *args, **kwargs) -> str:
    """``dtorch.compile.explain(fn, *args)``: run ``fn`` once traced and return (and print) its guards, what the
    replay runs, and the graph breaks that make it run eagerly."""
    step = fn if isinstance(fn, Compiled) else Compiled(fn)
    text = step.explain(*args, **kwargs)
    print(text)
    return text


compile.explain = explain


def _graph_of(args, kwargs):
    for _, leaf in arg_leaves((args, kwargs)):
        if isinstance(leaf, Tensor):
            return leaf._graph
    return Graph.default_graph()


def _key(graph, args, kwargs) -> tuple:
    parts = [id(graph), id(graph.runtime), is_grad_enabled()]
    for path, leaf in arg_leaves((args, kwargs)):
        if isinstance(leaf, Tensor):
            ag = leaf._ag
            parts.append((path, leaf._spec, ag is not None and (ag.requires_grad or ag.grad_fn is not None)))
        elif isinstance(leaf, torch.Tensor):
            parts.append((path, tuple(leaf.shape), leaf.dtype, leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            parts.append((path, type(leaf), leaf))
        else:
            parts.append((path, id(leaf)))
    return tuple(parts)
