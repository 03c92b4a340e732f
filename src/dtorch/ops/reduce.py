"""Reductions, scans and softmax.

Rule for a reduction over ``dims``, per mesh dim (expanded to N-D by looping over mesh dims):

    S(d), d not reduced      -> S(d')       d' = d, or d minus the reduced dims before it (keepdim=False)
    S(d), d reduced, sum     -> P(sum)      sum_dev (sum of the local block)
    S(d), d reduced, mean    -> P(sum)      sum_dev (local sum / GLOBAL count): uneven shards stay exact
    S(d), d reduced, amax    -> P(max)      max_dev (local max); an empty shard yields -inf
    S(d), d reduced, amin    -> P(min)      likewise
    S(d), d reduced, all/any -> P(min/max)  and/or of booleans
    S(d), d reduced, other   -> gather d    argmax, max/min with indices, prod, var, std, logsumexp
    P(sum|avg), sum/mean     -> P           linear: reduce(sum_dev x_dev) = sum_dev reduce(x_dev)
    P(max), amax             -> P(max)      max commutes with max (likewise P(min) with amin)
    P otherwise              -> R first     nonlinear reductions reduce the partial terms first
    R                        -> R

norm, var and std over a sharded dim are built from the linear pieces instead of gathering the
input: norm_p = (P(sum) of |x|^p)^(1/p) (inf: P(max) of |x|), var = P(sum) of (x - mean)^2 / (N - c),
so only reduced-size tensors cross devices.

Scans (cumsum) and softmax need their dim whole: mesh dims sharding it are gathered, other shards
pass through; a P(sum) input stays partial for cumsum (linear) and is reduced first for softmax.
"""
from __future__ import annotations

import builtins
import math

import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .pointwise import pointwise
from .registry import OpPlan, dispatch, meta_call, register, spec_like

# -- local implementations: (x, dims, keepdim, **kw) on trailing dims; dims are negative -----------


def _keep_shape(x, dims):
    return tuple(1 if i - x.ndim in dims else s for i, s in enumerate(x.shape))


def _one_dim(fn):
    """Adapt a torch reduction that takes a single int dim to a tuple of dims (moved last, flattened)."""

    def impl(x, dims, keepdim, **kw):
        if len(dims) == 1:
            return fn(x, dims[0], keepdim, **kw)
        k = len(dims)
        flat = x.movedim(dims, tuple(range(-k, 0))).flatten(-k)
        y = fn(flat, -1, False, **kw)
        return y.reshape(_keep_shape(x, dims)) if keepdim else y

    return impl


def _extreme(fn, largest: bool):
    """amax/amin that tolerate the empty block of an uneven shard (it yields the reduction identity)."""

    def impl(x, dims, keepdim, **kw):
        if any(x.shape[d] == 0 for d in dims):
            x = torch.full(_keep_shape(x, dims), _identity(x.dtype, largest), dtype=x.dtype, device=x.device)
        return fn(x, dims, keepdim)

    return impl


def _identity(dtype, largest):
    if dtype == torch.bool:
        return not largest
    if dtype.is_floating_point:
        return -math.inf if largest else math.inf
    info = torch.iinfo(dtype)
    return info.min if largest else info.max


def _powsum(x, dims, keepdim, ord):
    """sum |x|^p: the part of a p-norm that adds up across shards."""
    if ord == 0:
        return (x != 0).sum(dims, keepdim=keepdim, dtype=x.dtype)
    a = x.abs()
    return (a * a if ord == 2 else a if ord == 1 else a.pow(ord)).sum(dims, keepdim=keepdim)


def _quiet_empty(fn, x, dims, keepdim, correction):
    """var/std of a block left empty by an uneven shard of a kept dim: nothing to compute (torch would warn)."""
    if any(n == 0 for i, n in enumerate(x.shape) if i - x.ndim not in dims):
        return x.sum(dims, keepdim=keepdim)
    return fn(x, dims, correction=correction, keepdim=keepdim)


