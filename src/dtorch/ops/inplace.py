"""In-place ops: ``x.add_(y)``, ``x += y``, ``x.copy_(src)``, ``x.fill_(v)``, ``x.zero_()``.

The result is written into ``x``'s own storage: the runtime runs an in-place kernel on ``x``'s blocks
(``Runtime.write``), copying first when anyone else can see a block (copy-on-write), so the Python
object keeps its identity and placements and no other tensor sees the change, except x's views, which
show it when next read (ops/views.py). An in-place op on a view writes into its root at the view's
positions (ops/view_writes.py), so the root and its other views show it too, as in torch.

How: the op's ordinary plan with ``x`` as its first operand. When that plan takes ``x`` as it lies and
leaves the result in ``x``'s placements, every device writes its own block, with the other operands
laid out as the plan asks (a Replicate operand is cut locally to meet a sharded ``x``, no communication).
Otherwise (a Partial ``x`` under a nonlinear op, a sharded operand meeting a replicated ``x``) the result
is computed out of place, laid out like ``x`` and becomes ``x``'s storage: same value, same placements.
"""
from __future__ import annotations

import functools
import inspect
import numbers

import torch

from ..autograd.dispatched import record_rebind
from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..autograd.mode import no_grad as _no_grad
from ..autograd.redistribute import redistribute_spec
from ..errors import DTorchError, OpError
from ..graph import check_one_graph
from ..placement import Replicate
from ..runtime.kernels import get_kernel, kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from . import pointwise as pw
from ..runtime.kernels import broadcast_shape as _broadcast_shape
from .dispatch import OpPlan, _plan, describe, dispatch
from .rules import to_dtensors
from .table import register
from .views import WRITER, View


class InplaceError(OpError, RuntimeError):
    """An in-place op torch refuses too (a result of another shape or an uncastable dtype)."""


@kernel("inplace", align=True)
def _inplace_kernel(target, *xs, inner: str, inner_kw: dict, lead: int = 0, **device_kw):
    """Run the op's own kernel on (target, *xs), then copy the result into ``target`` (cast to its dtype)."""
    k = get_kernel(inner)
    kw = dict(inner_kw, **device_kw)
    if _takes_lead(inner):
        kw["lead"] = lead
    target.copy_(k.fn(target, *xs, **kw))


@kernel("inplace_plain")
def _inplace_plain_kernel(target, *xs, inner: str, inner_kw: dict, lead: int = 0, **device_kw):
    """``_inplace_kernel`` for kernels whose inputs must keep their own ranks (index tensors, values of
    another rank than the target: item assignment)."""
    _inplace_kernel.fn(target, *xs, inner=inner, inner_kw=inner_kw, lead=lead, **device_kw)


@functools.lru_cache(maxsize=1024)  # one entry per registered kernel name
def _takes_lead(name: str) -> bool:
    return "lead" in inspect.signature(get_kernel(name).fn).parameters


def dispatch_inplace(name: str, rule, tensors, static: tuple, kwargs: dict | None = None, *,
                     writes: bool = False, align: bool = True) -> Tensor:
    """``tensors[0] <- op(*tensors)`` in place; the plan is the out-of-place op's (same cache).

    ``writes``: the plan's kernel is itself an in-place kernel (``copy_``), run as it is. ``align``: the
    inputs' local ranks are padded to one length, as element-wise kernels expect (False: kept as they are).
    """
    target = tensors[0]
    if type(target) is View:  # the write goes into the view's root
        return WRITER.write(name, rule, tensors, static, kwargs, writes, align)
    tspec = target._spec
    if any(t._graph is not target._graph for t in tensors[1:]):
        check_one_graph(name, tensors)  # (two meshes: the plan below says so)
    if _grad_enabled() and any(t._ag is not None for t in tensors):
        return _recorded_inplace(name, rule, tensors, static, kwargs, writes)
    c = _plan(name, rule, tuple(t._spec for t in tensors), static)
    plan = c.plan
    out = plan.out_specs[0]
    check_result(name, out, tspec)
    graph = target._graph
    if plan.in_specs[0] == tspec and out.placements == tspec.placements:
        others = [t if t._spec == s else redistribute_spec(t, s) for t, s in zip(tensors[1:], plan.in_specs[1:])]
        kw = dict(plan.kwargs, **kwargs) if kwargs else plan.kwargs
        wrapper = _inplace_kernel if align else _inplace_plain_kernel
        k, kw = (plan.kernel, kw) if writes else (wrapper, {"inner": plan.kernel.name, "inner_kw": kw})
        try:
            handle = graph.runtime.write(k, target._h, tspec, [o._h for o in others], plan.in_specs[1:], kw,
                                         plan.device_args)
        except DTorchError:  # (a backend's fault, a lost worker, too: not this op's)
            raise
        except Exception as exc:
            raise OpError(f"dtorch.{name}_ failed on inputs {describe([t._spec for t in tensors])}: "
                          f"{type(exc).__name__}: {exc}") from exc
    else:
        if writes:  # (its rule always keeps the target as it lies)
            raise AssertionError(f"in-place kernel {plan.kernel.name} planned to move its target")
        result = dispatch(name, rule, tensors, static, kwargs)
        if result.dtype != tspec.dtype:
            result = pw.to_dtype(result, tspec.dtype)
        handle = redistribute_spec(result, tspec)._h
    target._written(handle)
    return target


