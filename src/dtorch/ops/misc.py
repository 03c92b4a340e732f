"""Small ops a new user reaches for, built from the op table's own ops (their placements and gradients
come from those): one_hot, normalize, cosine_similarity, glu, Tensor.equal.

one_hot keeps every shard (a new last dim; ``num_classes=-1`` fetches the maximum, as torch reads it
too). normalize and cosine_similarity reduce over ``dim`` with ``norm``/``sum``, which turn a sharded dim
into Partial sums (no gather of the input). glu is torch's kernel on each block (a shard of its dim is gathered)."""
from __future__ import annotations

import torch

from ..errors import OpError
from ..placement import Replicate, Shard
from ..runtime.kernels import broadcast_shape as _broadcast_shape, kernel
from ..spec import DTensorSpec
from . import pointwise as pw
from . import reduce as rd
from .args import _dim, _tensor
from .dispatch import OpPlan, dispatch
from .rules import spec_like
from .table import register


@kernel("misc.one_hot")
def _one_hot_kernel(x, *, num_classes):
    return torch.nn.functional.one_hot(x, num_classes)


def _one_hot_rule(specs, num_classes):
    (s,) = specs
    return OpPlan((s,), (DTensorSpec(s.mesh, s.placements, s.shape + (num_classes,), torch.int64),),
                  _one_hot_kernel, {"num_classes": num_classes})


@register(rule=_one_hot_rule, kernel=_one_hot_kernel, functional=True, torch_fns=(torch.nn.functional.one_hot,))
def one_hot(tensor, num_classes=-1):
    x = _tensor("one_hot", tensor)
    if x.dtype != torch.int64:
        raise OpError("one_hot is only applicable to index tensor of type LongTensor.")
    if any(p.is_partial() for p in x.placements):
        x = rd._unpartial(x)
    if num_classes == -1:
        num_classes = int(rd.amax(x).item()) + 1 if x.numel() else 0
    return dispatch("one_hot", _one_hot_rule, [x], (int(num_classes),))


@register(functional=True, torch_fns=(torch.nn.functional.normalize,))
def normalize(input, p=2.0, dim=1, eps=1e-12, out=None):
    """``F.normalize``: ``input / norm(input, p, dim).clamp_min(eps)`` (torch's own decomposition)."""
    if out is not None:
        raise OpError("dtorch.nn.functional.normalize: out= is not supported; use the returned tensor")
    x = _tensor("normalize", input)
    denom = pw.clamp(rd.norm(x, p, dim, keepdim=True), min=eps)
    return x / denom.expand(tuple(x.shape))


@register(functional=True, torch_fns=(torch.nn.functional.cosine_similarity, torch.cosine_similarity))
def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """``F.cosine_similarity``: each input over its norm (clamped at eps), multiplied, summed over ``dim``."""
    a, b = _tensor("cosine_similarity", x1), _tensor("cosine_similarity", x2)
    shape = _broadcast_shape([tuple(a.shape), tuple(b.shape)])
    if shape is None:
        raise OpError(f"dtorch.cosine_similarity: shapes {list(a.shape)} and {list(b.shape)} do not broadcast")
    a = a if tuple(a.shape) == shape else a.expand(shape)
    b = b if tuple(b.shape) == shape else b.expand(shape)
    na = pw.clamp(rd.norm(a, 2, dim, keepdim=True), min=eps)
    nb = pw.clamp(rd.norm(b, 2, dim, keepdim=True), min=eps)
    return rd.sum_((a / na) * (b / nb), dim)


@kernel("misc.glu")
def _glu_kernel(x, *, dim):
    return torch.nn.functional.glu(x, dim)


def _glu_rule(specs, dim):
    (s,) = specs
    d = dim % len(s.shape)
    # the halves must meet on one device: a shard of ``dim`` is gathered; glu is not linear: partials reduce
    places = tuple(Replicate() if p.is_partial() or (isinstance(p, Shard) and p.dim % len(s.shape) == d) else p
                   for p in s.placements)
    shape = tuple(n // 2 if k == d else n for k, n in enumerate(s.shape))
    return OpPlan((spec_like(s, placements=places),), (spec_like(s, placements=places, shape=shape),), _glu_kernel,
                  {"dim": dim})


@register(rule=_glu_rule, kernel=_glu_kernel, functional=True, torch_fns=(torch.nn.functional.glu,))
def glu(input, dim=-1):
    """``F.glu``: first half times the sigmoid of the second half along ``dim`` (torch's own kernel on each
    device's block: ``dim`` is gathered where it is sharded, other shards stay)."""
    x = _tensor("glu", input)
    d = _dim(dim, x.ndim, "glu")
    if x.shape[d] % 2:
        raise OpError(f"Halving dimension must be even, but dimension {d} is size {x.shape[d]}")
    return dispatch("glu", _glu_rule, [x], (d - x.ndim,))


@register(methods=("equal",), torch_fns=(torch.equal,))
def equal(input, other) -> bool:
    """``torch.equal``: same shape and every element equal (a Python bool)."""
    a, b = _tensor("equal", input), _tensor("equal", other)
    if tuple(a.shape) != tuple(b.shape):
        return False
    return bool(rd.all_(a == b).item())
