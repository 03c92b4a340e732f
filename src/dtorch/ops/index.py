"""Advanced indexing: ``x[tensor]``, ``x[mask]``, masked_select, nonzero/argwhere, and what the other
indexing modules share (the parsing of an index, running a kernel once per device).

Reads. ``x[index]`` is torch's two steps: the basic part (ints, slices, None, Ellipsis) is the view op
``getitem`` (view.py: shards of untouched dims stay), then the index tensors pick along the dims they
index (``take``): those dims are gathered on the mesh dims sharding them, every other shard stays and
moves to the output dim torch puts it in; the index tensors are replicated (they are small next to the
data, and every device needs every index). A bool mask has a data-dependent result shape: it is fetched
and turned into index tensors (``nonzero``), as torch synchronises on it too.

Writes (``x[index] = value``, index_put/index_copy/index_fill, masked_scatter) are in ops/index_put.py;
gather/scatter, index_select and take_along_dim in ops/gather.py. Both take their per-device helpers
(``each_device``) and the index parsing from here.

``x[basic index]`` is a view of ``x`` (ops/views.py): ``y = x[1:3]; y[0] = 5`` writes into ``x``, as in torch
(an assignment into a view goes to its root: ops/view_writes.py).
"""
from __future__ import annotations

import itertools
import operator

import numpy as np
import torch

from ..errors import OpError
from ..placement import Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from . import pointwise as pw
from . import view as vw
from .args import IndexOutOfRangeError, UnsupportedIndexError, _tensor
from .dispatch import OpPlan, dispatch
from .rules import replicated, spec_like, to_dtensors
from .table import register


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
        raise IndexOutOfRangeError("tensors used as indices must be long, int, byte or bool tensors, got "
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
                raise UnsupportedIndexError("dtorch indexing with the Python bool False (an empty new dim) is "
                                               "not supported; use x[None][:0]")
            parsed.append(None)  # x[True] adds a dim of 1, as None does
        elif isinstance(it, (Tensor, torch.Tensor)) and it.ndim == 0 and not it.dtype.is_floating_point \
                and not it.dtype.is_complex and it.dtype not in (torch.bool, torch.uint8):
            parsed.append(operator.index(it.item()))  # a 0-d integer tensor indexes like an int, as in torch
        elif isinstance(it, (Tensor, torch.Tensor, list, tuple, np.ndarray)):
            t = _index_tensor(it, x.device_mesh)
            if t.dtype == torch.bool and t.ndim == 0:
                if not bool(t.item()):
                    raise UnsupportedIndexError("dtorch indexing with a 0-d False mask is not supported")
                parsed.append(None)
                continue
            tensors.append(t)
            parsed.append(("m", len(tensors) - 1, t.ndim) if t.dtype == torch.bool else ("t", len(tensors) - 1))
        elif hasattr(it, "__index__"):
            parsed.append(operator.index(it))
        else:
            raise UnsupportedIndexError(
                f"dtorch indexing takes ints, slices, None, Ellipsis, bool masks and index tensors/lists; got a "
                f"{type(it).__name__} index")
    shape = tuple(x.shape)
    used = sum(1 if not isinstance(p, tuple) else (p[2] if p[0] == "m" else 1)
               for p in parsed if p is not None and p is not Ellipsis)
    if used > len(shape):
        raise IndexOutOfRangeError(f"too many indices for tensor of dimension {len(shape)} ({used} given)")
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
                    raise IndexOutOfRangeError(
                        f"The shape of the mask {list(got)} at index {d} does not match the shape of the indexed "
                        f"tensor {list(shape)}")
                d += p[2]
            else:
                d += 1
            items.append(p)
        else:
            n = shape[d]
            if not -n <= p < n:
                raise IndexOutOfRangeError(f"index {p} is out of bounds for dim {d} with size {n}")
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
                raise IndexOutOfRangeError(f"shape mismatch: indexing tensors could not be broadcast together "
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
    x = _tensor("getitem", input)
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
    x, m = _mask_like("masked_select", _tensor("masked_select", input), mask)
    return getitem(x, m)


def _nonzero_value(x):
    return torch.nonzero(x.to_torch())


@register(methods=("nonzero",), torch_fns=(torch.nonzero,))
def nonzero(input, *, as_tuple=False):
    """``torch.nonzero``: the result's size depends on the data, so the input is fetched (replicated result)."""
    x = _tensor("nonzero", input)
    nz = _nonzero_value(x)
    if as_tuple:
        if x.ndim == 0:
            return (Tensor(torch.zeros(int(bool(x.item())), dtype=torch.long), device_mesh=x.device_mesh),)
        return tuple(Tensor(c.contiguous(), device_mesh=x.device_mesh) for c in nz.unbind(1))
    return Tensor(nz, device_mesh=x.device_mesh)


@register(methods=("argwhere",), torch_fns=(torch.argwhere,))
def argwhere(input):
    return nonzero(input)
