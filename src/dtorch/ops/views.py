"""Views: tensors that show part of another tensor's storage, as torch's views do (in global view).

A view op (basic indexing, ``view``/``reshape`` where torch returns a view, ``t``/``transpose``/``permute``,
``narrow``, ``select``, ``squeeze``/``unsqueeze``, ``expand``, ``split``/``chunk``/``unbind``,
``diagonal``, ``.data``, ``detach()``, and chains of these) returns a ``View``, a ``dtorch.Tensor``
that remembers

- its root (``_vroot``): the tensor whose storage it shows, never a view itself (a view of a view keeps
  the root and the longer chain);
- the chain of view ops from the root (``_vsteps``): each step is ``(op name, rule, static arguments,
  output index)`` as dispatched, or a marker step (``DETACH``, ``DATA``) that keeps the value and drops
  the autograd history;
- the root's write count (``_writes``) its value was computed at (``_vat``; ``-1 - count`` until the
  value is first computed: a view's value is computed when it is first read).

``View._h`` and ``View._ag`` are properties that recompute the value from the root when the root was
written since (plain tensors keep their plain slots and pay nothing). So a write into the root shows in
every view, and a write through a view, which is a write into the root at the view's positions
(ops/view_writes.py), shows in the root and in every other view. Root and views share the version
counter (``_version``) that autograd checks saved tensors with.

Where a view lies in its root (sizes, strides, storage offset) torch decides: the chain replayed on a
meta tensor of the root's shape (``geometry``, cached). That is also how ``.view`` of a view that torch
cannot view raises torch's error, and ``reshape`` of one returns a copy, as torch's do.
"""
from __future__ import annotations

import weakref

import torch

from .._lru import LRU
from ..autograd.dispatched import SHAPE_ONLY_KERNELS
from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..errors import OpError, PlacementError
from ..placement import Placement, Shard, normalize_placements
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .dispatch import OpPlan, _last1_get, dispatch, plan_of
from .rules import to_dtensors
from .table import register

_new_object = object.__new__
_H, _AG = Tensor.__dict__["_h"], Tensor.__dict__["_ag"]  # the slots a View's properties stand in front of
_get_h, _set_h = _H.__get__, _H.__set__
_get_ag, _set_ag = _AG.__get__, _AG.__set__
_get_writes = Tensor.__dict__["_writes"].__get__  # (raises at once when unset: no Tensor.__getattr__)

# marker steps: the value is the parent's (a handle of its own on the same blocks) without autograd history;
# writes through a DATA step do not count in the root's _version (torch's ``.data``)
DETACH = ("detach", None, (), None)
DATA = ("data", None, (), None)


class ViewError(OpError, RuntimeError):
    """An in-place write torch refuses on a view, or a view whose base's storage was replaced."""


def _view_h(self):
    if self._vat != self._vroot._writes:
        _sync(self)
    return _get_h(self)


def _view_ag(self):
    if self._vat != self._vroot._writes:
        _sync(self)
    return _get_ag(self)


class View(Tensor):
    """A tensor showing part of its root's storage (module docstring)."""

    # _vgrad: its value is recomputed with autograd recording (False: made under no_grad or through a marker)
    # _vsrc: where its autograd history starts when that is not the root: a view along the chain that became a
    # leaf of its own (``w.detach().requires_grad_()``: torch's detach is a new leaf on the same storage), else None
    __slots__ = ("_vroot", "_vsteps", "_vat", "_vgrad", "_vsrc")

    _h = property(_view_h, _set_h)
    _ag = property(_view_ag, _set_ag)

    @property
    def _version(self) -> int:
        return self._vroot._version

    @classmethod
    def _make(cls, spec, handle, graph):
        return Tensor._make(spec, handle, graph)  # a value made from a view (clone, a relayout) is no view

    def _written(self, handle) -> None:
        """A runtime write into the view's own storage (optimizers write their targets so): the new value
        goes into the root, unrecorded."""
        _set_h(self, handle)
        value = Tensor._make(self._spec, handle, self._graph)
        with torch.no_grad():
            WRITER.write_back(self, value)
        self._vat = self._vroot._writes

    def contiguous(self, memory_format=None):
        """The view itself where torch's would be contiguous, else a copy (no view), as in torch."""
        return self if geometry(self)[3] else self.clone()

    def is_contiguous(self, memory_format=None) -> bool:
        return geometry(self)[3]

    def detach_(self):
        raise ViewError("Can't detach views in-place. Use detach() instead.")


