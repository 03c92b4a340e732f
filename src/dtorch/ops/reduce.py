"""Reductions (sum, mean, amax, max/min with indices, norm, var, ...). Ops that read a dim whole (scans,
softmax, sort, topk of a whole dim, median, flip/roll/unfold) are in ops/whole_dim.py.

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
"""
from __future__ import annotations

import builtins
import math

import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec, block_offsets
from ..tensor import Tensor
from .pointwise import pointwise
from .dispatch import OpPlan, dispatch
from .rules import meta_call, spec_like
from .table import register
from .view import flatten, reshape

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
    "nansum": lambda x, dims, keepdim, dtype=None: torch.nansum(x, dims, keepdim=keepdim, dtype=dtype),
    "count_nonzero": lambda x, dims, keepdim: torch.count_nonzero(x, dims),
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
    "nansum": ("sum", ()),
    "count_nonzero": ("sum", ()),
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
        dims = _dims(name, dim, x.ndim, single=True)
        if _splits(x.spec, dims):
            values, indices = _with_index(name, _unpartial(x), name, dims[0], keepdim)
        else:
            values, indices = _reduce(name, f"{name}_dim", x, dims, keepdim)
        return (torch.return_types.max if largest else torch.return_types.min)((values, indices))

    return fn


def _arg(name):
    def fn(input, dim=None, keepdim=False):
        x = _input(name, input)
        dims = _dims(name, dim, x.ndim, single=dim is not None)
        if x.ndim and _splits(x.spec, dims):
            if dim is None:  # the flattened tensor's index (keepdim: every dim of size 1, like torch)
                i = fn(flatten(x), 0)
                return reshape(i, (1,) * x.ndim) if keepdim else i
            return _with_index(name, _unpartial(x), "max" if name == "argmax" else "min", dims[0], keepdim)[1]
        return _reduce(name, name, x, dims, keepdim)

    return fn


def prod(input, dim=None, keepdim=False, *, dtype=None):
    x = _input("prod", input)
    kw = {"dtype": dtype} if dtype else {}
    dims = _dims("prod", dim, x.ndim, single=dim is not None)
    return _reduce("prod", "prod", _combined("prod", "prod", x, dims, dtype), dims, keepdim)


def _bool_reduce(name):
    def fn(input, dim=None, keepdim=False):
        x = _input(name, input)
        return _reduce(name, name, x, _dims(name, dim, x.ndim), keepdim)

    return fn


def logsumexp(input, dim, keepdim=False):
    x = _input("logsumexp", input)
    dims = _dims("logsumexp", dim, x.ndim)
    return _reduce("logsumexp", "logsumexp", _combined("logsumexp", "logsumexp", x, dims), dims, keepdim)


def _combined(name, op, x, dims, dtype=None):
    """``x`` with each sharded dim of ``dims`` already reduced to size 1 (keepdim) by its per-device
    candidates (a logsumexp / product per block, only those gathered): the final local reduction over
    ``dims`` then sees whole dims (a size-1 dim reduces to itself)."""
    if not x.ndim:
        return x
    for d in dims:
        if _splits(x.spec, (d,)):
            (c,) = _candidates(name, _unpartial(x), op, d, dtype=dtype)
            x = _reduce(name, op, _unshard_dim(c, d), (d,), True, **({"dtype": dtype} if dtype else {}))
            dtype = None  # (cast once)
    return x


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


def nansum(input, dim=None, keepdim=False, *, dtype=None):
    """``torch.nansum``; over a sharded dim the result is ``Partial(sum)`` of the local nansums."""
    x = _input("nansum", input)
    return _reduce("nansum", "nansum", x, _dims("nansum", dim, x.ndim), keepdim, **({"dtype": dtype} if dtype else {}))


def count_nonzero(input, dim=None):
    """``torch.count_nonzero``; over a sharded dim the result is ``Partial(sum)`` of the local counts."""
    x = _input("count_nonzero", input)
    return _reduce("count_nonzero", "count_nonzero", x, _dims("count_nonzero", dim, x.ndim), False)


_named("nansum", nansum, torch_fns=(torch.nansum,))
_named("count_nonzero", count_nonzero, torch_fns=(torch.count_nonzero,))


# -- reductions with indices over a sharded dim: per-shard candidates, then a combine --------------------
#
# argmax/argmin, max/min with indices, topk, logsumexp and prod over a dim that some mesh dims shard do
# not gather the input. Each device reduces its own block to candidates (its extreme and its global index
# = local index + the block's offset; its top k; its logsumexp; its product) laid out as a new size-M*k
# dim sharded over those mesh dims (one candidate block per device); only the candidates are gathered
# (M*k elements per output row instead of the dim) and reduced again. An empty block of an uneven split
# offers the reduction's identity (-inf for max: it never wins over a value, and ties go to the earlier
# device, which holds the lower global index, as torch returns the first extreme).

def _pad_to(x, dim, k, fill):
    n = x.shape[dim]
    if n >= k:
        return x
    shape = list(x.shape)
    shape[dim] = k - n
    return torch.cat([x, torch.full(shape, fill, dtype=x.dtype, device=x.device)], dim)


