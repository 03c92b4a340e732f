"""Writes through views: an in-place op, item assignment or ``copy_``/``fill_``/``zero_`` on a view (ops/views.py)
writes into the view's root at the view's positions; the root's other views show it when next read.

Where the view lies in its root (``views.geometry``: torch's sizes, strides and storage offset of the view,
replayed on a meta tensor of the root's shape) decides how (``layout``):

- **a box**: the view's elements, in order, are those of a box of the root (an int or a strided slice per
  root dim), maybe with the box's dims permuted and regrouped: ``x[1:3]``, ``x[0]``, ``x[:, 2]``, ``x.t()``,
  ``x.narrow(0, 2, 2)``, ``x.unsqueeze(0)``, ``x.view(-1)``, ``x.view(3, 4)[0]``. An element-wise op (``add_``,
  ``mul_``, ``clamp_``, ``masked_fill_``, ...) and ``copy_``/``fill_``/``zero_`` run on the root's blocks
  restricted to the box (``_box_apply_kernel``): every device updates the part of the box it holds, the
  other operands laid out like the box (a replicated operand is cut locally, one sharded like a whole
  sharded dim of the root stays where it is). The view's value is not computed and the root is never
  gathered: no communication.
- **anything else** (a diagonal), any other in-place op (item assignment into a view, ``scatter_``), or a
  Partial root: the view's value is computed, the op writes it, and the new value goes into the root by item
  assignment (``write_back``: into the box, or at one integer index tensor per root dim). Communication,
  where the layouts need it, shows in CommLog.

Under autograd the root's history is rebased as torch's CopySlices does: its new value is the old one with
the view's positions replaced, differentiable in both. torch's refusals are kept: a view of a leaf that
requires grad, a view made under no_grad written with grad on, a view whose elements overlap (``expand``).
Writes through ``.data`` do not count in the root's ``_version``, as in torch.
"""
from __future__ import annotations

import torch

from .._lru import LRU
from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..placement import Partial, Replicate
from ..runtime.kernels import get_kernel, kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from . import index_put as ix
from . import inplace as ip
from . import pointwise as pw
from . import view as vw
from .dispatch import OpPlan, _plan, dispatch, make_plan
from .index import each_device
from .rules import replicated, spec_like
from .views import DATA, WRITER, View, ViewError, _get_ag, _set_ag, _set_h, detached, geometry

_OVERLAP = ("unsupported operation: more than one element of the written-to tensor refers to a single memory "
            "location. Please clone() the tensor before performing the operation.")
_NO_GRAD_VIEW = ("A view was created in no_grad mode and is being modified inplace with grad mode enabled. Given "
                 "that this use case is ambiguous and error-prone, it is forbidden. You can clarify your code by "
                 "moving both the view and the inplace either both inside the no_grad block (if you don't want the "
                 "inplace to be tracked) or both outside (if you want the inplace to be tracked).")


def write(name, rule, tensors, static, kwargs, writes: bool, align: bool) -> View:
    """``dispatch_inplace`` on a view (``tensors[0]``): the op written into the view's root (module docstring)."""
    view = tensors[0]
    lay = layout(view)
    _check_writable(view, lay, name)
    plan = _plan(name, rule, tuple(t._spec for t in tensors), static).plan
    ip.check_result(name, plan.out_specs[0], view._spec)  # torch's checks, on the view as the target
    if _grad_enabled() and not detached(view):
        _write(view, lay, name, rule, tensors, static, kwargs, writes, align)
    else:
        with torch.no_grad():
            _write(view, lay, name, rule, tensors, static, kwargs, writes, align)
    if DATA in view._vsteps:
        _quiet(view._vroot)
    return view


def _write(view, lay, name, rule, tensors, static, kwargs, writes, align) -> None:
    root = view._vroot
    if lay[0] == "box" and (writes or rule is pw._pointwise_rule) and \
            not any(isinstance(p, Partial) for p in root._spec.placements) and \
            not (_grad_enabled() and any(_shows(t, root) for t in tensors[1:])):
        _, items, pieces, perm = lay
        ops = [t if t.ndim == 0 and not writes else _to_box(t, tuple(view.shape), pieces, perm) for t in tensors[1:]]
        ip.dispatch_inplace(name, _box_rule, [root] + ops, (items, name, rule, static, writes), kwargs, align=False)
        return  # (the view is stale now: it recomputes from the root when read)
    # the view's value, written by the op, then written into the root
    value = Tensor._make(view._spec, view._h, view._graph)
    value._ag = view._ag
    if lay[0] == "overlap":  # its blocks repeat elements: the new value is computed out of place (fill_, ...)
        value = tensors[1] if writes else dispatch(name, rule, (value,) + tuple(tensors[1:]), static, kwargs)
        write_back(view, value if value.dtype == view.dtype else pw.to_dtype(value, view.dtype), lay)
        return  # (the view is stale now: it recomputes from the root when read)
    ip.dispatch_inplace(name, rule, (value,) + tuple(tensors[1:]), static, kwargs, writes=writes, align=align)
    write_back(view, value, lay)
    _set_h(view, value._h)
    _set_ag(view, value._ag)
    view._vat = root._writes


