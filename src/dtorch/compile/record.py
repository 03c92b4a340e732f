"""The recorder: what one eager run of a step dispatched, as a program of runtime calls over slots.

While a step is traced, the Graph's runtime is a ``RecordingRuntime``: every call the front end makes on it (an
executable's run, an in-place write, one collective step, an alias, a placement of host data) runs on the real
runtime and is written down as an entry ``outputs = target(*arguments)``, where every handle (and tape) is a
*slot*: the output of an earlier entry, or an *external* handle the step found (a parameter's, an optimizer
state's, an argument's). Calls the runtime makes on itself are not seen (they are part of the recorded call).
Host torch computation on the function's torch arguments is recorded beside it (compile/host.py), and the
Python state that ``dtorch.capture`` declares (effects, live values) too. A value read back to Python (``.item()``,
``to_torch()``, printing) cannot be replayed: it refuses the trace (a graph break, ``explain`` names it).
"""
from __future__ import annotations

import threading
import traceback
import weakref

import torch

from .. import commlog


class Slot:
    """A value the replay computes: slot ``k`` of the program."""
    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k

    def __repr__(self):
        return f"s{self.k}"


def leaves(x, keep, out: list) -> list:
    """The items of ``x`` for which ``keep`` holds, through lists, tuples and dicts (a template's slots, a call's
    tensors), appended to ``out``."""
    t = type(x)
    if t in (list, tuple):
        for v in x:
            leaves(v, keep, out)
    elif t is dict:
        for v in x.values():
            leaves(v, keep, out)
    elif keep(x):
        out.append(x)
    return out


class Entry:
    """``out = target.<method>(*args, **kwargs)`` (``method`` None: ``target(*args, **kwargs)``). ``args`` and
    ``kwargs`` are templates (Slots where values come from the program); ``out`` is the output's structure with
    a Slot for every value the program keeps. ``kind``: "device", "host" (host torch ops), "effect", "live",
    "guard" (a host value read: ``out`` is the value it must give), "log" (a CommLog record)."""
    __slots__ = ("kind", "target", "method", "args", "kwargs", "out")

    def __init__(self, kind, target, method, args, kwargs, out):
        self.kind, self.target, self.method, self.args, self.kwargs, self.out = kind, target, method, args, kwargs, out


