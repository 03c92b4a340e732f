"""The op table and the one dispatch path every op takes.

Every operator is one ``Op`` entry in ``TABLE`` (``register``): its public function, the rule and
kernel it dispatches with, the Tensor attributes and torch functions that lead to it. Nothing else
attaches operators anywhere: ``dtorch.Tensor._install_ops`` binds the Tensor methods from the table
(once, from ``dtorch/__init__``), ``dtorch.<name>`` and ``dtorch.nn.functional.<name>`` are read from
it, and ``__torch_function__`` routes torch functions with it.

An op call is: specs of the tensor inputs + hashable static arguments -> ``OpPlan`` (computed once by
the op family's rule, then a dict lookup) together with the runtime's ``Executable`` for it ->
redistribute the inputs the plan asks to move (none in the steady state of most code: then the
handles go straight to the executable) -> run the kernel on every device -> wrap the outputs. Rules
see specs only, never data. Scalar operands are not part of the plan key: their values travel to the
kernel as run-time keyword arguments (``dispatch(..., kwargs=)``), only their types shape the plan.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from .._lru import LRU
from ..errors import DTorchError, OpError
from ..graph import check_one_graph
from ..placement import Replicate
from ..autograd.dispatched import differentiable, record_kernel, refetch_positions
from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..autograd.torch_leaves import torch_leaf
from ..redistribute import relayout
from ..runtime.kernels import Kernel
from ..runtime.kernels import broadcast_shape as _broadcast_shape
from ..spec import DTensorSpec
from ..tensor import Tensor, as_torch


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


@dataclass(frozen=True)
class OpPlan:
    in_specs: tuple  # the spec each tensor input must have (same mesh, shape, dtype; maybe other placements)
    out_specs: tuple
    kernel: Kernel
    kwargs: dict = field(default_factory=dict)
    device_args: dict | None = None  # name -> numpy array over the mesh shape (per-device values)
    multi_output: bool = False


class _Compiled:
    """A cached plan, whether its inputs arrive as they are (no redistribution), and the executable of
    the runtime that ran it last."""

    # the plan's fields the steady state reads are copied here: one attribute lookup each
    __slots__ = ("plan", "direct", "kwargs", "device_args", "out_spec", "executable", "last_kwargs")

    def __init__(self, plan: OpPlan, direct: bool):
        self.plan = plan
        self.direct = direct
        self.kwargs = plan.kwargs
        self.device_args = plan.device_args
        self.out_spec = None if plan.multi_output else plan.out_specs[0]
        # (runtime, weakref to it, its executable), one attribute so that threads running the plan on two
        # runtimes never pair one's runtime with the other's executable. The runtime itself only when its
        # handles are plain tensors of this process (nothing to release), else None and weakly: a cache
        # must not keep worker processes alive.
        self.executable = (None, _dead_ref, None)
        # (run-time kwargs, the kwargs dict made from them) of the last call that had some: a loop that
        # repeats its scalars (x * 0.5) hands the executable the same dict again, which it can bind
        self.last_kwargs = (None, None)


def _dead_ref():
    return None


# (op name, input specs, static arguments) -> _Compiled. Bounded: shapes that change every step (a decode
# loop) would otherwise add plans forever.
_PLANS = LRU("ops.plans", 8192)
_plans_fast_get = _PLANS.fast_get
_make = Tensor._make  # (bound once: the classmethod lookup is a measurable part of a tiny op)
# number of inputs (1, 2) -> op name -> (_Compiled, static, *specs) of its last call: one entry per op name
_LAST: dict = {1: {}, 2: {}}
_last1_get, _last2_get = _LAST[1].get, _LAST[2].get
stats = {"plan_misses": 0}


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


def dispatch(name: str, rule: Callable, tensors, static: tuple = (), kwargs: dict | None = None):
    """Run op ``name`` on dtorch tensors; ``rule(specs, *static) -> OpPlan``.

    ``kwargs`` are run-time keyword arguments for the kernel, on top of the plan's (scalar operand
    values): they never key a plan, so they must not change the output specs.
    """
    # Every element-wise op and view goes through here. The plan: the one this op used last when the
    # specs (the same objects) and statics are the same again: no hashing, the steady state of a loop;
    # else the bounded cache; else the rule. One and two inputs are spelled out (a comprehension costs
    # as much as the rest of a cache hit).
    t0 = tensors[0]
    graph = t0._graph
    n = len(tensors)
    if n == 2:
        t1 = tensors[1]
        if t1._graph is not graph:  # plans are cached by specs alone: the graphs are checked on every call
            check_one_graph(name, tensors)
        s0, s1 = t0._spec, t1._spec
        last = _last2_get(name)
        if last is not None and last[2] is s0 and last[3] is s1 and (last[1] is static or last[1] == static):
            c = last[0]
        else:
            c = _plan(name, rule, (s0, s1), static)
        handles = [t0._h, t1._h]
        recording = t0._ag is not None or t1._ag is not None
    elif n == 1:
        s0 = t0._spec
        last = _last1_get(name)
        if last is not None and last[2] is s0 and (last[1] is static or last[1] == static):
            c = last[0]
        else:
            c = _plan(name, rule, (s0,), static)
        handles = [t0._h]
        recording = t0._ag is not None
    else:
        for t in tensors:
            if t._graph is not graph:
                check_one_graph(name, tensors)
                break
        c = _plan(name, rule, tuple([t._spec for t in tensors]), static)
        handles = [t._h for t in tensors]
        recording = any(t._ag is not None for t in tensors)
    rt = graph.runtime
    e = c.executable
    ex = e[2] if e[0] is rt or e[1]() is rt else _executable(c, rt, name, tensors)
    if not c.direct:  # some input must be laid out as the plan says first
        handles = [(t if t._spec == s else relayout(t, s))._h for t, s in zip(tensors, c.plan.in_specs)]
    if kwargs is None:
        kwargs = c.kwargs
    else:
        last = c.last_kwargs  # (one read: another thread may replace the pair, never half of it)
        if kwargs == last[0]:
            kwargs = last[1]
        else:
            merged = {**c.kwargs, **kwargs}
            c.last_kwargs = (kwargs, merged)
            kwargs = merged
    if recording and _grad_enabled():  # an input requires grad: the output remembers how it was made
        return _recorded(name, c, ex, graph, tensors, handles, kwargs)
    try:
        outs = ex.run(handles, kwargs, c.device_args)
    except DTorchError:
        raise
    except Exception as exc:
        raise _failed(name, tensors, exc) from exc
    if c.out_spec is None:  # several outputs
        return tuple(_make(s, h, graph) for s, h in zip(c.plan.out_specs, outs))
    return _make(c.out_spec, outs[0], graph)


def _failed(name, tensors, exc) -> OpError:
    return OpError(f"dtorch.{name} failed on inputs {describe([t._spec for t in tensors])}: "
                   f"{type(exc).__name__}: {exc}")


def _recorded(name, c: "_Compiled", ex, graph, tensors, handles, kwargs):
    """``dispatch`` when autograd records: the runtime may keep each device's local autograd graph
    (``Executable.run_tracked``), then the op's node differentiates it instead of recomputing."""
    plan = c.plan
    tape = None
    try:
        diff = differentiable(tensors, plan.in_specs)
        tracked = None
        if any(diff):
            refetch = refetch_positions(plan.kernel, tensors, handles)
            tracked = (ex.run_tracked(handles, kwargs, c.device_args, diff, refetch) if refetch
                       else ex.run_tracked(handles, kwargs, c.device_args, diff))
        if tracked is not None:
            outs, tape = tracked
        else:
            outs = ex.run(handles, kwargs, c.device_args)
    except DTorchError:
        raise
    except Exception as exc:
        raise _failed(name, tensors, exc) from exc
    res = tuple(_make(s, h, graph) for s, h in zip(plan.out_specs, outs))
    record_kernel(name, plan.kernel, plan.in_specs, plan.out_specs, kwargs, c.device_args, tensors, handles, res,
                  tape=(ex, tape) if tape is not None else None)
    return res if c.out_spec is None else res[0]


