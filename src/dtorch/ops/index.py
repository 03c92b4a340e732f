"""Advanced indexing and item assignment: ``x[tensor]``, ``x[mask]``, ``x[index] = value``, gather/scatter,
index_select, take_along_dim, masked_select/masked_scatter, nonzero, index_copy/index_put.

Reads. ``x[index]`` is torch's two steps: the basic part (ints, slices, None, Ellipsis) is the view op
``getitem`` (view.py: shards of untouched dims stay), then the index tensors pick along the dims they
index (``take``): those dims are gathered on the mesh dims sharding them, every other shard stays and
moves to the output dim torch puts it in; the index tensors are replicated (they are small next to the
data, and every device needs every index). A bool mask has a data-dependent result shape: it is fetched
and turned into index tensors (``nonzero``), as torch synchronises on it too.

Writes. ``x[index] = value`` never gathers ``x``. Every device writes the part of its own block that the
index covers: the kernel asks torch which global coordinates the index selects (indexing an expanded
``arange`` per dim, so ints, slices with steps, None, several Ellipsis, bool masks and index tensors
mean exactly what they mean in torch), keeps those inside its block and ``index_put_``s them with the
matching values. A basic index (no tensors) writes a strided box: each device writes its part of the
box, and a value sharded like the box (the box takes whole sharded dims) is written block by block
without moving. A Partial target stays partial: ``sum`` terms get the value on one device and zeros on
the others, ``avg``/``max``/``min`` terms all get it. The object keeps its identity and placements
(``inplace.dispatch_inplace``), and under autograd records like any in-place op.

``x[basic index]`` is a view of ``x`` (ops/views.py): ``y = x[1:3]; y[0] = 5`` writes into ``x``, as in torch
(an assignment into a view goes to its root: ops/view_writes.py).
"""
from __future__ import annotations

import itertools
import numbers
import operator

import numpy as np
import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec, block_offsets
from ..tensor import Tensor
from . import pointwise as pw
from . import view as vw
from .inplace import copy_, dispatch_inplace
from .registry import OpPlan, dispatch, register, replicated, spec_like, to_dtensors
from .views import View


# ------------------------------------------------------------------------------------------------
# running a kernel once per device on stacked grids


def each_device(fn, lead: int, tensors, device_kw: dict, grid=None):
    """``fn(*blocks, **per-device values)`` per device. The in-process backend may hand a kernel every
    device's block stacked behind ``lead`` grid dims (a replicated tensor stored once: grid dim 1), with
    per-device values as grid-shaped tensors; kernels whose work differs per device (offsets) loop here.
    ``grid``: the grid to run over (default: the broadcast of every input's grid)."""
    if not lead:
        return fn(*tensors, **device_kw)
    if grid is None:
        shapes = [tuple(t.shape[:lead]) for t in tensors if isinstance(t, torch.Tensor)]
        shapes += [tuple(v.shape) for v in device_kw.values() if isinstance(v, torch.Tensor)]
        grid = tuple(max(s[k] for s in shapes) for k in range(lead))

    def pick(t, idx):
        return t[tuple(i if n > 1 else 0 for i, n in zip(idx, t.shape[:lead]))]

    outs = []
    for idx in itertools.product(*map(range, grid)):
        ts = [pick(t, idx) if isinstance(t, torch.Tensor) else t for t in tensors]
        kw = {k: (pick(v, idx).item() if isinstance(v, torch.Tensor) else v) for k, v in device_kw.items()}
        outs.append(fn(*ts, **kw))
    if isinstance(outs[0], tuple):
        return tuple(torch.stack([o[j] for o in outs]).reshape(tuple(grid) + tuple(outs[0][j].shape))
                     for j in range(len(outs[0])))
    return torch.stack(outs).reshape(tuple(grid) + tuple(outs[0].shape))


def _local(t, rank, lead):
    """A replicated index input as one device's tensor: every grid entry is equal, and aligned kernels
    (the in-place wrapper) may have padded its rank with leading 1s after the grid dims."""
    if lead:
        t = t[(0,) * lead]
    return t.reshape(t.shape[t.ndim - rank:]) if t.ndim != rank else t


def _grid_expand(lead, *ts):
    """Inputs whose grid dims must line up element for element (gather, scatter): expanded to one grid."""
    if not lead:
        return ts
    grid = tuple(max(t.shape[k] for t in ts) for k in range(lead))
    return tuple(t.expand(grid + tuple(t.shape[lead:])) for t in ts)


# ------------------------------------------------------------------------------------------------
# parsing an index (torch's semantics)


def _is_seq(v):
    return isinstance(v, (list, tuple))


