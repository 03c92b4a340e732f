"""Element-wise ops: unary math, binary ops with broadcasting and scalars, comparisons, casts.

Rule, per mesh dim (expanded to N-D by looping over mesh dims):

    S(d) with anything   -> S(d)   the other operands are cut to match (a Replicate operand is sliced
                                   locally, no communication; a broadcast size-1 dim stays Replicate)
    P + P, P - P, -P     -> P      sum_d a_d + sum_d b_d = sum_d (a_d + b_d)
    P + R                -> P      R becomes partial locally (value on one device, zeros elsewhere)
    P * R, P / R, P * c  -> P      sum_d a_d * b = sum_d (a_d * b)
    P otherwise          -> R      the partial is reduced first (nonlinear ops, P * P, P + scalar)
    R with R             -> R

Scalar operands (Python and numpy numbers) are kernel arguments: the plan knows each one's type (it
decides the result dtype), the value reaches the kernel at run time, so ``x * c`` for a thousand
values of ``c`` is one plan.
"""
from __future__ import annotations

import functools
import itertools
import numbers
import operator

import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from ..runtime.kernels import broadcast_shape as _broadcast_shape
from .dispatch import OpPlan, dispatch
from .rules import meta_call, to_dtensors
from .table import register, write_out
from .views import View

# op name -> how it treats partial inputs: "add" (linear in every operand), "scale" (linear in its
# first operand when the others are replicated or scalars)
_PARTIAL_RULE = {
    "add": "add", "sub": "add", "neg": "add", "positive": "add",
    "mul": "scale", "div": "scale", "true_divide": "scale",
}

# How the torch function's arguments are made from the kernel's tensors ``xs`` and run-time ``scalars``.
# ``template`` lists the positional arguments: n (tensor n), ("s", k) (scalar k), ("c", v) (the constant v:
# None, a string, a dtype); ``kwargs`` the keyword ones, (name, same vocabulary). The common calls get a
# short form the kernel runs without building argument lists: None (the tensors in order, nothing else),
# "ts" (tensor, scalar), "st" (scalar, tensor).
_SHORT_FORMS = {(("s", 0), 0): "st", (0, ("s", 0)): "ts"}


def _value(ref, xs, scalars):
    if type(ref) is int:
        return xs[ref]
    return scalars[ref[1]] if ref[0] == "s" else ref[1]


# The torch function each element-wise kernel calls, by the name its kwargs carry ('torch.add', 'F.gelu',
# 'Tensor.to': a name travels to worker processes and keys plans). Resolved when the op registers
# (``kernel_function``), so a kernel only looks its function up here, on every backend's process alike.
TORCH_FNS: dict = {}
_METHODS: dict = {}
_ROOTS = {"torch": torch, "F": torch.nn.functional, "Tensor": torch.Tensor, "special": torch.special}


def kernel_function(path: str) -> str:
    """Resolve the torch callable ``path`` names into ``TORCH_FNS`` (at import, as ops register); returns it."""
    if path not in TORCH_FNS:
        root, _, rest = path.partition(".")
        obj = _ROOTS[root]
        for part in rest.split("."):
            obj = getattr(obj, part)
        TORCH_FNS[path] = obj
        method = path.partition("torch.")[2]  # x.mul(c) as the method call (C level) where torch.Tensor has it
        _METHODS[path] = method if method and getattr(torch.Tensor, method, None) is not None else None
    return path


def _call(fn: str, template, kwargs, xs, scalars):
    f = TORCH_FNS[fn]
    if template is None:
        return f(*xs)
    if template == "ts":
        return f(xs[0], scalars[0])
    if template == "st":
        return f(scalars[0], xs[0])
    return f(*[_value(r, xs, scalars) for r in template], **{k: _value(r, xs, scalars) for k, r in kwargs})


def _bind_pointwise(kw: dict, lead: int, out_shapes):
    """``Kernel.bind``: tensors only, in order: the torch function itself; one tensor and one scalar (a
    loop repeating ``x * 0.5``): the torch function with the scalar bound."""
    template, f = kw["template"], TORCH_FNS[kw["fn"]]
    if template is None:
        return f
    if template == "st":
        return functools.partial(f, kw["scalars"][0])
    if template == "ts":
        method = _METHODS[kw["fn"]]
        if method is not None:  # x.mul(c): a C-level call
            return operator.methodcaller(method, kw["scalars"][0])
        c = kw["scalars"][0]
        return lambda x: f(x, c)
    return None


