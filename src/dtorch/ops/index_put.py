"""Item assignment: ``x[index] = value``, index_put, index_copy, index_fill, masked_scatter.

Writes. ``x[index] = value`` never gathers ``x``. Every device writes the part of its own block that the
index covers: the kernel asks torch which global coordinates the index selects (indexing an expanded
``arange`` per dim, so ints, slices with steps, None, several Ellipsis, bool masks and index tensors
mean exactly what they mean in torch), keeps those inside its block and ``index_put_``s them with the
matching values. A basic index (no tensors) writes a strided box: each device writes its part of the
box, and a value sharded like the box (the box takes whole sharded dims) is written block by block
without moving. A Partial target stays partial: ``sum`` terms get the value on one device and zeros on
the others, ``avg``/``max``/``min`` terms all get it. The object keeps its identity and placements
(``inplace.dispatch_inplace``), and under autograd records like any in-place op.

An assignment into a view goes to its root (ops/view_writes.py, which shares ``box_slices``,
``box_value_layout`` and ``shard_offsets`` with this module).
"""
from __future__ import annotations

import numbers

import numpy as np
import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec, block_offsets
from ..tensor import Tensor
from . import pointwise as pw
from . import view as vw
from .args import IndexOutOfRangeError, _dim, _tensor
from .index import _local, _mask_like, _torch_index, each_device, parse_index
from .inplace import copy_, dispatch_inplace
from .dispatch import OpPlan
from .rules import replicated, spec_like, to_dtensors
from .table import register
from .views import View


def _arange_along(shape, d, device):
    view = [1] * len(shape)
    view[d] = shape[d]
    return torch.arange(shape[d], device=device).view(view).expand(shape)


def _put_one(xb, v, *idx, items, shape, accumulate, sharded, box, d_own=1, **offs):
    """One device: the global coordinates the index selects (torch decides them), the ones inside this
    block written with the matching values."""
    out = xb.clone()
    if not d_own and accumulate:
        return out
    if box is not None:  # a basic index: a strided box, cut per dim (no coordinate arrays)
        return _put_box(out, v, items, box, shape, offs, d_own)
    dev = xb.device
    index = _torch_index(items, [t.to(dev) for t in idx])
    coords = [_arange_along(shape, d, dev)[index] for d in range(len(shape))]
    sel = coords[0].shape
    while v.ndim > len(sel) and v.shape[0] == 1:
        v = v[0]
    v = v.to(out.dtype).expand(sel)
    if not d_own:
        v = torch.zeros_like(v)
    valid = None
    for d in sharded:
        lo = offs[f"d_off{d}"]
        ok = (coords[d] >= lo) & (coords[d] < lo + xb.shape[d])
        valid = ok if valid is None else valid & ok
    if valid is None:
        loc = tuple(coords)
    else:
        loc = tuple((c - offs.get(f"d_off{d}", 0))[valid] for d, c in enumerate(coords))
        v = v[valid]
    return out.index_put_(loc, v, accumulate=accumulate)


def _put_box(out, v, items, box, shape, offs, own):
    cuts = box_slices(items, box, shape, offs, out.shape)
    if cuts is None:
        return out  # the index misses this block
    local, cut = cuts
    piece = v[cut].to(out.dtype)
    if not own:
        piece = torch.zeros_like(piece)
    out[local] = piece
    return out


