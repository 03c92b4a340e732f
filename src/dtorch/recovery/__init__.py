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

from ..graph import Graph, resolve_graph
from .config import RecoveryError, RecoveryEvent, configure, mode
from .snapshot import Snapshot

__all__ = ["configure", "mode", "snapshot", "run_step", "inject_fault", "RecoveryError", "RecoveryEvent",
           "Snapshot"]

_LATEST: "dict[Graph, Snapshot]" = {}  # the latest snapshot per Graph, for the module-level run_step


def snapshot(model, optimizer=None, every: int = 1) -> Snapshot:
    """Keep what a step of ``model`` and ``optimizer`` needs to restart, now and after every ``every``-th
    ``run_step``; a fault re-runs the steps since the latest snapshot (``every`` of them at most)."""
    snap = Snapshot(model, optimizer, every)
    _LATEST[snap.graph] = snap
    return snap


def run_step(fn, *args, **kwargs):
    """``Snapshot.run_step`` of the default Graph's latest snapshot."""
    snap = _LATEST.get(Graph.default_graph())
    if snap is None:
        raise RuntimeError("dtorch.recovery.run_step needs a snapshot of this Graph's model and optimizer: call "
                           "snap = dtorch.recovery.snapshot(model, optimizer) first (then snap.run_step(fn, ...))")
    return snap.run_step(fn, *args, **kwargs)


def inject_fault(device: int, at_op: int, kind: str = "kill", graph=None) -> None:
    """Tests: lose ``device``'s worker just before the ``at_op``-th op issued from now (1: the next op), by
    SIGKILL (``kind="kill"``) or SIGSTOP (``"stop"``: a hang, noticed after the heartbeat timeout)."""
    resolve_graph(graph).runtime.inject_fault(device, at_op, kind)
