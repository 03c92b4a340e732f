"""Training that survives a lost device (process and ray backends): snapshots, recovery, fault injection.

    snap = dtorch.recovery.snapshot(model, optimizer, every=1)   # keeps what a step needs to restart
    for batch in batches:
        loss = snap.run_step(train_step, batch)                     # re-run on new workers after a fault

A worker that dies (or hangs past the heartbeat timeout) mid-step makes the backend stop every worker, as
without recovery; ``run_step`` then starts new workers (``replace``), writes the snapshot back into the
same tensor objects (parameters, buffers, optimizer states, dtorch tensors passed to the step: handles
re-pointed, never invalidated) and re-runs the steps since the snapshot, the interrupted one last. The
re-run computes the same bits: same values, same plans, same reduction order. docs/recovery.md.
"""
from __future__ import annotations

import weakref

from ..graph import Graph, resolve_graph
from .config import RecoveryError, RecoveryEvent, configure, mode
from .snapshot import Snapshot

__all__ = ["configure", "mode", "snapshot", "run_step", "inject_fault", "RecoveryError", "RecoveryEvent",
           "Snapshot"]

# the latest snapshot per Graph, for the module-level run_step; weak both ways: a snapshot lives as long as the
# caller keeps it (it holds the model, the optimizer and a host copy of their state)
_LATEST: "weakref.WeakKeyDictionary[Graph, weakref.ref]" = weakref.WeakKeyDictionary()


def snapshot(model, optimizer=None, every: int = 1) -> Snapshot:
    """Keep what a step of ``model`` and ``optimizer`` needs to restart, now and after every ``every``-th
    ``run_step``; a fault re-runs the steps since the latest snapshot (``every`` of them at most)."""
    snap = Snapshot(model, optimizer, every)
    _LATEST[snap.graph] = weakref.ref(snap)
    return snap


def run_step(fn, *args, **kwargs):
    """``Snapshot.run_step`` of the default Graph's latest snapshot."""
    ref = _LATEST.get(Graph.default_graph())
    snap = None if ref is None else ref()
    if snap is None:
        raise RuntimeError("dtorch.recovery.run_step needs a live snapshot of this Graph's model and optimizer: keep "
                           "snap = dtorch.recovery.snapshot(model, optimizer) (then snap.run_step(fn, ...) or this)")
    return snap.run_step(fn, *args, **kwargs)


def inject_fault(device: int, at_op: int, kind: str = "kill", graph=None) -> None:
    """Tests: lose ``device``'s worker just before the ``at_op``-th op issued from now (1: the next op), by
    SIGKILL (``kind="kill"``) or SIGSTOP (``"stop"``: a hang, noticed after the heartbeat timeout), or on the ray
    backend by ``ray.kill`` of its actor from the controller (``"ray_kill"``)."""
    resolve_graph(graph).runtime.inject_fault(device, at_op, kind)
