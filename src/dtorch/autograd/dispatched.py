"""The backward of an op that ran one kernel on every device's blocks (the one dispatch path).

The forward laid its inputs out as the plan asked, then ran the kernel on each device's blocks. Its
vector-Jacobian product is torch's own autograd on the same blocks (``runtime.kernels.vjp_kernel``):
each device differentiates its local computation. What the global gradient is made of follows from
the placements, per mesh dim (the dual layout):

    output S(d)          cotangent laid out S(d)     input S(d) -> grad S(d)
    output P(sum|avg)    cotangent laid out R        input R    -> grad P(sum|avg) (each device's term)
    output R             cotangent R or P(sum) as it comes; inputs R -> grad R or P(sum) likewise
    input P(sum|avg)     -> grad R (every device's term saw the whole cotangent)
    output P(max|min)    cotangent R, masked to the devices whose local extreme is the global one and
                         split evenly between them (exactly torch's tie split when each holds as many
                         tied elements; a replicated operand made partial ties on every device)
    input P(max|min)     -> grad P(sum), only where the output keeps that partial (amax of a P(max) input):
                            the masked cotangent reaches the terms that hold the extreme

The gradient of a redistribution is the gradient itself (a redistribution keeps the global value):
the gradient of a laid-out input is the gradient of the input as it was, in whatever layout the
math gave it (all_gather in the forward meets a P(sum) gradient: the reduce-scatter to the input's
own layout happens when it is stored).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from .._lru import LRU
from ..errors import DTorchError, OpError
from ..placement import Partial, Replicate, Shard
from ..redistribute import relayout
from ..redistribute.executor import record_only
from ..redistribute.planner import plan_redistribute
from ..runtime.kernels import kernel, vjp_kernel
from ..spec import DTensorSpec, interned
from ..tensor import Tensor
from .engine import grad_spec
from .kernel_entry import run_blocks, wrap
from .fsdp import GatherNode, Regather, regather_source, register_derived
from .fsdp import regathering as _REGATHER_ANY
from .node import Node, attach, requires_grad

_R = Replicate()
_P = Partial("sum")


def _floating(dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


# kernels whose backward needs only their inputs' shapes (views: reshape, permute, index, ...), filled by the
# op families. A node keeps a handle on the input's blocks as they were, without a version check, as torch's
# views save nothing: writing the input afterwards (through the view itself, ops/views.py) is no error.
SHAPE_ONLY_KERNELS: set = set()
# ops whose torch backward uses their result (derivatives.yaml's ``result``): torch refuses the backward once
# the result was written in place (``a = x.sigmoid(); a[0].mul_(2); a.sum().backward()``), and so does a node of
# theirs here, though its local VJP recomputes the forward from the inputs. (tests/test_views.py checks the
# list against torch; max, min and median save it only in their whole-tensor form and are left out.)
SAVES_RESULT = frozenset({"amax", "amin", "copysign", "cumprod", "exp", "exp2", "expm1", "log_softmax", "logsumexp",
                          "norm", "prod", "reciprocal", "relu", "rsqrt", "sigmoid", "softmax", "sqrt", "std", "tan",
                          "tanh"})


class NoGradientError(OpError, RuntimeError):
    """The backward reached an op whose local computation torch cannot differentiate (RuntimeError, like
    torch's "derivative for ... is not implemented")."""


class KernelNode(Node):
    """One kernel on every device. Keeps what its backward needs: the runtime's local autograd graph of the
    forward (with what torch saved), or the laid-out inputs to recompute the local forward from; an
    fsdp-gathered input as its shard (gathered again)."""

    # regathers: some input is saved in another layout or dtype, laid out again in the backward (``_laid_out``)
    __slots__ = ("op", "kernel", "in_specs", "out_specs", "kwargs", "device_args", "saved", "diff", "graph",
                 "outputs_saved", "tape", "results", "kept", "memory", "prefetched", "regathers")

    def __init__(self, op, kern, in_specs, out_specs, kwargs, device_args, inputs, handles, outputs, diff, tape=None):
        super().__init__([t for t, d in zip(inputs, diff) if d], len(out_specs))
        self.op = op
        self.kernel = kern
        self.in_specs = tuple(in_specs)
        self.out_specs = tuple(out_specs)
        self.kwargs = kwargs
        self.device_args = device_args
        self.diff = diff
        self.graph = graph = inputs[0]._graph
        self.memory = self.prefetched = self.kept = None
        saved = []
        regathered = relaid = 0
        for t, s, h in zip(inputs, in_specs, handles):
            kind = _saved_kind(kern, t, h)
            if kind == "regather":
                # an fsdp-gathered parameter (autograd/fsdp.py): keep its shard, gather it again in the backward
                gather = t._ag.grad_fn if t._ag is not None and isinstance(t._ag.grad_fn, GatherNode) else None
                again = Regather(regather_source(t), t._spec, gather)
                saved.append((again, again._version, s))
                regathered += 1
            elif kind == "leaf":
                # a leaf (a parameter) laid out anew: lay it out again in the backward rather than keep the copy
                saved.append((t, t._version, s))
                relaid += 1
            elif kind == "tensor":
                saved.append((t, t._version, None))
            else:
                saved.append((type(t)._make(s, h, t._graph), 0, None))
        self.saved = saved
        self.regathers = regathers = bool(regathered or relaid)
        if regathered == len(inputs):  # a function of gathered weights alone (w.t()): made again, not kept
            register_derived(self, outputs)
        # (executable, tape): the runtime kept each device's local autograd graph from the forward
        # (Executable.run_tracked), so the backward differentiates it instead of recomputing the forward. An
        # input laid out again in the backward (an fsdp-gathered weight) was saved by that graph as a place
        # to put it then (``refetch_positions``), so the graph keeps no gathered copy.
        # (a parameter laid out anew keeps the old way: the backward recomputes from it laid out again)
        self.tape = tape if tape is not None and not (regathers and any(
            layout is not None and not (isinstance(t, Regather) and keeps_graph_of_gathered(kern))
            for t, _, layout in saved)) else None
        if self.tape is not None:
            # torch's graph of the local computation keeps what its derivative needs, as torch would: an input
            # that graph does not hold is not kept either, only a weak reference to tell an in-place write
            # while it lives (its version). While the memory is measured, the node keeps the handles of the
            # outputs that graph saved, so they stay counted while it holds them. (An input made again keeps
            # what makes it.)
            ex, local = self.tape
            released = [n for n in ex.tape_released(local) if saved[n][2] is None]
            for n in released:
                t, version, layout = saved[n]
                saved[n] = (weakref.ref(t), version, layout)
            if graph.tracks_memory:  # and what it saves besides the inputs and outputs, by the bytes
                self.kept = [outputs[k]._h for k in ex.tape_saved_outputs(local)]
                self.memory = graph.count_memory(self, self.out_specs[0].mesh, ex.tape_bytes(local))
        # outputs that are Partial(max|min) keep their local extremes: the backward masks the cotangent
        self.outputs_saved = {k: type(o)._make(o._spec, o._h, o._graph) for k, o in enumerate(outputs)
                              if any(isinstance(p, Partial) and p.reduce_op in ("max", "min")
                                     for p in o._spec.placements)}
        # (weakly: an output that died cannot have been written) each output and its version, for SAVES_RESULT
        self.results = [(weakref.ref(o), o._version) for o in outputs] if op in SAVES_RESULT else None

    def _laid_out(self, n: int):
        """Saved input ``n`` as the kernel takes it: a parameter saved in another layout (an fsdp shard) or
        dtype (mixed precision) is cast and gathered again."""
        t, _, layout = self.saved[n]
        if layout is None:
            return t
        graph = self.graph
        with graph.memory_kind("gathered") if graph.tracks_memory else contextlib.nullcontext():
            if isinstance(t, Regather):
                t = t.make()
            if t.dtype != layout.dtype:
                t = t.to(layout.dtype)
            return relayout(t, layout)

    def prefetch(self) -> None:
        """Gather the inputs saved as shards now, ahead of ``apply`` (the engine calls it one node early, so an
        asynchronous backend moves them while the node before computes)."""
        if self.saved is not None and self.prefetched is None:
            self.prefetched = {n: self._laid_out(n) for n, (_, _, layout) in enumerate(self.saved)
                               if layout is not None}

    @property
    def name(self):
        return self.op

    def _summed_gathered(self, grad_specs) -> tuple:
        """Stacked grids compute every device's gradient term of an fsdp-gathered weight in one GEMM, summed:
        kept so (Replicate where it would be Partial) rather than spread into one full-size term per device.
        The reduction those terms would get at the weight's ``GatherNode`` (a reduce-scatter on fsdp, an
        all-reduce on dp, in its reduce dtype) is recorded in CommLog here, as the devices run it; the node
        then only cuts its shard. (grad specs, which are summed)."""

        out, summed = [], []
        for spec, (producer, _, _) in zip(grad_specs, self.edges):
            if isinstance(producer, GatherNode) and _P in spec.placements:
                dtype = producer.reduce_dtype or spec.dtype
                target = grad_spec(producer.leaf._spec)
                record_only(plan_redistribute(DTensorSpec(spec.mesh, spec.placements, spec.shape, dtype),
                                              DTensorSpec(target.mesh, target.placements, target.shape, dtype)))
                spec = DTensorSpec(spec.mesh, tuple(_R if p == _P else p for p in spec.placements), spec.shape,
                                   spec.dtype)
                summed.append(True)
            else:
                summed.append(False)
            out.append(spec)
        return tuple(out), tuple(summed)

    def release(self):
        super().release()
        self.saved = None
        self.regathers = False
        self.outputs_saved = None
        self.tape = None
        self.results = None
        self.kept = None
        self.prefetched = None
        self.graph.uncount_memory(self.memory)
        self.memory = None

    def apply(self, grads):
        for k, (ref, version) in enumerate(self.results or ()):
            out = ref()
            if out is not None and out._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: output {k} of dtorch.{self.op} ({out._spec}) is at version {out._version}; expected "
                    f"version {version} instead. Write into a copy (y = x.{self.op}().clone()) instead, or run the "
                    "in-place op after the backward.")
        handles, specs = [], []
        prefetched, self.prefetched = self.prefetched or {}, None
        tracked = self.tape is not None
        refetched = {}
        sig = (self.in_specs, self.diff, self.out_specs, tuple(None if leaf is None else leaf._spec
                                                               for _, _, leaf in self.edges))
        layout = _LAYOUTS_get(sig) or _NodeLayout.of(sig)
        for n, ((t, version, saved_layout), s) in enumerate(zip(self.saved, self.in_specs)):
            if type(t) is weakref.ref:
                t = t()  # (an input the local graph did not keep: gone since, it cannot have been written)
            if t is not None and t._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: input {n} of dtorch.{self.op} ({t._spec}) is at version {t._version}; expected "
                    f"version {version} instead. Write a copy (x.clone()) instead, or run the in-place op after "
                    "the backward.")
            if saved_layout is not None:
                t = prefetched[n] if n in prefetched else self._laid_out(n)
                if tracked:
                    refetched[n] = t._h
            if n in layout.no_grad_through:
                raise OpError(f"dtorch.{self.op}: no gradient through a Partial(max|min) input ({s}); "
                              "redistribute it to Replicate before the op")
            if not tracked:
                handles.append(t._h)
            specs.append(s)
        has_ct, ct_specs = [], []
        cts = [None if g is None or not _floating(spec.dtype) else g for spec, g in zip(self.out_specs, grads)]
        gs = tuple([None if g is None else g._spec for g in cts])
        targets = layout.cotangents.get(gs) or layout.targets(gs)
        for k, (spec, g) in enumerate(zip(self.out_specs, cts)):
            if g is None:
                has_ct.append(False)
                continue
            if g.dtype != spec.dtype:
                g = g.to(spec.dtype)
            g = relayout(g, targets[k])
            if k in self.outputs_saved:
                g = _mask_extreme_cotangent(self.outputs_saved[k], g)
            has_ct.append(True)
            handles.append(g._h)
            ct_specs.append(g._spec)
        if not ct_specs:
            return [None] * len(self.edges)
        key = (tuple(has_ct), tuple(ct_specs), tracked)
        ct_specs, has_ct, grad_specs, folds = layout.gradients.get(key) or layout.gradients_for(key)
        rt = self.graph.runtime
        try:
            if self.tape is not None:
                ex, tape = self.tape
                for plan in folds:  # (the reductions the kept graph's GEMM folded in: gradients_for)
                    record_only(plan)
                if refetched:  # the gathered weights' gradients come summed over the devices (one GEMM)
                    grad_specs = self._summed_gathered(grad_specs)[0]
                    outs = ex.vjp_tracked(tape, handles, ct_specs, has_ct, grad_specs, refetched)
                else:
                    outs = ex.vjp_tracked(tape, handles, ct_specs, has_ct, grad_specs)
            else:
                vjp = (self.diff, has_ct)
                ex = rt.executable(vjp_kernel(self.kernel), tuple(specs) + ct_specs, grad_specs)
                if ex.sums_over_devices and self.regathers:
                    grad_specs, summed = self._summed_gathered(grad_specs)
                    if any(summed):
                        vjp += (summed,)
                        ex = rt.executable(vjp_kernel(self.kernel), tuple(specs) + ct_specs, grad_specs)
                outs = ex.run(handles, {**self.kwargs, "vjp": vjp}, self.device_args)
        except DTorchError:  # (a backend's fault, a lost worker, too: not a missing derivative)
            raise
        except Exception as exc:  # torch has no derivative for the local computation (floor_divide), ...
            raise NoGradientError(f"dtorch.{self.op} has no gradient here: differentiating its kernel "
                          f"({self.kernel.name}) on the local blocks failed with {type(exc).__name__}: {exc}. "
                          "Compute it under dtorch.no_grad() or on inputs that do not require grad") from exc
        graph = self.graph
        return [_make(s, h, graph) for s, h in zip(grad_specs, outs)]