def _shows(t: Tensor, root: Tensor) -> bool:
    """Whether ``t`` is ``root`` or a view of it. Such an operand is saved by the op's own node (as torch's
    op saves it), so the write that follows shows in its version and the backward refuses, as torch's does."""
    return t is root or (type(t) is View and t._vroot is root)


def write_back(view: View, value: Tensor, lay=None) -> None:
    """``value`` (the view's shape) written into the view's root at the view's positions, by item assignment."""
    lay = lay or layout(view)
    root = view._vroot
    if lay[0] == "empty":
        return
    if lay[0] == "box":
        _, items, pieces, perm = lay
        ix._index_put(root, items, [], _to_box(value, tuple(view.shape), pieces, perm), False, "view write")
        return
    coords = [Tensor(c, device_mesh=root.device_mesh, graph=root._graph) for c in lay[1]]
    ix._index_put(root, tuple(("t", j) for j in range(len(coords))), coords, value, False, "view write")


# in-place ops torch lets write a view whose elements overlap (an expanded one): every copy of an element gets
# the same value (fill_, zero_), or torch's own order decides, with a deprecation warning (index_put_, masked_fill_)
_OVERLAP_OK = frozenset({"fill", "index_put", "masked_fill"})


def _check_writable(view: View, lay, name: str) -> None:
    """torch's refusals, before anything is written (a failing op leaves every tensor as it was)."""
    if lay[0] == "overlap" and name not in _OVERLAP_OK:
        raise ViewError(f"dtorch: {_OVERLAP}")
    if not _grad_enabled():
        return
    own = _get_ag(view)
    if own is not None and own.requires_grad and own.grad_fn is None:
        raise ip.InplaceError("dtorch: a leaf Variable that requires grad is being used in an in-place operation; "
                              "write it inside `with dtorch.no_grad():` or use the out-of-place op")
    src = view._vsrc
    if src is not None and view._vgrad:
        raise ViewError("dtorch: a view of a leaf Variable that requires grad is being used in an in-place "
                        "operation; write it inside `with dtorch.no_grad():` (as optimizers and initializers do)")
    if detached(view):
        return
    ag = view._vroot._ag
    if ag is not None and (ag.requires_grad or ag.grad_fn is not None):
        if not view._vgrad:
            raise ViewError(f"dtorch: {_NO_GRAD_VIEW}")
        if ag.grad_fn is None:
            raise ViewError("dtorch: a view of a leaf Variable that requires grad is being used in an in-place "
                            "operation; write it inside `with dtorch.no_grad():` (as optimizers and initializers do)")


def _quiet(root: Tensor) -> None:
    """A write through ``.data``: not counted in ``_version`` (torch). The root takes a handle of its own on
    its blocks, so that caches keyed by (handle, ``_version``) still see that its value changed."""
    root._quiet += 1  # (set: the root was written just now)
    h = root._graph.runtime.alias(root._h, root._spec)
    root._h = h
    if root._graph.tracks_memory:
        root._graph._on_handle(h, root._spec)


def _to_box(t: Tensor, shape: tuple, pieces: tuple, perm) -> Tensor:
    """An operand of the view's ``shape`` (or broadcasting to it) as the box of the root it stands for: its
    dims regrouped as the box's (``pieces``) and put in the root's order (``perm``)."""
    if tuple(t.shape) != shape:
        t = dispatch("expand", vw._expand_rule, [t], (shape,))
    if tuple(t.shape) != pieces:
        t = dispatch("reshape", vw._reshape_rule, [t], (pieces,))
    if perm is not None:
        t = dispatch("permute", vw._permute_rule, [t], (perm,))
    return t


# ------------------------------------------------------------------------------------------------
# an element-wise op on the root's blocks, restricted to a box


@kernel("views.box_apply")
def _box_apply_kernel(x, *vs, items, shape, box, writes, inner=None, inner_kw=None, scalars=None, lead=0, **offs):
    """Each device: the part of the box its block holds, updated by the op's own kernel (``inner``) with the
    matching part of each operand (``writes``: set to the first operand). A new block (the in-place wrapper
    copies it into the target; autograd differentiates it)."""
    if not writes:
        fn, kw = get_kernel(inner).fn, inner_kw if scalars is None else dict(inner_kw, scalars=scalars)
        if ip._takes_lead(inner):
            kw = dict(kw, lead=0)

    def one(xb, *vbs, **o):
        out = xb.clone()
        cuts = ix.box_slices(items, box, shape, o, xb.shape)
        if cuts is None:
            return out  # the box misses this block
        local, cut = cuts
        vals = [v if v.ndim == 0 else v[cut] for v in vbs]
        # (the op reads the input block, never the one written: torch's autograd keeps what it read)
        out[local] = (vals[0] if writes else fn(xb[local], *vals, **kw)).to(out.dtype)
        return out

    if lead:
        return each_device(one, lead, [x, *vs], offs, grid=tuple(x.shape[:lead]))
    return one(x, *vs, **offs)