class _Writer:
    """What ops/view_writes.py (above the in-place ops it writes with) installs: ``write(name, rule, tensors,
    static, kwargs, writes, align)`` (an in-place op on a view) and ``write_back(view, value)``."""

    write = write_back = None


WRITER = _Writer()


# ------------------------------------------------------------------------------------------------
# making views

def view_op(name: str, rule, x: Tensor, static: tuple, n_out: int = 0):
    """The view of ``x`` op ``name`` makes (``n_out``: how many views, for an op with several outputs). Only
    the plan runs now (its errors are raised here); the value is computed when first read."""
    # (spelled out: this is the whole cost of a view op until the view is read; the plan as dispatch finds it)
    spec = x._spec
    last = _last1_get(name)
    if last is not None and last[2] is spec and (last[1] is static or last[1] == static):
        c = last[0]
    else:
        c = plan_of(name, rule, spec, static)
    if type(x) is View:
        root, steps, src = x._vroot, x._vsteps, history_source(x)
        grad = (x._vgrad or src is not None) and _grad_enabled()
    else:
        root, steps, grad, src = x, (), _grad_enabled(), None
    try:
        at = -1 - _get_writes(root)
    except AttributeError:
        root._writes = root._quiet = 0
        at = -1
    if n_out:
        return tuple(_new_view(s, x._graph, root, steps + ((name, rule, static, k),), at, grad, src)
                     for k, s in enumerate(c.plan.out_specs))
    v = _new_object(View)
    v._spec = c.out_spec
    v._graph = x._graph
    _set_ag(v, None)
    v._vroot = root
    v._vsteps = steps + ((name, rule, static, None),)
    v._vat = at
    v._vgrad = grad
    v._vsrc = src if grad else None
    return v


def history_source(x: View):
    """Where the autograd history of a view of ``x`` starts, when not at the root: ``x`` itself when it is a
    leaf of its own that requires grad (a detached view, or one made under no_grad, then ``requires_grad_()``),
    else the view ``x`` takes its history from (None: the root)."""
    if not x._vgrad:
        own = _get_ag(x)  # (the slot: a view without history keeps the leaf's metadata there)
        return x if own is not None and own.requires_grad and own.grad_fn is None else None
    return x._vsrc


def marker_view(x: Tensor, step) -> View:
    """``x.detach()`` / ``x.data``: x's value and storage, no autograd history."""
    root, steps = (x._vroot, x._vsteps) if type(x) is View else (x, ())
    return _new_view(x._spec, x._graph, root, steps + (step,), -1 - _writes_of(root), False)


def _writes_of(root: Tensor) -> int:
    """The root's write count, set to 0 if it had none (its views compare with it on every read)."""
    try:
        return _get_writes(root)
    except AttributeError:
        root._writes = root._quiet = 0
        return 0


def _new_view(spec, graph, root, steps, at, grad, src=None) -> View:
    v = _new_object(View)
    v._spec = spec
    v._graph = graph
    _set_ag(v, None)
    v._vroot = root
    v._vsteps = steps
    v._vat = at
    v._vgrad = grad
    v._vsrc = src if grad else None
    return v


def detached(v: View) -> bool:
    """Whether the chain passes a marker (detach, .data): no history, writes unrecorded."""
    return any(step[1] is None for step in v._vsteps)


# ------------------------------------------------------------------------------------------------
# the value: recomputed from the root


# id(root) -> (weakref to it, its _writes before, after) of its last storage replacement (rare: a side table
# rather than a slot every tensor would carry)
_REPLACED: dict = {}