@kernel("pointwise", align=True, bind=_bind_pointwise)
def _pointwise_kernel(*xs, fn: str, template, kwargs: tuple = (), scalars: tuple = ()):
    if template == "ts":  # x * c: the common scalar call, without building argument lists
        return TORCH_FNS[fn](xs[0], scalars[0])
    return _call(fn, template, kwargs, xs, scalars)


@kernel("pointwise_0d", align=True)
def _pointwise_0d_kernel(*xs, fn: str, template, zero_d: tuple, lead=0, kwargs: tuple = (), scalars: tuple = ()):
    """The element-wise call when some operands are 0-d and others are not (their indices: ``zero_d``).

    torch promotes a 0-d tensor like a scalar (``fp16 x + 0-d fp32`` is float16, computed with the
    scalar's own value), but the blocks it arrives as here have rank: grid dims and the alignment
    padding. Each such operand goes back to 0-d before the torch call, so the call is torch's own.
    Where one differs per device (a Partial operand stacked over a grid), the call runs per device."""
    if all(xs[j].numel() == 1 for j in zero_d):
        xs = tuple(x.reshape(()) if j in zero_d else x for j, x in enumerate(xs))
        return _call(fn, template, kwargs, xs, scalars)
    grid = _broadcast_shape([x.shape[:lead] for x in xs])
    outs = []
    for idx in itertools.product(*(range(n) for n in grid)):
        ys = [x[tuple(i if x.shape[d] != 1 else 0 for d, i in enumerate(idx))] for x in xs]
        outs.append(_call(fn, template, kwargs, [y.reshape(()) if j in zero_d else y for j, y in enumerate(ys)],
                          scalars))
    return torch.stack(outs).reshape(tuple(grid) + tuple(outs[0].shape))


def _full_template(template, n_tensors: int) -> tuple:
    if template is None:
        return tuple(range(n_tensors))
    if template == "ts":
        return (0, ("s", 0))
    if template == "st":
        return (("s", 0), 0)
    return template


def pointwise(name: str, fn: str, *args, **kwargs):
    """Run torch function ``fn`` element-wise on a mix of dtorch tensors, torch tensors and scalars."""
    if not kwargs:
        for a in args:
            if type(a) is not Tensor and type(a) is not View:
                break
        else:  # tensors only: the short form, no argument analysis
            return dispatch(name, _pointwise_rule, args, (name, fn, None, (), ()))
    return dispatch(name, _pointwise_rule, *analyse(name, fn, args, kwargs))


def analyse(name: str, fn: str, args, kwargs) -> tuple:
    """(tensor operands, static plan key, run-time kwargs) of ``fn(*args, **kwargs)``: what ``dispatch``
    takes for an element-wise call (the in-place ops use it too)."""
    if any(isinstance(v, torch.Tensor) for v in args) or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
        names = list(kwargs)
        converted = to_dtensors(name, list(args) + [kwargs[k] for k in names])
        args, kwargs = converted[: len(args)], dict(zip(names, converted[len(args):]))
    tensors, scalars = [], []

    def ref(v):
        if isinstance(v, Tensor):
            tensors.append(v)
            return len(tensors) - 1
        if isinstance(v, numbers.Number):
            scalars.append(v)
            return ("s", len(scalars) - 1)
        try:
            hash(v)
        except TypeError:
            raise OpError(f"dtorch.{name}: argument {v!r} is not supported; pass tensors, numbers, None or "
                          "strings") from None
        return ("c", v)

    template = tuple(ref(a) for a in args)
    kw = tuple((k, ref(v)) for k, v in sorted(kwargs.items()) if v is not None)
    if not tensors:
        raise OpError(f"dtorch.{name} needs at least one tensor operand, got {[type(a).__name__ for a in args]}")
    if not kw:
        template = None if template == tuple(range(len(tensors))) else _SHORT_FORMS.get(template, template)
    static = (name, fn, template, kw, tuple(type(s) for s in scalars))
    return tensors, static, ({"scalars": tuple(scalars)} if scalars else None)


