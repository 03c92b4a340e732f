"""``dtorch.compile(fn, backend="inductor")``: each device's local program of a replay handed to ``torch.compile``.

On the in-process backend a replay runs the executables it recorded as bare torch calls on grids (every device's
block stacked in one tensor: runtime/inprocess.py), so the local program of all devices is plain torch code. Here
the replay's entries (compile/replay.py, in replay order) are cut into *segments*: runs of consecutive calls that
record no autograd and read nothing back, namely the kernels that run as one call on grids (``local_call``), the
collective steps between grids (``collective_grid_call``) and the in-place writes that are one grid call
(``write_grid_call``: the optimizer's update). Each segment of at least ``MIN_OPS`` calls becomes one Python
function of its input grids, generated from the entries, and goes to
``torch.compile(fullgraph=True, dynamic=False)``; the replay calls it in place of the calls. What records autograd
(a training forward's kept graphs, the backward), a placement of host data, stays as it was.

Python-state entries between two fused calls (an optimizer's step count, its bias corrections: ``capture.effect``
and ``capture.live``, host torch code, CommLog records) read no device value, so they move before the segment.

Floats that change every step (AdamW's ``step_size``, ``bias_correction2_sqrt``) would make torch.compile
recompile at every step (it specialises on them). So a segment runs eagerly on its first call and compiles on its
second: a float of a live kwargs dict that changed between the two is passed as a 0-d float64 tensor from then on
to the compiled function (the kernels take a 0-d tensor wherever they take a Python number).

A compiled call has a fixed cost (dynamo's guards, the wrappers: a few tenths of a ms on a CPU) that a few small
kernels do not repay: a segment times 3 compiled and 3 eager calls and keeps the faster way.

Copy-on-write (runtime/cow.py) is kept: a write's target is made writable (copied when anyone else sees it)
just before the segment runs, and a target must be an input of its segment that no other call of the segment
reads, so that nothing the segment does changes who sees it.

A segment torch.compile cannot take (a graph break, no C++ compiler) runs eagerly (the same function, not compiled)
and its reason is kept in ``Compiled.inductor.fallbacks`` (``dtorch.compile.explain`` prints them).
"""
from __future__ import annotations

import operator
import time
import weakref

import torch

from .record import Entry, Slot
from .replay import _slots, write_call

MIN_OPS = 3  # a compiled call's fixed cost (guards, wrappers) is more than one or two small kernels take
# writes whose live kwargs are positions (ints that change every step: a KV cache's slot); the optimizer's writes
# take live floats, which a segment passes as 0-d tensors (module doc)
_POSITION_WRITES = ("kv_cache.write",)
_MOVABLE = ("live", "effect", "log", "host")  # entries that read no device value: they may run before a segment
_COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "local_slice", "to_partial")


class Inductor:
    """The segments of one compiled function's traces, and why some run eagerly (module doc)."""

    def __init__(self):
        self._segments: list = []  # weak references: a segment lives as long as the replay that calls it
        self.fallbacks: list[str] = []
        self.slower = 0  # segments measured slower compiled than eager, run eagerly

    @property
    def segments(self) -> list:
        """The segments of the replays alive now."""
        self._segments = [r for r in self._segments if r() is not None]
        return [r() for r in self._segments]

    def fuse(self, order: list[Entry], results: list[Slot]) -> list[Entry]:
        """``order`` with every segment of ``MIN_OPS`` calls or more replaced by one call of a ``Segment``."""
        items = _group(order)
        read_after: set = {s.k for s in results}
        out: list = []
        for item in reversed(items):  # (backwards: which slots are read after each segment)
            if type(item) is Entry:
                out.append(item)
                read_after.update(_slots((item.args, item.kwargs), []))
                continue
            moved, calls = item
            if len(calls) < MIN_OPS:
                out += [e for e, _ in reversed(calls)]
            else:
                seg = Segment(self, calls, read_after)
                self._segments.append(weakref.ref(seg))
                out.append(Entry("device", seg, None, tuple(seg.inputs), {}, seg.outputs or None))
            for e, _ in calls:
                read_after.update(_slots((e.args, e.kwargs), []))
            out += reversed(moved)
        return out[::-1]

    def describe(self) -> str:
        ops = sum(len(s.calls) for s in self.segments)
        lines = [f"inductor: {len(self.segments)} segments ({ops} local calls) handed to torch.compile, "
                 f"{sum(s.compiled is not None for s in self.segments)} compiled so far (a segment compiles on its "
                 "second call)"]
        if self.slower:
            lines.append(f"  {self.slower} segments run eagerly: measured faster so (a compiled call's fixed cost)")
        lines += [f"  ran eagerly: {r}" for r in dict.fromkeys(self.fallbacks)]
        return "\n".join(lines)


