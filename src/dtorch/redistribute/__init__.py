"""Redistribution: plan (pure, cached) then execute step by step on the runtime.

This package knows specs, handles and the runtime, nothing of autograd or the ops: ``relayout`` lays a tensor
out anew and records no history. The differentiable ``Tensor.redistribute`` / ``redistribute_spec`` is in
``dtorch.autograd.redistribute``; the batched ``copy_tensors_`` (many ``copy_`` in one move) in
``dtorch.ops.copy_tensors``."""
from __future__ import annotations

from ..spec import DTensorSpec
from .executor import execute
from .planner import Plan, plan_redistribute
from .steps import AllGather, AllReduce, AllToAll, LocalSlice, Move, ReduceScatter, Step, ToPartial

__all__ = ["relayout", "plan_redistribute", "execute", "Plan", "Step", "AllGather", "AllReduce", "ReduceScatter",
           "AllToAll", "LocalSlice", "ToPartial", "Move"]


def relayout(t, dst: DTensorSpec):
    """``t`` laid out as ``dst``, recording no autograd history (the op dispatch lays out its inputs with it:
    the op's own backward accounts for them; ``dtorch.autograd.redistribute`` records one for the rest)."""
    src = t._spec
    if src == dst:
        return t
    return type(t)._make(dst, execute(plan_redistribute(src, dst), t._h, t._graph.runtime), t._graph)