# The layouts of a node's backward are functions of specs alone, the same for the node of one op in every step:
# computed once and kept here, by the node's signature (input specs, which inputs are differentiable, output
# specs, the specs of the parameters its edges lead to), then by the specs its cotangents come in and are laid
# out in. Returning the same spec objects every step lets the caches keyed by them (the runtime's vjp plans, the
# dispatch of the gradients' adds) hit by identity.
_LAYOUTS = LRU("autograd.backward_layouts", 4096)
_LAYOUTS_get = _LAYOUTS.fast_get
_make = Tensor._make


class _NodeLayout:
    """The backward layouts of the nodes of one signature."""

    __slots__ = ("sig", "no_grad_through", "reduce_partial", "cotangents", "gradients")
    _MAX = 16  # entries of ``cotangents`` / ``gradients`` (one or two in a training loop): cleared beyond

    def __init__(self, sig):
        in_specs, diff, out_specs, leaf_specs = self.sig = sig
        # positions of differentiable Partial(max|min) inputs that no output keeps partial
        self.no_grad_through = frozenset(n for n, (s, d) in enumerate(zip(in_specs, diff))
                                         if d and not _extreme_input_ok(s, out_specs))
        # mesh dims on which a parameter is among the replicated inputs (``cotangent_specs``)
        reduce_partial = set()
        for leaf, in_spec in zip(leaf_specs, [s for s, d in zip(in_specs, diff) if d]):
            if leaf is not None:
                reduce_partial.update(m for m, p in enumerate(in_spec.placements) if p == _R)
        self.reduce_partial = frozenset(reduce_partial)
        self.cotangents: dict = {}  # the specs the cotangents come in -> the specs they are laid out in
        self.gradients: dict = {}  # (has_ct, the cotangents' specs, tracked) -> ``gradients_for``

    @staticmethod
    def of(sig) -> "_NodeLayout":
        layout = _LAYOUTS.get(sig)  # (in the older generation)
        if layout is None:
            layout = _LAYOUTS[sig] = _NodeLayout(sig)
        return layout

    def targets(self, gs) -> list:
        if len(self.cotangents) >= self._MAX:
            self.cotangents.clear()
        # (a cotangent already laid out as needed keeps its spec object: relayout finds it by identity)
        targets = self.cotangents[gs] = [g if g is None or t == g else interned(t)
                                         for t, g in zip(cotangent_specs(self.sig[2], gs, self.reduce_partial), gs)]
        return targets

    def gradients_for(self, key) -> tuple:
        """(cotangent specs, which outputs have one, the gradients' specs, the redistributions folded into the
        GEMM, to record): with the local graph kept (one torch autograd call over every simulated device), the
        gradient of a parameter replicated on a mesh dim comes out summed over that dim's devices (one GEMM
        over all their rows): its reduction, which storing it in ``.grad`` would run next, is already done.
        Those gradients are laid out Replicate there, and the all-reduce the devices perform is recorded in
        CommLog as the executor would record it (``executor.record_only``)."""
        in_specs, diff, out_specs, leaf_specs = self.sig
        has_ct, ct_specs, tracked = key
        grad_specs = input_grad_specs(in_specs, diff, out_specs, has_ct, ct_specs)
        folds = []
        if tracked:
            out = []
            for spec, leaf in zip(grad_specs, leaf_specs):
                if leaf is not None and any(p == _P and q == _R for p, q in zip(spec.placements, leaf.placements)):
                    folded = DTensorSpec(spec.mesh, tuple(_R if p == _P and q == _R else p
                                                          for p, q in zip(spec.placements, leaf.placements)),
                                         spec.shape, spec.dtype)
                    folds.append(plan_redistribute(spec, folded))
                    spec = folded
                out.append(spec)
            grad_specs = tuple(out)
        grad_specs = tuple([interned(s) for s in grad_specs])  # (the gradients' next ops find their plans by identity)
        if len(self.gradients) >= self._MAX:
            self.gradients.clear()
        entry = self.gradients[key] = (ct_specs, has_ct, grad_specs, tuple(folds))
        return entry


