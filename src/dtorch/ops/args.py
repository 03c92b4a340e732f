"""Arguments with torch's semantics, shared by the op families: a tensor argument, sizes as varargs or one
sequence, a dim in range, the keyword spelling of sizes; and the errors torch raises for them."""
from __future__ import annotations

import operator

import torch

from ..errors import OpError
from ..tensor import Tensor
from .rules import to_dtensors
from .views import View


class IndexOutOfRangeError(OpError, IndexError):
    """A dim or an index lies outside the tensor (an IndexError, as in torch)."""


class UnsupportedIndexError(OpError, NotImplementedError):
    """An index or argument form dtorch does not implement (a False bool index, per-element repeats)."""


def _tensor(name, x) -> Tensor:
    if type(x) is Tensor or type(x) is View:
        return x
    x = to_dtensors(name, [x])[0]
    if not isinstance(x, Tensor):
        raise OpError(f"dtorch.{name} expects a tensor, got {type(x).__name__}")
    return x


def _sizes(args, name) -> tuple:
    """Sizes given as varargs or as one tuple / list / torch.Size."""
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = args[0]
    for a in args:
        if type(a) is not int:
            break
    else:  # plain ints, the usual case: no conversion
        return args if type(args) is tuple else tuple(args)
    try:
        return tuple(operator.index(a) for a in args)
    except TypeError:
        raise OpError(f"dtorch.{name}: sizes must be ints (varargs or one tuple/list/torch.Size), got {args!r}") from None


def _dim(dim, ndim, name, extra=0) -> int:
    n = max(ndim + extra, 1)  # like torch, a 0-D tensor accepts dims -1 and 0
    if type(dim) is int and -n <= dim < n:  # the usual case, first
        return dim % n
    d = operator.index(dim)
    if not -n <= d < n:
        raise IndexOutOfRangeError(f"dtorch.{name}: dim {dim} is out of range for a {ndim}-D tensor; "
                                   f"use a dim in [{-n}, {n - 1}]")
    return d % n


def _kw(name, kw, key):
    """The keyword spelling torch's methods accept (``x.repeat(repeats=(2, 1))``, ``x.view(size=...)``)."""
    if set(kw) != {key}:
        raise OpError(f"dtorch.{name}() takes its sizes positionally or as {key}=..., got keywords {sorted(kw)}")
    return kw[key]
