"""Grid form: every device's block of an even spec stacked into one tensor ``[*grid_shape, *local_shape]``
(``grid_shape``: the mesh size on mesh dims where devices differ, Shard and Partial; 1 where they agree,
Replicate), and the collectives as reshapes and reductions of it. Pure tensor arithmetic that the in-process
backend (on its data) and the meta backend (on meta tensors: the same shapes and strides, no data) share.
"""
from __future__ import annotations

import functools

import torch

from ..placement import Partial, Replicate, Shard
from ..spec import DTensorSpec
from .blocks import reduce_dim


def _shard_factors(spec: DTensorSpec):
    """For each tensor dim, the mesh dims sharding it (outer to inner) and its local size."""
    M = spec.mesh.shape
    local = list(spec.shape)
    factors = [[] for _ in spec.shape]
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            factors[p.dim].append(i)
            local[p.dim] //= M[i]
    return factors, local


def global_to_grid(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    M = spec.mesh.shape
    factors, local = _shard_factors(spec)
    split_shape, factor_pos, local_pos = [], {}, []
    for k in range(len(spec.shape)):
        for i in factors[k]:
            factor_pos[i] = len(split_shape)
            split_shape.append(M[i])
        local_pos.append(len(split_shape))
        split_shape.append(local[k])
    x = full.reshape(split_shape)
    shard_dims = sorted(factor_pos)
    x = x.permute([factor_pos[i] for i in shard_dims] + local_pos)
    x = x.reshape(tuple(M[i] if isinstance(p, Shard) else 1 for i, p in enumerate(spec.placements)) + tuple(local))
    if sum(isinstance(p, Shard) for p in spec.placements) < 2:
        # one sharding mesh dim: each device's block dense (a tp row-parallel weight in the full tensor's layout
        # has strided rows, and AdamW's kernels over it and its gradient, laid out by the GEMM, cost more:
        # dp2xtp2xpp2 1.28-1.34 -> 1.36-1.41x HF). Two or more (fsdp x tp): the full tensor's layout, where the fsdp
        # all-gather is a view (grid_gather)
        x = x.contiguous()
    for i, p in enumerate(spec.placements):
        if isinstance(p, Partial):
            x = to_partial_grid(x, i, M[i], p.reduce_op)
    return unbased(x)


def grid_to_global(x: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    M = spec.mesh.shape
    for i, p in enumerate(spec.placements):
        if isinstance(p, Partial):
            x = reduce_dim(p.reduce_op, x, i)
        elif isinstance(p, Replicate) and x.shape[i] != 1:
            x = x.narrow(i, 0, 1)
    factors, local = _shard_factors(spec)
    shard_dims = [i for i, p in enumerate(spec.placements) if isinstance(p, Shard)]
    # drop non-shard grid dims, then move each mesh factor next to its tensor dim
    x = x.reshape(tuple(M[i] for i in shard_dims) + tuple(local))
    pos_of = {i: n for n, i in enumerate(shard_dims)}
    ns = len(shard_dims)
    perm = []
    for k in range(len(spec.shape)):
        perm += [pos_of[i] for i in factors[k]]
        perm.append(ns + k)
    return x.permute(perm).reshape(spec.shape)


def to_partial_grid(x: torch.Tensor, i: int, m: int, op: str) -> torch.Tensor:
    """Replicated (size 1 on grid dim i) -> Partial terms whose reduction is the value."""
    if op == "sum":
        if m == 1:
            return x
        zeros = torch.zeros_like(x).expand(*x.shape[:i], m - 1, *x.shape[i + 1:])
        return torch.cat([x, zeros], dim=i)
    return x.expand(*x.shape[:i], m, *x.shape[i + 1:])


def unbased(x: torch.Tensor) -> torch.Tensor:
    """``x`` on the same storage, keeping no base tensor alive, where it is a view of a temporary (a grid this
    module made of a full tensor; a weight's gradient that torch's graph handed out reshaped to its grid): a kept
    base would count as a second holder of the storage in copy-on-write (``cow.writable``), so the first in-place
    write (an init, the optimizer's update, the next micro-batch's gradient accumulated) would copy it, and in
    the contiguous layout that makes ``grid_gather`` copy too. Whoever else holds the storage still counts."""
    return x.detach() if x._base is not None else x


def grid_gather(x: torch.Tensor, i: int, k: int, nd: int) -> torch.Tensor:
    """All-gather along mesh dim ``i`` of tensor dim ``k`` (``nd``: mesh dims): a view of ``x``, no copy,
    when the shards along ``i`` lie in ``x``'s memory as in the gathered tensor (the layout of a grid that
    ``global_to_grid`` or ``grid_slice`` made: the full tensor's, which FSDP parameters keep), else a copy."""
    pos = nd + k
    x = x.movedim(i, pos - 1)
    s = list(x.shape)
    x = x.reshape(s[: pos - 1] + [s[pos - 1] * s[pos]] + s[pos + 1:])
    return x.unsqueeze(i)


def grid_slice(x: torch.Tensor, i: int, k: int, nd: int, m: int) -> torch.Tensor:
    """Each device along mesh dim ``i`` keeps its ``m``-th of tensor dim ``k`` (``nd``: mesh dims): a view of the
    whole, made dense first where it is not. A weight's gradient comes from the GEMM column-major (torch's
    layout for it, in each tp block); sliced as it is, its shards would be laid out unlike the parameter's and
    the optimizer states', and AdamW's element-wise kernels over the two layouts cost ~4x (a [512, 1408]
    weight over fsdp4 x tp2: ~14 ms per step against ~4 ms with the copy, measured)."""
    x = x.squeeze(i) if x.shape[i] == 1 else x.narrow(i, 0, 1).squeeze(i)
    x = x.contiguous()
    pos = nd - 1 + k
    s = list(x.shape)
    x = x.reshape(s[:pos] + [m, s[pos] // m] + s[pos + 1:])
    return unbased(x.movedim(pos, i))


def grid_step(method: str, before: DTensorSpec, after: DTensorSpec, i: int):
    """The in-process runtime's collective ``method`` along mesh dim ``i`` on a grid (both specs stored as grids),
    as a function of the grid (for dtorch.compile's backend="inductor" to fuse it); None for other methods."""
    nd, m = before.mesh.ndim, before.mesh.shape[i]
    b, a = before.placements[i], after.placements[i]
    if method == "all_gather":
        return functools.partial(grid_gather, i=i, k=b.dim, nd=nd)
    if method == "all_reduce":
        return functools.partial(reduce_dim, b.reduce_op, d=i)
    if method == "reduce_scatter":
        return lambda x: grid_slice(reduce_dim(b.reduce_op, x, i), i, a.dim, nd, m)
    if method == "all_to_all":
        return lambda x: grid_slice(grid_gather(x, i, b.dim, nd), i, a.dim, nd, m)
    if method == "local_slice":
        return functools.partial(grid_slice, i=i, k=a.dim, nd=nd, m=m)
    if method == "to_partial":
        return functools.partial(to_partial_grid, i=i, m=m, op=a.reduce_op)
    return None
