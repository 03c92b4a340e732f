"""Compiled steps as worker programs (process and ray backends): a replayed step is one message per worker.

A ``dtorch.compile``d step replays the same runtime calls every time, so each worker gets the same records every
time but for three things: the ids of the blocks the step makes (fresh ids each step), the ids of its inputs (a
parameter that took a new handle), and the kwargs that carry live values (the optimizer's bias corrections).
So the controller taps the records one replay sends (``begin_program`` / ``end_program``), and lowers each
worker's share into a *program*: its records with every block id a slot (an input's index, or an offset from a
base id) and every live kwargs dict a parameter. The program goes to the worker once (``Program``); a later step
is ``run_program``: one ``RunProgram`` per worker with the input ids, a fresh base id, the op numbers and the
parameters. The worker (``ProgramWorker``) rebuilds the records from its program and runs them through its usual
handlers, so the bits are the per-call replay's.

What stays out of a program: plan definitions, process-group creation and forgets (sent while the tap ran, kept
by the worker: a program holds the definitions it uses, so a later forget does not break it), frees of blocks
the step did not make (they go as usual when their handle dies), and the placements of host data (the controller
places them before each run and passes them as inputs). A recording that holds anything else (a fetch, a sync, a
fault) is not lowered. A program belongs to one pool of workers: after a recovery (a new epoch) the step is
recorded again; a dropped program object drops it on the workers (``DropProgram``).
"""
from __future__ import annotations

import itertools
import weakref

from ..errors import RuntimeBackendError
from . import protocol as rec
from .process_ops import Handle


class Param:
    """In a program record: the ``n``-th parameter of the run (a kwargs dict or value computed at each step)."""
    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __reduce__(self):
        return (Param, (self.n,))


# how each record kept in a program names blocks: field -> "seq" (op number), "id", "ids", "pairs" (MoveInto),
# "kw" (a kwargs dict that may be a parameter)
SLOTS = {
    rec.Kernel: {"seq": "seq", "in_ids": "ids", "out_ids": "ids", "kwargs": "kw"},
    rec.Write: {"seq": "seq", "tid": "id", "in_ids": "ids", "kwargs": "kw"},
    rec.Step: {"seq": "seq", "in_id": "id", "out_id": "id"},
    rec.RingShift: {"seq": "seq", "in_id": "id", "out_id": "id"},
    rec.MoveInto: {"seq": "seq", "ids": "pairs"},
    rec.Alias: {"hid": "id", "new_id": "id"},
    rec.Free: {"ids": "ids"},
    rec.Zeros: {"seq": "seq", "hid": "id"},
    rec.FileRead: {"seq": "seq", "hid": "id"},
    rec.Put: {"seq": "seq", "hid": "id"},  # only with its bytes in the record (a constant the runtime placed)
}
SETUP = (rec.DefineKernel, rec.DefineStep, rec.DefineMoveInto, rec.DefineRingShift, rec.Groups)
PLANNED = (rec.Kernel, rec.Write, rec.Step, rec.MoveInto, rec.RingShift)  # (kind, seq, pid, ...)
_FIELDS = {kind: tuple((1 + kind.fields.index(f), how) for f, how in slots.items())
           for kind, slots in SLOTS.items()}


class NotLowered(Exception):
    """The tapped records cannot become a program (the reason); the step replays call by call."""


class Lowered:
    """A program on the workers of one epoch: what ``run_program`` needs on the controller."""

    def __init__(self, pgid, epoch, ranks, span, seqs, whats, outs, params_of, plan):
        self.pgid, self.epoch, self.ranks = pgid, epoch, ranks
        self.span, self.seqs, self.whats = span, seqs, whats  # ids it makes; op numbers it uses; what they were
        self.outs = outs  # per result: ("local", offset, ranks) | ("input", index)
        self.params_of = params_of  # rank -> the parameter indices its program reads
        self.plan = plan  # rank -> its program's records (kept to describe, and for tests)


