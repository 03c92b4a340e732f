"""The records a controller sends its workers (process and ray backends): one type per message.

Both sides import these types; a worker dispatches on a record's type (``Worker.HANDLERS``, built from
``RECORD_TYPES`` and the handlers' ``@handles`` marks), so a record and its handler cannot drift apart.

A record is the tuple ``(Kind, *fields)``: ``Kind`` (a ``Record`` subclass) declares the fields as
annotations, and calling it checks them as a call does (names, count, defaults). Plain tuples because a
batch is one pickle per worker per push: a tuple of a class and values pickles in C, where NamedTuples
and dataclasses call back into Python per record (3-10x the pickling time per record, measured; the
controller's time per op grew by half: docs/benchmarks.md, "Worker records and the transport seam").

Fields named ``seq`` carry the op's number, by which the controller names a failed op (``failure``);
``pid`` names a plan definition (``Define*``) the worker holds until a ``Forget`` drops it.
"""
from __future__ import annotations

import traceback
from typing import Any


RECORD_TYPES: list = []  # every record type, in definition order


class Record:
    """A record type: its fields are the class's annotations (in order; a class attribute is a default).
    ``Kind(*fields)`` checks the fields as a call does and returns the tuple ``(Kind, *fields)``."""

    fields: tuple = ()

    def __init_subclass__(cls):
        names = tuple(cls.__dict__.get("__annotations__", {}))
        cls.fields = names
        params = ", ".join(f"{n}={n}" if n in cls.__dict__ else n for n in names)
        # named after the record: a wrong call says "Kernel() missing 1 required positional argument: 'dev_kw'"
        src = f"def {cls.__name__}(cls, {params}):\n    return (cls, {''.join(n + ', ' for n in names)})"
        scope: dict = {}
        exec(src, {n: cls.__dict__[n] for n in names if n in cls.__dict__}, scope)  # defaults: the class's values
        cls.__new__ = staticmethod(scope[cls.__name__])
        RECORD_TYPES.append(cls)


# -- membership and lifetime ------------------------------------------------------------------------------
class Reform(Record):
    """Join the current process-group generation (the process backend's workers read it from the store:
    ``cfg`` None; Ray actors get it here)."""
    cfg: Any = None


class Pair(Record):
    """Open the gloo group of two with the controller (process backend: its data plane off this host)."""
    gen: int


class Groups(Record):
    """Create these process groups, in this order (new_group is collective over every worker)."""
    groups: tuple


class Free(Record):
    ids: tuple


class Forget(Record):
    """The controller dropped these plan ids; no later record uses them."""
    pids: tuple


class EmptyCache(Record):
    """Hand the device's cached memory back (CUDA)."""


class Exit(Record):
    """Leave once the queue reaches this record."""


class Fault(Record):
    """Tests of recovery (``dtorch.recovery.inject_fault``): the worker is lost here, by SIGKILL ("kill") or
    SIGSTOP ("stop", a hang), as a crash or a frozen device would lose it."""
    kind: str


class Batch(Record):
    """A batch too large for one queue message, stored under ``name`` (process backend)."""
    name: str
    size: int


# -- answers: the worker replies through its link (``worker_link``) ---------------------------------------------
class Sync(Record):
    """Complete every posted transfer, then answer: the controller waits for ``world`` answers."""
    tok: int
    world: int


class Stats(Record):
    req: int
    collectives: bool
    world: int


class MirrorRead(Record):
    """Place block ``hid`` read from ``path`` at byte ``offset`` (a snapshot's mirror file, ``Mirror``)."""
    seq: int
    hid: int
    dtype: Any
    shape: tuple
    device_type: str
    path: str
    offset: int


MIRROR_FAILED = "mirror-failed"  # the kind of a worker's answer to a ``Mirror`` record it could not write


class Mirror(Record):
    """Write these blocks ((handle id, byte offset), ...) into the file ``path`` (shared memory, ``size`` bytes
    of blocks), then ``token`` after them: a snapshot's copy the worker keeps (``process_recovery.mirror_many``).
    A write that fails (an OSError: /dev/shm full) is answered, as ``MIRROR_FAILED`` request ``token``, with why."""
    path: str
    items: tuple
    size: int
    token: int


