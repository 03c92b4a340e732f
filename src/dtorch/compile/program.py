"""A trace run as worker programs (process and ray backends): a replayed step is one message per worker.

The per-call replay (compile/replay.py) still makes a record per runtime call on the controller: ~20 us per op
of Python, 8 ms for a small Llama training step. A backend that can keep programs on its workers
(``runtime.programs_supported``: the process and ray backends, runtime/process_program.py) takes the trace
lowered instead:

1. One replay runs call by call with the runtime *tapping* the records it sends (``begin_program`` /
   ``end_program``), and with the replay's placements of host data and its live kwargs (``dtorch.capture.live``:
   the optimizer's bias corrections) passed through ``_Tap``, so the runtime knows which blocks are host data and
   which kwargs change every step. The runtime lowers each worker's records into a program and sends it.
2. Each later replay runs the *driver* on the controller: the host torch code and its guards, the effects and
   live values (the optimizer's step count), the placements of host data, and the live kwargs, in replay order;
   then ``run_program`` sends one record per worker (its inputs' block ids, the live kwargs) and makes handles for
   the step's results. No record, plan look-up or handle per op.

A program holds what a step does on the devices and nothing the controller decides per step; a trace whose live
values or host values reach the devices other than as kwargs or placed data replays call by call (``reason``).
``DTORCH_COMPILE_PROGRAMS=0`` turns programs off (the per-call replay, as before). When the workers are replaced
(a recovery) the next replay records the program again; an armed fault (``inject_fault``) replays call by call
until it has fired, so it fires at its op.
"""
from __future__ import annotations

import os

from .. import commlog
from .host import same
from .record import Entry, Slot
from .replay import Miss, _describe, _Source, _slots, build, ordered

PLACEMENTS = frozenset({"from_global", "from_blocks", "zeros", "from_files"})
_KWARGS_AT = {"run": 1, "run_tracked": 1, "write": 5}  # where a device call's kwargs are (compile/record.py)
_TRIES = 2  # recordings that could not be lowered before the trace stays call by call


def enabled() -> bool:
    return os.environ.get("DTORCH_COMPILE_PROGRAMS", "1") not in ("0", "false", "no")


class _Tap:
    """What the recording replay hands the runtime besides its calls: the placed handles and live kwargs."""

    def __init__(self, live: set):
        self.live = live
        self.placed_handles: list = []
        self.params: list = []

    def placement(self, e: Entry) -> bool:
        return e.kind == "device" and e.method in PLACEMENTS

    def kwargs_at(self, e: Entry):
        n = _KWARGS_AT.get(e.method) if e.kind == "device" else None
        return n if n is not None and set(_slots(e.args[n], [])) & self.live else None

    def placed(self, h):
        self.placed_handles.append(h)
        return h

    def param(self, kw):
        self.params.append(kw)
        return kw


class OnWorkers:
    """A trace's replay as worker programs (module doc). ``run(X)`` replaces the replay function's call."""

    def __init__(self, runtime, entries: list[Entry], inputs: list[Slot], results: list[Slot], bindings: list):
        self.runtime = runtime
        self.handle_pos = [n for n, (kind, _) in enumerate(bindings) if kind != "torch"]
        live = {e.out.k for e in entries if e.kind == "live"}
        self.tap = _Tap(live)
        self.reason = _refusal(entries, inputs, results, bindings, live, self.tap)
        self.lowered = None
        self.failures = 0
        if self.reason is None:
            self.record = build(entries, inputs, results, tap=self.tap)
            self.drive = _driver(entries, inputs, results, self.tap)

    def run(self, replay, xs) -> tuple:
        rt, low = self.runtime, self.lowered
        ready = rt.program_ready(low)
        if low is not None and ready:
            placed, params = self.drive(xs)
            return rt.run_program(low, [xs[n] for n in self.handle_pos], placed, params)
        if low is not None and ready is None:  # its workers are gone (a recovery): record it again
            self.lowered = low = None
        if low is not None or not ready or self.failures >= _TRIES:
            return replay(xs)
        tap = self.tap
        tap.placed_handles, tap.params = [], []
        inputs = [xs[n] for n in self.handle_pos]
        cap = rt.begin_program()
        try:
            res = self.record(xs)
        except BaseException:
            rt.abort_program()
            raise
        finally:
            placed, params = tap.placed_handles, tap.params
            tap.placed_handles, tap.params = [], []
        got = rt.end_program(cap, inputs, placed, params, res)
        if isinstance(got, str):
            self.failures += 1
            self.reason = got
        else:
            self.lowered = got
        return res


def on_workers(runtime, entries, inputs, results, bindings):
    """The worker-program replay of a trace, or None where the backend has none or programs are off."""
    if not getattr(runtime, "programs_supported", False) or not enabled():
        return None
    got = OnWorkers(runtime, entries, inputs, results, bindings)
    return got if got.reason is None else None


def _refusal(entries, inputs, results, bindings, live, tap) -> str | None:
    """Why the trace cannot be a program (None: it can): every device call must take handles and constants, live
    values only as its kwargs, host values only as data placed."""
    handles = {s.k for s, (kind, _) in zip(inputs, bindings) if kind != "torch"}
    for e in entries:
        if e.kind == "device":
            handles.update(_slots(e.out, []))
    for e in entries:
        used = set(_slots((e.args, e.kwargs), []))
        if e.kind != "device":
            if used & handles:
                return f"Python code of the step ({getattr(e.target, '__name__', e.target)}) reads a device handle"
            continue
        if tap.placement(e):
            if used & handles:
                return "a placement of host data reads a device handle"
            continue
        n = tap.kwargs_at(e)
        rest = set(_slots([a for i, a in enumerate(e.args) if i != n], [])) | set(_slots(e.kwargs, []))
        kw = set(_slots(e.args[n], [])) if n is not None else set()
        if not rest <= handles or not kw <= live:
            return f"a host or live value reaches the devices other than as kwargs or placed data ({e.method})"
    if not {s.k for s in results} <= handles:
        return "the step's results are not all device handles"
    return None


def _driver(entries, inputs, results, tap):
    """``drive(X) -> (placed handles, live kwargs)``: the controller's part of a replay (module doc, step 2)."""
    src = _Source()
    src.consts.update(_same=same, _Miss=Miss, _commlog=commlog)
    body = ["def drive(X):", "    H = []", "    P = []"]
    body += [f"    s{s.k} = X[{n}]" for n, s in enumerate(inputs)]
    for e in ordered(entries, inputs, results):
        if e.kind == "guard":
            body.append(f"    if not _same({src.call(e)}, {src.const(e.out)}): "
                        f"raise _Miss({src.const(_describe(e))})")
        elif e.kind == "log":
            body.append(f"    if _commlog.is_recording(): {src.call(e)}")
        elif e.kind != "device":
            body.append(f"    {src.target(e.out)} = {src.call(e)}")
        elif tap.placement(e):
            body.append(f"    {src.target(e.out)} = {src.call(e)}")
            body.append(f"    H.append(s{e.out.k})")
        elif tap.kwargs_at(e) is not None:
            body.append(f"    P.append({src.expr(e.args[tap.kwargs_at(e)])})")
    body.append("    return H, P")
    namespace = dict(src.consts)
    exec(compile("\n".join(body), "<dtorch.compile driver>", "exec"), namespace)
    drive = namespace.pop("drive")
    drive.source = "\n".join(body)
    return drive