@kernel("reduce.candidates")
def _cand_kernel(x, *, op, dim, k=1, largest=True, dtype=None, d_off=0, lead=0):
    off = d_off if not isinstance(d_off, torch.Tensor) else d_off.reshape(tuple(d_off.shape) + (1,) * (x.ndim - d_off.ndim)).to(x.device)
    if op in ("max", "min", "topk"):
        big = op == "max" or (op == "topk" and largest)
        x = _pad_to(x, dim, k, _identity(x.dtype, big) if x.dtype != torch.bool else not big)
        if op == "topk":
            v, i = torch.topk(x, k, dim, largest=largest, sorted=True)
        else:
            v, i = (torch.max if big else torch.min)(x, dim, keepdim=True)
        return v, i + off
    if op == "logsumexp":
        return torch.logsumexp(x, dim, keepdim=True)
    if op == "prod":
        return torch.prod(x, dim, keepdim=True, dtype=dtype)
    raise AssertionError(op)


def _cand_rule(specs, op, dim, k, largest, dtype):
    (s,) = specs
    levels = s.shard_mesh_dims(dim)
    in_pl = [Replicate() if isinstance(p, Partial) else p for p in s.placements]
    ins = spec_like(s, placements=in_pl)
    m = math.prod(s.mesh.shape[i] for i in levels)
    shape = list(s.shape)
    shape[dim] = m * k
    out_pl = tuple(Shard(dim) if i in levels else p for i, p in enumerate(in_pl))
    if op == "prod":
        vdtype = torch.prod(torch.ones(1, dtype=s.dtype), dtype=dtype).dtype
    else:
        vdtype = s.dtype
    outs = (DTensorSpec(s.mesh, out_pl, tuple(shape), vdtype),)
    if op in ("max", "min", "topk"):
        outs += (DTensorSpec(s.mesh, out_pl, tuple(shape), torch.int64),)
    return OpPlan((ins,), outs, _cand_kernel, {"op": op, "dim": dim - s.ndim, "k": k, "largest": largest,
                                                "dtype": dtype},
                  device_args={"d_off": block_offsets(ins, dim)}, multi_output=len(outs) > 1)


@kernel("reduce.combine")
def _combine_kernel(vals, idxs, *, op, dim, keepdim, k=1, largest=True, sorted=True, lead=0):
    if lead:
        grid = tuple(max(a, b) for a, b in zip(vals.shape[:lead], idxs.shape[:lead]))
        vals = vals.expand(grid + tuple(vals.shape[lead:]))
        idxs = idxs.expand(grid + tuple(idxs.shape[lead:]))
    if op == "topk":
        v, j = torch.topk(vals, k, dim, largest=largest, sorted=sorted)
        return v, idxs.gather(dim, j)
    v, j = (torch.max if op == "max" else torch.min)(vals, dim, keepdim=True)
    i = idxs.gather(dim, j)
    if not keepdim:
        v, i = v.squeeze(dim), i.squeeze(dim)
    return v, i


def _combine_rule(specs, op, dim, keepdim, k, largest, sorted_):
    v, i = specs
    out_shape = list(v.shape)
    if op == "topk":
        out_shape[dim] = k
    elif keepdim:
        out_shape[dim] = 1
    else:
        del out_shape[dim]
    pl = []
    for p in v.placements:
        if isinstance(p, Shard) and p.dim == dim:
            p = Replicate()
        pl.append(p)
    out_pl = [Shard(p.dim - 1) if isinstance(p, Shard) and p.dim > dim and op != "topk" and not keepdim else p
              for p in pl]
    ins = (spec_like(v, placements=pl), spec_like(i, placements=pl))
    outs = (DTensorSpec(v.mesh, tuple(out_pl), tuple(out_shape), v.dtype),
            DTensorSpec(v.mesh, tuple(out_pl), tuple(out_shape), torch.int64))
    return OpPlan(ins, outs, _combine_kernel, {"op": op, "dim": dim - v.ndim, "keepdim": keepdim, "k": k,
                                               "largest": largest, "sorted": sorted_}, multi_output=True)


def _candidates(name, x, op, dim, k=1, largest=True, dtype=None):
    out = dispatch(name, _cand_rule, [x], (op, dim, k, largest, dtype))
    return out if isinstance(out, tuple) else (out,)


def _with_index(name, x, op, dim, keepdim, k=1, largest=True, sorted_=True):
    """(values, global indices) of max/min/topk over sharded ``dim``: candidates, then the combine."""
    v, i = _candidates(name, x, "topk" if op == "topk" else op, dim, k, largest)
    return dispatch(name, _combine_rule, [v, i], ("topk" if op == "topk" else op, dim, bool(keepdim), k, largest,
                                                  sorted_))


def _unshard_dim(t, dim):
    pl = [Replicate() if isinstance(p, Shard) and p.dim == dim else p for p in t.placements]
    return t.redistribute(t.device_mesh, pl) if pl != t.placements else t
