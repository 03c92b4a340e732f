"""What ``dtorch.recovery`` asks of the process and ray backends' controller (``Recovery``, mixed into
``process.ProcessRuntime``): the workers' pids, faults injected at an op for tests, and many values fetched
in one pass (a snapshot)."""
from __future__ import annotations

import concurrent.futures
import threading

from . import process_plan as pp
from . import protocol as rec


class Recovery:
    def worker_pids(self) -> dict:
        with self._lock:
            pool = self._pool
            return {} if pool is None else {r: pool.pid(r) for r in range(self._world)}

    def inject_fault(self, device: int, at_op: int, kind: str = "kill") -> None:
        """Worker ``device`` SIGKILLs or SIGSTOPs itself just before the ``at_op``-th op (kernel, step, put, get)
        issued from now: the fault record is queued in order, so where it dies does not depend on timing."""
        if kind not in ("kill", "stop") or not (isinstance(at_op, int) and at_op >= 1) or \
                self._pool is None or not 0 <= device < self._world:
            raise ValueError(f"inject_fault(device={device}, at_op={at_op!r}, kind={kind!r}): kind is 'kill' or 'stop', "
                             f"at_op >= 1 (1: the next op), device a running worker's id (0..{self._world - 1})")
        fire = self.stats["ops"] + at_op
        note = type(self)._note.__get__(self)

        def armed(what):  # this runtime's _note until the fault is queued (no cost once it is)
            seq = note(what)
            if self.stats["ops"] == fire:
                del self._note
                self._buf.setdefault(device, []).append(rec.Fault(kind))
            return seq

        self._note = armed

    def to_global_many(self, handles, specs) -> list:
        """The global values of many tensors: every request is queued first, then the answers are collected
        in order, so the workers write one block after another instead of waiting for a round trip each."""
        return self._collect_many(self._ask_many(handles, specs))

    def to_global_many_async(self, handles, specs) -> concurrent.futures.Future:
        """``to_global_many`` whose requests are queued now (the values are those after the work queued so far)
        and whose answers one thread collects while the caller goes on queueing work."""
        asked = self._ask_many(handles, specs)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def collect():
            try:
                fut.set_result(self._collect_many(asked))
            except BaseException as exc:  # noqa: BLE001  (delivered through the future)
                fut.set_exception(exc)

        threading.Thread(target=collect, name="dtorch-fetch-many", daemon=True).start()
        return fut

    def _ask_many(self, handles, specs) -> list:
        asked = []
        with self._lock:
            for h, spec in zip(handles, specs):
                coords = pp.grid_coords(spec)
                asked.append((self._request(h, spec, coords, whole=True), spec, coords))
        return asked

    def _collect_many(self, asked) -> list:
        return [self._fetch(req, ranks, pool, out, spec, coords) for (req, ranks, pool, out), spec, coords in asked]