def _box_rule(specs, items, name, rule, static, writes):
    x, ops = specs[0], specs[1:]
    sel = tuple(torch.empty(x.shape, device="meta")[vw._as_index(items)].shape)
    v_pl, box = ix.box_value_layout(x, items)
    _, device_args = ix.shard_offsets(x)
    kw = {"items": items, "shape": x.shape, "box": box, "writes": writes}
    if not writes:
        # the op's own kernel and arguments, planned on the box (element-wise kernels do not depend on layouts)
        target = DTensorSpec(x.mesh, (Replicate(),) * x.mesh.ndim, sel, x.dtype)
        inner = make_plan(name, rule, (target,) + tuple(replicated(o) for o in ops), static)
        ip.check_result(name, inner.out_specs[0], target)
        kw.update(inner=inner.kernel.name, inner_kw=inner.kwargs)
    in_specs = (x,) + tuple(spec_like(o, placements=v_pl) if o.ndim else replicated(o) for o in ops)
    return OpPlan(in_specs, (x,), _box_apply_kernel, kw, device_args=device_args or None)


# ------------------------------------------------------------------------------------------------
# where the view lies: a box of the root, or anything else


_LAYOUTS = LRU("ops.view_writes.layouts", 4096)


def layout(view: View) -> tuple:
    """("box", root items, the box's dims in the view's order, the permutation to the root's order or None),
    ("coords", one long torch tensor of the view's shape per root dim), ("empty",), or ("overlap", coords) for a
    view whose elements overlap (expanded: several of them are one element of the root)."""
    key = (view._vroot._spec.shape, view._vsteps)
    lay = _LAYOUTS.get(key)
    if lay is None:
        sizes, strides, offset, _ = geometry(view)
        if 0 in sizes:
            lay = ("empty",)
        elif any(n > 1 and st == 0 for n, st in zip(sizes, strides)):
            lay = ("overlap", _coords(key[0], sizes, strides, offset))
        else:
            lay = _box(key[0], sizes, strides, offset) or ("coords", _coords(key[0], sizes, strides, offset))
        _LAYOUTS[key] = lay
    return lay


def _contiguous_strides(shape) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _box(root_shape, sizes, strides, offset):
    """The box of the root (contiguous, ``root_shape``) whose elements, in order, are the view's, or None.

    The view's dims of size > 1 are merged into runs that walk memory with one stride; each run is one
    root dim read with a step, or (step 1) whole inner root dims and a part of the next outer one. A root
    dim no run reads is fixed at the offset's coordinate there."""
    rs = _contiguous_strides(root_shape)
    start, rest = [], offset
    for s in rs:
        start.append(rest // s)
        rest %= s
    runs = []
    for n, st in zip(sizes, strides):
        if n == 1:
            continue
        if runs and runs[-1][1] == st * n:
            runs[-1] = (runs[-1][0] * n, st)
        else:
            runs.append((n, st))
    pieces = []  # (root dim, count, step), in the view's order
    for n, st in runs:
        run = []
        while True:  # the outermost root dim whose stride divides the run's: the only one it can walk
            d = next((d for d in range(len(root_shape)) if root_shape[d] > 1 and st % rs[d] == 0), None)
            if d is None:
                return None
            step = st // rs[d]
            if start[d] + step * (n - 1) < root_shape[d]:
                run.append((d, n, step))
                break
            if step != 1 or start[d] != 0 or n % root_shape[d] or d == 0:
                return None
            run.append((d, root_shape[d], 1))  # the whole dim d, then the rest of the run walks dim d - 1
            n //= root_shape[d]
            st = rs[d - 1]
        pieces += reversed(run)
    dims = [d for d, _, _ in pieces]
    if len(set(dims)) != len(dims):
        return None
    used = {d: (n, step) for d, n, step in pieces}
    items = []
    for d, size in enumerate(root_shape):
        if d in used:
            n, step = used[d]
            a = start[d]
            items.append(("all",) if (a, n, step) == (0, size, 1) else ("slice", a, a + step * (n - 1) + 1, step))
        else:
            items.append(("int", start[d]))
    order = sorted(range(len(dims)), key=lambda j: dims[j])
    perm = tuple(order) if order != list(range(len(order))) else None
    return ("box", tuple(items), tuple(n for _, n, _ in pieces), perm)


def _coords(root_shape, sizes, strides, offset) -> tuple:
    """The root coordinates of each element of the view: one long tensor of the view's shape per root dim."""
    flat = torch.full(sizes, offset, dtype=torch.long)
    for k, (n, st) in enumerate(zip(sizes, strides)):
        along = [1] * len(sizes)
        along[k] = n
        flat = flat + torch.arange(n).view(along) * st
    return tuple((flat // s) % n for s, n in zip(_contiguous_strides(root_shape), root_shape))


WRITER.write = write
WRITER.write_back = write_back
