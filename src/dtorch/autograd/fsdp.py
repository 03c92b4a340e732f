"""Fully sharded data parallel as a placement: a mesh dim named ``"fsdp"`` shards every parameter (and so
its gradient and optimizer states) along it, and splits the batch. A parameter is sharded on its first
tensor dim that no other mesh dim shards (``fsdp_placements``).

What lives when (FSDP2's schedule, ``reshard_after_forward=True``):

- forward: an *FSDP unit* (a module given to ``dtorch.nn.fully_shard``, else each module with parameters of
  its own) gathers its parameters on the fsdp dim just before its forward, cast to the mixed-precision
  policy's ``param_dtype`` first (``unshard``), and lets the copies go when its forward returns. Once the
  forward order is known, a unit also issues the next unit's gather (prefetch), so an asynchronous backend
  moves it while this unit computes.
- consumers never keep a gathered copy: an op whose input is one saves the sharded parameter and gathers it
  again in its backward (``regather_source``, read by ``dispatched.KernelNode``), frozen parameters too.
  Under a ``param_dtype`` cast they save the forward's cast shard instead (one cast per weight per step, as
  the plain-torch policy; that shard lives until its consumers' backward, half a float32 shard for bf16).
  With ``reshard_after_forward=False`` (ZeRO-2) the copies stay saved until the backward instead.
- backward: the gather's node (``GatherNode``) receives the whole gradient of the gathered copy (every
  consumer's part) and reduces it into the parameter's layout at once, in ``reduce_dtype``: a
  reduce-scatter on fsdp (and an all-reduce on dp under HSDP), then a cast to the parameter's dtype. So a
  full-size gradient lives only from its consumers' backward to that node, as FSDP2 reduce-scatters after
  each layer's backward; ``.grad`` (and the optimizer states) stay sharded and float32.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch

from ..placement import Replicate, Shard
from ..redistribute import relayout
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .engine import grad_spec
from .kernel_entry import run_blocks, wrap
from .mode import backward_count, in_backward, is_grad_enabled, no_grad
from .node import Node, attach, requires_grad

FSDP_DIM = "fsdp"


def fsdp_index(mesh) -> int | None:
    return mesh.dim_name_index(FSDP_DIM) if mesh.dim_names else None


def fsdp_sharded(p) -> bool:
    i = fsdp_index(p._spec.mesh)
    return i is not None and isinstance(p._spec.placements[i], Shard)


def fsdp_placements(mesh, placements: list, ndim: int) -> list:
    """A parameter's placements with its first tensor dim that no other mesh dim shards sharded on the fsdp
    mesh dim (a tp-sharded weight keeps its tp blocks whole: gathering fsdp then moves no tp data). A
    parameter with every dim sharded already (a tp-sharded bias) stays Replicate on fsdp."""
    i = fsdp_index(mesh)
    if i is None:
        return placements
    taken = {p.dim % ndim for p in placements if isinstance(p, Shard)}
    free = [d for d in range(ndim) if d not in taken]
    out = list(placements)
    out[i] = Shard(free[0]) if free else Replicate()
    return out


# -- mixed precision -------------------------------------------------------------------------------

def _dtype_or_none(name: str, value):
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise TypeError(f"MixedPrecisionPolicy({name}=...) takes a floating-point torch dtype (torch.bfloat16, "
                        f"torch.float16, torch.float32) or None, got {value!r}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's ``MixedPrecisionPolicy``: how a unit's parameters are gathered and its gradients reduced.

    ``param_dtype``: the dtype the gathered parameters (and so the forward and backward compute) have; the
    sharded parameters, their gradients and the optimizer states keep theirs (float32 master weights).
    ``reduce_dtype``: the dtype gradients are reduced in (None: ``param_dtype``'s), then cast to the
    parameter's. ``output_dtype``: floating outputs of the unit's forward are cast to it (None: as computed).
    ``cast_forward_inputs``: floating inputs of the unit's forward are cast to ``param_dtype``.
    """
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _dtype_or_none(name, getattr(self, name))


