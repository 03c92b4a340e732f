"""gather, scatter (and its reductions), index_select, take_along_dim: reads and writes along one dim at the
global positions an index tensor holds.
"""
from __future__ import annotations

import numbers

import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec, block_offsets
from ..tensor import Tensor
from . import pointwise as pw
from . import view as vw
from .args import _dim, _tensor
from .index import _broadcast, _grid_expand, _local
from .inplace import dispatch_inplace
from .dispatch import OpPlan, dispatch
from .rules import replicated, spec_like, to_dtensors
from .table import register


#
# Along ``dim`` the index holds global positions. gather/index_select read there: x's mesh dims sharding
# ``dim`` are gathered, but an index sharded on ``dim`` keeps its shard (each device reads its own rows
# from the whole dim). scatter writes there: x keeps its shard of ``dim`` and every device writes the
# positions inside its block (the others go to a scratch slot past its end). On another dim ``e``, x and
# the index (and src) line up position by position, so a shard of ``e`` stays where they have the same
# size along ``e`` (a replicated partner is cut locally), else it is gathered.


def _along_rule_pl(x, others, dim, x_keeps_dim: bool, partial_ok: bool):
    """Per mesh dim: (x placement, placement of each of ``others``, output placement)."""
    px_all, po_all, out_all = [], [], []
    for i in range(x.mesh.ndim):
        px, pos = x.placements[i], [o.placements[i] for o in others]
        if isinstance(px, Shard) and px.dim == dim and not x_keeps_dim:
            px = Replicate()
        if isinstance(px, Partial) and not (partial_ok and all(p == Replicate() for p in pos)):
            px = Replicate()
        if isinstance(px, Shard) and px.dim != dim:
            if all(o.shape[px.dim] == x.shape[px.dim] for o in others):
                pos = [px] * len(others)
                out = px
            else:
                px = Replicate()
        if isinstance(px, Shard) and px.dim != dim:
            pass
        elif isinstance(px, Shard):  # scatter: x keeps its shard of dim, the index/src are whole
            pos, out = [Replicate()] * len(others), px
        elif isinstance(px, Partial):
            out = px
        else:  # x whole on this mesh dim
            e = next((p.dim for p in pos if isinstance(p, Shard)), None)
            if not x_keeps_dim and e == dim and others and isinstance(pos[0], Shard) and len(others) == 1:
                out = pos[0]  # gather: each device reads its own index rows
            elif e is not None and e != dim and all(o.shape[e] == x.shape[e] for o in others):
                px = Shard(e)  # cut x locally to meet the index's shard
                pos, out = [px] * len(others), px
            else:
                pos, out = [Replicate()] * len(others), Replicate()
        px_all.append(px)
        po_all.append(pos)
        out_all.append(out)
    return px_all, [tuple(p[k] for p in po_all) for k in range(len(others))], out_all


@kernel("index.gather")
def _gather_kernel(x, idx, *, dim, lead=0):
    x, idx = _grid_expand(lead, x, idx)
    return torch.gather(x, dim, idx)


def _gather_rule(specs, dim):
    x, idx = specs
    if idx.ndim != x.ndim:
        raise OpError(f"Index tensor must have the same number of dimensions as input tensor ({idx.ndim} vs "
                      f"{x.ndim})")
    px, (pi,), out = _along_rule_pl(x, [idx], dim, False, True)
    return OpPlan((spec_like(x, placements=px), spec_like(idx, placements=pi)),
                  (DTensorSpec(x.mesh, tuple(out), idx.shape, x.dtype),), _gather_kernel, {"dim": dim - max(x.ndim, 1)})


def _long(name, index, mesh):
    if isinstance(index, (list, tuple)):
        index = torch.tensor(index)
    (t,) = to_dtensors(name, [index], mesh_from=mesh)
    if not isinstance(t, Tensor) or t.dtype != torch.int64:
        raise OpError(f"dtorch.{name}(): Expected dtype int64 for index, got "
                      f"{getattr(t, 'dtype', type(t).__name__)}")
    return t