def _normalize(index) -> tuple:
    if isinstance(index, tuple):
        return index
    if isinstance(index, list) and any(isinstance(v, (list, tuple, Tensor, torch.Tensor, slice)) or v is None
                                       or v is Ellipsis for v in index):
        return tuple(index)  # torch's legacy reading of a list of sequences as a tuple of indices
    return (index,)


def _index_tensor(it, mesh):
    """An index array (dtorch or torch tensor, list, tuple, numpy array) as a dtorch tensor (long or bool)."""
    if isinstance(it, (list, tuple, np.ndarray)):
        try:
            it = torch.tensor(np.asarray(it)) if isinstance(it, np.ndarray) else torch.tensor(it)
        except (TypeError, ValueError) as exc:
            raise OpError(f"dtorch indexing: cannot use {it!r} as an index array: {exc}") from None
        if it.numel() == 0:
            it = it.long()
    if isinstance(it, torch.Tensor):
        (it,) = to_dtensors("index", [it], mesh_from=mesh)
    if it.dtype in (torch.bool, torch.uint8):
        return it if it.dtype == torch.bool else pw.to_dtype(it, torch.bool)
    if it.dtype.is_floating_point or it.dtype.is_complex:
        raise vw.IndexOutOfRangeError("tensors used as indices must be long, int, byte or bool tensors, got "
                                      f"{it.dtype}")
    return it if it.dtype == torch.int64 else pw.to_dtype(it, torch.int64)


def parse_index(x: Tensor, index):
    """``index`` -> (items, tensors). items: one entry per index position: ('int', k), ('slice', s, e, st),
    ('all',), ('new',), ('t', j) (an int index tensor, one dim) or ('m', j, k) (a bool mask over k dims);
    Ellipsis expanded (the first takes the remaining dims, later ones none, like torch)."""
    raw = _normalize(index)
    parsed, tensors = [], []
    for it in raw:
        if it is None or it is Ellipsis or isinstance(it, slice):
            parsed.append(it)
        elif isinstance(it, bool):
            if it is False:
                raise vw.UnsupportedIndexError("dtorch indexing with the Python bool False (an empty new dim) is "
                                               "not supported; use x[None][:0]")
            parsed.append(None)  # x[True] adds a dim of 1, as None does
        elif isinstance(it, (Tensor, torch.Tensor)) and it.ndim == 0 and not it.dtype.is_floating_point \
                and not it.dtype.is_complex and it.dtype not in (torch.bool, torch.uint8):
            parsed.append(operator.index(it.item()))  # a 0-d integer tensor indexes like an int, as in torch
        elif isinstance(it, (Tensor, torch.Tensor, list, tuple, np.ndarray)):
            t = _index_tensor(it, x.device_mesh)
            if t.dtype == torch.bool and t.ndim == 0:
                if not bool(t.item()):
                    raise vw.UnsupportedIndexError("dtorch indexing with a 0-d False mask is not supported")
                parsed.append(None)
                continue
            tensors.append(t)
            parsed.append(("m", len(tensors) - 1, t.ndim) if t.dtype == torch.bool else ("t", len(tensors) - 1))
        elif hasattr(it, "__index__"):
            parsed.append(operator.index(it))
        else:
            raise vw.UnsupportedIndexError(
                f"dtorch indexing takes ints, slices, None, Ellipsis, bool masks and index tensors/lists; got a "
                f"{type(it).__name__} index")
    shape = tuple(x.shape)
    used = sum(1 if not isinstance(p, tuple) else (p[2] if p[0] == "m" else 1)
               for p in parsed if p is not None and p is not Ellipsis)
    if used > len(shape):
        raise vw.IndexOutOfRangeError(f"too many indices for tensor of dimension {len(shape)} ({used} given)")
    items, d, seen_ellipsis = [], 0, False
    for p in parsed:
        if p is Ellipsis:
            n = 0 if seen_ellipsis else len(shape) - used
            seen_ellipsis = True
            items += [("all",)] * n
            d += n
        elif p is None:
            items.append(("new",))
        elif isinstance(p, slice):
            step = 1 if p.step is None else operator.index(p.step)
            if step <= 0:
                raise OpError(f"dtorch indexing: slice step must be greater than zero, got {step}")
            s, e, st = slice(p.start, p.stop, step).indices(shape[d])
            items.append(("all",) if (s, e, st) == (0, shape[d], 1) else ("slice", s, max(e, s), st))
            d += 1
        elif isinstance(p, tuple):
            if p[0] == "m":
                got, want = tuple(tensors[p[1]].shape), shape[d:d + p[2]]
                if got != want:
                    raise vw.IndexOutOfRangeError(
                        f"The shape of the mask {list(got)} at index {d} does not match the shape of the indexed "
                        f"tensor {list(shape)}")
                d += p[2]
            else:
                d += 1
            items.append(p)
        else:
            n = shape[d]
            if not -n <= p < n:
                raise vw.IndexOutOfRangeError(f"index {p} is out of bounds for dim {d} with size {n}")
            items.append(("int", p % n))
            d += 1
    return tuple(items) + (("all",),) * (len(shape) - d), tensors


