"""Ops that read a dim whole: scans (cumsum, cumprod), softmax and log_softmax, sort/argsort, topk of a
whole dim, median, cummax/cummin, and the data movers flip, roll and unfold.

Mesh dims sharding the dim an op reads whole are gathered, other shards pass through (shifted past a dropped
dim); a P(sum) input stays partial for cumsum (linear) and the movers (they only move elements), and is
reduced first for the others. topk over a sharded dim is the exception: each device offers its top k
(ops/reduce.py's candidates) and only those are gathered.
"""
from __future__ import annotations

import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from .reduce import _dims, _input, _keeps, _named, _splits, _unpartial, _with_index
from .dispatch import OpPlan, dispatch
from .rules import meta_call, spec_like
from .view import flatten, reshape

# -- scans and softmax: the dim must be whole ---------------------------------------------------------

_SCANS = {
    "cumsum": lambda x, d, dtype: torch.cumsum(x, d, dtype=dtype),
    "cumprod": lambda x, d, dtype: torch.cumprod(x, d, dtype=dtype),
    "softmax": lambda x, d, dtype: torch.softmax(x, d, dtype=dtype),
    "log_softmax": lambda x, d, dtype: torch.log_softmax(x, d, dtype=dtype),
}
_SCAN_KEEPS = {"cumsum": ("sum", "avg")}  # cumsum is linear; softmax is not


def _run_scan(op, x, dim, nd, dtype):
    if nd == 0:
        return _SCANS[op](x.unsqueeze(-1), -1, dtype).squeeze(-1)
    return _SCANS[op](x, dim, dtype)


@kernel("scan")
def _scan_kernel(x, *, op, dim, nd, dtype):
    return _run_scan(op, x, dim, nd, dtype)


def _scan_rule(specs, op, dim, dtype) -> OpPlan:
    (s,) = specs
    meta = meta_call(lambda x: _run_scan(op, x, dim - s.ndim, s.ndim, dtype), (s,), out_shape=s.shape)
    keeps = _SCAN_KEEPS.get(op, ())
    pl = [Replicate() if (isinstance(p, Shard) and p.dim == dim) or (isinstance(p, Partial) and not _keeps(p, keeps, s.dtype))
          else p for p in s.placements]
    out = DTensorSpec(s.mesh, tuple(pl), tuple(meta.shape), meta.dtype)
    return OpPlan((spec_like(s, placements=pl),), (out,), _scan_kernel,
                  {"op": op, "dim": dim - s.ndim, "nd": s.ndim, "dtype": dtype})


def _scan(name, input, dim, dtype):
    x = _input(name, input)
    (d,) = _dims(name, dim, x.ndim, single=True) or (0,)
    return dispatch(name, _scan_rule, [x], (name, d, dtype))


def cumsum(input, dim, *, dtype=None):
    """``torch.cumsum``; the scanned dim is gathered where it is sharded, other shards pass through."""
    return _scan("cumsum", input, dim, dtype)


def cumprod(input, dim, *, dtype=None):
    """``torch.cumprod``; the scanned dim is gathered where it is sharded."""
    return _scan("cumprod", input, dim, dtype)


def _implicit_dim(ndim):
    return 0 if ndim in (0, 1, 3) else 1  # torch's legacy choice when softmax gets no dim


def softmax(input, dim=None, _stacklevel=3, dtype=None):
    """``softmax`` along ``dim``: the dim is made whole (gathered on the mesh dims sharding it)."""
    x = _input("softmax", input)
    return _scan("softmax", x, _implicit_dim(x.ndim) if dim is None else dim, dtype)


def log_softmax(input, dim=None, _stacklevel=3, dtype=None):
    x = _input("log_softmax", input)
    return _scan("log_softmax", x, _implicit_dim(x.ndim) if dim is None else dim, dtype)


_SCAN = {"rule": _scan_rule, "kernel": _scan_kernel}
_named("cumsum", cumsum, torch_fns=(torch.cumsum,), **_SCAN)
_named("softmax", softmax, torch_fns=(torch.softmax, torch.nn.functional.softmax), functional=True, **_SCAN)
_named("log_softmax", log_softmax, torch_fns=(torch.log_softmax, torch.nn.functional.log_softmax), functional=True,
       **_SCAN)