def _user_frame() -> str:
    """Where in the user's code the current call comes from (the innermost frame outside dtorch and torch)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename
        if "/dtorch/" not in f and "/torch/" not in f and "/contextlib" not in f:
            return f"{f}:{frame.lineno} ({frame.line})"
    return "(no user frame)"


class Recorder:
    """Slots, entries, externals and refusals of one trace (module doc)."""

    def __init__(self, real_runtime):
        self.real = real_runtime
        self.entries: list[Entry] = []
        self.n = 0
        self._slot = {}  # id(obj) -> (weakref to it or the object, Slot): the slot holding that object now
        self.externals: list[tuple[Slot, object]] = []  # handles first seen as inputs: (slot, the handle)
        self._live = {}  # id(value) -> (value, Slot)
        self.refusals: list[str] = []
        self.inside = 0  # > 0 while a recorded call runs: the runtime's own calls, and its torch ops, are not ours
        self.thread = threading.get_ident()  # another thread's calls on the Graph are not the step's

    @property
    def passthrough(self) -> bool:
        """True for calls that are not the step's own (module doc): they run unrecorded."""
        return self.inside > 0 or threading.get_ident() != self.thread

    # -- slots -------------------------------------------------------------------------------------
    def new_slot(self, obj) -> Slot:
        s = Slot(self.n)
        self.n += 1
        try:
            ref = weakref.ref(obj)
        except TypeError:  # (tapes, tuples: kept alive for the trace, so that their id is not reused)
            ref = None
        self._slot[id(obj)] = (ref if ref is not None else obj, s)
        return s

    def slot_of(self, obj) -> Slot | None:
        got = self._slot.get(id(obj))
        if got is None:
            return None
        held, s = got
        alive = held() if isinstance(held, weakref.ref) else held
        return s if alive is obj else None

    def handle(self, h) -> Slot:
        """The slot of handle ``h``: the entry that made it, else a new external input."""
        s = self.slot_of(h)
        if s is None:
            s = self.new_slot(h)
            self.externals.append((s, h))
        return s

    def outputs(self, out):
        """``out``'s structure with a new slot for every value in it (lists and tuples are walked)."""
        if out is None:
            return None
        if type(out) in (list, tuple):
            return type(out)(self.outputs(x) for x in out)
        return self.new_slot(out)

    def host_value(self, data):
        """Host data placed on the devices: a tracked torch tensor (compile/host.py) as its slot, else itself."""
        if type(data) is list:
            return [self.host_value(d) for d in data]
        s = self.slot_of(data) if isinstance(data, torch.Tensor) else None
        return data if s is None else s

    def template(self, x):
        """``x`` with live values (``dtorch.capture.live``) as their slots; lists, tuples and dicts are walked."""
        got = self._live.get(id(x))
        if got is not None and got[0] is x:
            return got[1]
        t = type(x)
        if t is dict:
            out = {k: self.template(v) for k, v in x.items()}
        elif t in (list, tuple):
            out = t(self.template(v) for v in x)
        else:
            return x
        # the object itself when nothing in it is live: a plan's own kwargs dict stays that dict, which the
        # in-process executables bind their kernel to (they recognise it by identity)
        return x if all(a is b for a, b in zip(out.values() if t is dict else out, x.values() if t is dict else x)) \
            else out

    # -- entries -------------------------------------------------------------------------------------
    def call(self, target, method, args, kwargs, tpl_args, tpl_kwargs=None, kind="device"):
        """Run ``target.method(*args, **kwargs)`` on the real side, record it, return its result."""
        self.inside += 1
        try:
            out = getattr(target, method)(*args, **(kwargs or {}))
        finally:
            self.inside -= 1
        self.entries.append(Entry(kind, target, method, tpl_args, tpl_kwargs or {}, self.outputs(out)))
        return out

    def note_effect(self, fn, args) -> None:
        """Run the effect ``fn(*args)`` (dtorch.capture.effect) and record it."""
        mine = not self.passthrough
        self._unrecorded(fn, args)
        if mine:
            self.entries.append(Entry("effect", fn, None, self._by_reference(args), {}, None))

    def note_live(self, fn, args):
        """``fn(*args)`` (dtorch.capture.live), recorded as a value the replay computes again."""
        mine = not self.passthrough
        value = self._unrecorded(fn, args)
        if mine:
            s = self.new_slot(value)
            self._live[id(value)] = (value, s)
            self.entries.append(Entry("live", fn, None, self._by_reference(args), {}, s))
        return value

    def _unrecorded(self, fn, args):
        # the torch ops inside are the effect's own: the replay runs the effect, not them
        self.inside += 1
        try:
            return fn(*args)
        finally:
            self.inside -= 1

    def _by_reference(self, args) -> tuple:
        """An effect's or live value's arguments: the objects themselves (a replay must read their state then,
        not a copy made now), live values and tracked host tensors as their slots."""
        out = []
        for a in args:
            got = self._live.get(id(a))
            s = self.slot_of(a) if isinstance(a, torch.Tensor) else None  # a tracked host tensor (compile/host.py)
            out.append(got[1] if got is not None and got[0] is a else a if s is None else s)
        return tuple(out)

    def note_refusal(self, reason: str) -> None:
        if self.passthrough:
            return
        self.refusals.append(f"{reason} (at {_user_frame()})")

    def note_log(self, args, kwargs) -> None:
        self.entries.append(Entry("log", commlog.record, None, args, kwargs, None))

    def drop(self) -> None:
        """Forget the objects of the trace (the handles die with their last user, not with the recorder). The
        recorder may outlive the trace (op plans cached while it ran keep its runtime until their next call): it
        must not keep what the entries name (a KV cache, a module) alive; the Trace holds what it replays."""
        self._slot.clear()
        self._live.clear()
        self.externals = []
        self.entries = []