def _plan(name, rule, specs, static) -> _Compiled:
    key = (name, specs, static)
    c = _plans_fast_get(key) or _PLANS.get(key)
    if c is None:
        stats["plan_misses"] += 1  # (hits are not counted: that would cost a tenth of a tiny op)
        c = _PLANS[key] = _compile(name, rule, specs, static)
    if len(specs) <= 2:
        _LAST[len(specs)][name] = (c, static) + specs
    return c


def plan_of(name, rule, spec, static) -> _Compiled:
    """The cached plan of a one-input op, as ``dispatch`` finds it, without running it (a view is made
    from its plan's output spec; its value is computed when first read: ops/views.py)."""
    last = _last1_get(name)
    if last is not None and last[2] is spec and (last[1] is static or last[1] == static):
        return last[0]
    return _plan(name, rule, (spec,), static)


def _compile(name, rule, specs, static) -> _Compiled:
    plan = make_plan(name, rule, specs, static)
    return _Compiled(plan, plan.in_specs == specs)


def _executable(c: _Compiled, rt, name, tensors):
    """The runtime's executable for ``c``'s plan (the runtime caches it too: several plans share one)."""
    plan = c.plan
    try:
        ex = rt.executable(plan.kernel, plan.in_specs, plan.out_specs)
    except DTorchError:
        raise
    except Exception as exc:
        raise OpError(f"dtorch.{name} cannot run on inputs {describe([t._spec for t in tensors])}: "
                      f"{type(exc).__name__}: {exc}") from exc
    c.executable = (rt if rt.handles_in_process else None, weakref.ref(rt), ex)
    return ex