def _torch_index(items, tensors) -> tuple:
    out = []
    for it in items:
        k = it[0]
        out.append(None if k == "new" else slice(None) if k == "all" else it[1] if k == "int"
                   else tensors[it[1]] if k in ("t", "m") else slice(*it[1:]))
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# reads: x[index]


def _take_positions(items):
    """(index-tensor positions in the basic view, in order; the basic items: tensors as whole dims)."""
    basic, positions, y = [], [], 0
    for it in items:
        if it[0] == "t":
            basic.append(("all",))
            positions.append((y, it[1]))
            y += 1
        elif it[0] == "m":
            basic += [("all",)] * it[2]
            positions.append((y, it[1]))
            y += it[2]
        else:
            basic.append(it)
            y += it[0] != "int"
    return tuple(basic), positions


def _broadcast(shapes):
    out = [1] * max((len(s) for s in shapes), default=0)
    for s in shapes:
        for k, n in enumerate(s, start=len(out) - len(s)):
            if out[k] == 1:
                out[k] = n
            elif n not in (1, out[k]):
                raise vw.IndexOutOfRangeError(f"shape mismatch: indexing tensors could not be broadcast together "
                                              f"with shapes {[list(x) for x in shapes]}")
    return tuple(out)


def _take_layout(shape, positions, bshape):
    """Output shape and, per input dim not indexed, its output dim (torch: the broadcast index dims sit
    where the indexed dims were when those are adjacent, else in front)."""
    adjacent = list(positions) == list(range(positions[0], positions[0] + len(positions)))
    rest = [d for d in range(len(shape)) if d not in positions]
    nb = len(bshape)
    if adjacent:
        p0 = positions[0]
        out_of = {d: (d if d < p0 else d - len(positions) + nb) for d in rest}
        out_shape = shape[:p0] + bshape + shape[p0 + len(positions):]
    else:
        out_of = {d: nb + k for k, d in enumerate(rest)}
        out_shape = bshape + tuple(shape[d] for d in rest)
    return tuple(out_shape), out_of, adjacent


@kernel("index.take")
def _take_kernel(y, *idx, positions, ranks, adjacent, lead=0):
    full = [slice(None)] * y.ndim
    for p, t, r in zip(positions, idx, ranks):
        full[lead + p] = _local(t, r, lead)
    out = y[tuple(full)]
    if lead and not adjacent:  # torch put the index dims in front of the grid dims
        nb = out.ndim - y.ndim + len(positions)
        out = out.movedim(tuple(range(nb)), tuple(range(lead, lead + nb)))
    return out


def _take_rule(specs, positions):
    y, idx = specs[0], specs[1:]
    bshape = _broadcast([s.shape for s in idx])
    out_shape, out_of, adjacent = _take_layout(y.shape, positions, bshape)
    in_pl, out_pl = [], []
    for p in y.placements:
        if isinstance(p, Shard) and p.dim in positions:
            p = Replicate()  # an indexed dim is read at arbitrary places: whole on every device
        in_pl.append(p)
        out_pl.append(Shard(out_of[p.dim]) if isinstance(p, Shard) else p)
    out = DTensorSpec(y.mesh, tuple(out_pl), out_shape, y.dtype)
    return OpPlan((spec_like(y, placements=in_pl),) + tuple(replicated(s) for s in idx), (out,), _take_kernel,
                  {"positions": positions, "ranks": tuple(s.ndim for s in idx), "adjacent": adjacent})


def _mask_to_indices(mask: Tensor) -> list:
    """A bool mask's True positions as one long index tensor per mask dim (the result size depends on the
    data: the mask is fetched, as torch synchronises on it)."""
    nz = torch.nonzero(mask.to_torch()).unbind(1)
    return [Tensor(t.contiguous(), device_mesh=mask.device_mesh) for t in nz]


@register(public=False, rule=_take_rule, kernel=_take_kernel, methods=("__getitem__",))
def getitem(input, index):
    """``x[index]``: ints, slices, None, Ellipsis (several, like torch), index tensors and lists, bool masks."""
    x = vw._tensor("getitem", input)
    items, tensors = parse_index(x, index)
    basic, positions = _take_positions(items)
    if not positions:
        return vw._index("getitem", x, basic)  # a view of x
    y = x if all(it[0] == "all" for it in basic) else dispatch("getitem", vw._index_rule, [x], (basic,))
    pos, idx = [], []
    for p, j in positions:
        t = tensors[j]
        if t.dtype == torch.bool:
            for k, u in enumerate(_mask_to_indices(t)):
                pos.append(p + k)
                idx.append(u)
        else:
            pos.append(p)
            idx.append(t)
    return dispatch("index", _take_rule, [y] + idx, (tuple(pos),))


