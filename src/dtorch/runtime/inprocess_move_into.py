"""The in-process backend's ``move_into``: many tensors written into other tensors' storage, each in its
own layout (the weight sync), region by region."""
from __future__ import annotations

import torch

from ..spec import move_transfers
from .cow import writable


def move_into(rt, moves, make_shards) -> list:
    """Each region of each target block copied straight from a source block that holds it (one copy per
    distinct block: replicas of a grid are stored once). A shared target gets fresh storage: every
    element is about to be written."""
    out = []
    for src, before, target, after in moves:
        sources = rt.local_blocks(src, before)
        index = {d: n for n, d in enumerate(before.mesh.device_ids)}
        if target.grid is not None:
            if not writable(target.grid):
                target = make_shards(grid=torch.empty_like(target.grid, memory_format=torch.contiguous_format))
            grid = target.grid
            g = grid.shape[: after.mesh.ndim]
            slots = [tuple(c if m > 1 else 0 for c, m in zip(coord, g)) for coord in after.mesh.coordinates()]
            dest = [grid[c] for c in slots]
        else:
            blocks = target.blocks
            slots = [id(b) for b in blocks]
            held = {}
            for n in range(len(blocks)):  # (no loop variable may keep a block referenced: writable() counts)
                held[slots[n]] = held.get(slots[n], 0) + 1
            if not all(writable(blocks[slots.index(k)], holder_refs=c) for k, c in held.items()):
                fresh = {k: torch.empty_like(blocks[slots.index(k)], memory_format=torch.contiguous_format)
                         for k in held}
                target = make_shards(blocks=[fresh[k] for k in slots])
            dest = target.blocks
        position = {d: n for n, d in enumerate(after.mesh.device_ids)}
        writer: dict = {}  # storage slot -> the one device that writes it (replicas stored once: once)
        for n, slot in enumerate(slots):
            writer.setdefault(slot, n)
        for s_id, d_id, s_sl, d_sl, _ in move_transfers(before, after):
            n = position[d_id]
            if writer[slots[n]] == n:
                dest[n][d_sl].copy_(sources[index[s_id]][s_sl])
        out.append(target)
    return out