def make_plan(name, rule, specs, static) -> OpPlan:
    mesh = specs[0].mesh
    for s in specs[1:]:
        if s.mesh != mesh:
            raise OpError(
                f"dtorch.{name}: inputs live on different meshes ({mesh!r} and {s.mesh!r}); "
                "redistribute one onto the other's mesh first, e.g. x.redistribute(device_mesh=y.device_mesh)"
            )
    try:
        return rule(specs, *static)
    except DTorchError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise OpError(f"dtorch.{name} cannot run on inputs {describe(specs)}: {exc}") from exc


def describe(specs) -> str:
    return "; ".join(f"#{n}: {s}" for n, s in enumerate(specs))


def placement_error(name: str, specs, accepted: str) -> OpError:
    return OpError(f"dtorch.{name} does not accept inputs {describe(specs)}; it accepts {accepted}")


# ------------------------------------------------------------------------------------------------
# helpers shared by the op families


def spec_like(spec: DTensorSpec, *, placements=None, shape=None, dtype=None) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements) if placements is not None else spec.placements,
                       tuple(shape) if shape is not None else spec.shape, dtype if dtype is not None else spec.dtype)


def replicated(spec: DTensorSpec) -> DTensorSpec:
    return spec_like(spec, placements=(Replicate(),) * spec.mesh.ndim)


def meta_call(fn: Callable, specs, *args, out_shape=None, **kwargs):
    """Run a torch function on meta tensors of ``specs``' global shapes: output shapes and dtypes, no data.

    Many ops' meta kernels are torch's Python references, and the first call of one imports
    ``torch._dynamo`` (seconds, on the first op after ``import dtorch``). Callers that know the output
    shape pass it as ``out_shape`` ("broadcast": the broadcast of the input shapes, for element-wise ops):
    the dtypes then come from ``fn`` on small real CPU tensors of the inputs' ranks and dtypes, which
    never reaches those kernels. When that run fails or gives other ranks, the meta tensors decide (and
    raise torch's own error).
    """
    if out_shape is not None:
        out = _meta_from_small_call(fn, specs, out_shape, args, kwargs)
        if out is not None:
            return out
    metas = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs]
    return fn(*metas, *args, **kwargs)


def _meta_from_small_call(fn, specs, out_shape, args, kwargs):
    if out_shape == "broadcast":
        out_shape = _broadcast_shape([s.shape for s in specs])
        if out_shape is None:
            return None  # not broadcastable: the op's own error comes from the meta run
    # sizes capped at 2: a handful of elements, yet size-1 dims still broadcast and 2-element
    # reductions (var, std) stay well defined; ones are in every op's domain (division, log, pow)
    smalls = [torch.ones(tuple(min(n, 2) for n in s.shape), dtype=s.dtype) for s in specs]
    try:
        out = fn(*smalls, *args, **kwargs)
    except Exception:  # noqa: BLE001  (the meta run gives the error, with torch's message)
        return None
    outs = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(o, torch.Tensor) and o.ndim == len(out_shape) for o in outs):
        return None
    metas = tuple(torch.empty(out_shape, dtype=o.dtype, device="meta") for o in outs)
    return metas if isinstance(out, tuple) else metas[0]


def to_dtensors(name: str, args, mesh_from=None) -> list:
    """dtorch tensors among ``args``; torch tensors become Replicate dtorch tensors on the same mesh,
    in the first dtorch tensor's Graph (which need not be this thread's default). A torch tensor that
    requires grad (grad mode on) becomes a leaf whose gradient the backward hands to it
    (``autograd.torch_leaves``)."""
    first = next((a for a in args if isinstance(a, Tensor)), None)
    mesh = mesh_from if mesh_from is not None or first is None else first.device_mesh
    out = []
    for a in args:
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, torch.Tensor):
            if first is None:
                t = Tensor(a, device_mesh=mesh)
            else:
                graph = first._graph
                full = as_torch(a, None, graph)
                spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(full.shape), full.dtype)
                t = Tensor._make(spec, graph.runtime.from_global(full, spec), graph)
            out.append(torch_leaf(t, a) if a.requires_grad and _grad_enabled() else t)
        else:
            out.append(a)
    return out


def static_value(v):
    """A hashable stand-in for a static argument (slices, lists) that keeps types apart (1 vs True vs 1.0)."""
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(static_value(x) for x in v)
    if isinstance(v, bool) or isinstance(v, (int, float, complex)):
        return (type(v).__name__, v)
    return v


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


def resolve_torch(path: str) -> Callable:
    """'torch.add' / 'F.gelu' / 'Tensor.to' -> the torch callable (kernels carry names, not functions)."""
    fn = _RESOLVED.get(path)
    if fn is None:
        root, _, rest = path.partition(".")
        obj = {"torch": torch, "F": torch.nn.functional, "Tensor": torch.Tensor, "special": torch.special}[root]
        for part in rest.split("."):
            obj = getattr(obj, part)
        fn = _RESOLVED[path] = obj
    return fn


_RESOLVED = LRU("ops.resolved_torch_functions", 1024)
