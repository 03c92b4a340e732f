"""The one dispatch path every op takes, and ``local_map``, the kernel entry for code that knows its layouts.

An op call is: specs of the tensor inputs + hashable static arguments -> ``OpPlan`` (computed once by
the op family's rule, then a dict lookup) together with the runtime's ``Executable`` for it ->
redistribute the inputs the plan asks to move (none in the steady state of most code: then the
handles go straight to the executable) -> run the kernel on every device -> wrap the outputs. Rules
see specs only, never data. Scalar operands are not part of the plan key: their values travel to the
kernel as run-time keyword arguments (``dispatch(..., kwargs=)``), only their types shape the plan.

``local_map(name, kernel, inputs, out_specs)`` runs kernels without a rule (DTensor's ``local_map``): an
attention algorithm of several kernels, the KV cache. Its unrecorded half (handles in and out, in-place
writes) is autograd/kernel_entry.py, which autograd's own nodes use too.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

from .._lru import LRU
from ..autograd.dispatched import differentiable, record_kernel, refetch_positions
from ..autograd.kernel_entry import describe, run_blocks
from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..errors import DTorchError, OpError
from ..graph import check_one_graph
from ..redistribute import relayout
from ..runtime.kernels import Kernel
from ..spec import DTensorSpec, interned
from ..tensor import Tensor


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
    diff = differentiable(tensors, plan.in_specs)  # (once: the node takes it as it is)
    some = any(diff)  # (no input needs a gradient: integer inputs, or requires_grad only in name)
    tape = None
    try:
        tracked = None
        if some:
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
    if some:
        record_kernel(name, plan.kernel, plan.in_specs, plan.out_specs, kwargs, c.device_args, tensors, handles, res,
                      diff, tape=(ex, tape) if tape is not None else None)
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
    # (equal output specs of different plans as one object: the next op's plan is found by identity)
    out_specs = tuple([interned(s) if type(s) is DTensorSpec else s for s in plan.out_specs])
    if any(a is not b for a, b in zip(out_specs, plan.out_specs)):
        plan = replace(plan, out_specs=out_specs)
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





def local_map(name: str, kernel: Kernel, inputs, out_specs, kwargs: dict | None = None,
              device_args: dict | None = None, record: bool = True) -> list:
    """Run ``kernel`` on every device's blocks of the dtorch tensors ``inputs`` (taken as they are laid out)
    -> one dtorch tensor per spec of ``out_specs``: the kernel entry for code that knows its layouts (no rule,
    no plan). Recorded for autograd as op ``name`` when an input requires grad (its VJP: torch's autograd on
    the same blocks, like a dispatched op's), unless ``record`` is False: the caller's own node covers the
    kernel. ``kwargs``: the kernel's keyword arguments; ``device_args``: per-device values (arrays over the
    mesh shape). Lay the inputs out first (``relayout``) when the kernel needs another layout."""
    graph = inputs[0]._graph
    for x in inputs:
        if x._graph is not graph:
            check_one_graph(name, inputs)
    handles = [x._h for x in inputs]
    in_specs = [x._spec for x in inputs]
    kwargs = kwargs or {}
    outs = [_make(s, h, graph) for s, h in zip(out_specs, run_blocks(name, kernel, graph, handles, in_specs,
                                                                        out_specs, kwargs, device_args))]
    if record and _grad_enabled() and any(x._ag is not None for x in inputs):
        diff = differentiable(inputs, in_specs)
        if any(diff):
            record_kernel(name, kernel, in_specs, out_specs, kwargs, device_args, inputs, handles, outs, diff)
    return outs
