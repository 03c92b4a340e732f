"""Fully sharded data parallel as a placement: a mesh dim named ``"fsdp"`` shards every parameter (and so
its gradient and optimizer states) along it, and splits the batch. A parameter is sharded on its first
tensor dim that no other mesh dim shards (``fsdp_placements``).

A module gathers its own parameters on that dim just before its forward (``unshard_fsdp``) and drops
the gathered copy after it. The gather is recorded as a ``RegatherNode``: ops that use the gathered weight
save the sharded parameter instead and gather it again in the backward, so no full weight stays alive
between the forward and the backward. The gradient arrives Partial on fsdp (the batch is split there) and
is reduce-scattered into the parameter's own layout when it is stored in ``.grad``.
"""
from __future__ import annotations

from ..placement import Replicate, Shard
from ..spec import DTensorSpec
from .dispatched import IdentityNode
from .mode import is_grad_enabled
from .node import attach, requires_grad

FSDP_DIM = "fsdp"


def fsdp_index(mesh) -> int | None:
    return mesh.dim_name_index(FSDP_DIM) if mesh.dim_names else None


def fsdp_sharded(p) -> bool:
    i = fsdp_index(p._spec.mesh)
    return i is not None and isinstance(p._spec.placements[i], Shard)


def fsdp_placements(mesh, placements: list, ndim: int) -> list:
    """A parameter's placements with its first tensor dim that no other mesh dim shards sharded on the fsdp
    mesh dim (a tp-sharded weight keeps its tp blocks whole: gathering fsdp then moves no tp data). A
    parameter with every dim sharded already (a tp-sharded bias) stays Replicate on fsdp."""
    i = fsdp_index(mesh)
    if i is None:
        return placements
    taken = {p.dim % ndim for p in placements if isinstance(p, Shard)}
    free = [d for d in range(ndim) if d not in taken]
    out = list(placements)
    out[i] = Shard(free[0]) if free else Replicate()
    return out


class RegatherNode(IdentityNode):
    """The gather of a parameter for use; consumers gather again in the backward instead of saving it."""

    __slots__ = ("leaf",)

    def __init__(self, leaf):
        super().__init__("fsdp_gather", leaf)
        self.leaf = leaf


def unshard_fsdp(p):
    """``p`` with its fsdp mesh dim Replicate (an all-gather); differentiable."""
    from ..redistribute import relayout

    spec = p._spec
    i = fsdp_index(spec.mesh)
    places = list(spec.placements)
    places[i] = Replicate()
    out = relayout(p, DTensorSpec(spec.mesh, tuple(places), spec.shape, spec.dtype))
    if out is not p and is_grad_enabled() and requires_grad(p):
        attach(RegatherNode(p), [out])
    return out
