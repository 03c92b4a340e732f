"""Element-wise ops: unary math, binary ops with broadcasting and scalars, comparisons, casts.

Rule, per mesh dim (expanded to N-D by looping over mesh dims):

    S(d) with anything   -> S(d)   the other operands are cut to match (a Replicate operand is sliced
                                   locally, no communication; a broadcast size-1 dim stays Replicate)
    P + P, P - P, -P     -> P      sum_d a_d + sum_d b_d = sum_d (a_d + b_d)
    P + R                -> P      R becomes partial locally (value on one device, zeros elsewhere)
    P * R, P / R, P * c  -> P      sum_d a_d * b = sum_d (a_d * b)
    P otherwise          -> R      the partial is reduced first (nonlinear ops, P * P, P + scalar)
    R with R             -> R
"""
from __future__ import annotations

import numbers

import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .registry import (_PLANS, TORCH_FUNCTIONS, OpPlan, dispatch, meta_call, register, reject_out, resolve_torch,
                       static_value, to_dtensors)

# op name -> how it treats partial inputs: "add" (linear in every operand), "scale" (linear in its
# first operand when the others are replicated or scalars)
_PARTIAL_RULE = {
    "add": "add", "sub": "add", "neg": "add", "positive": "add",
    "mul": "scale", "div": "scale", "true_divide": "scale",
}


@kernel("pointwise", align=True)
def _pointwise_kernel(*xs, fn: str, template: tuple, kwargs: tuple):
    args = [xs[a] if isinstance(a, int) else a[-1] for a in template]
    return resolve_torch(fn)(*args, **_kwargs_with_tensors(kwargs, xs))


def _kwargs_with_tensors(kwargs: tuple, xs) -> dict:
    return {k: xs[v[1]] if isinstance(v, tuple) and len(v) == 2 and v[0] == _TENSOR_KW else v for k, v in kwargs}


# Steady-state fast path: (fn, graph, spec or scalar per operand) -> a closure that calls the torch
# function straight on the stacked blocks. Filled after a first, fully planned call showed that the
# plan needs no redistribution and the runtime can run the kernel directly on grids.
_FAST: dict = {}


def _fast_key(fn, args):
    key = [fn]
    for a in args:
        if type(a) is Tensor:
            key.append(a._spec)
        elif type(a) in (int, float, bool):
            key.append(type(a))
            key.append(a)
        else:
            return None
    return tuple(key)


def pointwise(name: str, fn: str, *args, **kwargs):
    """Run torch function ``fn`` element-wise on a mix of dtorch tensors and scalars."""
    key = None
    if not kwargs:
        key = _fast_key(fn, args)
        if key is not None:
            fast = _FAST.get(key)
            if fast is not None:
                out = fast(*args)
                if out is not None:
                    return out
    out, plan_key = _pointwise_slow(name, fn, args, kwargs)
    if key is not None:
        _maybe_fast(key, fn, args, out, _PLANS.get(plan_key))
    return out


def _maybe_fast(key, fn, args, out, plan):
    tensors = [a for a in args if type(a) is Tensor]
    graph = out._graph
    rt = graph.runtime
    grid_direct = getattr(rt, "grid_direct", None)
    if grid_direct is None or any(t._graph is not graph for t in tensors):
        return
    specs = tuple(t._spec for t in tensors)
    if plan is None or plan.in_specs != specs or not grid_direct(plan.kernel, specs, plan.out_specs):
        return
    torch_fn = resolve_torch(fn)
    _FAST[key] = _make_fast(torch_fn, args, plan.out_specs[0], graph)


def _make_fast(torch_fn, args, out_spec, graph):
    from ..runtime.inprocess import Shards

    make = Tensor._make
    positions = [n for n, a in enumerate(args) if type(a) is Tensor]
    if positions == [0] and len(args) == 1:
        def fast(a):
            g = a._h.grid
            return None if g is None or a._graph is not graph else make(out_spec, Shards(grid=torch_fn(g)), graph)
    elif positions == [0, 1] and len(args) == 2:
        def fast(a, b):
            ga, gb = a._h.grid, b._h.grid
            if ga is None or gb is None or a._graph is not graph or b._graph is not graph:
                return None
            return make(out_spec, Shards(grid=torch_fn(ga, gb)), graph)
    elif positions == [0] and len(args) == 2:
        def fast(a, c):
            g = a._h.grid
            return None if g is None or a._graph is not graph else make(out_spec, Shards(grid=torch_fn(g, c)), graph)
    elif positions == [1] and len(args) == 2:
        def fast(c, a):
            g = a._h.grid
            return None if g is None or a._graph is not graph else make(out_spec, Shards(grid=torch_fn(c, g)), graph)
    else:
        return None
    return fast


_TENSOR_KW = "__tensor__"  # a keyword argument holding tensor input number n: (_TENSOR_KW, n)


