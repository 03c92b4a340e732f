"""Where a snapshot keeps its values: with the workers, in files in shared memory (``Mirror``), or fetched to the
controller's host (``snapshot.Fetch``) where the backend cannot mirror.

Fetching every value to the controller after each step cost +15-33 % of a step on the issue's 32 M Llama (the
workers writing blocks for the controller, the controller assembling global values; docs/benchmarks.md). A
mirror instead has every worker write its own blocks, one replica of each, into its own file in this host's
shared memory (``Runtime.mirror_many``): a copy in memory per step, no assembly, nothing for the controller to
wait for. The file outlives a worker that dies (it is not the worker's memory), so a recovery has each new
worker read its blocks straight from the files (the lost worker's included); only where the layout changed (a
shrink) are global values assembled from them (``Snapshot.global_values``).

Two slots per snapshot: the one being written never is the one that counts, so a worker killed mid-write
leaves the previous snapshot whole (a file ends with the token of the write that completed it). The files go
when the snapshot is closed or dropped, and with the backend's directory at its shutdown.

A worker that cannot write its file (/dev/shm full: ENOSPC) removes it and says why (``MirrorCopy.failure``);
that snapshot does not count (the previous one stands, as for a worker killed mid-write), and the snapshot
fetches its values to the controller from then on (``Snapshot._mirror_failed``: one warning, then the files go).
"""
from __future__ import annotations

import itertools
import weakref

_names = itertools.count(1)


class Mirrored:
    """The values of ``tensors`` as one ``mirror_many`` asked the workers to write them (``copy``: the backend's
    ``MirrorCopy``), with the interface of ``snapshot.Fetch``: ``succeeded``, ``failure``, ``wait``, ``values``,
    ``nbytes``, ``place_direct``."""

    def __init__(self, tensors, copy, slot: int):
        self.tensors, self.copy, self.slot = list(tensors), copy, slot

    def succeeded(self) -> bool:
        return self.copy.done()

    def failure(self) -> str | None:
        return self.copy.failure()  # (a worker could not write its file: /dev/shm full)

    def fault(self, timeout: float):
        return None  # (no thread of ours collects: a fault meets the step's own waits)

    def wait(self) -> None:
        self.copy.wait()

    def values(self, only=None) -> list:
        index = {id(t): i for i, t in enumerate(self.tensors)}
        picked = None if only is None else [index[id(t)] for t in only]
        return list(zip(self.tensors if only is None else only, self.copy.values(picked)))

    def place_direct(self, tensors) -> list:
        """Give ``tensors`` their kept values on the backend's current workers, each worker reading its blocks
        straight from the mirror files, where a tensor's layout is the one mirrored; returns the others (a
        shrink changed their mesh: they take global values)."""
        index = {id(t): i for i, t in enumerate(self.tensors)}
        left = []
        for t in tensors:
            h = t._graph.runtime.mirror_place(self.copy, index[id(t)], t._spec)
            if h is None:
                left.append(t)
            else:
                t._written(h)
        return left

    def nbytes(self) -> int:
        return self.copy.nbytes


class Mirror:
    """The mirror files of one snapshot on ``runtime``: ``begin`` asks for a copy into the slot not in use by
    ``kept`` (None where the backend cannot mirror); ``close`` removes the files (also done when it is dropped)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.name = f"snap{next(_names)}"
        self._close = weakref.finalize(self, _drop, runtime, self.name)

    def begin(self, tensors, kept) -> Mirrored | None:
        slot = 1 - kept.slot if isinstance(kept, Mirrored) else 0
        copy = self.runtime.mirror_many([t._h for t in tensors], [t._spec for t in tensors], f"{self.name}-{slot}")
        return None if copy is None else Mirrored(tensors, copy, slot)

    def close(self) -> None:
        self._close()


def _drop(runtime, name: str) -> None:
    try:
        runtime.mirror_drop(name)
    except Exception:  # noqa: BLE001  (at interpreter exit the backend may be half gone: its shutdown removes them)
        pass