def box_slices(items, box, shape, offs, block_shape):
    """A basic index (``items`` of a tensor of global ``shape``) on one device's block (``block_shape``, its
    offsets ``offs["d_off<dim>"]`` on sharded dims): (the index of the part of the box this block holds, in
    the block; the index of that part in a value of the selection's shape), or None when the box misses the
    block. ``box[k]``: value dim k arrives cut like the target (a whole sharded dim: taken whole)."""
    local, cut, d, k = [], [], 0, 0
    for it in items:
        kind = it[0]
        if kind == "new":
            cut.append(0)
            k += 1
            continue
        lo = offs.get(f"d_off{d}", 0)
        n = block_shape[d]
        if kind == "int":
            if not lo <= it[1] < lo + n:
                return None
            local.append(it[1] - lo)
        else:
            s, e, st = (0, shape[d], 1) if kind == "all" else it[1:]
            j0 = max(0, -(-(lo - s) // st))
            j1 = max(j0, min(len(range(s, e, st)), -(-(lo + n - s) // st)))
            local.append(slice(s + j0 * st - lo, s + (j1 - 1) * st - lo + 1, st) if j1 > j0 else slice(0, 0))
            cut.append(slice(None) if box[k] else slice(j0, j1))
            k += 1
        d += 1
    return tuple(local), tuple(cut)


@kernel("index.put")
def _put_kernel(x, v, *idx, items, ranks, shape, accumulate, sharded, box=None, lead=0, **device_kw):
    if lead:
        idx = tuple(_local(t, r, lead) for t, r in zip(idx, ranks))
        def one(xb, vb, **kw):
            return _put_one(xb, vb, *idx, items=items, shape=shape, accumulate=accumulate, sharded=sharded,
                            box=box, **kw)
        # the grid of the target: a replicated mesh dim of it (stored once) has the same offsets throughout
        return each_device(one, lead, [x, v], device_kw, grid=tuple(x.shape[:lead]))
    idx = tuple(_local(t, r, 0) for t, r in zip(idx, ranks))
    return _put_one(x, v, *idx, items=items, shape=shape, accumulate=accumulate, sharded=sharded, box=box,
                    **device_kw)


def shard_offsets(x: DTensorSpec) -> tuple:
    """(the dims of ``x`` that are sharded, device_args with each device's offset along each: ``d_off<dim>``)."""
    sharded = tuple(sorted({p.dim for p in x.placements if isinstance(p, Shard)}))
    return sharded, {f"d_off{d}": block_offsets(x, d) for d in sharded}


def box_value_layout(x: DTensorSpec, items) -> tuple:
    """A value of the selection's shape written into ``x[items]`` (a basic index): (its placements, ``box``).
    Replicate, except that a whole sharded dim of x arrives cut like x (``box[k]``: value dim k does), so
    each device writes its own part of the value without moving it."""
    v_pl = [Replicate()] * x.mesh.ndim
    out_of, d, k = {}, 0, 0
    for it in items:
        if it[0] != "new":
            if it[0] != "int":
                out_of[d] = (k, it[0] == "all")
            d += 1
        k += it[0] != "int"
    box = [False] * k
    for i, p in enumerate(x.placements):
        if isinstance(p, Shard) and out_of.get(p.dim, (0, False))[1]:
            v_pl[i] = Shard(out_of[p.dim][0])
            box[out_of[p.dim][0]] = True
    return tuple(v_pl), tuple(box)


def _put_rule(specs, items, accumulate, box_ok):
    x, v, idx = specs[0], specs[1], specs[2:]
    mesh = x.mesh
    sharded, device_args = shard_offsets(x)
    sum_dims = [i for i, p in enumerate(x.placements) if isinstance(p, Partial) and p.reduce_op == "sum"]
    if sum_dims:
        own = np.ones(mesh.shape, dtype=np.int64)
        for c in mesh.coordinates():
            own[c] = int(all(c[i] == 0 for i in sum_dims))
        device_args["d_own"] = own
    v_pl, box = box_value_layout(x, items) if box_ok else ((Replicate(),) * mesh.ndim, None)
    v_spec = spec_like(v, placements=v_pl, dtype=x.dtype)
    kwargs = {"items": items, "ranks": tuple(s.ndim for s in idx), "shape": x.shape, "accumulate": accumulate,
              "sharded": sharded, "box": box}
    return OpPlan((x, v_spec) + tuple(replicated(s) for s in idx), (x,), _put_kernel, kwargs,
                  device_args=device_args or None)


def _value(x: Tensor, value) -> Tensor:
    if isinstance(value, (bool, numbers.Number)):
        value = torch.tensor(value).to(x.dtype)
    if isinstance(value, (list, tuple, np.ndarray)):
        value = torch.tensor(np.asarray(value) if isinstance(value, np.ndarray) else value)
    if not isinstance(value, (Tensor, torch.Tensor)):
        raise OpError(f"dtorch item assignment: the value must be a number or a tensor, got {type(value).__name__}")
    (v,) = to_dtensors("setitem", [value], mesh_from=x.device_mesh)
    if v.device_mesh != x.device_mesh:
        v = v.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return v if v.dtype == x.dtype else pw.to_dtype(v, x.dtype)


def _check_value_shape(items, tensors, x, v):
    """torch's "shape mismatch" check, on the controller (the kernels broadcast per device); returns the
    selection's shape (None for a mask: the selected count depends on its data, the kernel checks)."""
    if any(it[0] == "m" for it in items):
        return None
    metas = [torch.empty(t.shape, dtype=torch.long, device="meta") for t in tensors]
    try:
        sel = torch.empty(x.shape, device="meta")[_torch_index(items, metas)].shape
    except IndexError as exc:
        raise IndexOutOfRangeError(str(exc)) from None
    vs = list(v.shape)
    while len(vs) > len(sel) and vs[0] == 1:
        vs.pop(0)
    ok = len(vs) <= len(sel) and all(a in (1, b) for a, b in zip(vs[::-1], tuple(sel)[::-1]))
    if not ok:
        raise IndexOutOfRangeError(f"shape mismatch: value tensor of shape {list(v.shape)} cannot be broadcast "
                                      f"to indexing result of shape {list(sel)}")
    return tuple(sel)


def _index_put(x: Tensor, items, tensors, value, accumulate: bool, what: str) -> Tensor:
    v = _value(x, value)
    sel = _check_value_shape(items, tensors, x, v)
    box_ok = not tensors and not accumulate
    if box_ok and tuple(v.shape) != sel:  # the value as the selection's shape (a view: nothing is copied)
        while v.ndim > len(sel) and v.shape[0] == 1:
            v = vw.squeeze(v, 0)
        v = v.expand(sel)
    return dispatch_inplace("index_put", _put_rule, [x, v] + list(tensors), (items, bool(accumulate), box_ok),
                            align=False)


def _setitem(self, index, value):
    items, tensors = parse_index(self, index)
    if type(self) is View and not tensors:
        # torch's self[index].copy_(value): a view of the view, written where it lies in the root (its own
        # geometry decides how: x[1:3][0] = v writes one row of x where it is)
        v = _value(self, value)
        sel = _check_value_shape(items, tensors, self, v)
        while v.ndim > len(sel) and v.shape[0] == 1:
            v = vw.squeeze(v, 0)
        copy_(vw._index("setitem", self, items), v)
        return self
    _index_put(self, items, tensors, value, False, "setitem")
    return self  # (Python drops it for x[i] = v; dtorch.setitem(x, i, v) returns the tensor, as in-place ops do)


register("setitem", rule=_put_rule, kernel=_put_kernel, public=False, methods=(("__setitem__", _setitem),))(_setitem)


def _put_items(x, indices):
    if not isinstance(indices, (tuple, list)):
        raise OpError(f"dtorch.index_put: indices must be a tuple of tensors, got {type(indices).__name__}")
    return parse_index(x, tuple(indices))


@register(public=False, rule=_put_rule, kernel=_put_kernel, methods=("index_put_",))
def index_put_(self, indices, values, accumulate=False):
    """``x.index_put_(indices, values, accumulate)``: ``x[indices] = values`` (``+=`` with accumulate)."""
    items, tensors = _put_items(self, indices)
    return _index_put(self, items, tensors, values, accumulate, "index_put_")


@register(rule=_put_rule, kernel=_put_kernel, methods=("index_put",), torch_fns=(torch.index_put,))
def index_put(input, indices, values, accumulate=False):
    x = _tensor("index_put", input).clone()
    items, tensors = _put_items(x, indices)
    return _index_put(x, items, tensors, values, accumulate, "index_put")


def _copy_items(x, dim, index):
    d = _dim(dim, x.ndim, "index_copy")
    idx = index if isinstance(index, (Tensor, torch.Tensor)) else torch.tensor(index)
    if idx.ndim > 1:
        raise OpError(f"dtorch.index_copy: index must be 0-d or 1-d, got shape {list(idx.shape)}")
    # (a 0-d index picks one row that keeps its dim, as torch's index_copy_: not an int index)
    return parse_index(x, (slice(None),) * d + (idx.reshape(1) if idx.ndim == 0 else idx,))


@register(public=False, rule=_put_rule, kernel=_put_kernel, methods=("index_copy_",))
def index_copy_(self, dim, index, source):
    """``x.index_copy_(dim, index, source)``: rows ``index`` of dim ``dim`` set from ``source``."""
    items, tensors = _copy_items(self, dim, index)
    return _index_put(self, items, tensors, _moved_source(self, dim, source), False, "index_copy_")


def _moved_source(x, dim, source):
    # torch's source has the index dim where ``dim`` is; x[..., idx] puts it there too (one tensor index)
    return source


@register(rule=_put_rule, kernel=_put_kernel, methods=("index_copy",), torch_fns=(torch.index_copy,))
def index_copy(input, dim, index, source):
    x = _tensor("index_copy", input).clone()
    items, tensors = _copy_items(x, dim, index)
    return _index_put(x, items, tensors, source, False, "index_copy")


@register(rule=_put_rule, kernel=_put_kernel, methods=("index_fill_",))
def index_fill_(self, dim, index, value):
    items, tensors = _copy_items(self, dim, index)
    return _index_put(self, items, tensors, value, False, "index_fill_")


# masked_scatter: the values where the mask holds (only its count is fetched)

def _masked_scatter(x, mask, source, name):
    x2, m = _mask_like(name, x, mask)
    if tuple(x2.shape) != tuple(x.shape):
        raise OpError(f"dtorch.{name}: the mask {list(m.shape)} must broadcast to self's shape {list(x.shape)}")
    (src,) = to_dtensors(name, [source], mesh_from=x.device_mesh)
    k = int(pw.to_dtype(m, torch.int64).sum().item()) if m.numel() else 0
    if src.numel() < k:
        raise OpError(f"dtorch.{name}: Number of elements of source < number of ones in mask ({src.numel()} < {k})")
    flat = vw.flatten(src)
    return m, (flat if flat.shape[0] == k else vw.narrow(flat, 0, 0, k))


@register(rule=_put_rule, kernel=_put_kernel, methods=("masked_scatter",), torch_fns=(torch.masked_scatter,))
def masked_scatter(input, mask, source):
    """``torch.masked_scatter``: source's first elements, in order, where ``mask`` holds (written per device
    like ``x[mask] = values``; only the count of the mask is fetched)."""
    x = _tensor("masked_scatter", input).clone()
    m, vals = _masked_scatter(x, mask, source, "masked_scatter")
    items, tensors = parse_index(x, m)
    return _index_put(x, items, tensors, vals, False, "masked_scatter")


@register(public=False, rule=_put_rule, kernel=_put_kernel, methods=("masked_scatter_",))
def masked_scatter_(self, mask, source):
    m, vals = _masked_scatter(self, mask, source, "masked_scatter_")
    items, tensors = parse_index(self, m)
    return _index_put(self, items, tensors, vals, False, "masked_scatter_")
