"""Redistribution: plan (pure, cached) then execute step by step on the runtime."""
from __future__ import annotations

from ..autograd.dispatched import record_redistribute
from ..autograd.mode import is_grad_enabled
from ..autograd.node import requires_grad
from ..errors import MeshError
from ..mesh import DeviceMesh
from ..placement import normalize_placements
from ..spec import DTensorSpec
from .executor import execute
from .planner import Plan, plan_redistribute
from .steps import AllGather, AllReduce, AllToAll, LocalSlice, Move, ReduceScatter, Step, ToPartial

__all__ = ["redistribute", "redistribute_spec", "plan_redistribute", "Plan", "Step", "AllGather", "AllReduce",
           "ReduceScatter", "AllToAll", "LocalSlice", "ToPartial", "Move", "copy_tensors_"]


def redistribute(t, device_mesh: DeviceMesh | None = None, placements=None):
    """``t`` laid out on ``device_mesh`` with ``placements``; ``t`` itself is never modified."""
    src = t._spec
    mesh = src.mesh if device_mesh is None else device_mesh
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"device_mesh must be a DeviceMesh, got {type(mesh).__name__}")
    if placements is None:
        if mesh == src.mesh:
            return t
        placements = src.placements if mesh.ndim == src.mesh.ndim else None
    dst = DTensorSpec(mesh, normalize_placements(placements, mesh.ndim, len(src.shape), mesh.shape), src.shape, src.dtype)
    return redistribute_spec(t, dst)


def redistribute_spec(t, dst: DTensorSpec):
    """``t`` laid out as ``dst``; differentiable (the gradient goes back unchanged, or to the source mesh)."""
    out = relayout(t, dst)
    if out is not t and t._ag is not None and is_grad_enabled() and requires_grad(t):
        record_redistribute(t, out)
    return out


def relayout(t, dst: DTensorSpec):
    """``t`` laid out as ``dst``, recording no autograd history (the op dispatch lays out its inputs with it:
    the op's own backward accounts for them)."""
    src = t._spec
    if src == dst:
        return t
    return type(t)._make(dst, execute(plan_redistribute(src, dst), t._h, t._graph.runtime), t._graph)


from .copy import copy_tensors_  # noqa: E402  (it lays out sources with relayout, above)
