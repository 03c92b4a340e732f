"""Pure block arithmetic every backend shares: cutting shards, reducing Partial terms, cutting a global
value into per-device blocks and assembling it back.

A backend stores what it likes; whatever it stores, device ``coord`` holds exactly the block
``DTensorSpec.local_box(coord)`` defines. These functions are the one definition of the arithmetic on
such blocks (torch only, no storage form, no devices beyond what a caller passes in), so that every
backend reduces Partial terms with the same function in the same order.

Partial order: with Partial on several mesh dims, the value is the reduction over mesh dim 0 (the
outer one) first, then mesh dim 1, and so on (docs/placements.md). ``assemble`` follows it, as every
redistribution does.
"""
from __future__ import annotations

from functools import lru_cache

import torch

from ..placement import Partial, Replicate, Shard
from ..spec import DTensorSpec, shard_range


def nbytes(shape, dtype: torch.dtype) -> int:
    """Bytes of a block of ``shape`` and ``dtype``."""
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def cut_shard(x: torch.Tensor, dim: int, m: int, j: int) -> torch.Tensor:
    """Shard ``j`` of ``m`` of ``x`` along ``dim`` (torch.chunk sizes; may be empty). A view of ``x``."""
    off, n = shard_range(x.shape[dim], m, j)
    return x.narrow(dim, off, n)


def cut_shape(shape, dim: int, m: int, j: int) -> tuple:
    """The shape ``cut_shard`` gives for a block of ``shape``."""
    out = list(shape)
    out[dim] = shard_range(shape[dim], m, j)[1]
    return tuple(out)


def reduce_dim(op: str, x: torch.Tensor, d: int) -> torch.Tensor:
    """Reduce Partial terms stacked along dim ``d`` (kept, size 1), in ``x``'s dtype like a collective."""
    if op == "max":
        return x.amax(d, keepdim=True)
    if op == "min":
        return x.amin(d, keepdim=True)
    if op == "avg" and (x.is_floating_point() or x.is_complex()):
        return x.mean(d, keepdim=True)
    if op == "avg":  # integers and bools: floor of the mean (the sum is taken in int64)
        return x.sum(d, keepdim=True).div(x.shape[d], rounding_mode="floor").to(x.dtype)
    return x.sum(d, keepdim=True, dtype=x.dtype)


def reduce_list(op: str, tensors) -> torch.Tensor:
    """Reduce equal-shaped Partial terms given in mesh order (one term: returned as is, not copied)."""
    if len(tensors) == 1:
        return tensors[0]
    return reduce_dim(op, torch.stack(list(tensors)), 0).squeeze(0)


@lru_cache(maxsize=4096)
def dim_groups(mesh_shape: tuple, i: int) -> tuple:
    """The groups of devices along mesh dim ``i``: tuples of flat (mesh-order) indices, each in mesh order."""
    m = mesh_shape[i]
    stride = 1
    for s in mesh_shape[i + 1:]:
        stride *= s
    size = stride * m
    total = 1
    for s in mesh_shape:
        total *= s
    return tuple(tuple(base + j * stride for j in range(m))
                 for outer in range(0, total, size) for base in range(outer, outer + stride))


def partial_zero(spec: DTensorSpec, coord) -> bool:
    """Does device ``coord`` hold zeros when a global value is placed (a sum Partial, index != 0)?"""
    return any(isinstance(p, Partial) and p.reduce_op == "sum" and coord[i] != 0 for i, p in enumerate(spec.placements))


def cut_global(full: torch.Tensor, spec: DTensorSpec) -> list:
    """Each device's block of the global value ``full``, in mesh order (views of ``full``).

    None where the device's block is zeros (a sum Partial keeps the value on index 0: the caller makes
    them on its device). Replicas get the same view object, so a caller can move each once.
    """
    which, slices = _cut_plan(spec)
    views = [full[s] for s in slices]
    return [None if i is None else views[i] for i in which]


def _cut_plan(spec: DTensorSpec) -> tuple:
    """(per device in mesh order: the index of its distinct box, None for zeros; each distinct box as slices),
    cached on the spec."""
    try:
        return spec.__dict__["_cut_plan"]
    except KeyError:
        pass
    index: dict = {}
    which = []
    for coord in spec.mesh.coordinates():
        if partial_zero(spec, coord):
            which.append(None)
        else:
            which.append(index.setdefault(spec.local_box(coord), len(index)))
    plan = (tuple(which), tuple(tuple(slice(o, o + n) for o, n in box) for box in index))
    object.__setattr__(spec, "_cut_plan", plan)
    return plan


def assemble(blocks, spec: DTensorSpec, device=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """The global value from every device's block (mesh order) as a new tensor on ``device`` (``out``:
    written into that new, empty tensor of the global shape instead).

    Partial terms reduce one mesh dim at a time, the outer mesh dim first (the documented order), each
    group with ``reduce_list`` on ``device``. Devices that differ only on Replicate mesh dims must hold
    equal blocks: one of them is read (callers may pass the same block object for all of them).
    """
    coords = spec.mesh.coordinates()
    pl = spec.placements
    if device is None:
        device = next((b.device for b in blocks if b is not None), torch.device("cpu"))
    blocks = list(blocks)
    shape = spec.mesh.shape
    # which mesh dims a device's block still varies on: reduced and Replicate dims are read at index 0
    settled = [isinstance(p, Replicate) for p in pl]
    for i, p in enumerate(pl):
        if not isinstance(p, Partial):
            continue
        for members in dim_groups(shape, i):
            first = coords[members[0]]
            if any(first[k] for k in range(len(pl)) if settled[k]):
                continue  # a group no device in the result reads
            blocks[members[0]] = reduce_list(p.reduce_op, [blocks[g].to(device) for g in members])
        settled[i] = True
    if out is None:
        out = torch.empty(spec.shape, dtype=spec.dtype, device=device)
    for block, coord in zip(blocks, coords):
        if all(c == 0 or isinstance(p, Shard) for c, p in zip(coord, pl)):  # one replica each
            out[tuple(slice(o, o + n) for o, n in spec.local_box(coord))] = block
    return out