@register(rule=_gather_rule, kernel=_gather_kernel, methods=("gather",), torch_fns=(torch.gather,))
def gather(input, dim, index, *, sparse_grad=False):
    x = _tensor("gather", input)
    d = _dim(dim, x.ndim, "gather")
    return dispatch("gather", _gather_rule, [x, _long("gather", index, x.device_mesh)], (d,))


@kernel("index.scatter")
def _scatter_kernel(x, idx, *src, dim, mode, reduce, include_self, sharded=False, value=None, d_off=0, lead=0):
    ts = _grid_expand(lead, x, idx, *src)
    x, idx, src = ts[0], ts[1], ts[2:]
    n = x.shape[dim]
    if not sharded:
        local = idx
        pad = x
    else:  # positions outside this block go to a scratch slot past its end
        local = idx - _per(d_off, idx, lead)
        local = torch.where((local >= 0) & (local < n), local, n)
        shape = list(x.shape)
        shape[dim] = 1
        pad = torch.cat([x, x.new_zeros(shape)], dim)
    if mode == "reduce_":
        out = pad.scatter_reduce(dim, local, src[0], reduce, include_self=include_self)
    elif mode == "add":
        out = pad.scatter_add(dim, local, src[0])
    elif src:
        out = pad.scatter(dim, local, src[0]) if reduce is None else pad.scatter(dim, local, src[0], reduce=reduce)
    else:
        out = pad.scatter(dim, local, value) if reduce is None else pad.scatter(dim, local, value, reduce=reduce)
    return out.narrow(dim, 0, n) if out.shape[dim] != n else out


def _per(v, like, lead):
    if not isinstance(v, torch.Tensor):
        return v
    return v.reshape(tuple(v.shape) + (1,) * (like.ndim - v.ndim)).to(like.device)


def _scatter_rule(specs, dim, mode, reduce, include_self):
    x, others = specs[0], specs[1:]
    for o in others:
        if o.ndim != x.ndim:
            raise OpError(f"Index tensor must have the same number of dimensions as self tensor ({o.ndim} vs "
                          f"{x.ndim})")
    px, pos, out = _along_rule_pl(x, list(others), dim, True, False)
    # src lines up with the index, not with x: keep a src shard only where the index has the same one
    xs = spec_like(x, placements=px)
    in_specs = (xs,) + tuple(spec_like(o, placements=p) for o, p in zip(others, pos))
    sharded_dim = bool(xs.shard_mesh_dims(dim))
    kw = {"dim": dim - max(x.ndim, 1), "mode": mode, "reduce": reduce, "include_self": include_self,
          "sharded": sharded_dim}
    dargs = {"d_off": block_offsets(xs, dim)} if sharded_dim else None
    return OpPlan(in_specs, (xs,), _scatter_kernel, kw, device_args=dargs)


def _scatter(name, x, dim, index, src, value, mode, reduce=None, include_self=True, inplace=False):
    x = _tensor(name, x)
    d = _dim(dim, x.ndim, name)
    tensors = [x, _long(name, index, x.device_mesh)]
    kwargs = None
    if src is not None:
        (s,) = to_dtensors(name, [src], mesh_from=x.device_mesh)
        tensors.append(s if s.dtype == x.dtype else pw.to_dtype(s, x.dtype))
    else:
        kwargs = {"value": value.item() if isinstance(value, (Tensor, torch.Tensor)) else value}
    static = (d, mode, reduce, include_self)
    if inplace:
        return dispatch_inplace(name, _scatter_rule, tensors, static, kwargs, align=False)
    return dispatch(name, _scatter_rule, tensors, static, kwargs)


def _src_or_value(src, value, kw):
    if "src" in kw:
        src = kw.pop("src")
    if "value" in kw:
        value = kw.pop("value")
    if isinstance(src, (bool, numbers.Number)):
        src, value = None, src
    return src, value


@register(rule=_scatter_rule, kernel=_scatter_kernel, methods=("scatter",), torch_fns=(torch.scatter,))
def scatter(input, dim, index, src=None, value=None, *, reduce=None, **kw):
    src, value = _src_or_value(src, value, kw)
    return _scatter("scatter", input, dim, index, src, value, "set", reduce)


@register(public=False, rule=_scatter_rule, kernel=_scatter_kernel, methods=("scatter_",))
def scatter_(self, dim, index, src=None, value=None, *, reduce=None, **kw):
    src, value = _src_or_value(src, value, kw)
    return _scatter("scatter", self, dim, index, src, value, "set", reduce, inplace=True)