def _extreme_input_ok(s: DTensorSpec, out_specs) -> bool:
    """A Partial(max|min) input is differentiable where every output keeps that partial (amax of a
    Partial(max) term): the masked cotangent reaches the devices whose term holds the extreme, so each
    device's gradient is its term's share (module docstring: the input's gradient is Partial(sum) there)."""
    return all(not (isinstance(p, Partial) and p.reduce_op in ("max", "min"))
               or all(o.placements[m] == p for o in out_specs) for m, p in enumerate(s.placements))


def cotangent_specs(outs, gs, reduce_partial=()) -> list:
    """The layout the cotangent of each output (layouts ``outs``; ``gs``: the layouts the cotangents come
    in, None where an output has none) is given to the local VJP in. The devices' gradient terms for a
    replicated input are summed over a mesh dim as soon as one output's are (a sharded or partial
    output, a replicated one whose cotangent is a sum of terms): there, a replicated output's cotangent
    must be a sum of terms too, else every device would add the whole of it.

    ``reduce_partial``: mesh dims where a parameter enters replicated; there a cotangent that is a sum of
    terms is reduced first when every output is replicated, so the parameter's gradient comes out whole
    (one reduction of the activation gradient, as Megatron does for a norm's weight under tp, instead of
    one more per parameter)."""
    live = [(o, g) for o, g in zip(outs, gs) if g is not None]
    mesh = outs[0].mesh
    summed = [any(not isinstance(o.placements[m], Replicate) for o, g in live)
              or (m not in reduce_partial and any(g.placements[m] == _P for o, g in live))
              for m in range(mesh.ndim)]
    specs = []
    for out, g in zip(outs, gs):
        if g is None:
            specs.append(None)
            continue
        places = []
        for m, (p, q) in enumerate(zip(out.placements, g.placements)):
            if isinstance(p, Shard):
                places.append(p)
            elif isinstance(p, Partial):
                places.append(_R)
            else:  # a replicated output: any cotangent summing to the gradient works (the VJP is linear in it)
                places.append(_P if summed[m] else _R)
        specs.append(DTensorSpec(out.mesh, tuple(places), out.shape, out.dtype))
    return specs