def _pointwise_rule(specs, name, fn, template, kwargs, scalar_types) -> OpPlan:
    if fn not in TORCH_FNS:
        raise OpError(f"dtorch.{name}: the element-wise kernel calls {fn!r}, which no op registered: resolve it "
                      "with pointwise.kernel_function where the op is defined")
    mesh = specs[0].mesh
    # Output shape (the broadcast one) and dtype from torch itself, without its slow first meta call. A
    # scalar's value is not known here (plans are shared by all values): torch's result dtype depends on
    # its type only, so 1 of that type stands in (in the domain of every op: division, log, pow).
    stand_ins = tuple(t(1) for t in scalar_types)
    out_meta = meta_call(lambda *ms: _call(fn, template, kwargs, ms, stand_ins), specs, out_shape="broadcast")
    out_shape = tuple(out_meta.shape)
    nout = len(out_shape)
    full = _full_template(template, len(specs))
    has_scalar = any(not isinstance(a, int) for a in full)
    # div(..., rounding_mode=...) rounds each quotient: not linear in its operands, partials are reduced first
    partial_rule = None if any(k == "rounding_mode" for k, _ in kwargs) else _PARTIAL_RULE.get(name)

    in_pl = [list(s.placements) for s in specs]
    out_pl = []
    for i in range(mesh.ndim):
        # 1. a shard on a non-broadcast dim wins; take it from the largest operand
        best = None
        for j, s in enumerate(specs):
            p = s.placements[i]
            if isinstance(p, Shard):
                o = p.dim + nout - s.ndim
                if s.shape[p.dim] == out_shape[o] and (best is None or _numel(s.shape) > best[0]):
                    best = (_numel(s.shape), o)
        if best is not None:
            o = best[1]
            for j, s in enumerate(specs):
                d = o - (nout - s.ndim)
                in_pl[j][i] = Shard(d) if d >= 0 and s.shape[d] == out_shape[o] else Replicate()
            out_pl.append(Shard(o))
            continue
        partials = [j for j, s in enumerate(specs) if isinstance(s.placements[i], Partial)]
        if not partials:
            for j in range(len(specs)):
                in_pl[j][i] = Replicate()
            out_pl.append(Replicate())
            continue
        ops = {specs[j].placements[i].reduce_op for j in partials}
        keep = None
        if len(ops) == 1 and ops <= {"sum", "avg"}:
            op = ops.pop()
            if partial_rule == "add" and not has_scalar:
                keep = Partial(op)
                for j in range(len(specs)):
                    in_pl[j][i] = keep  # replicated operands become partial locally
            elif partial_rule == "scale" and len(partials) == 1 and (name == "mul" or full[0] == partials[0]):
                keep = Partial(op)
                for j in range(len(specs)):
                    if j != partials[0]:
                        in_pl[j][i] = Replicate()
        if keep is None:
            for j in range(len(specs)):
                in_pl[j][i] = Replicate()
            out_pl.append(Replicate())
        else:
            out_pl.append(keep)
    in_specs = tuple(DTensorSpec(mesh, tuple(p), s.shape, s.dtype) for p, s in zip(in_pl, specs))
    out = DTensorSpec(mesh, tuple(out_pl), out_shape, out_meta.dtype)
    kw = {"fn": fn, "template": template, "kwargs": kwargs}
    # 0-d operands next to n-d ones promote like scalars in torch: they must reach torch as 0-d tensors
    zero_d = tuple(j for j, s in enumerate(specs) if s.ndim == 0) if nout else ()
    if zero_d:
        return OpPlan(in_specs, (out,), _pointwise_0d_kernel, dict(kw, zero_d=zero_d))
    return OpPlan(in_specs, (out,), _pointwise_kernel, kw)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ------------------------------------------------------------------------------------------------
# the op set

# what Python operators take besides dtorch tensors; anything else (None, str, list) gets NotImplemented, as
# torch's operators do, so Python falls back: ``x == None`` is False, ``x != None`` True, ``x + None`` a TypeError
_OPERANDS = (Tensor, torch.Tensor, numbers.Number)