@register(rule=_scatter_rule, kernel=_scatter_kernel, methods=("scatter_add",), torch_fns=(torch.scatter_add,))
def scatter_add(input, dim, index, src):
    return _scatter("scatter_add", input, dim, index, src, None, "add")


@register(public=False, rule=_scatter_rule, kernel=_scatter_kernel, methods=("scatter_add_",))
def scatter_add_(self, dim, index, src):
    return _scatter("scatter_add", self, dim, index, src, None, "add", inplace=True)


_REDUCES = ("sum", "prod", "mean", "amax", "amin")


@register(rule=_scatter_rule, kernel=_scatter_kernel, methods=("scatter_reduce",), torch_fns=(torch.scatter_reduce,))
def scatter_reduce(input, dim, index, src, reduce, *, include_self=True):
    if reduce not in _REDUCES:
        raise OpError(f"dtorch.scatter_reduce: reduce must be one of {_REDUCES}, got {reduce!r}")
    return _scatter("scatter_reduce", input, dim, index, src, None, "reduce_", reduce, bool(include_self))


@register(public=False, rule=_scatter_rule, kernel=_scatter_kernel, methods=("scatter_reduce_",))
def scatter_reduce_(self, dim, index, src, reduce, *, include_self=True):
    if reduce not in _REDUCES:
        raise OpError(f"dtorch.scatter_reduce_: reduce must be one of {_REDUCES}, got {reduce!r}")
    return _scatter("scatter_reduce", self, dim, index, src, None, "reduce_", reduce, bool(include_self),
                    inplace=True)


@kernel("index.select")
def _index_select_kernel(x, idx, *, dim, lead=0):
    return torch.index_select(x, dim, _local(idx, 1, lead))


def _index_select_rule(specs, dim):
    x, idx = specs
    if idx.ndim > 1:
        raise OpError(f"dtorch.index_select: index must be 0-d or 1-d, got shape {list(idx.shape)}")
    pl = [Replicate() if isinstance(p, Shard) and p.dim == dim else p for p in x.placements]
    shape = list(x.shape)
    if x.ndim:
        shape[dim] = idx.shape[0] if idx.ndim else 1
    out = DTensorSpec(x.mesh, tuple(pl), tuple(shape), x.dtype)
    return OpPlan((spec_like(x, placements=pl), replicated(idx)), (out,), _index_select_kernel,
                  {"dim": dim - max(x.ndim, 1)})


@register(rule=_index_select_rule, kernel=_index_select_kernel, methods=("index_select",),
          torch_fns=(torch.index_select,))
def index_select(input, dim, index):
    x = _tensor("index_select", input)
    d = _dim(dim, x.ndim, "index_select")
    return dispatch("index_select", _index_select_rule, [x, _long("index_select", index, x.device_mesh)], (d,))


@register(rule=_gather_rule, kernel=_gather_kernel, methods=("take_along_dim",), torch_fns=(torch.take_along_dim,))
def take_along_dim(input, indices, dim=None):
    x = _tensor("take_along_dim", input)
    idx = _long("take_along_dim", indices, x.device_mesh)
    if dim is None:
        return gather(vw.flatten(x), 0, vw.flatten(idx))
    d = _dim(dim, x.ndim, "take_along_dim")
    if idx.ndim != x.ndim:
        raise OpError(f"torch.take_along_dim(): input and indices should have the same number of dimensions, but "
                      f"got {x.ndim} dimensions for input, and {idx.ndim} dimensions for indices")
    xs, ids = list(x.shape), list(idx.shape)
    xs[d] = ids[d] = 1
    b = _broadcast([tuple(xs), tuple(ids)])
    xe = x if all(n == b[k] for k, n in enumerate(x.shape) if k != d) else \
        x.expand(tuple(x.shape[k] if k == d else b[k] for k in range(x.ndim)))
    ie = idx if all(n == b[k] for k, n in enumerate(idx.shape) if k != d) else \
        idx.expand(tuple(idx.shape[k] if k == d else b[k] for k in range(idx.ndim)))
    return gather(xe, d, ie)