class Get(Record):
    """Send block ``hid`` to the controller. ``how``: False (the link's default), True (a shared-memory
    file of its own), or (path, offset) into the controller's file of the global value; ``tag`` for the
    process backend's pair."""
    seq: int
    hid: int
    req: int
    how: Any = False
    tag: int = 0


# -- placement -------------------------------------------------------------------------------------------
class Put(Record):
    """A block from the controller: ``data`` is its bytes (small) or what the transport staged."""
    seq: int
    hid: int
    dtype: Any
    shape: tuple
    device_type: str
    data: Any


class Zeros(Record):
    seq: int
    hid: int
    dtype: Any
    shape: tuple
    device_type: str


class FileRead(Record):
    """Read the block from files where the worker is (``interface.read_file_block``)."""
    seq: int
    hid: int
    dtype: Any
    shape: tuple
    device_type: str
    where: Any


class Alias(Record):
    hid: int
    new_id: int


# -- kernels ---------------------------------------------------------------------------------------------
class DefineKernel(Record):
    pid: int
    name: str
    module: str
    in_specs: tuple
    out_specs: tuple


class Kernel(Record):
    """Run kernel plan ``pid`` on blocks ``in_ids`` into new blocks ``out_ids``; ``dev_kw``: this device's
    own values (``device_args``) or None."""
    seq: int
    pid: int
    in_ids: tuple
    out_ids: tuple
    kwargs: dict
    dev_kw: Any


class Write(Record):
    """Run in-place kernel plan ``pid`` into block ``tid`` (copied first when its storage is shared)."""
    seq: int
    pid: int
    tid: int
    in_ids: tuple
    kwargs: dict
    dev_kw: Any


# -- redistribution --------------------------------------------------------------------------------------
class DefineStep(Record):
    """A redistribution primitive (``primitive``: a ``Worker.p_*`` name) between two specs; ``arg``: the mesh
    dim (a move: whether the layouts match)."""
    pid: int
    primitive: str
    before: Any
    after: Any
    arg: Any


class Step(Record):
    seq: int
    pid: int
    in_id: int
    out_id: int
    tag: int


class DefineMoveInto(Record):
    pid: int
    pairs: tuple


class MoveInto(Record):
    seq: int
    pid: int
    ids: tuple
    tag: int


class DefineRingShift(Record):
    pid: int
    spec: Any
    mesh_dim: int
    shift: int


class RingShift(Record):
    seq: int
    pid: int
    in_id: int
    out_id: int
    tag: int


# -- compiled steps (``process_program``) ------------------------------------------------------------------
class Program(Record):
    """Keep program ``pgid``: a compiled step's records for this worker, its block ids as slots (``process_program``)."""
    pgid: int
    records: tuple


class RunProgram(Record):
    """Run program ``pgid`` with op numbers from ``seq``, the blocks it makes numbered from ``base``, inputs
    ``ins`` and this worker's parameters ``params`` (live kwargs)."""
    seq: int
    pgid: int
    base: int
    ins: tuple
    params: tuple


class DropProgram(Record):
    """The controller dropped program ``pgid`` (its trace was dropped); no later record runs it."""
    pgid: int


NUMBERED = frozenset(t for t in RECORD_TYPES if "seq" in t.fields)  # records that carry an op number


def failure(rec, exc: BaseException) -> tuple:
    """(op number or None, record kind, the exception in one line, its traceback): what the controller
    needs to name the op a record belonged to (it knows what op #seq was)."""
    kind = rec[0]
    seq = rec[1 + kind.fields.index("seq")] if kind in NUMBERED else None
    name = kind.__name__ if seq is not None or len(rec) < 2 else f"{kind.__name__} {rec[1]!r}"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return seq, name, text, traceback.format_exc()


def handles(record_type):
    """Marks a worker method as the handler of ``record_type`` (``handler_table`` collects the marks)."""
    def mark(fn):
        fn.handles = record_type
        return fn
    return mark


def handler_table(cls) -> dict:
    """record type -> the method of ``cls`` marked to handle it; every record type must have exactly one."""
    table: dict = {}
    for klass in reversed(cls.__mro__):
        for fn in vars(klass).values():
            t = getattr(fn, "handles", None)
            if t is not None:
                table[t] = fn
    missing = [t.__name__ for t in RECORD_TYPES if t not in table]
    if missing:
        raise TypeError(f"{cls.__name__} handles no {', '.join(missing)}: mark a method @handles(<record type>)")
    return table