def input_grad_specs(in_specs, diff, out_specs, has_ct, ct_specs) -> tuple:
    """The layout of each differentiable input's gradient as the local VJPs leave it (module docstring)."""
    outs = [s for s, h in zip(out_specs, has_ct) if h]
    mesh = in_specs[0].mesh
    replicated_grad = []  # per mesh dim: what a Replicate input's gradient is
    for m in range(mesh.ndim):
        kinds = set()
        for o, c in zip(outs, ct_specs):
            p = o.placements[m]
            if isinstance(p, Shard):
                kinds.add("sum")
            elif isinstance(p, Partial):
                kinds.add("avg" if p.reduce_op == "avg" else "sum")
            elif c.placements[m] == _P:
                kinds.add("sum")
        if not kinds:
            replicated_grad.append(_R)
        elif kinds == {"avg"}:
            replicated_grad.append(Partial("avg"))
        elif "avg" in kinds:
            raise OpError("no gradient for an op with both Partial('avg') and other partial outputs on one mesh dim")
        else:
            replicated_grad.append(_P)
    specs = []
    for s, d in zip(in_specs, diff):
        if not d:
            continue
        places = []
        for m, p in enumerate(s.placements):
            if isinstance(p, Shard):
                places.append(p)
            elif isinstance(p, Partial):  # every term saw the whole cotangent; an extreme's: its masked share
                places.append(_P if p.reduce_op in ("max", "min") else _R)
            else:
                places.append(replicated_grad[m])
        specs.append(DTensorSpec(s.mesh, tuple(places), s.shape, s.dtype))
    return tuple(specs)