_FULL_PRECISION = MixedPrecisionPolicy()


def _cast_floating(value, dtype):
    """``value`` (a tensor, or a tuple / list / dict of them) with floating dtorch tensors cast to ``dtype``."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.dtype.is_floating_point and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floating(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    return value


# -- gathering one parameter -----------------------------------------------------------------------

# id(gathered copy) -> its sharded parameter, or a ``Derived`` for a value computed from gathered copies
# alone (``w.t()``, ``w.to(dtype)``): an op that consumes it saves that instead and makes the copy again in
# its backward (KernelNode). Entries leave with their copy.
_REGATHER: dict[int, object] = {}


# the recorded ops whose every input is a gathered copy (``register_derived``): any tensor they output is
# made again in the backward, whichever object carries it (a view's value is computed into the view object)
_DERIVED_NODES: "weakref.WeakSet" = weakref.WeakSet()


def regather_source(t):
    """What makes ``t`` again in the backward when ``t`` is a gathered copy not to keep (its sharded
    parameter, or a ``Derived``), else None."""
    if not _REGATHER:
        return None
    source = _REGATHER.get(id(t))
    if source is None and _DERIVED_NODES:
        ag = t._ag
        if ag is not None and ag.grad_fn in _DERIVED_NODES:
            return Derived(ag.grad_fn, ag.output_nr)
    return source


def regathering() -> bool:
    """Some gathered copy is alive (to be gathered again by its consumers' backward)."""
    return bool(_REGATHER)


def _register(copy, source) -> None:
    key = id(copy)
    _REGATHER[key] = source
    weakref.finalize(copy, _REGATHER.pop, key, None)


class Regather:
    """What a consumer of a gathered copy saves instead of it: the copy's source (a sharded parameter or a
    ``Derived``) and layout. ``make()`` gives the copy back in the backward, once for every consumer of one
    gather: the first makes it, the others find it on the gather's node, which lets it go when it runs
    (after every consumer: it is older than all of them)."""

    __slots__ = ("source", "spec", "gather")

    def __init__(self, source, spec, gather):
        self.source, self.spec, self.gather = source, spec, gather

    @property
    def _version(self) -> int:
        return self.source._version

    @property
    def _spec(self):
        return self.spec

    def make(self):
        gather = self.gather
        if gather is not None and gather.copy is not None:
            return gather.copy
        src = self.source
        if isinstance(src, Derived):
            copy = src.remake()
        else:
            copy = relayout(src.to(self.spec.dtype) if src.dtype != self.spec.dtype else src, self.spec)
        if gather is not None:
            gather.copy = copy
        return copy


class Derived:
    """Output ``k`` of a recorded op whose every input is a gathered copy (a view, a cast or any function of
    weights alone): made again in the backward by running that op's kernel on the inputs gathered again,
    rather than kept (it would keep the gathered weight it views)."""

    __slots__ = ("node", "k")
    _version = 0  # (its inputs' versions are the producing node's to check)

    def __init__(self, node, k: int):
        self.node, self.k = node, k

    @property
    def dtype(self):
        return self.node.out_specs[self.k].dtype

    def remake(self):
        node = self.node
        graph = node.graph
        handles = [node._laid_out(i)._h for i in range(len(node.saved))]
        outs = run_blocks(node.op, node.kernel, graph, handles, node.in_specs, node.out_specs, node.kwargs,
                          node.device_args)
        return wrap(node.out_specs[self.k], outs[self.k], graph)


def register_derived(node, outputs) -> None:
    """``node``'s inputs are all gathered copies: its outputs are made again in the backward too."""
    _DERIVED_NODES.add(node)
    for k, out in enumerate(outputs):
        _register(out, Derived(node, k))


class GatherNode(Node):
    """The gather (and cast) of a parameter for use. Its backward reduces the gathered copy's gradient into
    the parameter's own layout in ``reduce_dtype`` (module docstring), then casts it to the parameter's."""

    __slots__ = ("leaf", "reduce_dtype", "copy")
    name = "fsdp_gather"

    def __init__(self, leaf, reduce_dtype):
        super().__init__([leaf], 1)
        self.leaf = leaf
        self.reduce_dtype = reduce_dtype
        self.copy = None  # the copy gathered again for the backward of its consumers (Regather.make)

    def release(self):
        super().release()
        self.copy = None

    def apply(self, grads):
        self.copy = None  # every consumer ran
        g = grads[0]
        spec = self.leaf._spec
        dtype = self.reduce_dtype or g.dtype
        if g.dtype != dtype:
            g = cast_terms(g, dtype)
        graph = g._graph
        with graph.memory_kind("grads") if graph.tracks_memory else contextlib.nullcontext():
            g = relayout(g, grad_spec(DTensorSpec(spec.mesh, spec.placements, spec.shape, dtype)))
            if g.dtype != spec.dtype:
                g = g.to(spec.dtype)
        return [g]


@kernel("fsdp.cast_terms")
def _cast_kernel(x, dtype):
    return x.to(dtype)


def cast_terms(g, dtype):
    """``g`` with each device's block cast to ``dtype``, placements kept: a Partial gradient's terms are cast
    one by one (reduced after, in ``dtype``, as FSDP2 casts to ``reduce_dtype`` before the reduce-scatter),
    where the ``to`` op would reduce them first."""
    spec = g._spec
    out = DTensorSpec(spec.mesh, spec.placements, spec.shape, dtype)
    h, = run_blocks("fsdp.cast_terms", _cast_kernel, g._graph, [g._h], [spec], [out], {"dtype": dtype})
    return wrap(out, h, g._graph)


def unshard(p, param_dtype=None, reduce_dtype=None, reshard_after_forward: bool = True):
    """``p`` cast to ``param_dtype`` (None: as it is) and gathered on its fsdp mesh dim (an all-gather, in
    ``param_dtype``); differentiable. ``p`` itself when neither applies."""
    spec = p._spec
    i = fsdp_index(spec.mesh)
    gather = i is not None and isinstance(spec.placements[i], Shard)
    cast = param_dtype is not None and param_dtype != spec.dtype and spec.dtype.is_floating_point
    if not (gather or cast):
        return p
    graph = p._graph
    with no_grad():
        # the cast shard is what the consumers' backward gathers again when both apply (below): it is saved
        # for the backward, so it counts as an activation; the gathered copy counts as gathered memory
        x = p.to(param_dtype) if cast else p
    shard = x
    with no_grad(), graph.memory_kind("gathered") if graph.tracks_memory else contextlib.nullcontext():
        if gather:
            places = list(spec.placements)
            places[i] = Replicate()
            x = relayout(x, DTensorSpec(spec.mesh, tuple(places), spec.shape, x.dtype))
        out = Tensor._make(x._spec, x._h, graph)  # a plain tensor (relayout keeps the Parameter class)
    if is_grad_enabled() and requires_grad(p):
        attach(GatherNode(p, reduce_dtype or param_dtype), [out])
    if reshard_after_forward:
        # cast and gathered: the backward gathers the forward's cast shard again rather than casting the
        # float32 shard a second time (the plain-torch policy casts each weight once per step; its bf16
        # copy of the whole model outlives the step, this shard of it lives until its consumers' backward)
        _register(out, shard if cast and gather else p)
    return out


# -- FSDP units ------------------------------------------------------------------------------------

_order = threading.local()  # the unit that ran last, the backward pass it ran after, the prefetched gather


class FSDPUnit:
    """The parameters one module gathers together for its forward, and how (``dtorch.nn.fully_shard``).

    ``params``: (owner module, parameter name) of every parameter of the module's subtree that no nested unit
    owns; the parameter object is read from the owner at each gather (``load_state_dict`` keeps objects,
    ``register_parameter`` may replace them). ``next``: the unit whose forward came after this one's in the
    last forward (learned as it runs, outside the backward), whose gather this one issues ahead.
    """

    __slots__ = ("params", "mp", "reshard_after_forward", "ordered", "next", "__weakref__")

    def __init__(self, params, mp: MixedPrecisionPolicy | None = None, reshard_after_forward: bool = True,
                 ordered: bool = True):
        self.params = list(params)
        self.mp = mp or _FULL_PRECISION
        self.reshard_after_forward = bool(reshard_after_forward)
        self.ordered = ordered  # False: a module's own parameters, made at each call (no order, no prefetch)
        self.next = None  # weakref to the next unit

    def gather(self) -> dict:
        """{id(owner): (owner, {name: gathered copy})} for this unit's parameters."""
        mp = self.mp
        # a forward recomputed in the backward (activation checkpointing) is differentiated right away: its
        # consumers keep the copies for that, rather than gathering them once more
        reshard = self.reshard_after_forward and not in_backward()
        out: dict = {}
        for owner, name in self.params:
            p = owner._parameters.get(name)
            if p is None:
                continue
            g = unshard(p, mp.param_dtype, mp.reduce_dtype, reshard)
            out.setdefault(id(owner), (owner, {}))[1][name] = g
        return out

    def run(self, module, args, kwargs):
        """``module.forward(*args, **kwargs)`` with this unit's parameters gathered around it."""
        gathered = self._gathered()
        mp = self.mp
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast_floating(args, mp.param_dtype), _cast_floating(kwargs, mp.param_dtype)
        owners = [owner for owner, _ in gathered.values()]
        for owner, copies in gathered.values():
            owner.__dict__["_unsharded"] = copies
        del gathered  # the owners hold the copies now: they go when the forward returns
        try:
            out = module.forward(*args, **kwargs)
        finally:
            for owner in owners:
                owner.__dict__.pop("_unsharded", None)
        if mp.output_dtype is not None:
            out = _cast_floating(out, mp.output_dtype)
        return out

    def _gathered(self) -> dict:
        """This unit's gathered parameters (prefetched by the unit before, or gathered now); learns the order
        and issues the next unit's gather."""
        if not self.ordered:
            return self.gather()
        state = _order
        pending = getattr(state, "pending", None)
        state.pending = None
        if pending is not None and pending[0]() is self:
            gathered = pending[1]
        else:
            gathered = self.gather()  # (a prefetch for another unit is dropped: the order changed)
        del pending
        # learned in training forwards only: a recomputation in the backward runs in another order, and a
        # prefetch at the end of an inference forward would hold the next call's first weights meanwhile
        if is_grad_enabled() and not in_backward():
            epoch = backward_count()
            last = getattr(state, "last", None)
            if last is not None and last[1] == epoch:
                prev = last[0]()
                if prev is not None and prev is not self and (prev.next is None or prev.next() is not self):
                    prev.next = weakref.ref(self)
            state.last = (weakref.ref(self), epoch)
            nxt = self.next() if self.next is not None else None
            if nxt is not None and nxt is not self:
                state.pending = (self.next, nxt.gather())
        return gathered


def module_unit(module) -> FSDPUnit | None:
    """The unit that gathers for ``module``'s forward: its own (``fully_shard``), else one for its own
    fsdp-sharded parameters (none when an enclosing unit gathered them already), else None."""
    d = module.__dict__
    unit = d.get("_fsdp_unit")
    if unit is not None:
        return unit
    if "_unsharded" in d:
        return None
    own = [(module, n) for n, p in module._parameters.items() if p is not None and fsdp_sharded(p)]
    return FSDPUnit(own, ordered=False) if own else None