def check_result(name: str, out: DTensorSpec, tspec: DTensorSpec) -> None:
    """torch's refusals of an in-place op whose result (``out``) does not fit its target (``tspec``)."""
    if out.shape != tspec.shape:
        raise InplaceError(f"dtorch.{name}_: output with shape {list(tspec.shape)} doesn't match the broadcast "
                           f"shape {list(out.shape)}; use the out-of-place x = dtorch.{name}(...) instead")
    if out.dtype != tspec.dtype and not torch.can_cast(out.dtype, tspec.dtype):
        raise InplaceError(f"dtorch.{name}_: result type {_dtype_name(out.dtype)} can't be cast to the desired "
                           f"output type {_dtype_name(tspec.dtype)}; cast x first or use the out-of-place op")


def _recorded_inplace(name, rule, tensors, static, kwargs, writes: bool) -> Tensor:
    """An in-place op while autograd records: the value is computed out of place (recorded like any op) and
    becomes the target's storage and history, as torch rebases the target onto the op's node."""
    target = tensors[0]
    tspec = target._spec
    ag = target._ag
    if ag is not None and ag.requires_grad and ag.grad_fn is None:
        raise InplaceError(f"dtorch.{name}_: a leaf tensor that requires grad is being used in an in-place operation; "
                           "write it inside `with dtorch.no_grad():` (as optimizers do) or use the out-of-place op")
    # the op reads the target's value from before the write: a tensor object of its own holds that value
    # (and history) for the backward, while the target is rebound to the result
    before = Tensor._make(tspec, target._h, target._graph)
    before._ag = ag
    tensors = (before,) + tuple(tensors[1:])
    if writes:  # copy_: the value is the source (laid out like the target by the caller), cast
        with _no_grad():
            result = tensors[1].clone()
    else:
        result = dispatch(name, rule, tensors, static, kwargs)
    if result.dtype != tspec.dtype:
        result = pw.to_dtype(result, tspec.dtype)
    result = redistribute_spec(result, tspec)
    if result._ag is None and (tspec.dtype.is_floating_point or tspec.dtype.is_complex):
        # copy_/fill_ (the value is the source's), comparisons written into a float tensor (no derivative):
        # torch still links the result to the inputs, the target's old value getting a zero gradient
        record_rebind(name, tensors, result, through=1 if writes else None)
    target._written(result._h)
    target._ag = result._ag
    return target


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "Float", torch.float64: "Double", torch.int64: "Long", torch.int32: "Int",
            torch.bool: "Bool", torch.float16: "Half", torch.bfloat16: "BFloat16"}.get(dtype, str(dtype))


def elementwise_(name: str, fn: str, target: Tensor, *args, **kwargs) -> Tensor:
    """``target.<name>_(*args)``: the element-wise op ``fn(target, *args)`` written into ``target``."""
    if not isinstance(target, Tensor):
        raise OpError(f"dtorch.{name}_ expects a dtorch.Tensor to write into, got {type(target).__name__}")
    tensors, static, run_kw = pw.analyse(name, fn, (target,) + args, kwargs)
    if tensors[0] is not target:  # the template puts operands in order: target is operand 0
        raise OpError(f"dtorch.{name}_: the tensor written into must be the first operand")
    return dispatch_inplace(name, pw._pointwise_rule, tensors, static, run_kw)


def _inplace_method(name: str, fn: str):
    def method(self, *args, **kwargs):
        return elementwise_(name, fn, self, *args, **kwargs)

    method.__name__ = f"{name}_"
    method.__doc__ = f"In-place ``{name}``: the result is written into this tensor's own storage."
    return method