def _extreme(p) -> bool:
    return isinstance(p, Partial) and p.reduce_op in ("max", "min")


@kernel("autograd.holds_extreme")
def _holds_kernel(local, extreme):
    return (local == extreme).to(local.dtype)


@kernel("autograd.mask_extreme_cotangent")
def _mask_kernel(local, extreme, g, holders):
    return torch.where(local == extreme, g / holders, torch.zeros((), dtype=g.dtype, device=g.device))


def _mask_extreme_cotangent(out, g):
    """The cotangent of a Partial(max|min) output: each device's term gets the cotangent only where its
    local extreme is the global one, split evenly between the devices that hold it (a replicated operand
    made partial holds it on every device; ties split like torch's amax does).

    Several partial mesh dims reduce outer first (redistribute/planner.py): for an extreme on mesh dim m,
    the value each device competes with is the tensor with the partial dims before m reduced, and the
    extreme is that tensor reduced over m too."""
    spec = out._spec
    mesh = spec.mesh
    graph = out._graph

    def relabel(upto, m=None, place=None):  # partial dims before ``upto`` reduced; mesh dim m -> place
        return DTensorSpec(mesh, tuple(place if k == m else _R if isinstance(p, Partial) and k < upto else p
                                       for k, p in enumerate(spec.placements)), spec.shape, spec.dtype)

    masked = DTensorSpec(mesh, tuple(_P if _extreme(p) else q for p, q in zip(spec.placements, g._spec.placements)),
                         spec.shape, g.dtype)
    for m, p in enumerate(spec.placements):
        if not _extreme(p):
            continue
        pre, post = relayout(out, relabel(m)), relayout(out, relabel(m + 1))
        h = run_blocks("mask_extreme_cotangent", _holds_kernel, graph, [pre._h, post._h], [pre._spec, post._spec],
                       [relabel(m, m, _P)])
        holders = relayout(wrap(relabel(m, m, _P), h[0], graph), relabel(m, m, _R))  # how many
        h = run_blocks("mask_extreme_cotangent", _mask_kernel, graph, [pre._h, post._h, g._h, holders._h],
                       [pre._spec, post._spec, g._spec, holders._spec], [masked])
        g = wrap(masked, h[0], graph)
    return g


