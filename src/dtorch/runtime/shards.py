"""The in-process backend's storage handle (module docstring of runtime/inprocess.py: grid or blocks), and the
blocks-form handle of a run on a box of busy devices (runtime/box.py). Shared by the runtime, its kept local
graphs (runtime/inprocess_tracked.py) and the meta backend."""
from __future__ import annotations

import torch


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