# ops whose torch method has an in-place form (x.add_(y)); Python's augmented operators map to them
_AUGMENTED = {"add": "__iadd__", "sub": "__isub__", "mul": "__imul__", "div": "__itruediv__",
              "floor_divide": "__ifloordiv__", "remainder": "__imod__", "pow": "__ipow__",
              "bitwise_and": "__iand__", "bitwise_or": "__ior__", "bitwise_xor": "__ixor__"}

for _name, _fn, *_ in pw._UNARY + pw._BINARY:
    if getattr(torch.Tensor, f"{_name}_", None) is None:
        continue
    _method = _inplace_method(_name, _fn)
    _methods = (f"{_name}_",) + ((_AUGMENTED[_name],) if _name in _AUGMENTED else ())
    register(f"{_name}_", rule=pw._pointwise_rule, kernel=_inplace_kernel, public=False,
             methods=tuple((m, _method) for m in _methods))(_method)


@register("masked_fill_", rule=pw._pointwise_rule, kernel=_inplace_kernel, public=False, methods=("masked_fill_",))
def masked_fill_(self, mask, value):
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.requires_grad:
        value = value.item()
    if isinstance(value, (Tensor, torch.Tensor)):  # (a torch value that requires grad gets its gradient)
        # out of place on a copy: the backward of the select must not read self, which the copy_ writes
        return copy_(self, pw.masked_fill(self.clone(), mask, value))
    return elementwise_("masked_fill", "torch.masked_fill", self, mask, value)


# -- copy_, fill_, zero_ --------------------------------------------------------------------------------

@kernel("copy_into")
def _copy_kernel(target, src):
    target.copy_(src)


def _copy_rule(specs):
    target, src = specs
    # src arrives in target's shape and placements (the caller broadcast it); its dtype is cast by copy_
    return OpPlan((target, DTensorSpec(target.mesh, target.placements, target.shape, src.dtype)), (target,),
                  _copy_kernel)


@register("copy_", rule=_copy_rule, kernel=_copy_kernel, public=False, methods=("copy_",))
def copy_(self: Tensor, src, non_blocking: bool = False) -> Tensor:
    """``x.copy_(src)``: ``src`` (broadcast to x's shape, cast to its dtype) written into x's own storage."""
    return _copy(self, src, "copy")


def _copy(self: Tensor, src, name: str) -> Tensor:
    """copy_ (``name`` "copy") and fill_ ("fill": torch lets it write a view whose elements overlap)."""
    if isinstance(src, (bool, numbers.Number)):
        src = torch.tensor(src)
    if not isinstance(src, (Tensor, torch.Tensor)):
        raise OpError(f"dtorch copy_: src must be a tensor, got {type(src).__name__}")
    (src,) = to_dtensors("copy_", [src], mesh_from=self.device_mesh)
    if src.device_mesh != self.device_mesh:
        src = src.redistribute(self.device_mesh, [Replicate()] * self.device_mesh.ndim)
    if tuple(src.shape) != tuple(self.shape):
        # (registry's broadcast, not torch.broadcast_shapes: that one imports sympy on its first call)
        if _broadcast_shape([tuple(src.shape), tuple(self.shape)]) != tuple(self.shape):
            raise InplaceError(f"dtorch copy_: src of shape {list(src.shape)} cannot be broadcast to the "
                               f"destination's shape {list(self.shape)}")
        src = src.expand(tuple(self.shape))
    src = redistribute_spec(src, DTensorSpec(self.device_mesh, self._spec.placements, self._spec.shape, src.dtype))
    return dispatch_inplace(name, _copy_rule, (self, src), (), writes=True)


@register("fill_", public=False, methods=("fill_",))
def fill_(self: Tensor, value) -> Tensor:
    """``x.fill_(v)``: every element set to ``v`` (a number or a 0-d tensor)."""
    if isinstance(value, Tensor):
        value = value.item()
    elif isinstance(value, torch.Tensor):
        if value.ndim != 0:
            raise OpError(f"fill_ only supports 0-dimension value tensor but got tensor with {value.ndim} dimensions.")
        value = value.item()
    return _copy(self, torch.tensor(value, dtype=self.dtype) if self.dtype != torch.bool else torch.tensor(bool(value)),
                 "fill")


@register("zero_", public=False, methods=("zero_",))
def zero_(self: Tensor) -> Tensor:
    return fill_(self, 0)