# Keep the local graph of an op on an fsdp-gathered weight, with a place for the weight gathered again
# (``refetch_positions``, ``runtime/tapes.Refetch``) instead of recomputing its local forward in the backward: on
# the issue-22 Llama it takes the fsdp8 step from 1.33-1.51x to 1.20x Hugging Face's time at the same process RSS
# (docs/benchmarks.md: the kept graphs once held 49 MiB more, the GEMM results their outputs are views of, which
# ``tapes.drop_output_values`` now lets go, and the rms_norms' normalised activations, see below).
KEEP_GRAPHS_OF_GATHERED = True
# The kernels whose local graph is kept on gathered weights: the GEMMs, whose graph saves only their inputs (the
# activation the node would keep anyway, and a place for the weight), and whose recomputation is the costly part
# of the backward. Others (rms_norm: its graph saves the normalised activation, one more activation-sized tensor
# per norm) recompute their cheap forward from the inputs instead.
KEEP_GATHERED_GRAPH_KERNELS = frozenset({"linear", "matmul"})


def keeps_graph_of_gathered(kern) -> bool:
    """Whether a node of ``kern`` keeps its local graph over fsdp-gathered inputs (``refetch_positions``)."""
    return KEEP_GRAPHS_OF_GATHERED and kern.name in KEEP_GATHERED_GRAPH_KERNELS