def _fusable(e: Entry):
    """``("run", (f, handle_of, executable))``, ``("step", (f, handle_of))`` (a collective on grids) or
    ``("write", (f, writable, handle_of))`` for an entry a segment can take."""
    if e.kind != "device":
        return None
    if e.method == "run" and hasattr(e.target, "local_call"):
        handles, kwargs, device_args = e.args
        if _slots(kwargs, []) or any(type(h) is not Slot for h in handles):
            return None  # (a live value in the kwargs: a KV cache's positions, which change every step)
        got = e.target.local_call(kwargs, device_args)
        return None if got is None else ("run", (got[0], got[1], e.target))
    if e.method in _COLLECTIVES and hasattr(e.target, "collective_grid_call") and type(e.args[0]) is Slot:
        got = e.target.collective_grid_call(e.method, *e.args[1:])
        return None if got is None else ("step", got)
    if e.method == "write" and type(e.args[5]) is Slot and e.args[0].name in _POSITION_WRITES:
        return None  # (a segment boundary: its live slot would make torch.compile recompile at every step)
    got = write_call(e)
    return None if got is None else ("write", got)


def _group(order: list[Entry]) -> list:
    """``order`` as plain entries and ``(moved, calls)`` groups: consecutive fusable calls, and the Python-state
    entries that sat between them (run before the group)."""
    items: list = []
    moved, calls = [], []
    made: set = set()  # slots the open group makes
    read: set = set()  # slots the open group reads
    written: set = set()  # the targets (input slots) of its writes: no later call of the group may read them

    def close():
        nonlocal moved, calls
        if calls:
            items.append((moved, calls))
        else:
            items.extend(moved)
        moved, calls = [], []
        made.clear(), read.clear(), written.clear()

    for e in order:
        how = _fusable(e)
        reads = set(_slots((e.args, e.kwargs), []))
        if how is not None and (reads & written or (how[0] == "write" and (e.args[1].k in made or
                                                                           e.args[1].k in read))):
            close()  # it starts a new group: what it reads or writes is then an input, the writes before done
        if how is not None:
            calls.append((e, how))
            made.update(_slots(e.out, []))
            read.update(reads)
            if how[0] == "write":
                written.add(e.args[1].k)
        elif e.kind in _MOVABLE and calls and not reads & made:
            moved.append(e)
        else:
            close()
            items.append(e)
    close()
    return items


def _call(f, args: list, const) -> str:
    """The source of ``f(*args)``; an ``operator.methodcaller`` or ``itemgetter`` (a bound view kernel:
    ``x.reshape(*shape)``, ``x[items]``) as the call it makes, which torch.compile traces (it traces neither)."""
    if type(f) is operator.methodcaller:
        maker, margs = f.__reduce__()
        kwargs = {}
        if maker is not operator.methodcaller:  # (with keyword arguments: a partial of methodcaller)
            margs, kwargs = maker.args + tuple(margs), maker.keywords
        name, margs = margs[0], margs[1:]
        rest = [f"*{const(tuple(margs))}"] if margs else []
        rest += [f"**{const(dict(kwargs))}"] if kwargs else []
        return f"{args[0]}.{name}({', '.join(args[1:] + rest)})"
    if type(f) is operator.itemgetter and len(f.__reduce__()[1]) == 1:  # (a bound index: ``x[items]``)
        return f"{args[0]}[{const(f.__reduce__()[1][0])}]"
    return f"{const(f)}({', '.join(args)})"


