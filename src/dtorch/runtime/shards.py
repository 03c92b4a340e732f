"""The in-process backend's storage handle (module docstring of runtime/inprocess.py: grid or blocks), and the
blocks-form handle of a run on a box of busy devices (runtime/box.py). Shared by the runtime, its kept local
graphs (runtime/inprocess_tracked.py) and the meta backend."""
from __future__ import annotations

import torch

from .kernels import as_terms


class Shards:
    __slots__ = ("grid", "blocks", "__weakref__")  # weakly referenced: Runtime.observe (memory accounting)

    def __init__(self, grid: torch.Tensor | None = None, blocks: list | None = None):
        self.grid = grid
        self.blocks = blocks

    def __repr__(self):
        if self.grid is not None:
            return f"Shards(grid={tuple(self.grid.shape)})"
        return f"Shards(blocks={[tuple(b.shape) for b in self.blocks]})"


class BoxShards(Shards):
    """A blocks-form handle made by a run on a box of busy devices (runtime/box.py): the blocks, and the box grid
    they are views of (``boxed``, for the box ``key``), which the next run on that box takes as it is."""

    __slots__ = ("key", "boxed")

    def __init__(self, blocks: list, key: tuple, boxed: torch.Tensor):
        super().__init__(blocks=blocks)
        self.key, self.boxed = key, boxed


_GRID_SLOT = Shards.grid  # the base class's slot: SummedShards keeps the terms there once they are made


class SummedShards(Shards):
    """A sum-Partial grid handle whose terms are held as their sum: ``value`` has size 1 on the grid dims
    ``summed`` where the terms' grid (``terms``, its leading shape) has more; the terms are ``value`` on index 0
    of each such dim and zeros elsewhere (``kernels.as_terms``).

    Torch's autograd on a stacked grid already sums the gradient of a replicated input over the grid dims it was
    broadcast on (``vjp_tracked``): the reduction that comes next (``all_reduce``, ``reduce_scatter``) would only
    add zeros to it. The runtime's reductions (and the add of two such handles) take ``value`` as it is; anything
    else reads ``grid``, which makes the terms then, the same tensor as when they are made at once. The values are
    those of the terms' reduction, which gives the value exactly (x + 0 == x; only a -0.0 stays -0.0 instead of
    becoming +0.0). The process backend has no such handle: its devices hold and reduce real terms."""

    __slots__ = ("value", "terms", "summed")

    def __init__(self, value: torch.Tensor, terms: tuple):
        _GRID_SLOT.__set__(self, None)
        self.blocks = None
        self.value, self.terms = value, terms
        self.summed = tuple(d for d in range(len(terms)) if value.shape[d] == 1 and terms[d] > 1)

    @property
    def grid(self) -> torch.Tensor:
        g = _GRID_SLOT.__get__(self)
        if g is None:
            g = as_terms(self.value, self.terms, len(self.terms))
            _GRID_SLOT.__set__(self, g)
            self.value = None  # (from now on the terms are the handle's value: they may be written in place)
        return g

    def terms_shape(self) -> tuple:
        """The shape of the terms (of ``grid``)."""
        v = self.value
        return tuple(self.terms[d] if d in self.summed else n for d, n in enumerate(v.shape))

    def __repr__(self):
        if self.value is None:
            return super().__repr__()
        return f"SummedShards(value={tuple(self.value.shape)}, terms={self.terms})"


def add_sums(handles, kwargs) -> list | None:
    """``a + b`` (a pointwise kernel's ``kwargs``) of two sum-Partial grid handles that both hold their terms as
    their sums (summed over the same grid dims), as the handle of the sum of the sums; None otherwise. Exact: the
    terms' add is the sums' add on index 0 of the summed dims and 0 + 0 elsewhere."""
    a, b = handles
    if (type(a) is SummedShards and type(b) is SummedShards and kwargs.get("fn") == "torch.add"
            and kwargs.get("template") is None and not kwargs.get("kwargs")):
        x, y = a.value, b.value
        if x is not None and y is not None and a.summed == b.summed and x.shape == y.shape:
            return [SummedShards(torch.add(x, y), a.terms)]
    return None