def _pointwise_slow(name, fn, args, kwargs):
    kw_names = [k for k, v in kwargs.items() if isinstance(v, (Tensor, torch.Tensor))]
    converted = to_dtensors(name, list(args) + [kwargs[k] for k in kw_names])
    args = converted[: len(args)]
    tensors, template = [], []
    for a in args:
        if isinstance(a, Tensor):
            template.append(len(tensors))
            tensors.append(a)
        else:
            template.append(("c", static_value(a), a))
    kwargs = dict(kwargs)
    for k, t in zip(kw_names, converted[len(args):]):
        kwargs[k] = (_TENSOR_KW, len(tensors))
        tensors.append(t)
    static = (fn, tuple(template), tuple(sorted((k, static_value(v), v) for k, v in kwargs.items() if v is not None)))
    key_static = (fn, tuple(t[:2] if isinstance(t, tuple) else t for t in template),
                  tuple((k, sv) for k, sv, _ in static[2]))
    return dispatch(name, _rule_for(name, static), tensors, key_static), (name, tuple(t._spec for t in tensors), key_static)


def _rule_for(name, static):
    fn, template, kwargs = static
    kw = tuple((k, v) for k, _, v in kwargs)
    tmpl = tuple(t if isinstance(t, int) else ("c", t[2]) for t in template)

    def rule(specs, *_):
        return _pointwise_plan(name, fn, tmpl, kw, specs)

    return rule


def _pointwise_plan(name, fn, template, kwargs, specs) -> OpPlan:
    mesh = specs[0].mesh
    # output shape (the broadcast one) and dtype from torch itself, without its slow first meta call
    def call(*ms):
        return resolve_torch(fn)(*[ms[a] if isinstance(a, int) else a[-1] for a in template],
                                 **_kwargs_with_tensors(kwargs, ms))

    out_meta = meta_call(call, specs, out_shape="broadcast")
    out_shape = tuple(out_meta.shape)
    nout = len(out_shape)
    has_scalar = any(not isinstance(a, int) for a in template)
    partial_rule = _PARTIAL_RULE.get(name)

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
            elif partial_rule == "scale" and len(partials) == 1 and (name == "mul" or template[0] == partials[0]):
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
    return OpPlan(in_specs, (out,), _pointwise_kernel, {"fn": fn, "template": template, "kwargs": kwargs})


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ------------------------------------------------------------------------------------------------
# the op set

def _elementwise_op(name: str, fn: str, *, methods=None, torch_fn=None, functional=False):
    def op(input, *args, inplace: bool = False, out=None, **kwargs):
        if inplace:
            raise OpError(f"dtorch.{name}(inplace=True): dtorch tensors are not written in place; "
                          f"use the returned tensor (inplace=False)")
        reject_out(f"dtorch.{name}", out)  # else the kernel would write into out's shared blocks
        return pointwise(name, fn, input, *args, **kwargs)

    op.__name__ = name
    op.__doc__ = f"Element-wise ``{fn}`` on a dtorch tensor (placements pass through)."
    tfs = (torch_fn,) if torch_fn is not None else ()
    return register(name, methods=methods if methods is not None else (name,), torch_fns=tfs, functional=functional)(op)


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
    _tf = getattr(torch, _name, None) if _fn.startswith("torch.") else getattr(torch.nn.functional, _name)
    globals()[_name] = _elementwise_op(_name, _fn, torch_fn=_tf, functional=_functional)
    if _functional:  # the other spelling too: F.tanh next to torch.tanh, torch.selu next to F.selu
        for _other in (getattr(torch.nn.functional, _name, None), getattr(torch, _name, None)):
            if _other is not None:
                TORCH_FUNCTIONS.setdefault(_other, globals()[_name])

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

for _name, _fn in _BINARY:
    globals()[_name] = _elementwise_op(_name, _fn, torch_fn=getattr(torch, _name))


@register(methods=("where",), torch_fns=(torch.where,))
def where(condition, input=None, other=None, *, out=None):
    """``torch.where(condition, input, other)``; inputs may be dtorch tensors or scalars."""
    reject_out("dtorch.where", out)
    if input is None and other is None:
        raise NotImplementedError("dtorch.where(condition) (the nonzero form) is not supported; pass input and other")
    return pointwise("where", "torch.where", condition, input, other)


def _tensor_where(self, condition, other):
    return where(condition, self, other)


Tensor.where = _tensor_where


@register(methods=("masked_fill",), torch_fns=(torch.masked_fill,))
def masked_fill(input, mask, value):
    if isinstance(value, torch.Tensor) and value.ndim == 0:
        value = value.item()
    if isinstance(value, Tensor):  # a 0-d dtorch value: select instead (masked_fill wants a scalar)
        if value.ndim != 0:
            raise OpError(f"dtorch.masked_fill: value must be a number or a 0-d tensor, got shape {list(value.shape)}")
        return where(mask, to_dtype(value, input.dtype), input)
    return pointwise("masked_fill", "torch.masked_fill", input, mask, value)


