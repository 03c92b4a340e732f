"""CommLog: records every collective the runtime runs inside a ``with`` block.

Bytes are the payload the participating devices put on the wire: for collectives, the sum of the
input blocks of every device in the groups; for point-to-point moves, the bytes sent.
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")

_active = threading.local()


@dataclass(frozen=True)
class CommRecord:
    kind: str
    mesh_dim: object  # the mesh dim's name, else its index; None for moves between unrelated meshes
    nbytes: int
    devices: tuple[int, ...]
    dtype: object = None  # the torch dtype on the wire (None where the recorder did not say)


class CommLog:
    def __init__(self):
        self.records: list[CommRecord] = []

    def __enter__(self):
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc):
        _active.stack.remove(self)
        return False

    def counts(self) -> dict:
        return dict(Counter((r.kind, r.mesh_dim) for r in self.records))

    def bytes(self) -> dict:
        out: Counter = Counter()
        for r in self.records:
            out[(r.kind, r.mesh_dim)] += r.nbytes
        return dict(out)

    def total(self, kind: str | None = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def table(self) -> str:
        if not self.records:
            return "no communication"
        counts, nbytes = self.counts(), self.bytes()
        rows = [("collective", "mesh dim", "count", "bytes")]
        for key in sorted(counts, key=lambda k: (str(k[1]), k[0])):
            rows.append((key[0], str(key[1]), str(counts[key]), _human_bytes(nbytes[key])))
        widths = [max(len(r[c]) for r in rows) for c in range(4)]
        lines = ["  ".join(cell.ljust(w) if c < 2 else cell.rjust(w) for c, (cell, w) in enumerate(zip(r, widths))) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def __repr__(self):
        return f"CommLog({self.counts()})"


def record(kind: str, mesh_dim, nbytes: int, devices=(), dtype=None) -> None:
    stack = getattr(_active, "stack", None)
    if not stack:
        return
    rec = CommRecord(kind, mesh_dim, int(nbytes), tuple(devices), dtype)
    for log in stack:
        log.records.append(rec)


def is_recording() -> bool:
    return bool(getattr(_active, "stack", None))


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