_IMPL = {
    "sum": lambda x, dims, keepdim, dtype=None: torch.sum(x, dims, keepdim=keepdim, dtype=dtype),
    "mean": lambda x, dims, keepdim, dtype=None: torch.mean(x, dims, keepdim=keepdim, dtype=dtype),
    "amax": _extreme(torch.amax, True),
    "amin": _extreme(torch.amin, False),
    "all": lambda x, dims, keepdim: torch.all(x, dims, keepdim=keepdim),
    "any": lambda x, dims, keepdim: torch.any(x, dims, keepdim=keepdim),
    "prod": _one_dim(lambda x, d, keepdim, dtype=None: torch.prod(x, d, keepdim=keepdim, dtype=dtype)),
    "argmax": _one_dim(lambda x, d, keepdim: torch.argmax(x, d, keepdim=keepdim)),
    "argmin": _one_dim(lambda x, d, keepdim: torch.argmin(x, d, keepdim=keepdim)),
    "max_dim": lambda x, dims, keepdim: tuple(torch.max(x, dims[0], keepdim=keepdim)),
    "min_dim": lambda x, dims, keepdim: tuple(torch.min(x, dims[0], keepdim=keepdim)),
    "logsumexp": lambda x, dims, keepdim: torch.logsumexp(x, dims, keepdim=keepdim),
    "var": lambda x, dims, keepdim, correction: _quiet_empty(torch.var, x, dims, keepdim, correction),
    "std": lambda x, dims, keepdim, correction: _quiet_empty(torch.std, x, dims, keepdim, correction),
    "norm": lambda x, dims, keepdim, ord, dtype=None: torch.linalg.vector_norm(x, ord, dims, keepdim, dtype=dtype),
    "powsum": _powsum,
    "absmax": lambda x, dims, keepdim: _IMPL["amax"](x.abs(), dims, keepdim),
    "absmin": lambda x, dims, keepdim: _IMPL["amin"](x.abs(), dims, keepdim),
}

# op -> (placement a reduced sharded dim turns into, or None to gather it; partial ops kept as they are)
_PARTIAL = {
    "sum": ("sum", ("sum", "avg")),
    "mean": ("sum", ("sum", "avg")),
    "amax": ("max", ("max",)),
    "amin": ("min", ("min",)),
    "all": ("min", ()),
    "any": ("max", ()),
    "powsum": ("sum", ()),
    "absmax": ("max", ()),
    "absmin": ("min", ()),
}


def _keeps(p, keeps, dtype) -> bool:
    """May an op that commutes with the reductions ``keeps`` leave partial ``p`` unreduced?

    Integer avg terms reduce to a floored mean, which is not linear: sum/cumsum must reduce them first.
    """
    if not isinstance(p, Partial) or p.reduce_op not in keeps:
        return False
    return p.reduce_op != "avg" or dtype.is_floating_point or dtype.is_complex


def _run(op, x, dims, keepdim, nd, kw, count=None):
    if nd == 0:  # a 0-d tensor reduces over a dim of one element
        x, dims, keepdim = x.unsqueeze(-1), (-1,), False
    kw = dict(kw)
    if count is not None:  # mean over a sharded dim: local sums over the global count add up to the mean
        acc = kw.get("dtype") or (torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None)
        out = torch.sum(x, dims, keepdim=keepdim, dtype=acc) / count  # low precision: sum in float32, like torch
        return out.to(kw.get("dtype") or x.dtype)
    return _IMPL[op](x, dims, keepdim, **kw)


@kernel("reduce")
def _reduce_kernel(x, *, op, dims, keepdim, nd, kw, count=None):
    return _run(op, x, dims, keepdim, nd, kw, count)


def _reduce_rule(specs, op, dims, keepdim, kw) -> OpPlan:
    (s,) = specs
    nd = s.ndim
    neg = tuple(d - nd for d in dims)
    out_shape = tuple(1 if d in dims else n for d, n in enumerate(s.shape) if keepdim or d not in dims)
    meta = meta_call(lambda x: _run(op, x, neg, keepdim, nd, kw), (s,), out_shape=out_shape)
    shard_op, keeps = _PARTIAL.get(op, (None, ()))
    in_pl, out_pl, split = [], [], False
    for p in s.placements:
        if isinstance(p, Shard) and p.dim in dims:
            if shard_op is None:
                p, q = Replicate(), Replicate()
            else:
                q, split = Partial(shard_op), True
        elif isinstance(p, Shard):
            q = Shard(p.dim if keepdim else p.dim - builtins.sum(d < p.dim for d in dims))
        elif _keeps(p, keeps, s.dtype):
            q = p
        else:
            p = q = Replicate()
        in_pl.append(p)
        out_pl.append(q)
    count = math.prod(s.shape[d] for d in dims) if split and op == "mean" else None
    metas = meta if isinstance(meta, tuple) else (meta,)
    outs = tuple(DTensorSpec(s.mesh, tuple(out_pl), tuple(m.shape), m.dtype) for m in metas)
    kwargs = {"op": op, "dims": neg, "keepdim": keepdim, "nd": nd, "kw": kw, "count": count}
    return OpPlan((spec_like(s, placements=in_pl),), outs, _reduce_kernel, kwargs, multi_output=len(outs) > 1)


