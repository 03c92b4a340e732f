"""The op table: every operator is one ``Op`` entry in ``TABLE`` (``register``).

An entry holds the op's public function, the rule and kernel it dispatches with, the Tensor attributes and
torch functions that lead to it. Nothing else attaches operators anywhere: ``dtorch.Tensor._install_ops``
binds the Tensor methods from the table (once, from ``dtorch/__init__``), ``dtorch.<name>`` and
``dtorch.nn.functional.<name>`` are read from it, and ``__torch_function__`` routes torch functions with it
(``torch_function_dispatch``). What is not supported says what to call instead (``unsupported_message``).
How an op runs is ops/dispatch.py; the helpers rules share are ops/rules.py.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..errors import OpError
from ..runtime.kernels import Kernel
from ..tensor import Tensor


@dataclass(frozen=True)
class Op:
    """One operator: everything dtorch knows about where it is reachable from and how it runs."""
    name: str
    fn: Callable  # the public function (dtorch.<name> when ``public``)
    rule: Callable | None = None  # specs (+ static arguments) -> OpPlan; None: built from other ops
    kernel: Kernel | None = None  # what each device runs; None: built from other ops (or several kernels)
    # Tensor attributes: "name" binds ``fn`` as a method; ("name", value) binds ``value`` (a dunder, a property)
    methods: tuple = ()
    # torch callables routed here by __torch_function__: f calls ``fn``; (f, adapter) calls ``adapter``
    torch_fns: tuple = ()
    functional: bool = False  # also dtorch.nn.functional.<name>
    public: bool = True


TABLE: dict[str, Op] = {}
# derived from TABLE by ``register`` (lookups on hot paths): public name -> function (dtorch.<name>),
# nn.functional name -> function, torch function -> dtorch function
PUBLIC: dict[str, Callable] = {}
FUNCTIONAL: dict[str, Callable] = {}
TORCH_FUNCTIONS: dict[Callable, Callable] = {}


def register(name: str | None = None, *, rule=None, kernel=None, methods=(), torch_fns=(), functional: bool = False,
             public: bool = True):
    """Record ``fn`` in the op table (see ``Op`` for the fields); returns ``fn`` unchanged."""

    def deco(fn):
        n = name or fn.__name__
        if n in TABLE:
            raise RuntimeError(f"op {n!r} registered twice ({TABLE[n].fn} and {fn})")
        op = TABLE[n] = Op(n, fn, rule, kernel, tuple(methods), tuple(torch_fns), functional, public)
        if public:
            PUBLIC[n] = _taking_out(n, fn)
        if functional:
            FUNCTIONAL[n] = fn
        for tf in op.torch_fns:
            f, target = tf if isinstance(tf, tuple) else (tf, fn)
            TORCH_FUNCTIONS.setdefault(f, target)  # first registration wins (F.tanh and torch.tanh: one op)
        return fn

    return deco


class UnsupportedError(OpError, NotImplementedError):
    """A torch feature dtorch does not implement (yet): an operator, a Tensor method, ``out=``."""


def write_out(spelling: str, out, result):
    """torch's ``out=``: ``result`` written into ``out``'s own storage, laid out as ``out`` is (it must be a
    dtorch tensor of the result's shape, of a dtype the result casts to), and ``out`` returned; the outputs of
    a multi-output op go into a tuple of ``out`` tensors. ``out=None`` (torch's default) returns ``result``."""
    if out is None:
        return result
    if isinstance(result, tuple):
        if not isinstance(out, (tuple, list)) or len(out) != len(result):
            raise OpError(f"{spelling}(..., out=...) returns {len(result)} tensors: pass out as a tuple of "
                          f"{len(result)} dtorch tensors")
        return tuple(write_out(spelling, o, r) for o, r in zip(out, result))
    if not isinstance(out, Tensor):
        raise UnsupportedError(
            f"{spelling}(..., out=...) needs a dtorch tensor as out (the result lives on a mesh), got "
            f"{type(out).__name__}: pass a dtorch tensor of shape {list(result.shape)}, or write "
            f"`y = {spelling}(...)` instead of `{spelling}(..., out=y)`")
    if _grad_enabled() and (result._ag is not None or out._ag is not None):
        raise RuntimeError(f"{spelling}(): functions with out=... arguments don't support automatic "
                           "differentiation, but one of the arguments requires grad")  # (torch's words)
    if tuple(out.shape) != tuple(result.shape):
        raise OpError(f"{spelling}(..., out=...): out has shape {list(out.shape)} but the result has shape "
                      f"{list(result.shape)}; dtorch does not resize out: pass a tensor of the result's shape")
    if not torch.can_cast(result.dtype, out.dtype):
        raise OpError(f"{spelling}(..., out=...): result type {result.dtype} can't be cast to the desired output "
                      f"type {out.dtype}")
    return out.copy_(result)


def _taking_out(n: str, fn: Callable) -> Callable:
    """``dtorch.<n>``: ``fn`` with torch's ``out=`` (``write_out``), unless ``fn`` takes ``out`` itself.
    Only the ``dtorch.<n>`` entry is wrapped: Tensor methods and torch.nn.functional spellings take no
    ``out`` in torch either, and ``torch.<fn>(..., out=)`` is handled in torch_function_dispatch."""
    try:
        if "out" in inspect.signature(fn).parameters:
            return fn
    except (TypeError, ValueError):  # no signature to read: leave it as it is
        return fn

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        if "out" in kwargs:
            out = kwargs.pop("out")
            return write_out(f"dtorch.{n}", out, fn(*args, **kwargs))
        return fn(*args, **kwargs)

    return entry


_TORCH_NAMES: dict = {}  # torch callable -> its public spelling, built on the first error that needs one


def torch_public_name(func) -> str:
    """torch's public spelling of ``func``: ``torch.roll`` (not ``torch._VariableFunctionsClass.roll``),
    ``torch.nn.functional.max_pool1d`` (not ``boolean_dispatch.<locals>.fn``), ``torch.Tensor.roll``."""
    if not _TORCH_NAMES:
        tensor_attrs = {**vars(torch._C.TensorBase), **vars(torch.Tensor)}
        # first spelling wins: torch.nn.functional before torch (F.conv1d is torch.conv1d; nn code says F)
        for prefix, attrs in (("torch.nn.functional", vars(torch.nn.functional)), ("torch", vars(torch)),
                              ("torch.Tensor", tensor_attrs), ("torch.linalg", vars(torch.linalg)),
                              ("torch.special", vars(torch.special)), ("torch.fft", vars(torch.fft))):
            for attr, obj in attrs.items():
                if attr.startswith("_") and not (prefix == "torch.Tensor" and attr.startswith("__")):
                    continue
                try:
                    _TORCH_NAMES.setdefault(obj, f"{prefix}.{attr}")
                except TypeError:  # unhashable: never a function torch hands to __torch_function__
                    pass
    try:
        known = _TORCH_NAMES.get(func)
    except TypeError:
        known = None
    if known:
        return known
    module = getattr(func, "__module__", None) or "torch"
    return f"{module}.{getattr(func, '__name__', None) or repr(func)}"


def unsupported_message(spelling: str, what: str = "") -> str:
    """Why ``spelling`` (a torch function or ``torch.Tensor.<attr>``) cannot run on dtorch tensors, and what to
    do instead: the dtorch operator of that name where one exists, else the round trip through torch."""
    short = spelling.rpartition(".")[2]
    what = what or f"{spelling} is not supported on dtorch tensors"
    if short in PUBLIC:
        return f"{what}; call dtorch.{short}(...) instead (it takes dtorch and torch tensors)"
    if short in FUNCTIONAL:
        return f"{what}; call dtorch.nn.functional.{short}(...) instead (it takes dtorch and torch tensors)"
    if spelling.startswith("torch.Tensor.") and hasattr(Tensor, short):
        return (f"{what} with a torch tensor as self; make it a dtorch tensor first "
                f"(dtorch.Tensor(t, device_mesh=...)) and call .{short}(...) on that")
    return (f"{what} yet: dtorch has no {short} operator. To run it anyway, take the whole value with x.to_torch(), "
            f"apply {spelling} to the torch tensor, and distribute the result again with "
            "dtorch.Tensor(result, device_mesh=..., placements=[...])")


def torch_function_dispatch(func, args, kwargs):
    if "out" in kwargs:  # torch.add(x, 1, out=t): the result written into t (kwargs is torch's: copy it)
        kwargs = dict(kwargs)
        out = kwargs.pop("out")
        if out is not None:
            return write_out(torch_public_name(func), out, torch_function_dispatch(func, args, kwargs))
    target = TORCH_FUNCTIONS.get(func)
    if target is None:
        spelling = torch_public_name(func)
        method = spelling[len("torch.Tensor."):] if spelling.startswith("torch.Tensor.") else None
        if method and args and isinstance(args[0], Tensor) and callable(getattr(Tensor, method, None)):
            return getattr(args[0], method)(*args[1:], **kwargs)  # torch.Tensor.sum(x): dtorch's own method
        raise UnsupportedError(unsupported_message(spelling))
    return target(*args, **kwargs)


def missing_attribute(self, attr: str):
    """``Tensor.__getattr__`` (reached only when normal lookup fails): say whether torch has ``attr`` and what
    dtorch offers instead, rather than a bare "no attribute"."""
    if attr.startswith("_") or not hasattr(torch.Tensor, attr):
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{attr}'", name=attr, obj=self)
    raise AttributeError(unsupported_message(f"torch.Tensor.{attr}",
                                             f"dtorch.Tensor has no attribute '{attr}': torch.Tensor.{attr} is "
                                             "not supported on dtorch tensors"), name=attr, obj=self)

