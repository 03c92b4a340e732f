"""The differentiable redistribution: ``Tensor.redistribute`` (bound on the class by ``dtorch/__init__``) and
``redistribute_spec``, which the ops use to lay out their operands with a history.

The layout itself is ``dtorch.redistribute.relayout`` (plan, then the executor: no autograd below this
module). The gradient of a redistribution is the gradient itself, as the global value is unchanged: on one
mesh it passes as it comes (``IdentityNode``), across meshes it goes back to the source mesh (``MoveNode``).
"""
from __future__ import annotations

from ..errors import MeshError
from ..mesh import DeviceMesh
from ..placement import Partial, Replicate, normalize_placements
from ..redistribute import relayout
from ..spec import DTensorSpec
from .dispatched import IdentityNode
from .mode import is_grad_enabled
from .node import Node, attach, requires_grad

_R = Replicate()


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


class MoveNode(Node):
    """A tensor handed to another mesh: its gradient goes back to the source mesh."""

    __slots__ = ("src",)
    name = "redistribute"

    def __init__(self, t):
        super().__init__([t], 1)
        self.src = t._spec

    def apply(self, grads):
        g = grads[0]
        src = self.src
        back = DTensorSpec(src.mesh, tuple(_R if isinstance(p, Partial) else p for p in src.placements),
                           src.shape, g.dtype)
        here = g._spec
        if any(isinstance(p, Partial) for p in here.placements):  # moves carry no partial terms: reduce first
            g = relayout(g, DTensorSpec(here.mesh, tuple(_R if isinstance(p, Partial) else p for p in here.placements),
                                        here.shape, here.dtype))
        return [relayout(g, back)]


def record_redistribute(src, out) -> None:
    node = IdentityNode("redistribute", src) if src._spec.mesh == out._spec.mesh else MoveNode(src)
    attach(node, [out])
