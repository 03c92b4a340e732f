"""The records a controller sends its workers (process and ray backends): one type per message.

Both sides import these types; a worker dispatches on a record's type (``Worker.HANDLERS``, built from
``RECORD_TYPES`` and the handlers' ``@handles`` marks), so a record and its handler cannot drift apart.

Records are NamedTuples: a batch of them is one pickle per worker per push. They pickle as
``(type, fields)`` (``__reduce__``): NamedTuple's default reduction costs about 3x more per record
(docs/benchmarks.md, "worker records").

Fields named ``seq`` carry the op's number, by which the controller names a failed op (``failure``);
``pid`` names a plan definition (``Define*``) the worker holds until a ``Forget`` drops it.
"""
from __future__ import annotations

import traceback
from typing import Any, NamedTuple


RECORD_TYPES: list = []  # every record type, in definition order (``@record``)


def _reduce(self):
    return (type(self), tuple(self))


def record(cls):
    """Registers a record type; it pickles as its type and its fields (see the module docstring for why)."""
    cls.__reduce__ = _reduce
    RECORD_TYPES.append(cls)
    return cls


# -- membership and lifetime ------------------------------------------------------------------------------
@record
class Reform(NamedTuple):
    """Join the current process-group generation (the process backend's workers read it from the store:
    ``cfg`` None; Ray actors get it here)."""
    cfg: Any = None


@record
class Pair(NamedTuple):
    """Open the gloo group of two with the controller (process backend: its data plane off this host)."""
    gen: int


@record
class Groups(NamedTuple):
    """Create these process groups, in this order (new_group is collective over every worker)."""
    groups: tuple


@record
class Free(NamedTuple):
    ids: tuple


@record
class Forget(NamedTuple):
    """The controller dropped these plan ids; no later record uses them."""
    pids: tuple


@record
class EmptyCache(NamedTuple):
    pass


@record
class Exit(NamedTuple):
    pass


@record
class Batch(NamedTuple):
    """A batch too large for one queue message, stored under ``name`` (process backend)."""
    name: str
    size: int


# -- answers: the worker replies through its link (``worker_link``) ---------------------------------------------
@record
class Sync(NamedTuple):
    """Complete every posted transfer, then answer: the controller waits for ``world`` answers."""
    tok: int
    world: int


@record
class Stats(NamedTuple):
    req: int
    collectives: bool
    world: int


@record
class Get(NamedTuple):
    """Send block ``hid`` to the controller. ``how``: False (the link's default), True (a shared-memory
    file of its own), or (path, offset) into the controller's file of the global value; ``tag`` for the
    process backend's pair."""
    seq: int
    hid: int
    req: int
    how: Any = False
    tag: int = 0


# -- placement -------------------------------------------------------------------------------------------
@record
class Put(NamedTuple):
    """A block from the controller: ``data`` is its bytes (small) or what the transport staged."""
    seq: int
    hid: int
    dtype: Any
    shape: tuple
    device_type: str
    data: Any


@record
class Zeros(NamedTuple):
    seq: int
    hid: int
    dtype: Any
    shape: tuple
    device_type: str


@record
class FileRead(NamedTuple):
    """Read the block from files where the worker is (``interface.read_file_block``)."""
    seq: int
    hid: int
    dtype: Any
    shape: tuple
    device_type: str
    where: Any


@record
class Alias(NamedTuple):
    hid: int
    new_id: int


# -- kernels ---------------------------------------------------------------------------------------------
@record
class DefineKernel(NamedTuple):
    pid: int
    name: str
    module: str
    in_specs: tuple
    out_specs: tuple


@record
class Kernel(NamedTuple):
    """Run kernel plan ``pid`` on blocks ``in_ids`` into new blocks ``out_ids``; ``dev_kw``: this device's
    own values (``device_args``) or None."""
    seq: int
    pid: int
    in_ids: tuple
    out_ids: tuple
    kwargs: dict
    dev_kw: Any


@record
class Write(NamedTuple):
    """Run in-place kernel plan ``pid`` into block ``tid`` (copied first when its storage is shared)."""
    seq: int
    pid: int
    tid: int
    in_ids: tuple
    kwargs: dict
    dev_kw: Any


# -- redistribution --------------------------------------------------------------------------------------
@record
class DefineStep(NamedTuple):
    """A redistribution primitive (``primitive``: a ``Worker.p_*`` name) between two specs; ``arg``: the mesh
    dim (a move: whether the layouts match)."""
    pid: int
    primitive: str
    before: Any
    after: Any
    arg: Any


@record
class Step(NamedTuple):
    seq: int
    pid: int
    in_id: int
    out_id: int
    tag: int


@record
class DefineMoveInto(NamedTuple):
    pid: int
    pairs: tuple


@record
class MoveInto(NamedTuple):
    seq: int
    pid: int
    ids: tuple
    tag: int


@record
class DefineRingShift(NamedTuple):
    pid: int
    spec: Any
    mesh_dim: int
    shift: int


@record
class RingShift(NamedTuple):
    seq: int
    pid: int
    in_id: int
    out_id: int
    tag: int


NUMBERED = frozenset(t for t in RECORD_TYPES if "seq" in t._fields)  # records that carry an op number


def failure(rec, exc: BaseException) -> tuple:
    """(op number or None, record kind, the exception in one line, its traceback): what the controller
    needs to name the op a record belonged to (it knows what op #seq was)."""
    kind = type(rec).__name__
    seq = rec.seq if type(rec) in NUMBERED else None
    if seq is None and rec:
        kind = f"{kind} {rec[0]!r}"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return seq, kind, text, traceback.format_exc()


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