_named("cumprod", cumprod, torch_fns=(torch.cumprod,), **_SCAN)


# -- ops that need whole dims: sort, topk of a whole dim, median, cummax/cummin, and the data movers ------
#
# The dims an op reads as a whole are gathered on the mesh dims sharding them (sort: a sharded dim is
# gathered, said here and in the docs); other shards pass through (shifted past a dropped dim). Ops that
# only move elements (flip, roll, unfold) keep Partial inputs partial; the others reduce them first.

def _median_dim(x, d, keepdim):
    return tuple(torch.median(x, d, keepdim=keepdim))


_WHOLE = {
    "sort": lambda x, d, descending, stable: tuple(torch.sort(x, dim=d, descending=descending, stable=stable)),
    "argsort": lambda x, d, descending, stable: torch.argsort(x, dim=d, descending=descending, stable=stable),
    "topk": lambda x, d, k, largest, sorted: tuple(torch.topk(x, k, d, largest=largest, sorted=sorted)),
    "median_dim": lambda x, d, keepdim: _median_dim(x, d, keepdim),
    "median_all": lambda x, d: torch.median(x.flatten(d)),
    "cummax": lambda x, d: tuple(torch.cummax(x, d)),
    "cummin": lambda x, d: tuple(torch.cummin(x, d)),
    "flip": lambda x, d: torch.flip(x, d),
    "roll": lambda x, d, shifts: torch.roll(x, shifts, d),
    "unfold": lambda x, d, size, step: x.unfold(d[0], size, step),
}
_MOVERS = ("flip", "roll", "unfold")


@kernel("reduce.whole")
def _whole_kernel(x, *, op, dims, kw, lead=0):
    d = dims if op in ("flip", "roll", "unfold", "median_all") else dims[0]
    if op == "median_all":
        return torch.median(x.reshape(tuple(x.shape[:lead]) + (-1,)), -1).values if lead else torch.median(x)
    return _WHOLE[op](x, d, **dict(kw))


def _whole_rule(specs, op, dims, drop, kw):
    (s,) = specs
    nd = s.ndim
    neg = tuple(d - nd for d in dims) if nd else (-1,) * len(dims)
    x0 = lambda t: _WHOLE[op](t, neg if op in ("flip", "roll", "unfold") else neg[0], **dict(kw))  # noqa: E731
    if op == "median_all":
        meta = meta_call(lambda t: torch.median(t), specs)
    else:
        meta = meta_call(x0, specs)
    metas = meta if isinstance(meta, tuple) else (meta,)
    pl = []
    for p in s.placements:
        if (isinstance(p, Shard) and (p.dim in dims or op == "median_all")) or \
                (isinstance(p, Partial) and op not in _MOVERS):
            p = Replicate()
        pl.append(p)
    out_pl = tuple(Shard(p.dim - 1) if isinstance(p, Shard) and drop is not None and p.dim > drop else p for p in pl)
    outs = tuple(DTensorSpec(s.mesh, out_pl, tuple(m.shape), m.dtype) for m in metas)
    return OpPlan((spec_like(s, placements=pl),), outs, _whole_kernel, {"op": op, "dims": neg, "kw": kw},
                  multi_output=len(outs) > 1)


def _whole(name, op, x, dims, drop=None, **kw):
    return dispatch(name, _whole_rule, [x], (op, tuple(dims), drop, tuple(sorted(kw.items()))))


def _one(name, x, dim):
    (d,) = _dims(name, dim, x.ndim, single=True) or (0,)
    return d


def topk(input, k, dim=-1, largest=True, sorted=True):
    """``torch.topk``; over a sharded dim each device offers its top k (global indices), and only those
    candidates are gathered for the final top k."""
    x = _input("topk", input)
    d = _one("topk", x, dim)
    k = int(k)
    if x.ndim and not 0 <= k <= x.shape[d]:
        raise OpError(f"dtorch.topk: k ({k}) is out of range for dim {dim} of size {x.shape[d]}")
    if _splits(x.spec, (d,)) and k > 0:
        v, i = _with_index("topk", _unpartial(x), "topk", d, True, k, bool(largest), bool(sorted))
    else:
        v, i = _whole("topk", "topk", x, (d,), k=k, largest=bool(largest), sorted=bool(sorted))
    return torch.return_types.topk((v, i))


