"""Placements: how one mesh dim lays a tensor out.

``Shard(d)``: tensor dim d is split over the mesh dim (torch.chunk sizes, so uneven sizes work).
``Replicate()``: every device along the mesh dim holds the same value.
``Partial(op)``: every device holds a term; the value is their reduction (sum, avg, max, min).
"""
from __future__ import annotations

import numbers

from .errors import PlacementError

_REDUCE_OPS = ("sum", "avg", "max", "min")


class Placement:
    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


class Shard(Placement):
    __slots__ = ("dim",)

    def __init__(self, dim: int):
        if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
            raise PlacementError(f"Shard(dim) needs an int tensor dim, got {dim!r} of type {type(dim).__name__}")
        self.dim = int(dim)  # numpy ints too: they hash and print like ints

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or self.dim == dim

    def get_shard_index(self) -> int:
        """The sharded tensor dim (the original DTorch's name for ``dim``)."""
        return self.dim

    def __eq__(self, other):
        return isinstance(other, Shard) and other.dim == self.dim

    def __hash__(self):
        return hash(("S", self.dim))

    def __repr__(self):
        return f"Shard(dim={self.dim})"

    def __str__(self):
        return f"S({self.dim})"


class Replicate(Placement):
    __slots__ = ()

    def is_replicate(self) -> bool:
        return True

    def __eq__(self, other):
        return isinstance(other, Replicate)

    def __hash__(self):
        return hash("R")

    def __repr__(self):
        return "Replicate()"

    def __str__(self):
        return "R"


class Partial(Placement):
    __slots__ = ("reduce_op",)

    def __init__(self, reduce_op: str = "sum"):
        if reduce_op not in _REDUCE_OPS:
            raise PlacementError(f"Partial reduce_op must be one of {_REDUCE_OPS}, got {reduce_op!r}")
        self.reduce_op = reduce_op

    def is_partial(self) -> bool:
        return True

    def __eq__(self, other):
        return isinstance(other, Partial) and other.reduce_op == self.reduce_op

    def __hash__(self):
        return hash(("P", self.reduce_op))

    def __repr__(self):
        return f"Partial({self.reduce_op!r})"

    def __str__(self):
        return f"P({self.reduce_op})"


REPLICATE = Replicate()


def normalize_placements(placements, mesh_ndim: int, tensor_ndim: int, mesh_shape=None) -> tuple[Placement, ...]:
    """Validate placements against a mesh and a tensor rank; ``Shard(-1)`` becomes ``Shard(ndim-1)``.

    With ``mesh_shape``, a ``Shard`` on a mesh dim of size 1 becomes ``Replicate()``: its one device holds
    the whole dim either way, and the canonical form lets equal layouts compare (and print) equal."""
    if placements is None:
        return (REPLICATE,) * mesh_ndim
    if isinstance(placements, Placement):
        placements = [placements]
    placements = list(placements)
    if len(placements) != mesh_ndim:
        raise PlacementError(
            f"got {len(placements)} placements {fmt_placements(placements)} for a {mesh_ndim}-D mesh; "
            f"give exactly one placement per mesh dim"
        )
    out = []
    for i, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise PlacementError(f"placement {i} is {p!r}; use Shard(dim), Replicate() or Partial()")
        if isinstance(p, Shard):
            d = p.dim
            if not -tensor_ndim <= d < tensor_ndim:
                raise PlacementError(
                    f"Shard({d}) on mesh dim {i} is out of range for a {tensor_ndim}-D tensor; "
                    f"shard a dim in [{-tensor_ndim}, {tensor_ndim - 1}]" if tensor_ndim else
                    f"Shard({d}) on mesh dim {i}: a 0-D tensor cannot be sharded; use Replicate()"
                )
            if d < 0:
                p = Shard(d % tensor_ndim)
            if mesh_shape is not None and mesh_shape[i] == 1:
                p = REPLICATE
        out.append(p)
    return tuple(out)


def fmt_placements(placements) -> str:
    return "[" + ", ".join(str(p) for p in placements) + "]"
