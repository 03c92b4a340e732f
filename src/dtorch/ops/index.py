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

Views are values in dtorch (ops-views.md): ``y = x[1:3]; y[0] = 5`` cannot write through to ``x``, so
an assignment into a tensor made by basic indexing while its base is alive raises ``ViewWriteError``
naming the fix (write into the base with one combined index, or ``clone()`` the view first).
"""
from __future__ import annotations

import itertools
import numbers
import operator
import weakref

import numpy as np
import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec, block_offsets
from ..tensor import Tensor
from . import pointwise as pw
from . import view as vw
from .inplace import dispatch_inplace
from .registry import OpPlan, dispatch, register, replicated, spec_like, to_dtensors


class ViewWriteError(OpError, RuntimeError):
    """An assignment into a view of a live tensor (torch would write through into the base; dtorch views
    are values)."""


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
# views are values: an assignment into a live basic view refuses (see the module doc)

_VIEW_BASE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def note_view(out, base) -> None:
    if isinstance(out, Tensor) and out is not base:
        _VIEW_BASE[out] = weakref.ref(base)


def _refuse_view_write(x: Tensor, what: str) -> None:
    ref = _VIEW_BASE.get(x)
    if ref is not None and ref() is not None:
        raise ViewWriteError(
            f"{what}: this tensor was made by indexing another live tensor (a view in torch, which would write "
            "through into the base). dtorch views are values, so the write would not reach the base: write into "
            "the base with one combined index (x[1:3, 0] = v instead of x[1:3][0] = v), or take a copy first "
            "(y = x[1:3].clone()) if only the copy should change")


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
    y = vw._index("getitem", x, basic)
    if not positions:
        note_view(y, x)
        return y
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
    """Basic index: per input dim the local slice of the block and the slice of the value (already the
    selection's shape) it takes. ``box[k]``: value dim k arrives cut like the target (a whole sharded dim)."""
    local, cut, d, k = [], [], 0, 0
    for it in items:
        kind = it[0]
        if kind == "new":
            cut.append(0)
            k += 1
            continue
        lo = offs.get(f"d_off{d}", 0)
        n = out.shape[d]
        if kind == "int":
            if not lo <= it[1] < lo + n:
                return out  # the index misses this block
            local.append(it[1] - lo)
        else:
            s, e, st = (0, shape[d], 1) if kind == "all" else it[1:]
            j0 = max(0, -(-(lo - s) // st))
            j1 = max(j0, min(len(range(s, e, st)), -(-(lo + n - s) // st)))
            local.append(slice(s + j0 * st - lo, s + (j1 - 1) * st - lo + 1, st) if j1 > j0 else slice(0, 0))
            cut.append(slice(None) if box[k] else slice(j0, j1))
            k += 1
        d += 1
    piece = v[tuple(cut)].to(out.dtype)
    if not own:
        piece = torch.zeros_like(piece)
    out[tuple(local)] = piece
    return out


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


def _put_rule(specs, items, accumulate, box_ok):
    x, v, idx = specs[0], specs[1], specs[2:]
    mesh = x.mesh
    sharded = tuple(sorted({p.dim for p in x.placements if isinstance(p, Shard)}))
    device_args = {f"d_off{d}": block_offsets(x, d) for d in sharded}
    sum_dims = [i for i, p in enumerate(x.placements) if isinstance(p, Partial) and p.reduce_op == "sum"]
    if sum_dims:
        own = np.ones(mesh.shape, dtype=np.int64)
        for c in mesh.coordinates():
            own[c] = int(all(c[i] == 0 for i in sum_dims))
        device_args["d_own"] = own
    v_pl = [Replicate()] * mesh.ndim
    box = None
    if box_ok:  # the value is the selection's shape: a whole sharded dim of x arrives cut like x
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
        box = tuple(box)
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
    _refuse_view_write(self, "x[index] = value")
    items, tensors = parse_index(self, index)
    _index_put(self, items, tensors, value, False, "setitem")


register("setitem", rule=_put_rule, kernel=_put_kernel, public=False, methods=(("__setitem__", _setitem),))(_setitem)


def _put_items(x, indices):
    if not isinstance(indices, (tuple, list)):
        raise OpError(f"dtorch.index_put: indices must be a tuple of tensors, got {type(indices).__name__}")
    return parse_index(x, tuple(indices))


@register(public=False, rule=_put_rule, kernel=_put_kernel, methods=("index_put_",))
def index_put_(self, indices, values, accumulate=False):
    """``x.index_put_(indices, values, accumulate)``: ``x[indices] = values`` (``+=`` with accumulate)."""
    _refuse_view_write(self, "index_put_")
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
    return parse_index(x, (slice(None),) * d + (idx,))


@register(public=False, rule=_put_rule, kernel=_put_kernel, methods=("index_copy_",))
def index_copy_(self, dim, index, source):
    """``x.index_copy_(dim, index, source)``: rows ``index`` of dim ``dim`` set from ``source``."""
    _refuse_view_write(self, "index_copy_")
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
    _refuse_view_write(self, "index_fill_")
    items, tensors = _copy_items(self, dim, index)
    return _index_put(self, items, tensors, value, False, "index_fill_")