def _saved_kind(kern, t, h) -> str:
    """How a node saves input ``t`` (``h``: the handle the kernel took): ``"regather"`` (an fsdp-gathered
    copy: its shard, gathered again), ``"leaf"`` (a parameter laid out anew: laid out again), ``"tensor"`` (the
    input itself), ``"handle"`` (the laid-out handle)."""
    if regather_source(t) is not None:
        return "regather"
    if kern.name in SHAPE_ONLY_KERNELS:
        return "handle"
    if h is t._h:
        return "tensor"
    if t._ag is not None and t._ag.grad_fn is None:
        return "leaf"
    return "handle"


def refetch_positions(kern, inputs, handles) -> tuple:
    """The inputs a node of ``kern`` gathers again in its backward rather than keep (fsdp-gathered weights): a
    runtime keeping the local graph (``run_tracked``) saves places for them."""
    if not keeps_graph_of_gathered(kern) or not _REGATHER_ANY():
        return ()
    return tuple(n for n, t in enumerate(inputs) if regather_source(t) is not None)


def differentiable(inputs, in_specs) -> tuple:
    """Which inputs of a kernel get a gradient: floating-point ones that require grad."""
    return tuple(t._ag is not None and requires_grad(t) and _floating(s.dtype) for t, s in zip(inputs, in_specs))


def record_kernel(op, kern, in_specs, out_specs, kwargs, device_args, inputs, handles, outputs, diff,
                  tape=None) -> None:
    """Record one kernel run (``outputs``: the dtorch tensors it made); ``diff``: ``differentiable(inputs,
    in_specs)``, computed once by the caller (some True); ``tape``: (executable, its ``run_tracked`` tape) when
    the runtime kept the local autograd graph."""
    node = KernelNode(op, kern, in_specs, out_specs, kwargs, device_args, inputs, handles, outputs, diff, tape)
    attach(node, outputs)


class IdentityNode(Node):
    """The gradient passes as it is (clone, a redistribution on one mesh)."""

    __slots__ = ("op",)

    def __init__(self, op, t):
        super().__init__([t], 1)
        self.op = op

    @property
    def name(self):
        return self.op

    def apply(self, grads):
        return [grads[0]]


class RebindNode(Node):
    """An in-place write whose value carries no derivative from the op's kernel: ``x.copy_(src)`` and
    ``x.fill_(v)`` (the gradient passes to ``src`` only), a comparison written into a float tensor. Like
    torch, the result stays linked to every input; inputs other than ``through`` get zeros."""

    __slots__ = ("op", "specs", "through")

    def __init__(self, op, inputs, through):
        super().__init__(inputs, 1)
        self.op = op
        self.specs = [t._spec for t in inputs]
        self.through = through

    @property
    def name(self):
        return self.op

    def apply(self, grads):
        g = grads[0]
        out = []
        for n, spec in enumerate(self.specs):
            if n == self.through:
                out.append(g if g.dtype == spec.dtype else g.to(spec.dtype))
            else:
                spec = DTensorSpec(spec.mesh, (_R,) * spec.mesh.ndim, spec.shape, spec.dtype)
                full = torch.zeros(spec.shape, dtype=spec.dtype)
                out.append(type(g)._make(spec, g._graph.runtime.from_global(full, spec), g._graph))
        return out


def record_rebind(op, inputs, result, through=None) -> None:
    """Link ``result`` (made without recording) to those of ``inputs`` that require grad (``RebindNode``);
    ``through``: the index of the input whose gradient is the result's, if any."""
    keep = [n for n, t in enumerate(inputs) if requires_grad(t) and _floating(t.dtype)]
    if not keep:
        return
    node = RebindNode(op, [inputs[n] for n in keep], keep.index(through) if through in keep else None)
    attach(node, [result])