def _sync(v: View) -> None:
    root = v._vroot
    if _REPLACED and _replaced_since(v, root):
        return
    steps = v._vsteps
    grad = v._vgrad
    src = v._vsrc
    if src is not None:  # the steps after the leaf the history starts at, run on it (it reads its own value)
        with torch.set_grad_enabled(grad):
            value = value_of(src, steps[len(src._vsteps):])
    elif len(steps) == 1 and steps[0][3] is None:  # (the usual view: one op on the root)
        name, rule, static, _ = steps[0]
        if rule is None:  # detach() / .data of the root: its blocks, no op runs
            value = value_of(root, steps)
        elif grad is _grad_enabled():
            value = dispatch(name, rule, [root], static)
        else:
            with torch.set_grad_enabled(grad):
                value = dispatch(name, rule, [root], static)
    elif grad is _grad_enabled():
        value = value_of(root, steps)
    else:
        with torch.set_grad_enabled(grad):
            value = value_of(root, steps)
    _set_h(v, value._h)
    if grad:
        _set_ag(v, value._ag)
    v._vat = root._writes


def _replaced_since(v: View, root: Tensor) -> bool:
    """Whether ``root``'s storage was replaced since ``v`` was last computed (then ``v`` is dealt with)."""
    at = v._vat
    replaced = _REPLACED.get(id(root))
    if replaced is None or replaced[0]() is not root or (at if at >= 0 else -1 - at) >= replaced[2]:
        return False
    if at != replaced[1]:
        raise ViewError(
            f"this view's base had its storage replaced (x.data = ..., module.to(...), load_state_dict) after the "
            f"view was taken{' and before it was first read' if at < 0 else ', and was written before that'}; its "
            "value is gone. Take the view again from the base")
    _own_root(v)  # it was current when the base moved on: it keeps its value, on a storage of its own
    return True


def value_of(t: Tensor, steps) -> Tensor:
    """The value the view ops ``steps`` make of ``t``, as a plain tensor."""
    for name, rule, static, k in steps:
        if rule is None:
            t = Tensor._make(t._spec, t._graph.runtime.alias(t._h, t._spec), t._graph)
        else:
            out = dispatch(name, rule, [t], static)
            t = out if k is None else out[k]
    return t


def _own_root(v: View) -> None:
    """Make ``v`` a view of a new root holding its current value (its base's storage went elsewhere)."""
    root = Tensor._make(v._spec, v._graph.runtime.alias(_get_h(v), v._spec), v._graph)
    root._writes, root._quiet = 0, 0
    v._vroot, v._vsteps, v._vat, v._vsrc = root, (), 0, None


def replace_storage(t: Tensor, value: Tensor) -> None:
    """``t.data = value`` (and ``Parameter._set``): ``t`` takes ``value``'s storage and layout, keeping its
    identity, autograd metadata and ``_version``. Views of the old storage that were read since its last
    write keep that value; reading any other raises ``ViewError`` (torch keeps the old storage for them)."""
    before = _writes_of(t)
    ag = t._ag
    t._init(value._spec, value._graph.runtime.alias(value._h, value._spec), value._graph)
    t._ag = ag
    t._writes = before + 1  # (views of the old storage see a change; _version does not: one quiet write)
    t._quiet += 1
    key = id(t)
    _REPLACED[key] = (weakref.ref(t, lambda _, k=key: _REPLACED.pop(k, None)), before, before + 1)


# ------------------------------------------------------------------------------------------------
# geometry: where a view lies in its root's storage (torch on meta tensors)

# rule -> fn(meta tensor, *static) giving the step's meta result (a tuple of them for a split, indexed by k);
# filled by the view op families (view.py, here)
STEP_META: dict = {}
_GEOMETRY = LRU("ops.views.geometry", 4096)
_RESHAPES = LRU("ops.views.reshape_is_view", 4096)


def _meta(root_shape: tuple, steps) -> torch.Tensor:
    m = torch.empty(root_shape, device="meta")
    for _, rule, static, k in steps:
        if rule is not None:
            m = STEP_META[rule](m, *static)
            if k is not None:
                m = m[k]
    return m


def geometry(v: View) -> tuple:
    """(sizes, strides, storage offset, is_contiguous) of ``v`` in its root, a contiguous tensor."""
    key = (v._vroot._spec.shape, v._vsteps)
    g = _GEOMETRY.get(key)
    if g is None:
        m = _meta(*key)
        g = _GEOMETRY[key] = (tuple(m.shape), tuple(m.stride()), m.storage_offset(), m.is_contiguous())
    return g