class RecordingRuntime:
    """The Graph's runtime while a step is traced: the real one, every call recorded (module doc)."""

    def __init__(self, rec: Recorder):
        self._rec = rec
        self._real = rec.real
        self._execs = {}

    def __getattr__(self, name):  # configuration and queries (devices, config, holds_values, ...): the real ones
        return getattr(self._real, name)

    # -- compute -------------------------------------------------------------------------------------
    def executable(self, kernel, in_specs, out_specs):
        ex = self._real.executable(kernel, in_specs, out_specs)
        if self._rec.passthrough:
            return ex
        wrapped = self._execs.get(id(ex))
        if wrapped is None or wrapped._ex is not ex:
            wrapped = self._execs[id(ex)] = RecordingExecutable(self._rec, ex)
        return wrapped

    def run_local(self, kernel, inputs, in_specs, out_specs, kwargs, device_args=None):
        return self.executable(kernel, in_specs, out_specs).run(inputs, kwargs, device_args)

    def write(self, kernel, target, target_spec, inputs, in_specs, kwargs, device_args=None):
        r = self._rec
        if r.passthrough:
            return self._real.write(kernel, target, target_spec, inputs, in_specs, kwargs, device_args)
        tpl = (kernel, r.handle(target), target_spec, [r.handle(h) for h in inputs], in_specs, r.template(kwargs),
               r.template(device_args))
        return r.call(self._real, "write", (kernel, target, target_spec, inputs, in_specs, kwargs, device_args), None,
                      tpl)

    def alias(self, handle, spec):
        return self._one("alias", handle, (spec,))

    # -- placement of host data --------------------------------------------------------------------------
    def from_global(self, full, spec):
        return self._host_data("from_global", full, spec)

    def from_blocks(self, blocks, spec):
        return self._host_data("from_blocks", list(blocks), spec)

    def zeros(self, spec):
        return self._host_data("zeros", None, spec)

    def from_files(self, reads, spec):
        return self._host_data("from_files", list(reads), spec)

    def _host_data(self, method, data, spec):
        r = self._rec
        args = (spec,) if data is None else (data, spec)
        if r.passthrough:
            return getattr(self._real, method)(*args)
        tpl = (spec,) if data is None else (r.host_value(data), spec)
        return r.call(self._real, method, args, None, tpl)

    # -- reads: values back to Python cannot be replayed ---------------------------------------------------
    def to_global(self, handle, spec):
        self._read("to_torch() / .item() / a Python value of a dtorch tensor")
        return self._real.to_global(handle, spec)

    def to_global_async(self, handle, spec):
        self._read("to_torch_async()")
        return self._real.to_global_async(handle, spec)

    def to_global_many(self, handles, specs):
        self._read("a fetch of many values (to_global_many: a snapshot?)")
        return self._real.to_global_many(handles, specs)

    def to_global_many_async(self, handles, specs):
        self._read("a fetch of many values (to_global_many_async: a snapshot?)")
        return self._real.to_global_many_async(handles, specs)

    def local_blocks(self, handle, spec):
        self._read("local_blocks()")
        return self._real.local_blocks(handle, spec)

    def _read(self, what: str) -> None:
        if not self._rec.passthrough:
            self._rec.note_refusal(f"reads a value back to Python: {what}; a replay cannot give Python a new value "
                                   "(return the tensor and read it after the call)")

    # -- redistribution ------------------------------------------------------------------------------
    def all_gather(self, handle, before, after, mesh_dim):
        return self._one("all_gather", handle, (before, after, mesh_dim))

    def all_reduce(self, handle, before, after, mesh_dim):
        return self._one("all_reduce", handle, (before, after, mesh_dim))

    def reduce_scatter(self, handle, before, after, mesh_dim):
        return self._one("reduce_scatter", handle, (before, after, mesh_dim))

    def all_to_all(self, handle, before, after, mesh_dim):
        return self._one("all_to_all", handle, (before, after, mesh_dim))

    def local_slice(self, handle, before, after, mesh_dim):
        return self._one("local_slice", handle, (before, after, mesh_dim))

    def to_partial(self, handle, before, after, mesh_dim):
        return self._one("to_partial", handle, (before, after, mesh_dim))

    def move(self, handle, before, after, same_layout):
        return self._one("move", handle, (before, after, same_layout))

    def ring_shift(self, handle, spec, mesh_dim, shift=1):
        return self._one("ring_shift", handle, (spec, mesh_dim, shift))

    def move_into(self, moves):
        r = self._rec
        if r.passthrough:
            return self._real.move_into(moves)
        tpl = ([(r.handle(s), b, r.handle(t), a) for s, b, t, a in moves],)
        return r.call(self._real, "move_into", (list(moves),), None, tpl)

    def _one(self, method, handle, rest):
        r = self._rec
        if r.passthrough:
            return getattr(self._real, method)(handle, *rest)
        return r.call(self._real, method, (handle,) + rest, None, (r.handle(handle),) + rest)


class RecordingExecutable:
    """A runtime executable whose runs are recorded (queries go to the real one)."""

    def __init__(self, rec: Recorder, ex):
        self._rec = rec
        self._ex = ex

    def __getattr__(self, name):  # sums_over_devices, tape_released, tape_saved_outputs, tape_bytes
        return getattr(self._ex, name)

    def run(self, handles, kwargs, device_args=None):
        r = self._rec
        if r.passthrough:
            return self._ex.run(handles, kwargs, device_args)
        tpl = ([r.handle(h) for h in handles], r.template(kwargs), device_args)
        return r.call(self._ex, "run", (handles, kwargs, device_args), None, tpl)

    def run_tracked(self, handles, kwargs, device_args, diff, refetch=()):
        r = self._rec
        if r.passthrough:
            return self._ex.run_tracked(handles, kwargs, device_args, diff, refetch)
        tpl = ([r.handle(h) for h in handles], r.template(kwargs), device_args, diff, refetch)
        return r.call(self._ex, "run_tracked", (handles, kwargs, device_args, diff, refetch), None, tpl)

    def vjp_tracked(self, tape, cotangents, ct_specs, has_ct, grad_specs, refetched=None):
        r = self._rec
        if r.passthrough:
            return self._ex.vjp_tracked(tape, cotangents, ct_specs, has_ct, grad_specs, refetched)
        tpl = (r.handle(tape), [None if h is None else r.handle(h) for h in cotangents], ct_specs, has_ct, grad_specs,
               None if refetched is None else {k: r.handle(h) for k, h in refetched.items()})
        return r.call(self._ex, "vjp_tracked", (tape, cotangents, ct_specs, has_ct, grad_specs, refetched), None, tpl)