def _dims(name, dim, ndim, single=False) -> tuple:
    """Normalized, sorted reduced dims (all dims for None or an empty list, like torch)."""
    if dim is None and not single:
        return tuple(range(ndim))
    ds = (dim,) if isinstance(dim, int) else tuple(dim) if isinstance(dim, (list, tuple, torch.Size)) else None
    if ds is None or not builtins.all(isinstance(d, int) and not isinstance(d, bool) for d in ds) or (single and len(ds) != 1):
        want = "an int" if single else "an int, a tuple of ints or None"
        raise OpError(f"dtorch.{name}: dim must be {want}, got {dim!r}")
    if not ds:
        return tuple(range(ndim))
    n = builtins.max(ndim, 1)
    for d in ds:
        if not -n <= d < n:
            raise OpError(f"dtorch.{name}: dim {d} is out of range for a {ndim}-D tensor; use a dim in [{-n}, {n - 1}]")
    out = sorted({d % n for d in ds})
    if len(out) != len(ds):
        raise OpError(f"dtorch.{name}: dim {dim!r} names a dim twice; list each dim once")
    return tuple(out) if ndim else ()


def _input(name, input) -> Tensor:
    if not isinstance(input, Tensor):
        raise OpError(f"dtorch.{name} expects a dtorch.Tensor, got {type(input).__name__}")
    return input


def _reduce(name, op, input, dims, keepdim=False, **kw):
    kw = tuple(sorted(kw.items()))
    return dispatch(name, _reduce_rule, [input], (op, dims, bool(keepdim), kw))


def _splits(spec: DTensorSpec, dims) -> bool:
    """Does some mesh dim shard one of ``dims``?"""
    return builtins.any(isinstance(p, Shard) and p.dim in dims for p in spec.placements)


def _unpartial(x: Tensor) -> Tensor:
    pl = [Replicate() if isinstance(p, Partial) else p for p in x.placements]
    return x.redistribute(x.device_mesh, pl) if pl != x.placements else x


def _named(name, fn, methods=None, torch_fns=(), functional=False, rule=_reduce_rule, kernel=_reduce_kernel):
    fn.__name__ = fn.__qualname__ = name
    return register(name, rule=rule, kernel=kernel, methods=(name,) if methods is None else methods,
                    torch_fns=torch_fns, functional=functional)(fn)


# -- the op set --------------------------------------------------------------------------------------

def sum_(input, dim=None, keepdim=False, *, dtype=None):
    """``torch.sum``; over a sharded dim the result is ``Partial(sum)``, with no communication."""
    x = _input("sum", input)
    return _reduce("sum", "sum", x, _dims("sum", dim, x.ndim), keepdim, **({"dtype": dtype} if dtype else {}))


def mean(input, dim=None, keepdim=False, *, dtype=None):
    """``torch.mean``; over a sharded dim: ``Partial(sum)`` of local sums divided by the global count."""
    x = _input("mean", input)
    return _reduce("mean", "mean", x, _dims("mean", dim, x.ndim), keepdim, **({"dtype": dtype} if dtype else {}))


def amax(input, dim=(), keepdim=False):
    """``torch.amax``; over a sharded dim the result is ``Partial(max)``."""
    x = _input("amax", input)
    return _reduce("amax", "amax", x, _dims("amax", dim, x.ndim), keepdim)


def amin(input, dim=(), keepdim=False):
    x = _input("amin", input)
    return _reduce("amin", "amin", x, _dims("amin", dim, x.ndim), keepdim)


def _extremum(name, largest):
    def fn(input, dim=None, keepdim=False):
        """``torch.max``/``torch.min``: the whole-tensor value, (values, indices) along ``dim``, or the
        element-wise maximum/minimum with another tensor."""
        x = _input(name, input)
        if isinstance(dim, (Tensor, torch.Tensor)):
            return pointwise("maximum" if largest else "minimum", "torch.maximum" if largest else "torch.minimum", x, dim)
        if dim is None:
            return _reduce(name, "amax" if largest else "amin", x, _dims(name, None, x.ndim))
        values, indices = _reduce(name, f"{name}_dim", x, _dims(name, dim, x.ndim, single=True), keepdim)
        return (torch.return_types.max if largest else torch.return_types.min)((values, indices))

    return fn


def _arg(name):
    def fn(input, dim=None, keepdim=False):
        x = _input(name, input)
        return _reduce(name, name, x, _dims(name, dim, x.ndim, single=dim is not None), keepdim)

    return fn