def sort(input, dim=-1, descending=False, stable=False):
    """``torch.sort``: a sharded sort dim is gathered (every output element may depend on every input)."""
    x = _input("sort", input)
    if isinstance(dim, bool):  # torch.sort(x, True): descending
        dim, descending = -1, dim
    d = _one("sort", x, dim)
    v, i = _whole("sort", "sort", x, (d,), descending=bool(descending), stable=bool(stable))
    return torch.return_types.sort((v, i))


def argsort(input, dim=-1, descending=False, stable=False):
    x = _input("argsort", input)
    return _whole("argsort", "argsort", x, (_one("argsort", x, dim),), descending=bool(descending),
                  stable=bool(stable))


def median(input, dim=None, keepdim=False):
    """``torch.median``: the lower median; the dim (all dims without ``dim``) is gathered."""
    x = _input("median", input)
    if dim is None:
        return _whole("median", "median_all", x, tuple(range(x.ndim)) or (0,))
    d = _one("median", x, dim)
    v, i = _whole("median", "median_dim", x, (d,), drop=None if keepdim or not x.ndim else d, keepdim=bool(keepdim))
    return torch.return_types.median((v, i))


def _cum_ext(name):
    def fn(input, dim):
        x = _input(name, input)
        v, i = _whole(name, name, x, (_one(name, x, dim),))
        return getattr(torch.return_types, name)((v, i))
    return fn


def flip(input, dims):
    """``torch.flip``: flipped dims that are sharded are gathered (block k's output is block m-1-k's input)."""
    x = _input("flip", input)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    ds = tuple(_dims("flip", d, x.ndim, single=True)[0] if x.ndim else 0 for d in dims)
    if len(set(ds)) != len(ds):
        raise OpError(f"dtorch.flip: dim {dims} appears multiple times in the list of dims")
    if not ds or not x.ndim:
        return x.clone()
    return _whole("flip", "flip", x, ds)


def roll(input, shifts, dims=None):
    """``torch.roll``: rolled dims are gathered where sharded; without ``dims`` the flattened tensor rolls."""
    x = _input("roll", input)
    if dims is None:
        flat = flatten(x)
        return reshape(_whole("roll", "roll", flat, (0,), shifts=(int(shifts[0]) if isinstance(shifts, (tuple, list)) else int(shifts),)), tuple(x.shape))
    shifts = (shifts,) if isinstance(shifts, int) else tuple(int(s) for s in shifts)
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    if len(shifts) != len(dims):
        raise OpError(f"dtorch.roll: shifts and dimensions must align. shifts: {len(shifts)}, dims:{len(dims)}")
    ds = tuple(_dims("roll", d, x.ndim, single=True)[0] for d in dims)
    return _whole("roll", "roll", x, ds, shifts=shifts)


def unfold(self, dimension, size, step):
    """``Tensor.unfold``: the unfolded dim is gathered where sharded; windows become a new last dim."""
    x = _input("unfold", self)
    d = _one("unfold", x, dimension)
    return _whole("unfold", "unfold", x, (d,), size=int(size), step=int(step))


_WHOLE_K = {"rule": _whole_rule, "kernel": _whole_kernel}
_named("topk", topk, torch_fns=(torch.topk,), **_WHOLE_K)
_named("sort", sort, torch_fns=(torch.sort,), **_WHOLE_K)
_named("argsort", argsort, torch_fns=(torch.argsort,), **_WHOLE_K)
_named("median", median, torch_fns=(torch.median,), **_WHOLE_K)
_named("cummax", _cum_ext("cummax"), torch_fns=(torch.cummax,), **_WHOLE_K)
_named("cummin", _cum_ext("cummin"), torch_fns=(torch.cummin,), **_WHOLE_K)
_named("flip", flip, torch_fns=(torch.flip,), **_WHOLE_K)
_named("roll", roll, torch_fns=(torch.roll,), **_WHOLE_K)
_named("unfold", unfold, torch_fns=(torch.Tensor.unfold,), **_WHOLE_K)
