"""View ops that pick elements: ``select`` and ``diagonal`` (views of their input, ops/views.py).

``x.select(d, i)`` is ``x[:, ..., i]`` (the basic-index view op of view.py). ``diagonal`` keeps every
shard of the dims it does not read; the two dims it reads are gathered on the mesh dims sharding them
(the diagonal crosses every block boundary of both); a Partial stays Partial (it moves elements only).
"""
from __future__ import annotations

import operator

import torch

from ..autograd.dispatched import SHAPE_ONLY_KERNELS
from ..placement import Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from .args import IndexOutOfRangeError, _dim, _tensor
from .dispatch import OpPlan
from .rules import spec_like
from .table import register
from .view import _index
from .views import STEP_META, view_op


@register(methods=("select",), torch_fns=(torch.select,))
def select(input, dim, index):
    """``x.select(dim, index)``: the view ``x[..., index, ...]`` with ``index`` on ``dim`` (the dim goes away)."""
    x = _tensor("select", input)
    if x.ndim == 0:
        raise IndexOutOfRangeError("dtorch.select() cannot be applied to a 0-dim tensor.")
    d = _dim(dim, x.ndim, "select")
    n, i = x.shape[d], operator.index(index)
    if not -n <= i < n:
        raise IndexOutOfRangeError(f"select(): index {i} out of range for tensor of size {list(x.shape)} at "
                                   f"dimension {d}")
    items = (("all",),) * d + (("int", i % n),) + (("all",),) * (x.ndim - d - 1)
    return _index("select", x, items)


@kernel("views.diagonal")
def _diagonal_kernel(x, *, offset, dim1, dim2):
    return torch.diagonal(x, offset, dim1, dim2)  # (dims counted from the end: grid dims in front stay)


def _diagonal_rule(specs, offset, dim1, dim2):
    spec = specs[0]
    out_shape = tuple(torch.empty(spec.shape, device="meta").diagonal(offset, dim1, dim2).shape)
    kept = [d for d in range(spec.ndim) if d not in (dim1, dim2)]
    in_pl, out_pl = [], []
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim in (dim1, dim2):
            p = Replicate()  # the diagonal crosses every block boundary of the dims it reads
        in_pl.append(p)
        out_pl.append(Shard(kept.index(p.dim)) if isinstance(p, Shard) else p)
    out = DTensorSpec(spec.mesh, tuple(out_pl), out_shape, spec.dtype)
    return OpPlan((spec_like(spec, placements=in_pl),), (out,), _diagonal_kernel,
                  {"offset": offset, "dim1": dim1 - spec.ndim, "dim2": dim2 - spec.ndim})


@register(rule=_diagonal_rule, kernel=_diagonal_kernel, methods=("diagonal",), torch_fns=(torch.diagonal,))
def diagonal(input, offset=0, dim1=0, dim2=1):
    """``x.diagonal(offset, dim1, dim2)``: the view of the diagonal of dims ``dim1``/``dim2``, as a last dim."""
    x = _tensor("diagonal", input)
    a, b = _dim(dim1, x.ndim, "diagonal"), _dim(dim2, x.ndim, "diagonal")
    if a == b:
        raise IndexOutOfRangeError(f"dtorch.diagonal: dimensions cannot be identical {dim1}, {dim2}")
    return view_op("diagonal", _diagonal_rule, x, (operator.index(offset), a, b))


STEP_META[_diagonal_rule] = lambda m, offset, dim1, dim2: m.diagonal(offset, dim1, dim2)
SHAPE_ONLY_KERNELS.add(_diagonal_kernel.name)