class ProgramControl:
    """The controller's side (mixed into ``process.ProcessRuntime``; module doc)."""

    programs_supported = True

    # -- recording ---------------------------------------------------------------------------------
    def begin_program(self):
        """Tap every record from now on (after pushing what is queued)."""
        with self._lock:
            self.flush()
            self._tap = {}
            return (self._epoch, next(self._ids), next(self._seq))

    def abort_program(self) -> None:
        """The recorded replay failed: stop tapping."""
        with self._lock:
            self._tap = None

    def end_program(self, cap, inputs, placed, params, results):
        """Stop tapping and lower what was tapped: a ``Lowered`` (sent to the workers) or the reason it cannot be."""
        with self._lock:
            try:
                self.flush()
            finally:
                tapped, self._tap = self._tap, None
            epoch, first, seq0 = cap
            end, seq_end = next(self._ids), next(self._seq)
            try:
                if epoch != self._epoch or self._pool is None:
                    raise NotLowered("the workers were replaced while the step was recorded")
                return self._lower(tapped, first, end, seq0, seq_end, inputs, placed, params, results)
            except NotLowered as exc:
                return str(exc)

    def _lower(self, tapped, first, end, seq0, seq_end, inputs, placed, params, results):
        index: dict = {}
        for n, h in enumerate(list(inputs) + list(placed)):
            if index.setdefault(h.id, n) != n:
                raise NotLowered("two inputs of the step share one block")
        placed_ids = {h.id for h in placed}
        param_of = {}
        for n, p in enumerate(params):
            param_of.setdefault(id(p), n)

        def slot(i):
            got = index.get(i)
            if got is not None:
                return ~got
            if first < i < end:
                return i - first
            raise NotLowered(f"the step names block {i}, which it neither made nor took as an input")

        plan: dict = {}
        params_of: dict = {}
        made, freed, seqs, forgotten, planned = set(), set(), set(), set(), set()
        found_params = set()
        for r, recs in tapped.items():
            prog, mine = [], {}
            for record in recs:
                kind = record[0]
                if kind in SETUP:
                    continue
                if kind is rec.Forget:
                    forgotten.update(record[1])  # checked below: no program record may use a forgotten plan
                    continue
                if kind not in SLOTS:
                    raise NotLowered(f"the step sends a {kind.__name__} record (a fetch, a sync or a fault)")
                if kind in (rec.Put, rec.Zeros, rec.FileRead) and record[2] in placed_ids:
                    continue  # host data: placed by the controller before each run
                if kind is rec.Put and not isinstance(record[-1], bytes):
                    raise NotLowered("the runtime placed a large constant inside the step")
                out = list(record)
                for pos, how in _FIELDS[kind]:
                    v = record[pos]
                    if how == "seq":
                        out[pos] = v - seq0
                        seqs.add(v)
                    elif how == "id":
                        out[pos] = slot(v)
                    elif how == "ids":
                        out[pos] = tuple(slot(i) for i in v if kind is not rec.Free or first < i < end
                                         and i not in placed_ids)
                    elif how == "pairs":
                        out[pos] = tuple((slot(a), slot(b)) for a, b in v)
                    elif id(v) in param_of:
                        n = param_of[id(v)]
                        out[pos] = Param(mine.setdefault(n, len(mine)))
                        found_params.add(n)
                if kind is rec.Free:
                    if not out[1]:
                        continue
                    freed.update(out[1])
                elif kind is rec.Kernel:
                    made.update(out[4])
                elif kind in (rec.Step, rec.RingShift):
                    made.add(out[4])
                elif kind in (rec.Alias, rec.Zeros, rec.Put, rec.FileRead):
                    made.add(out[2])
                if kind in PLANNED:
                    planned.add(record[2])
                prog.append(tuple(out))
            if prog:
                plan[r] = prog
                params_of[r] = list(mine)
        if forgotten & planned:
            raise NotLowered("a plan the step uses was dropped from the plan table while it was recorded")
        if len(found_params) != len(params):
            raise NotLowered("a live value reaches the workers other than as a kernel's kwargs")
        outs = []
        for h in results:
            if h.id in index:
                outs.append(("input", index[h.id]))
            elif first < h.id < end:
                outs.append(("local", h.id - first, h.ranks))
            else:
                raise NotLowered("the step returns a block it neither made nor took as an input")
        kept = {o[1] for o in outs if o[0] == "local"}
        leaked = made - freed - kept
        if leaked:
            raise NotLowered(f"{len(leaked)} blocks the step made outlive it without being one of its results")
        pgid = next(self._ids)
        whats = {s - seq0: self._ops.get(s) for s in seqs}
        for r, prog in plan.items():
            self._buf[r].append(rec.Program(pgid, tuple(prog)))
        self.flush()
        low = Lowered(pgid, self._epoch, tuple(plan), end - first, len(seqs), whats, outs, params_of, plan)
        low.seq_span = seq_end - seq0
        weakref.finalize(low, self._dropped_programs.append, (pgid, low.epoch, low.ranks))
        return low

    # -- running -------------------------------------------------------------------------------------
    def program_ready(self, low: Lowered | None) -> bool | None:
        """True: ``run_program`` can run ``low`` now (``low`` None: a step may be recorded as a program now);
        None: it belongs to workers that are gone (record it again); False: run this step call by call (no
        workers yet, or a fault is armed: it must fire at its op)."""
        if low is not None and low.epoch != self._epoch:
            return None
        if self._pool is None:
            return None if low is not None else False
        return "_note" not in self.__dict__

    def run_program(self, low: Lowered, inputs, placed, params) -> tuple:
        """One ``RunProgram`` per worker; the step's results (new handles, or the inputs it returns)."""
        with self._lock:
            ins = [self._id(h) for h in inputs] + [self._id(h) for h in placed]
            base = next(self._ids)
            self._ids = itertools.count(base + low.span)
            seq0 = next(self._seq)
            self._seq = itertools.count(seq0 + low.seq_span)
            ops = self._ops
            ops[seq0] = ("program", low.whats, low.seq_span)  # (not ``low``: it must die with its trace)
            if len(ops) > 20000:
                for k in list(itertools.islice(ops, 10000)):
                    del ops[k]
            self.stats["ops"] += low.seqs
            self.stats["program_runs"] += 1
            ins = tuple(ins)
            buf = self._buf
            for r in low.ranks:
                buf[r].append((rec.RunProgram, seq0, low.pgid, base, ins,
                               tuple([params[n] for n in low.params_of[r]])))
            self._nrec += len(low.ranks)
            self.flush()
        every = inputs + placed if type(inputs) is list else list(inputs) + list(placed)
        epoch, sink = self._epoch, self._sink
        return tuple(Handle(base + o[1], o[2], epoch, sink) if o[0] == "local" else every[o[1]] for o in low.outs)

    def _program_what(self, seq):
        """What op ``seq`` of a program run was (error messages)."""
        for k, what in itertools.islice(reversed(self._ops.items()), 2000):
            if k <= seq and type(what) is tuple and what[0] == "program" and seq - k < what[2]:
                return what[1].get(seq - k)
        return None

    def _queue_drops(self) -> None:
        dropped = self._dropped_programs
        n = len(dropped)
        for pgid, epoch, ranks in dropped[:n]:
            if epoch == self._epoch:
                for r in ranks:
                    self._buf.setdefault(r, []).append(rec.DropProgram(pgid))
        del dropped[:n]


