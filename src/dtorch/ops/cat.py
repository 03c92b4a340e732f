"""cat, concat, concatenate and stack: the inputs are aligned on a common placement, the cat dim whole.

Per mesh dim: a shard of a non-cat dim stays (the largest input's; every input is cut the same way, so the
blocks line up); partial inputs of one kind stay partial (cat of sums is the sum of cats; a replicated input
becomes partial locally); anything else is replicated.
"""
from __future__ import annotations

import operator
from functools import reduce

import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .dim_map import _prod
from .dispatch import OpPlan, dispatch
from .rules import meta_call, spec_like, to_dtensors
from .table import register


@kernel("view.cat")
def _cat_kernel(*xs, dim, stack, lead=0):
    return (torch.stack if stack else torch.cat)(xs, dim=lead + dim)


def _cat_shape(shapes, dim, stack) -> tuple | None:
    """torch's output shape of cat / stack of ``shapes`` along ``dim``, or None where torch refuses them
    (the meta run then raises torch's error). The front end has dropped cat's legacy 1-D empty inputs."""
    first = shapes[0]
    nd = len(first) + stack
    if nd == 0 or not -nd <= dim < nd:  # (cat refuses zero-dim tensors)
        return None
    d = dim % nd
    if stack:
        return first[:d] + (len(shapes),) + first[d:] if all(s == first for s in shapes) else None
    for s in shapes:
        if len(s) != nd or any(a != b for k, (a, b) in enumerate(zip(s, first)) if k != d):
            return None
    return first[:d] + (sum(s[d] for s in shapes),) + first[d + 1:]


def _cat_rule(specs, dim, stack):
    # the dtype (type promotion over the inputs) from torch on small tensors, the shape from _cat_shape
    out_meta = meta_call(lambda *ts: (torch.stack if stack else torch.cat)(ts, dim), specs,
                         out_shape=_cat_shape([s.shape for s in specs], dim, stack))
    d = dim % out_meta.ndim
    to_out = (lambda e: e + 1 if e >= d else e) if stack else (lambda e: e)
    to_in = (lambda o: o - 1 if o > d else o) if stack else (lambda o: o)
    mesh = specs[0].mesh
    in_pl = [list(s.placements) for s in specs]
    out_pl = []
    for i in range(mesh.ndim):
        # S: the largest input's shard of a non-cat dim, every input cut the same way (same block shapes)
        shards = [(_prod(s.shape), to_out(s.placements[i].dim)) for s in specs
                  if isinstance(s.placements[i], Shard) and to_out(s.placements[i].dim) != d]
        if shards:
            o = max(shards)[1]
            new = Shard(to_in(o))
            out_pl.append(Shard(o))
        else:
            # P: cat(sum a_k, sum b_k) = sum cat(a_k, b_k); a replicated input becomes partial locally
            others = {s.placements[i] for s in specs} - {Replicate()}
            new = others.pop() if len(others) == 1 and isinstance(next(iter(others)), Partial) else Replicate()
            out_pl.append(new)
        for p in in_pl:
            p[i] = new
    in_specs = tuple(spec_like(s, placements=p) for s, p in zip(specs, in_pl))
    out = DTensorSpec(mesh, tuple(out_pl), tuple(out_meta.shape), out_meta.dtype)
    return OpPlan(in_specs, (out,), _cat_kernel, {"dim": d, "stack": stack})


def _cat_inputs(name, tensors):
    if isinstance(tensors, (Tensor, torch.Tensor)) or not isinstance(tensors, (tuple, list)):
        raise OpError(f"dtorch.{name} expects a sequence of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise OpError(f"dtorch.{name} expects a non-empty sequence of tensors")
    xs = to_dtensors(name, list(tensors))
    bad = [type(t).__name__ for t in xs if not isinstance(t, Tensor)]
    if bad:
        raise OpError(f"dtorch.{name} expects tensors, got {bad}")
    return xs


@register(rule=_cat_rule, kernel=_cat_kernel, torch_fns=(torch.cat,))
def cat(tensors, dim=0, *, axis=None):
    xs = _cat_inputs("cat", tensors)
    dim = axis if axis is not None else dim
    # torch skips 1-D empty tensors when concatenating higher-rank ones (legacy behavior)
    kept = [t for t in xs if not (tuple(t.shape) == (0,) and any(u.ndim > 1 for u in xs))]
    if len(kept) < len(xs):  # the dropped ones still take part in torch's type promotion
        dtype = reduce(torch.promote_types, [t.dtype for t in xs])
        kept = [t if t.dtype == dtype else t.to(dtype) for t in kept]
    return dispatch("cat", _cat_rule, kept, (operator.index(dim), False))


@register(rule=_cat_rule, kernel=_cat_kernel, torch_fns=(torch.concat,))
def concat(tensors, dim=0, *, axis=None):
    return cat(tensors, dim, axis=axis)


@register(rule=_cat_rule, kernel=_cat_kernel, torch_fns=(torch.concatenate,))
def concatenate(tensors, axis=0, *, dim=None):
    return cat(tensors, axis if dim is None else dim)


@register(rule=_cat_rule, kernel=_cat_kernel, torch_fns=(torch.stack,))
def stack(tensors, dim=0):
    return dispatch("stack", _cat_rule, _cat_inputs("stack", tensors), (operator.index(dim), True))