def _binop(name: str, fn: str, reflected: bool = False):
    """``x <op> y`` (``y <op> x`` when ``reflected``): the hottest path of all, so the static part of the plan
    key is made here once per operand type (the same key ``pointwise`` makes), not on every call."""
    tensors_static = (name, fn, None, (), ())
    scalar_static = {tp: (name, fn, "st" if reflected else "ts", (), (tp,)) for tp in (int, float, bool)}
    rule = _pointwise_rule

    def op(self, other):
        tp = type(other)
        if tp is Tensor or tp is View:
            if not reflected:
                return dispatch(name, rule, (self, other), tensors_static)
        else:
            static = scalar_static.get(tp)
            if static is not None:
                return dispatch(name, rule, (self,), static, {"scalars": (other,)})
        if not isinstance(other, _OPERANDS):
            return NotImplemented
        return pointwise(name, fn, other, self) if reflected else pointwise(name, fn, self, other)

    op.__name__ = op.__qualname__ = f"__{'r' if reflected else ''}{name}__"
    return op


def _unary_dunder(name: str, fn: str):
    static = (name, fn, None, (), ())

    def op(self):
        return dispatch(name, _pointwise_rule, (self,), static)

    return op


def _elementwise_op(name: str, fn: str, *, torch_fns=(), functional=False, methods=()):
    kernel_function(fn)
    unary_static = (name, fn, None, (), ())  # x.exp(): the key pointwise() would make, made once

    def op(input, *args, inplace: bool = False, out=None, **kwargs):
        if (type(input) is Tensor or type(input) is View) and not args and not kwargs and not inplace and out is None:
            return dispatch(name, _pointwise_rule, (input,), unary_static)
        if out is not None:  # (torch's out=: the result written into out's own storage)
            return write_out(f"dtorch.{name}", out, op(input, *args, inplace=inplace, **kwargs))
        if inplace:  # F.relu(x, inplace=True): the result written into x's own storage, x returned
            if not isinstance(input, Tensor):
                raise OpError(f"dtorch.{name}(inplace=True) writes into a dtorch.Tensor, got {type(input).__name__}")
            return input.copy_(pointwise(name, fn, input, *args, **kwargs))
        return pointwise(name, fn, input, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = f"Element-wise ``{fn}`` on a dtorch tensor (placements pass through)."
    return register(name, rule=_pointwise_rule, kernel=_pointwise_kernel, methods=(name,) + tuple(methods),
                    torch_fns=torch_fns, functional=functional)(op)


def _pos(self):
    return self  # +x: the tensor itself, as in torch


# Tensor attributes beyond the method of the op's own name
_UNARY_DUNDERS = {"neg": ("__neg__",), "abs": ("__abs__",), "bitwise_not": ("__invert__",)}

_UNARY = [
    # name, torch fn, also in torch.nn.functional
    ("abs", "torch.abs", False), ("neg", "torch.neg", False), ("positive", "torch.positive", False),
    ("exp", "torch.exp", False), ("exp2", "torch.exp2", False), ("expm1", "torch.expm1", False),
    ("log", "torch.log", False), ("log2", "torch.log2", False), ("log10", "torch.log10", False),
    ("log1p", "torch.log1p", False), ("sqrt", "torch.sqrt", False), ("rsqrt", "torch.rsqrt", False),
    ("square", "torch.square", False), ("reciprocal", "torch.reciprocal", False),
    ("sin", "torch.sin", False), ("cos", "torch.cos", False), ("tan", "torch.tan", False),
    ("asin", "torch.asin", False), ("acos", "torch.acos", False), ("atan", "torch.atan", False),
    ("sinh", "torch.sinh", False), ("cosh", "torch.cosh", False), ("tanh", "torch.tanh", True),
    ("sigmoid", "torch.sigmoid", True), ("erf", "torch.erf", False), ("erfinv", "torch.erfinv", False),
    ("floor", "torch.floor", False), ("ceil", "torch.ceil", False), ("round", "torch.round", False),
    ("trunc", "torch.trunc", False), ("frac", "torch.frac", False), ("sign", "torch.sign", False),
    ("logical_not", "torch.logical_not", False), ("bitwise_not", "torch.bitwise_not", False),
    ("isnan", "torch.isnan", False), ("isinf", "torch.isinf", False), ("isfinite", "torch.isfinite", False),
    ("nan_to_num", "torch.nan_to_num", False), ("clamp", "torch.clamp", False), ("clip", "torch.clip", False),
    ("relu", "torch.relu", True), ("silu", "F.silu", True), ("gelu", "F.gelu", True), ("mish", "F.mish", True),
    ("softplus", "F.softplus", True), ("elu", "F.elu", True), ("leaky_relu", "F.leaky_relu", True),
    ("hardtanh", "F.hardtanh", True), ("logsigmoid", "F.logsigmoid", True), ("relu6", "F.relu6", True),
    ("hardswish", "F.hardswish", True), ("hardsigmoid", "F.hardsigmoid", True), ("selu", "F.selu", True),
]

for _name, _fn, _functional in _UNARY:
    _own = getattr(torch, _name, None) if _fn.startswith("torch.") else getattr(torch.nn.functional, _name)
    # a functional op also answers its other spelling: F.tanh next to torch.tanh, torch.selu next to F.selu
    _others = (getattr(torch.nn.functional, _name, None), getattr(torch, _name, None)) if _functional else ()
    _methods = tuple((d, _unary_dunder(_name, _fn)) for d in _UNARY_DUNDERS.get(_name, ()))
    if _name == "positive":
        _methods = (("__pos__", _pos),)
    globals()[_name] = _elementwise_op(_name, _fn, functional=_functional, methods=_methods,
                                       torch_fns=tuple(f for f in (_own,) + _others if f is not None))

_BINARY = [
    ("add", "torch.add"), ("sub", "torch.sub"), ("mul", "torch.mul"), ("div", "torch.div"),
    ("true_divide", "torch.true_divide"), ("floor_divide", "torch.floor_divide"),
    ("remainder", "torch.remainder"), ("fmod", "torch.fmod"), ("pow", "torch.pow"),
    ("maximum", "torch.maximum"), ("minimum", "torch.minimum"), ("atan2", "torch.atan2"),
    ("eq", "torch.eq"), ("ne", "torch.ne"), ("lt", "torch.lt"), ("le", "torch.le"), ("gt", "torch.gt"),
    ("ge", "torch.ge"), ("logical_and", "torch.logical_and"), ("logical_or", "torch.logical_or"),
    ("logical_xor", "torch.logical_xor"), ("bitwise_and", "torch.bitwise_and"),
    ("bitwise_or", "torch.bitwise_or"), ("bitwise_xor", "torch.bitwise_xor"), ("lerp", "torch.lerp"),
    ("hypot", "torch.hypot"), ("copysign", "torch.copysign"), ("xlogy", "torch.xlogy"),
]
# Python operators: op name -> (dunder stem, has a reflected form); comparisons reflect by swapping (x < y: y > x)
_BINARY_DUNDERS = {
    "add": ("add", True), "sub": ("sub", True), "mul": ("mul", True), "div": ("truediv", True),
    "floor_divide": ("floordiv", True), "remainder": ("mod", True), "pow": ("pow", True),
    "bitwise_and": ("and", True), "bitwise_or": ("or", True), "bitwise_xor": ("xor", True),
    "eq": ("eq", False), "ne": ("ne", False), "lt": ("lt", False), "le": ("le", False), "gt": ("gt", False),
    "ge": ("ge", False),
}
# ``torch_tensor <op> dtensor``: torch calls its own method, which hands itself to __torch_function__
_TORCH_DUNDERS = {"pow": "__pow__", "floor_divide": "__floordiv__", "remainder": "__mod__", "div": "__truediv__",
                  "sub": "__sub__"}

# torch's other spellings of an op: Tensor methods and torch functions of the same op (dtorch/__init__ adds
# the dtorch.<alias> names)
ALIASES = {"gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal", "ne": "not_equal"}

for _name, _fn in _BINARY:
    _methods = (ALIASES[_name],) if _name in ALIASES else ()
    if _name in _BINARY_DUNDERS:
        _stem, _reflects = _BINARY_DUNDERS[_name]
        _methods += ((f"__{_stem}__", _binop(_name, _fn)),)
        if _reflects:
            _methods += ((f"__r{_stem}__", _binop(_name, _fn, reflected=True)),)
    _tfs = [getattr(torch, n) for n in (_name, ALIASES.get(_name)) if n and hasattr(torch, n)]
    _tfs += [getattr(o, n) for n in (_name, ALIASES.get(_name)) if n for o in (torch._C.TensorBase, torch.Tensor)
             if hasattr(o, n)]
    if _name in _TORCH_DUNDERS:
        _tfs.append(getattr(torch.Tensor, _TORCH_DUNDERS[_name]))
    globals()[_name] = _elementwise_op(_name, _fn, methods=_methods, torch_fns=tuple(dict.fromkeys(_tfs)))


def _tensor_where(self, condition, other):
    return where(condition, self, other)


@register(rule=_pointwise_rule, kernel=_pointwise_kernel, methods=(("where", _tensor_where),), torch_fns=(torch.where,))
def where(condition, input=None, other=None, *, out=None):
    """``torch.where(condition, input, other)``; inputs may be dtorch tensors or scalars."""
    if out is not None:
        return write_out("dtorch.where", out, where(condition, input, other))
    if input is None and other is None:
        raise NotImplementedError("dtorch.where(condition) (the nonzero form) is not supported; pass input and other")
    return pointwise("where", "torch.where", condition, input, other)


@register(rule=_pointwise_rule, kernel=_pointwise_kernel, methods=("masked_fill",), torch_fns=(torch.masked_fill,))
def masked_fill(input, mask, value):
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        # a value that requires grad gets its gradient (as a dtorch leaf), else it is a plain number
        value = to_dtensors("masked_fill", [input, value])[1] if value.requires_grad else value.item()
    if isinstance(value, Tensor):  # a 0-d dtorch value: select instead (masked_fill wants a scalar)
        if value.ndim != 0:
            raise OpError(f"dtorch.masked_fill: value must be a number or a 0-d tensor, got shape {list(value.shape)}")
        return where(mask, to_dtype(value, input.dtype), input)
    return pointwise("masked_fill", "torch.masked_fill", input, mask, value)


@register(rule=_pointwise_rule, kernel=_pointwise_kernel, methods=("addcmul",), torch_fns=(torch.addcmul,))
def addcmul(input, tensor1, tensor2, *, value=1, out=None):
    if out is not None:
        return write_out("dtorch.addcmul", out, addcmul(input, tensor1, tensor2, value=value))
    return pointwise("addcmul", "torch.addcmul", input, tensor1, tensor2, value=value)


@register(torch_fns=(torch.clone,))
def clone(input, *, memory_format=None):
    """``torch.clone``: a new Tensor object with the same value (``Tensor.clone``)."""
    if not isinstance(input, Tensor):
        raise OpError(f"dtorch.clone expects a dtorch.Tensor, got {type(input).__name__}")
    return input.clone()


# -- dtype casts ------------------------------------------------------------------------------------

def _cast(dtype):
    def method(self):
        return to_dtype(self, dtype)

    return method


def _type_as(self, other):
    return to_dtype(self, other.dtype)


def _type(self, dtype=None):
    if dtype is None:
        return str(self.dtype)
    return to_dtype(self, dtype)


_CAST_METHODS = tuple((m, _cast(dt)) for m, dt in (
    ("float", torch.float32), ("double", torch.float64), ("half", torch.float16), ("bfloat16", torch.bfloat16),
    ("int", torch.int32), ("long", torch.int64), ("bool", torch.bool)))


@register(public=False, rule=_pointwise_rule, kernel=_pointwise_kernel,
          methods=_CAST_METHODS + (("type_as", _type_as), ("type", _type)))
def to_dtype(input: Tensor, dtype: torch.dtype) -> Tensor:
    """The cast behind ``Tensor.to(dtype)``, ``.float()``, ``.type_as(other)``."""
    if input.dtype == dtype:
        return input
    return pointwise("to", "Tensor.to", input, dtype)


for _path in ("torch.where", "torch.masked_fill", "torch.addcmul", "Tensor.to"):  # the ops defined one by one above
    kernel_function(_path)