def reshape_is_view(x: View, name: str, shape: tuple) -> bool:
    """Whether torch's reshape of the view ``x`` to ``shape`` is a view (else it copies); ``view`` raises
    torch's error where it is not."""
    key = (x._vroot._spec.shape, x._vsteps, shape)
    hit = _RESHAPES.get(key)
    if hit is None:
        try:
            _meta(key[0], key[1]).view(shape)
            hit = (True, None)
        except RuntimeError as exc:
            hit = (False, str(exc))
        _RESHAPES[key] = hit
    if not hit[0] and name in ("view", "view_as"):
        raise ViewError(f"dtorch.{name}: {hit[1]}")
    return hit[0]


# ------------------------------------------------------------------------------------------------
# detach(), .data


@register(public=False, methods=("detach",), torch_fns=(torch.detach,))
def detach(input):
    """A view of ``input`` with no autograd history (torch: the same storage; writes to either show in both)."""
    if not isinstance(input, Tensor):
        raise OpError(f"dtorch.detach expects a dtorch.Tensor, got {type(input).__name__}")
    return marker_view(input, DETACH)


def _get_data(self):
    return marker_view(self, DATA)


def _set_data(self, value):
    if type(self) is View:
        raise ViewError("x.data = ... on a view: the view would stop showing its base; assign to the base's .data, "
                        "or write the values in with x.copy_(value)")
    if isinstance(value, torch.Tensor):
        (value,) = to_dtensors("data", [value], mesh_from=self.device_mesh)
    if not isinstance(value, Tensor):
        raise TypeError(f"x.data must be assigned a tensor, got {type(value).__name__}")
    replace_storage(self, value)
    ag = self._ag
    if ag is not None and ag.grad is not None and ag.grad._spec.shape != value._spec.shape:
        ag.grad = None


register("data", public=False, methods=(("data", property(_get_data, _set_data)),))(_get_data)


# ------------------------------------------------------------------------------------------------
# Tensor.view([placements]): the same blocks under other placements


@kernel("views.same_blocks")
def _same_blocks_kernel(x):
    return x.view(x.shape)


def _reinterpret_rule(specs, out: DTensorSpec):
    return OpPlan((specs[0],), (out,), _same_blocks_kernel)


def is_placements(shape_args) -> bool:
    """``x.view([Shard(0), Replicate()])``: one list or tuple of placements (not sizes)."""
    return (len(shape_args) == 1 and isinstance(shape_args[0], (list, tuple)) and len(shape_args[0]) > 0
            and all(isinstance(p, Placement) for p in shape_args[0]))


def reinterpret(x: Tensor, placements) -> Tensor:
    """``x.view([placements])``: every device's block, as it is, read under ``placements`` (no communication;
    DTorch's semantics: a Replicate tensor viewed as Partial is n times the value). The global shape is the
    one the blocks make under the new placements."""
    spec = x._spec
    mesh = spec.mesh
    pl = normalize_placements(list(placements), mesh.ndim, spec.ndim, mesh.shape)
    coords = mesh.coordinates()
    blocks = [spec.local_shape(c) for c in coords]
    shape = list(blocks[0])
    for d in range(spec.ndim):
        along = [i for i, p in enumerate(pl) if isinstance(p, Shard) and p.dim == d]
        if along:  # the blocks of one line along those mesh dims (the others at 0) make the dim
            shape[d] = sum(b[d] for c, b in zip(coords, blocks) if all(c[i] == 0 for i in range(mesh.ndim)
                                                                         if i not in along))
    out = DTensorSpec(mesh, pl, tuple(shape), spec.dtype)
    bad = [(c, b, out.local_shape(c)) for c, b in zip(coords, blocks) if out.local_shape(c) != b]
    if bad:
        c, b, want = bad[0]
        raise PlacementError(
            f"x.view({list(pl)}): the blocks of {spec} cannot form a tensor with those placements: device {c} holds "
            f"a {list(b)} block where a {list(shape)} tensor laid out so has a {list(want)} one (torch.chunk sizes); "
            "redistribute instead (it moves data)")
    return dispatch("view", _reinterpret_rule, [x], (out,))


SHAPE_ONLY_KERNELS.add(_same_blocks_kernel.name)