@register(methods=("addcmul",), torch_fns=(torch.addcmul,))
def addcmul(input, tensor1, tensor2, *, value=1, out=None):
    reject_out("dtorch.addcmul", out)
    return pointwise("addcmul", "torch.addcmul", input, tensor1, tensor2, value=value)


@register(torch_fns=(torch.clone,))
def clone(input, *, memory_format=None):
    """``torch.clone``: a new Tensor object with the same value (``Tensor.clone``)."""
    if not isinstance(input, Tensor):
        raise OpError(f"dtorch.clone expects a dtorch.Tensor, got {type(input).__name__}")
    return input.clone()


TORCH_FUNCTIONS[torch.detach] = Tensor.detach


# -- dtype casts ------------------------------------------------------------------------------------

def to_dtype(input: Tensor, dtype: torch.dtype) -> Tensor:
    if input.dtype == dtype:
        return input
    return pointwise("to", "Tensor.to", input, dtype)


def _cast(dtype):
    def method(self):
        return to_dtype(self, dtype)

    return method


for _m, _dt in (("float", torch.float32), ("double", torch.float64), ("half", torch.float16),
                ("bfloat16", torch.bfloat16), ("int", torch.int32), ("long", torch.int64), ("bool", torch.bool)):
    setattr(Tensor, _m, _cast(_dt))


def _type_as(self, other):
    return to_dtype(self, other.dtype)


def _type(self, dtype=None):
    if dtype is None:
        return str(self.dtype)
    return to_dtype(self, dtype)


Tensor.type_as = _type_as
Tensor.type = _type


# -- Python operators -------------------------------------------------------------------------------

# what Python operators take besides dtorch tensors; anything else (None, str, list) gets NotImplemented, as
# torch's operators do, so Python falls back: ``x == None`` is False, ``x != None`` True, ``x + None`` a TypeError
_OPERANDS = (Tensor, torch.Tensor, numbers.Number)


def _binop(name, fn, reflected=False):
    # Python operators are the hottest path: look the fast path up without going through pointwise()
    scalars = (int, float, bool)
    fast_get = _FAST.get

    if reflected:
        def op(self, other):
            tp = type(other)
            if tp in scalars:
                fast = fast_get((fn, tp, other, self._spec))
                if fast is not None:
                    out = fast(other, self)
                    if out is not None:
                        return out
            if not isinstance(other, _OPERANDS):
                return NotImplemented
            return pointwise(name, fn, other, self)
    else:
        def op(self, other):
            tp = type(other)
            if tp is Tensor:
                fast = fast_get((fn, self._spec, other._spec))
            elif tp in scalars:
                fast = fast_get((fn, self._spec, tp, other))
            else:
                fast = None
            if fast is not None:
                out = fast(self, other)
                if out is not None:
                    return out
            if not isinstance(other, _OPERANDS):
                return NotImplemented
            return pointwise(name, fn, self, other)
    op.__name__ = f"__{name}__"
    return op


for _dunder, _name, _fn in (
    ("add", "add", "torch.add"), ("sub", "sub", "torch.sub"), ("mul", "mul", "torch.mul"),
    ("truediv", "div", "torch.div"), ("floordiv", "floor_divide", "torch.floor_divide"),
    ("mod", "remainder", "torch.remainder"), ("pow", "pow", "torch.pow"),
    ("and", "bitwise_and", "torch.bitwise_and"), ("or", "bitwise_or", "torch.bitwise_or"),
    ("xor", "bitwise_xor", "torch.bitwise_xor"),
):
    setattr(Tensor, f"__{_dunder}__", _binop(_name, _fn))
    setattr(Tensor, f"__r{_dunder}__", _binop(_name, _fn, reflected=True))

for _dunder, _name, _fn in (("eq", "eq", "torch.eq"), ("ne", "ne", "torch.ne"), ("lt", "lt", "torch.lt"),
                            ("le", "le", "torch.le"), ("gt", "gt", "torch.gt"), ("ge", "ge", "torch.ge")):
    setattr(Tensor, f"__{_dunder}__", _binop(_name, _fn))

# ``torch_tensor + dtensor``: torch calls its own method, which hands itself to __torch_function__
for _name, _fn in _BINARY + [("div", "torch.div")]:
    for _owner in (torch._C.TensorBase, torch.Tensor):
        _method = getattr(_owner, _name, None)
        if _method is not None:
            TORCH_FUNCTIONS.setdefault(_method, globals()[_name])
for _dunder, _name in (("__pow__", "pow"), ("__floordiv__", "floor_divide"), ("__mod__", "remainder"),
                       ("__truediv__", "div"), ("__sub__", "sub")):
    TORCH_FUNCTIONS.setdefault(getattr(torch.Tensor, _dunder), globals()[_name])

Tensor.__neg__ = lambda self: pointwise("neg", "torch.neg", self)
Tensor.__pos__ = lambda self: self
Tensor.__abs__ = lambda self: pointwise("abs", "torch.abs", self)
Tensor.__invert__ = lambda self: pointwise("bitwise_not", "torch.bitwise_not", self)
Tensor.__hash__ = lambda self: id(self)