class ProgramWorker:
    """The worker's side (mixed into ``worker_loop.Worker``): programs by id, run on fresh ids."""

    @rec.handles(rec.Program)
    def on_program(self, r):
        _, pgid, records = r
        # the plans it uses, held here: the controller may forget them from its table later
        defs = {x[2]: self.defs[x[2]] for x in records if x[0] in PLANNED}
        self.programs[pgid] = ([(x, _FIELDS[x[0]]) for x in records], defs)

    @rec.handles(rec.DropProgram)
    def on_drop_program(self, r):
        self.programs.pop(r[1], None)

    @rec.handles(rec.RunProgram)
    def on_run_program(self, r):
        _, seq, pgid, base, ins, params = r
        got = self.programs.get(pgid)
        if got is None:
            raise RuntimeBackendError(f"program {pgid} is not on this worker (dropped, or sent to another pool)")
        records, defs = got
        restored = [p for p in defs if p not in self.defs]
        for p in restored:
            self.defs[p] = defs[p]

        def block(i):
            return i + base if i >= 0 else ins[~i]

        out = []
        for x, fields in records:
            y = list(x)
            for pos, how in fields:
                v = x[pos]
                if how == "seq":
                    y[pos] = v + seq
                elif how == "id":
                    y[pos] = block(v)
                elif how == "ids":
                    y[pos] = tuple([block(i) for i in v])
                elif how == "pairs":
                    y[pos] = tuple([(block(a), block(b)) for a, b in v])
                elif type(v) is Param:
                    y[pos] = params[v.n]
            out.append(tuple(y))
        try:
            self.run(out)  # the usual handlers; a failing record is reported with its own op number
        finally:
            for p in restored:
                self.defs.pop(p, None)
