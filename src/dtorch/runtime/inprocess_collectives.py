"""The in-process backend's redistribution primitives, one mesh dim each (CommLog is the executor's, not ours):
reshapes and reductions of the grid when both layouts are stored as grids (runtime/grids.py), else per group of
blocks. Mixed into ``inprocess.InProcessRuntime``, whose ``use_grid``, ``as_grid``, ``local_blocks``, ``devices``
and ``_make`` they use."""
from __future__ import annotations

import numpy as np
import torch

from ..spec import DTensorSpec
from .blocks import cut_shard, dim_groups, reduce_dim, reduce_list
from .grids import grid_gather as _grid_gather, grid_slice as _grid_slice, grid_step
from .grids import to_partial_grid as _to_partial_grid
from .shards import Shards, SummedShards


class GridCollectives:
    def _grids(self, h: Shards, before: DTensorSpec, after: DTensorSpec):
        """``h``'s grid tensor when both specs are stored as grids (the step is a reshape/reduction), else None."""
        if self.use_grid(before) and self.use_grid(after):
            return self.as_grid(h, before)
        return None

    def _reduced(self, h: Shards, before: DTensorSpec, after: DTensorSpec, i: int):
        """The grid of ``h``'s Partial terms reduced over mesh dim ``i`` when both specs are stored as grids, else
        None. Terms held as their sum (SummedShards) are that sum: it is taken as it is."""
        op = before.placements[i].reduce_op
        if type(h) is SummedShards and op == "sum" and h.summed == (i,) and h.value is not None \
                and self.use_grid(after):
            return h.value
        x = self._grids(h, before, after)
        return None if x is None else reduce_dim(op, x, i)

    def _per_group(self, h: Shards, before: DTensorSpec, after: DTensorSpec, i: int, fn) -> Shards:
        """Blocks form of a collective: each group along mesh dim ``i`` gathers its blocks (mesh order) on
        its first device, ``fn(blocks, m)`` gives the members' new blocks, which go back to their devices."""
        blocks = self.local_blocks(h, before)
        devs = self.devices(before.mesh)
        m = before.mesh.shape[i]
        out = list(blocks)
        for members in dim_groups(before.mesh.shape, i):
            dev = devs[members[0]]
            new = fn([blocks[g].to(dev) for g in members], m)
            for j, g in enumerate(members):
                out[g] = new[j].to(devs[g])
        return self._make(after, blocks=out)

    def all_gather(self, h: Shards, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Shards:
        k = before.placements[mesh_dim].dim
        x = self._grids(h, before, after)
        if x is not None:
            return Shards(grid=_grid_gather(x, mesh_dim, k, before.mesh.ndim))
        return self._per_group(h, before, after, mesh_dim, lambda g, m: [torch.cat(g, dim=k)] * m)

    def all_reduce(self, h: Shards, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Shards:
        op = before.placements[mesh_dim].reduce_op
        x = self._reduced(h, before, after, mesh_dim)
        if x is not None:
            return Shards(grid=x)
        return self._per_group(h, before, after, mesh_dim, lambda g, m: [reduce_list(op, g)] * m)

    def reduce_scatter(self, h: Shards, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Shards:
        op, k = before.placements[mesh_dim].reduce_op, after.placements[mesh_dim].dim
        x = self._reduced(h, before, after, mesh_dim)
        if x is not None:
            m = before.mesh.shape[mesh_dim]
            return Shards(grid=_grid_slice(x, mesh_dim, k, before.mesh.ndim, m))

        def fn(g, m):
            whole = reduce_list(op, g)
            return [cut_shard(whole, k, m, j) for j in range(m)]
        return self._per_group(h, before, after, mesh_dim, fn)

    def all_to_all(self, h: Shards, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Shards:
        src, dst = before.placements[mesh_dim].dim, after.placements[mesh_dim].dim
        x = self._grids(h, before, after)
        if x is not None:
            nd, m = before.mesh.ndim, before.mesh.shape[mesh_dim]
            return Shards(grid=_grid_slice(_grid_gather(x, mesh_dim, src, nd), mesh_dim, dst, nd, m))

        def fn(g, m):
            whole = torch.cat(g, dim=src)
            return [cut_shard(whole, dst, m, j) for j in range(m)]
        return self._per_group(h, before, after, mesh_dim, fn)

    def local_slice(self, h: Shards, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Shards:
        k, m = after.placements[mesh_dim].dim, before.mesh.shape[mesh_dim]
        x = self._grids(h, before, after)
        if x is not None:
            return Shards(grid=_grid_slice(x, mesh_dim, k, before.mesh.ndim, m))
        blocks = self.local_blocks(h, before)  # no communication: each device cuts its own block
        return self._make(after, blocks=[cut_shard(b, k, m, c[mesh_dim])
                                         for b, c in zip(blocks, before.mesh.coordinates())])

    def to_partial(self, h: Shards, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Shards:
        op, m = after.placements[mesh_dim].reduce_op, before.mesh.shape[mesh_dim]
        x = self._grids(h, before, after)
        if x is not None:
            return Shards(grid=_to_partial_grid(x, mesh_dim, m, op))
        blocks = self.local_blocks(h, before)  # sum: the value on index 0, zeros elsewhere; else the value
        return self._make(after, blocks=[torch.zeros_like(b) if op == "sum" and c[mesh_dim] != 0 else b
                                         for b, c in zip(blocks, before.mesh.coordinates())])

    def collective_grid_call(self, method: str, before: DTensorSpec, after: DTensorSpec, mesh_dim: int):
        """``(f, handle of a grid)``: the step ``method`` as ``f(grid)`` when both specs are stored as grids (for
        dtorch.compile's backend="inductor" to fuse it), else None."""
        f = grid_step(method, before, after, mesh_dim) if self.use_grid(before) and self.use_grid(after) else None
        return None if f is None else (f, Shards)

    def ring_shift(self, h: Shards, spec: DTensorSpec, mesh_dim: int, shift: int = 1) -> Shards:
        mesh = spec.mesh
        if h.grid is not None:
            return Shards(grid=torch.roll(h.grid, shifts=shift, dims=mesh_dim))
        m = mesh.shape[mesh_dim]
        stride = int(np.prod(mesh.shape[mesh_dim + 1:], dtype=np.int64))
        devs = self.devices(mesh)
        out = [None] * len(h.blocks)
        for n, coord in enumerate(mesh.coordinates()):
            src = n + (((coord[mesh_dim] - shift) % m) - coord[mesh_dim]) * stride
            out[n] = h.blocks[src].to(devs[n])
        return Shards(blocks=out)