# ------------------------------------------------------------------------------------------------
# writes: x[index] = value, index_put


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
        raise vw.IndexOutOfRangeError(str(exc)) from None
    vs = list(v.shape)
    while len(vs) > len(sel) and vs[0] == 1:
        vs.pop(0)
    ok = len(vs) <= len(sel) and all(a in (1, b) for a, b in zip(vs[::-1], tuple(sel)[::-1]))
    if not ok:
        raise vw.IndexOutOfRangeError(f"shape mismatch: value tensor of shape {list(v.shape)} cannot be broadcast "
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
    x = vw._tensor("index_put", input).clone()
    items, tensors = _put_items(x, indices)
    return _index_put(x, items, tensors, values, accumulate, "index_put")


def _copy_items(x, dim, index):
    d = vw._dim(dim, x.ndim, "index_copy")
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
    x = vw._tensor("index_copy", input).clone()
    items, tensors = _copy_items(x, dim, index)
    return _index_put(x, items, tensors, source, False, "index_copy")


@register(rule=_put_rule, kernel=_put_kernel, methods=("index_fill_",))
def index_fill_(self, dim, index, value):
    items, tensors = _copy_items(self, dim, index)
    return _index_put(self, items, tensors, value, False, "index_fill_")


# ------------------------------------------------------------------------------------------------
# gather, scatter, index_select, take_along_dim
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
    x = vw._tensor("gather", input)
    d = vw._dim(dim, x.ndim, "gather")
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
    x = vw._tensor(name, x)
    d = vw._dim(dim, x.ndim, name)
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
    x = vw._tensor("index_select", input)
    d = vw._dim(dim, x.ndim, "index_select")
    return dispatch("index_select", _index_select_rule, [x, _long("index_select", index, x.device_mesh)], (d,))


@register(rule=_gather_rule, kernel=_gather_kernel, methods=("take_along_dim",), torch_fns=(torch.take_along_dim,))
def take_along_dim(input, indices, dim=None):
    x = vw._tensor("take_along_dim", input)
    idx = _long("take_along_dim", indices, x.device_mesh)
    if dim is None:
        return gather(vw.flatten(x), 0, vw.flatten(idx))
    d = vw._dim(dim, x.ndim, "take_along_dim")
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


# ------------------------------------------------------------------------------------------------
# masks with data-dependent sizes: masked_select, masked_scatter, nonzero


def _mask_like(name, x, mask):
    (m,) = to_dtensors(name, [mask], mesh_from=x.device_mesh)
    if m.dtype != torch.bool:
        raise OpError(f"dtorch.{name}: expected a bool mask, got {m.dtype}")
    shape = _broadcast([tuple(x.shape), tuple(m.shape)])
    return (x if tuple(x.shape) == shape else x.expand(shape)), (m if tuple(m.shape) == shape else m.expand(shape))


@register(rule=_take_rule, kernel=_take_kernel, methods=("masked_select",), torch_fns=(torch.masked_select,))
def masked_select(input, mask):
    """``torch.masked_select``: the elements where ``mask`` holds, in order (1-D; the mask is fetched: the
    result's size depends on it)."""
    x, m = _mask_like("masked_select", vw._tensor("masked_select", input), mask)
    return getitem(x, m)


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
    x = vw._tensor("masked_scatter", input).clone()
    m, vals = _masked_scatter(x, mask, source, "masked_scatter")
    items, tensors = parse_index(x, m)
    return _index_put(x, items, tensors, vals, False, "masked_scatter")


@register(public=False, rule=_put_rule, kernel=_put_kernel, methods=("masked_scatter_",))
def masked_scatter_(self, mask, source):
    m, vals = _masked_scatter(self, mask, source, "masked_scatter_")
    items, tensors = parse_index(self, m)
    return _index_put(self, items, tensors, vals, False, "masked_scatter_")


def _nonzero_value(x):
    return torch.nonzero(x.to_torch())


@register(methods=("nonzero",), torch_fns=(torch.nonzero,))
def nonzero(input, *, as_tuple=False):
    """``torch.nonzero``: the result's size depends on the data, so the input is fetched (replicated result)."""
    x = vw._tensor("nonzero", input)
    nz = _nonzero_value(x)
    if as_tuple:
        if x.ndim == 0:
            return (Tensor(torch.zeros(int(bool(x.item())), dtype=torch.long), device_mesh=x.device_mesh),)
        return tuple(Tensor(c.contiguous(), device_mesh=x.device_mesh) for c in nz.unbind(1))
    return Tensor(nz, device_mesh=x.device_mesh)


@register(methods=("argwhere",), torch_fns=(torch.argwhere,))
def argwhere(input):
    return nonzero(input)