def prod(input, dim=None, keepdim=False, *, dtype=None):
    x = _input("prod", input)
    kw = {"dtype": dtype} if dtype else {}
    return _reduce("prod", "prod", x, _dims("prod", dim, x.ndim, single=dim is not None), keepdim, **kw)


def _bool_reduce(name):
    def fn(input, dim=None, keepdim=False):
        x = _input(name, input)
        return _reduce(name, name, x, _dims(name, dim, x.ndim), keepdim)

    return fn


def logsumexp(input, dim, keepdim=False):
    x = _input("logsumexp", input)
    return _reduce("logsumexp", "logsumexp", x, _dims("logsumexp", dim, x.ndim), keepdim)


def norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    """``torch.norm`` (vector p-norms; ``'fro'`` is the 2-norm over ``dim``)."""
    x = _input("norm", input)
    if out is not None:
        raise OpError("dtorch.norm: out= is not supported; use the returned tensor")
    if p == "fro" and not (dim is None or isinstance(dim, int) or len(dim) <= 2):
        raise OpError(f"dtorch.norm: p='fro' takes at most 2 dims, got dim={dim!r}; use p=2 for more dims")
    if p == "fro" or p is None:
        p = 2
    if isinstance(p, str) or not isinstance(p, (int, float)):
        raise OpError(f"dtorch.norm: p={p!r} is not supported; use a number, inf, -inf or 'fro'")
    if dtype is not None:
        x = x.to(dtype)
    dims = _dims("norm", dim, x.ndim)
    if not _splits(x.spec, dims) or not x.dtype.is_floating_point:
        return _reduce("norm", "norm", x, dims, keepdim, ord=p)
    x = _unpartial(x)
    if math.isinf(p):
        return _reduce("norm", "absmax" if p > 0 else "absmin", x, dims, keepdim)
    s = _reduce("norm", "powsum", x, dims, keepdim, ord=p)
    if p in (0, 1):
        return s
    return s.sqrt() if p == 2 else s.pow(1.0 / p)


def _correction(name, dim, unbiased, correction):
    if isinstance(dim, bool):  # torch.var(x, False): the second positional is ``unbiased``
        dim, unbiased = None, dim
    if correction is not None and unbiased is not None:
        raise OpError(f"dtorch.{name}: pass either unbiased or correction, not both")
    if correction is None:
        correction = 0 if unbiased is False else 1
    return dim, correction


def var(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    """``torch.var``; over a sharded dim: mean (P(sum) -> R, reduced size), then P(sum) of squared deviations."""
    x = _input("var", input)
    dim, c = _correction("var", dim, unbiased, correction)
    dims = _dims("var", dim, x.ndim)
    if not _splits(x.spec, dims) or not x.dtype.is_floating_point:
        return _reduce("var", "var", x, dims, keepdim, correction=c)
    x = _unpartial(x)
    dev = x - mean(x, dims, keepdim=True)
    n = math.prod(x.shape[d] for d in dims)
    return sum_(dev.square(), dims, keepdim) / builtins.max(n - c, 0)


def std(input, dim=None, unbiased=None, keepdim=False, *, correction=None):
    x = _input("std", input)
    dim, c = _correction("std", dim, unbiased, correction)
    dims = _dims("std", dim, x.ndim)
    if not _splits(x.spec, dims) or not x.dtype.is_floating_point:
        return _reduce("std", "std", x, dims, keepdim, correction=c)
    return var(x, dims, keepdim=keepdim, correction=c).sqrt()


_named("sum", sum_, torch_fns=(torch.sum,))
_named("mean", mean, torch_fns=(torch.mean,))
_named("amax", amax, torch_fns=(torch.amax,))
_named("amin", amin, torch_fns=(torch.amin,))
max_ = _named("max", _extremum("max", True), torch_fns=(torch.max,))
min_ = _named("min", _extremum("min", False), torch_fns=(torch.min,))
argmax = _named("argmax", _arg("argmax"), torch_fns=(torch.argmax,))
argmin = _named("argmin", _arg("argmin"), torch_fns=(torch.argmin,))
_named("prod", prod, torch_fns=(torch.prod,))
all_ = _named("all", _bool_reduce("all"), torch_fns=(torch.all,))
any_ = _named("any", _bool_reduce("any"), torch_fns=(torch.any,))
_named("logsumexp", logsumexp, torch_fns=(torch.logsumexp,))
_named("norm", norm, torch_fns=(torch.norm,))
_named("var", var, torch_fns=(torch.var,))
_named("std", std, torch_fns=(torch.std,))


# -- scans and softmax: the dim must be whole ---------------------------------------------------------

_SCANS = {
    "cumsum": lambda x, d, dtype: torch.cumsum(x, d, dtype=dtype),
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
