"""The one redistribution executor: runs a plan's typed steps on a runtime, one primitive per step.

It records CommLog once per communicating step (kind, the mesh dim's name or index, bytes of the spec
before the step, the devices), then calls ``step.run``, which calls the runtime primitive. Backends
never record CommLog: every record comes from here (ring shifts included, ``ring_shift`` below).
"""
from __future__ import annotations

from .. import commlog
from ..spec import DTensorSpec, moved_bytes
from .planner import Plan


def execute(plan: Plan, handle, rt):
    """Run ``plan`` on ``handle`` (laid out as ``plan.src``); returns the handle laid out as ``plan.dst``."""
    before = plan.src
    for step, after in zip(plan.steps, plan.specs):
        _record(step, before, after)
        handle = step.run(rt, handle, before, after)
        before = after
    return handle


def _record(step, before: DTensorSpec, after: DTensorSpec) -> None:
    if step.communicates and commlog.is_recording():
        commlog.record(step.kind, step.label, step.wire_bytes(before, after), step.devices(before, after),
                       before.dtype)


def record_only(plan: Plan) -> None:
    """Record ``plan``'s communicating steps without running them: a runtime computed their result inside
    a kernel (the in-process backend's VJP sums a replicated parameter's gradient over the simulated
    devices in one GEMM); the devices of a real system run these collectives."""
    before = plan.src
    for step, after in zip(plan.steps, plan.specs):
        _record(step, before, after)
        before = after


def ring_shift(rt, handle, spec: DTensorSpec, mesh_dim: int, shift: int = 1):
    """Every device sends its block ``shift`` steps along ``mesh_dim`` (cyclic): one send_recv record.

    The result is an internal handle whose blocks no longer match ``spec``'s boxes (see
    ``Runtime.ring_shift``)."""
    if commlog.is_recording():
        mesh = spec.mesh
        commlog.record("send_recv", mesh.dim_label(mesh_dim), spec.total_bytes(), mesh.device_ids, spec.dtype)
    return rt.ring_shift(handle, spec, mesh_dim, shift)


def move_into(rt, moves, label=None) -> list:
    """Run one batch of ``Runtime.move_into`` (``(source handle, source spec, target handle, target spec)``
    each): one send_recv record for the batch, whose bytes are the regions that change device (a region a
    device holds in both layouts stays where it is)."""
    if commlog.is_recording() and moves:
        devices = {}
        for _, before, _, after in moves:
            devices.update(dict.fromkeys(before.mesh.device_ids + after.mesh.device_ids))
        commlog.record("send_recv", label, sum(moved_bytes(b, a) for _, b, _, a in moves), tuple(devices))
    return rt.move_into(moves)