class Segment:
    """Consecutive local calls of a replay as one function, compiled by torch.compile on its second call."""

    def __init__(self, owner: Inductor, calls: list, read_after: set):
        self.owner = owner
        self.calls = calls
        made, inputs, lives, specs = set(), [], [], {}
        self.writes = []  # (index of the target among the grid inputs, the write's output slot, writable)
        for e, (kind, got) in calls:
            if kind == "run":
                slots, in_specs = e.args[0], got[2].in_specs
                runtime = got[2].runtime()
            elif kind == "step":
                slots, in_specs, runtime = [e.args[0]], (e.args[1],), e.target
            else:
                slots, in_specs = [e.args[1]] + list(e.args[3]), (e.args[2],) + tuple(e.args[4])
                runtime = e.target
                if type(e.args[5]) is Slot and e.args[5].k not in lives:
                    lives.append(e.args[5].k)
            self.handle_of = got[-1] if kind == "write" else got[1]
            for s, spec in zip(slots, in_specs):
                if s.k not in made and s.k not in specs:
                    specs[s.k] = (spec, runtime)
                    inputs.append(s.k)
            made.update(_slots(e.out, []))
        self.grid_inputs = inputs
        self.specs = [specs[k] for k in inputs]
        self.lives = lives
        self.inputs = [Slot(k) for k in inputs + lives]
        outs = [s.k for e, (kind, _) in calls if kind != "write" for s in (e.out if kind == "run" else [e.out])
                if s.k in read_after]
        write_outs = []
        for e, (kind, got) in calls:
            if kind == "write":
                self.writes.append((inputs.index(e.args[1].k), got[1]))
                write_outs.append(e.out.k if e.out.k in read_after else None)
        self.outputs = [Slot(k) for k in outs] + [Slot(k) for k in write_outs if k is not None]
        self._keep_write = [k is not None for k in write_outs]
        self.fn = self._source(outs)
        self.compiled = None
        self.calls_made = 0
        self.first_lives = None
        self._times = ([], [])  # seconds of its eager calls and of its compiled calls while it is measured
        self.varying: list = []  # per live dict: the keys whose floats changed between the first two calls

    def _source(self, outs: list):
        consts: dict = {}

        def const(obj) -> str:
            name = f"c{len(consts)}"
            consts[name] = obj
            return name

        body = [f"def segment({', '.join(f's{k}' for k in self.grid_inputs + self.lives)}):"]
        for e, (kind, got) in self.calls:
            if kind == "run":
                body.append(f"    y = {_call(got[0], [f's{s.k}' for s in e.args[0]], const)}")
                if len(e.out) == 1:  # (a kernel of one output may return it alone or in a tuple)
                    body.append(f"    s{e.out[0].k} = y[0] if type(y) is tuple else y")
                else:
                    body.append(f"    {''.join(f's{s.k}, ' for s in e.out)} = y")
            elif kind == "step":
                body.append(f"    s{e.out.k} = {const(got[0])}(s{e.args[0].k})")
            else:
                kwargs = e.args[5]
                kw = f"s{kwargs.k}" if type(kwargs) is Slot else const(kwargs)
                args = ", ".join([f"s{e.args[1].k}"] + [f"s{s.k}" for s in e.args[3]] + [f"**{kw}"])
                body.append(f"    {const(got[0])}({args})")
                body.append(f"    s{e.out.k} = s{e.args[1].k}")
        body.append("    return (" + "".join(f"s{k}, " for k in outs) + ")")
        namespace = dict(consts)
        n = len(self.owner._segments)
        exec(compile("\n".join(body), f"<dtorch.compile inductor segment {n}>", "exec"), namespace)
        fn = namespace.pop("segment")
        fn.source = "\n".join(body)
        return fn

    def __call__(self, *args):
        n_grid = len(self.grid_inputs)
        handles = list(args[:n_grid])
        lives = args[n_grid:]
        del args
        for i, writable in self.writes:  # before any grid is taken: the copy-on-write counts references
            handles[i] = writable(handles[i], self.specs[i][0])
        grids = [h.grid if h.grid is not None else rt.as_grid(h, spec) for h, (spec, rt) in zip(handles, self.specs)]
        fn, times = self._function(lives)
        t0 = time.perf_counter()
        with torch.no_grad():
            outs = fn(*grids, *(lives if fn is self.fn else self._lives(lives)))
        if times is not None:
            times.append(time.perf_counter() - t0)
        del grids
        Sh = self.handle_of
        res = [Sh(grid=y) for y in outs]
        res += [handles[i] for (i, _), keep in zip(self.writes, self._keep_write) if keep]
        return res

    def _function(self, lives):
        """The function this call runs, and the list its time goes to while the segment is measured (else None):
        call 1 runs eagerly, call 2 compiles, calls 3-5 run compiled and calls 6-8 eagerly, timed; from call 9 the
        segment keeps the faster way (a compiled call has a fixed cost, its guards and wrappers, that a few small
        kernels do not repay)."""
        self.calls_made += 1
        n = self.calls_made
        if n == 1:
            self.first_lives = [dict(d) for d in lives]
            return self.fn, None
        if n == 2:
            self.varying = [[k for k, v in d.items() if type(v) is float and first.get(k) != v]
                            for d, first in zip(lives, self.first_lives)]
            changed = [k for d, first in zip(lives, self.first_lives) for k, v in d.items()  # (tensors are inputs)
                       if type(v) is not float and not isinstance(v, torch.Tensor) and first.get(k) is not v
                       and first.get(k) != v]
            self.first_lives = None
            if changed:
                return self._fallback(f"a live value other than a float changes from step to step ({changed[0]!r}):"
                                      " torch.compile would recompile at every step"), None
            self.compiled = torch.compile(self.fn, fullgraph=True, dynamic=False)
            return self._first_compiled, None
        if self.compiled is None:
            return self.fn, None
        if n <= 5:
            return self.compiled, self._times[1]
        if n <= 8:
            return self.fn, self._times[0]
        if n == 9 and min(self._times[1]) >= min(self._times[0]):
            self.compiled = None
            self.owner.slower += 1
            return self.fn, None
        return self.compiled, None

    def _first_compiled(self, *args):
        import torch._inductor.config  # (not at import: dtorch's import stays light)

        try:
            # segments are small: compiled in this process, no pool of compile workers to start (seconds on a CPU)
            with torch._inductor.config.patch(compile_threads=1):
                return self.compiled(*args)
        except Exception as exc:  # noqa: BLE001 (torch.compile's failures have many types; the function is intact)
            lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
            why = [ln for ln in lines[1:] if ln.startswith("Explanation:")]  # (dynamo's graph breaks say why)
            self._fallback(f"{type(exc).__name__}: {'; '.join(lines[:1] + why[:1])}")
            return self.fn(*args)

    def _fallback(self, reason: str):
        self.compiled = None
        self.varying = []
        self.owner.fallbacks.append(f"segment of {len(self.calls)} calls ({self._names()}): {reason}")
        return self.fn

    def _names(self) -> str:
        names = [getattr(getattr(e.args[0], "fn", None), "__name__", "write") if kind == "write" else
                 getattr(got[0], "__name__", type(got[0]).__name__) for e, (kind, got) in self.calls[:3]]
        return ", ".join(names) + (", ..." if len(self.calls) > 3 else "")

    def _lives(self, lives):
        if not self.varying or not any(self.varying):
            return lives
        return [d if not keys else dict(d, **{k: torch.tensor(d[k], dtype=torch.float64) for k in keys})
                for d, keys in zip(lives, self.varying)]
