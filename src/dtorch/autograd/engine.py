"""The backward pass: walk the recorded nodes in reverse and run each one's vector-Jacobian product.

Every gradient is a dtorch tensor and every step of the walk is ordinary dtorch ops (run with grad
mode off), so the backward runs on every backend, its placements come from the op rules, and its
communication shows in CommLog. Gradients for one tensor from several consumers are added (any
placements: the add's rule lays them out); a leaf's ``.grad`` gets the leaf's own mesh and placements
(a Partial leaf's gradient is Replicate), so a Replicate weight met by batch-sharded activations is
all-reduced here, once per backward: data-parallel gradient reduction without DDP code.
"""
from __future__ import annotations

import sys
import threading

import torch

from .._collector import collector_paused
from ..errors import OpError
from ..placement import Partial, Replicate
from ..redistribute import relayout
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .kernel_entry import write_local
from .mode import backward_pass, set_grad_enabled
from .node import Node, requires_grad
from .torch_leaves import TorchLeafMeta, push_to_torch, torch_grads


def _add(a, b):
    if a is None:
        return b
    return a + b


def grad_spec(spec: DTensorSpec) -> DTensorSpec:
    """The layout a stored gradient takes: the tensor's own, with Partial mesh dims reduced."""
    if not any(isinstance(p, Partial) for p in spec.placements):
        return spec
    return DTensorSpec(spec.mesh, tuple(Replicate() if isinstance(p, Partial) else p for p in spec.placements),
                       spec.shape, spec.dtype)


def as_grad_of(g, spec: DTensorSpec):
    """``g`` in the dtype and layout a gradient of a tensor of ``spec`` is stored with."""
    if g.dtype != spec.dtype:
        g = g.to(spec.dtype)
    return relayout(g, grad_spec(spec))


_walks = threading.local()  # .leaves: the leaf gradients of the walks under way on this thread, innermost last


@collector_paused
def run_backward(outputs, grad_outputs, retain_graph: bool = False, inputs=None, allow_unused: bool = False):
    """Backpropagate from ``outputs``. With ``inputs``: return their gradients (``autograd.grad``);
    without: accumulate into the ``.grad`` of every leaf reached (``backward``)."""
    roots = _roots(outputs, grad_outputs)
    wanted = None
    torch_inputs = []  # torch tensors among ``inputs``: reached through dtorch leaves copied from torch tensors
    if inputs is not None:
        wanted = {}
        for t in inputs:
            if not (t.requires_grad if isinstance(t, torch.Tensor) else requires_grad(t)):
                raise RuntimeError("One of the differentiated Tensors does not require grad")
            if isinstance(t, torch.Tensor):
                torch_inputs.append(t)
            else:
                wanted[id(t)] = t
    with set_grad_enabled(False):
        leaves, captured = _walk(roots, retain_graph, wanted)
        if wanted is not None:
            from_torch = {}
            if torch_inputs:
                got = torch_grads(_store(leaves, only_torch=True), torch_inputs, retain_graph)
                from_torch = {id(t): g for t, g in zip(torch_inputs, got)}
            result = []
            for t in inputs:
                if isinstance(t, torch.Tensor):
                    g = from_torch[id(t)]
                    if g is None and not allow_unused:
                        raise RuntimeError("One of the differentiated Tensors appears to not have been used in the "
                                           "graph. Set allow_unused=True if this is the desired behavior.")
                    result.append(g)
                    continue
                g = captured.get(id(t))
                if g is None and id(t) in leaves:
                    g = _run_hooks(t._ag, as_grad_of(leaves[id(t)][1], t._spec))
                if g is None and not allow_unused:
                    raise RuntimeError("One of the differentiated Tensors appears to not have been used in the "
                                       "graph. Set allow_unused=True if this is the desired behavior.")
                result.append(None if g is None else as_grad_of(g, t._spec))
            return tuple(result)
        torch_sources = _store(leaves)
    if torch_sources:
        push_to_torch(torch_sources, retain_graph)
    return None


def backward_within(outputs, grad_outputs, inputs) -> list:
    """A backward run by a node's own backward (a checkpointed block's recomputed graph): the gradients of
    ``inputs`` (leaves of that graph, None where none came). Every other leaf's gradient joins the enclosing
    backward's, which stores it (summed with the leaf's other uses) or returns it (``autograd.grad``)."""
    stack = getattr(_walks, "leaves", None)
    enclosing = stack[-1] if stack else None
    with set_grad_enabled(False):
        leaves, _ = _walk(_roots(outputs, grad_outputs), False, None)
        out = [None] * len(inputs)
        position = {id(t): n for n, t in enumerate(inputs)}
        rest = {}
        for key, (leaf, g) in leaves.items():
            if key in position:
                out[position[key]] = g
            elif enclosing is not None:  # laid out as stored now: a parameter's Partial terms are not kept
                _to_leaf(enclosing, leaf, as_grad_of(g, leaf._spec))
            else:
                _to_leaf(rest, leaf, g)
        torch_sources = _store(rest)
    if torch_sources:
        push_to_torch(torch_sources, False)
    return out


def _roots(outputs, grad_outputs) -> list:
    roots = []
    for n, (out, g) in enumerate(zip(outputs, grad_outputs)):
        if not requires_grad(out):
            raise RuntimeError(f"element {n} of tensors does not require grad and does not have a grad_fn")
        if g is None:
            if out.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs")
            g = filled_like(out, 1.0)
        else:
            if tuple(g.shape) != tuple(out.shape):
                raise RuntimeError(f"Mismatch in shape: grad_output[{n}] has a shape of {tuple(g.shape)} and "
                                   f"output[{n}] has a shape of {tuple(out.shape)}.")
            g = _as_dtensor(g, out)
        roots.append((out, g))
    return roots


def _walk(roots, retain_graph: bool, wanted) -> tuple[dict, dict]:
    """Run the nodes reachable from ``roots`` in reverse order; (leaf id -> (leaf, its gradient), id of a
    non-leaf tensor of ``wanted`` -> its gradient)."""
    # (node, output_nr) -> gradient so far; leaf id -> (leaf, gradient so far)
    buffers: dict = {}
    leaves: dict = {}
    captured: dict = {}
    for out, g in roots:
        ag = out._ag
        if ag.grad_fn is None:
            _to_leaf(leaves, out, g)
        else:
            key = (ag.grad_fn, ag.output_nr)
            buffers[key] = _add(buffers.get(key), g)
    nodes = _reachable([out._ag.grad_fn for out, _ in roots if out._ag.grad_fn is not None])
    # non-leaf inputs of autograd.grad: their gradient is the buffer of their producing output
    wanted_nonleaf = {}
    if wanted:
        for t in wanted.values():
            if t._ag.grad_fn is not None:
                wanted_nonleaf[(t._ag.grad_fn, t._ag.output_nr)] = t
    stack = _walks.__dict__.setdefault("leaves", [])
    stack.append(leaves)
    try:
        with backward_pass():
            last = len(nodes) - 1
            for i, node in enumerate(nodes):
                if node.n_out == 1:  # (most nodes: one pop, no list or generator to build)
                    g = buffers.pop((node, 0), None)
                    if g is None:
                        continue
                    grads = [g]
                else:
                    grads = [buffers.pop((node, k), None) for k in range(node.n_out)]
                    if all(g is None for g in grads):
                        continue
                if i < last and nodes[i + 1].regathers:
                    _prefetch(nodes[i + 1], buffers)
                if node.released:
                    raise RuntimeError(
                        "Trying to backward through the graph a second time (or directly access saved tensors after "
                        "they have already been freed). Saved intermediate values of the graph are freed when you call "
                        ".backward() or autograd.grad(). Specify retain_graph=True if you need to backward through the "
                        "graph a second time or if you need to access saved tensors after calling backward.")
                for k, g in enumerate(grads if wanted_nonleaf or node.retained else ()):
                    if g is None:
                        continue
                    t = wanted_nonleaf.get((node, k))
                    if t is not None:
                        captured[id(t)] = g  # (before the tensor's hooks, as torch captures it)
                    if node.retained and k in node.retained:
                        # hooks, then retain_grad (which sees what the hooks made of the gradient), as in torch
                        meta = node.retained[k]
                        g = grads[k] = _run_hooks(meta, g)
                        if meta.retains_grad and wanted is None:
                            meta.grad = _add(meta.grad, g)
                try:
                    in_grads = node.apply(grads)
                except OpError as exc:
                    raise type(exc)(f"in the backward of {node.name}: {exc}") from exc
                for (producer, nr, leaf), g in zip(node.edges, in_grads):
                    if g is None:
                        continue
                    if producer is not None:
                        key = (producer, nr)
                        buffers[key] = _add(buffers.get(key), g)
                    else:
                        _to_leaf(leaves, leaf, g)
                if not retain_graph:
                    node.release()
    finally:
        stack.pop()
    return leaves, captured


def _store(leaves, only_torch: bool = False) -> dict:
    """Accumulate each leaf's gradient into its ``.grad`` (after its hooks); returns the gradients of leaves
    copied from torch tensors, by torch tensor (``torch_leaves.push_to_torch`` hands them over).
    ``only_torch``: store nothing, only return those."""
    torch_sources = {}  # id(torch tensor) -> (it, the sum of its dtorch copies' gradients)
    for leaf, g in leaves.values():
        recorded = id(g)  # (an id, not a reference: _accumulate counts the references to g)
        meta = leaf._ag
        if not meta.requires_grad or (only_torch and type(meta) is not TorchLeafMeta):
            continue
        if meta.grad_form is not None:
            g = meta.grad_form(g)
        g = as_grad_of(g, leaf._spec)
        if type(meta) is TorchLeafMeta:
            prev = torch_sources.get(id(meta.torch_source))
            torch_sources[id(meta.torch_source)] = (meta.torch_source, g if prev is None else prev[1] + g)
            continue
        if meta.hooks:
            g = as_grad_of(_run_hooks(meta, g), leaf._spec)
        meta.grad = _accumulate(meta, g, int(id(g) == recorded))
        meta.grad._graph.label_memory(meta.grad._h, "grads")
    return torch_sources


@kernel("autograd.accumulate_grad")
def _accumulate_grad_kernel(grad, new):
    grad.add_(new)


def _accumulate(meta, g, walk_refs: int):
    """``.grad`` plus ``g``, as torch's AccumulateGrad (create_graph off): added into the ``.grad`` tensor in place
    (one kernel on its blocks: whoever holds that tensor sees the sum), ``g`` laid out as it is. The first gradient
    becomes ``.grad`` itself unless someone else holds that tensor object (another leaf, a hook): then a second
    object on its blocks (copy-on-write keeps the two apart at the next write). ``walk_refs``: 1 when the walk's
    record of the leaf's gradient still holds ``g``."""
    prev = meta.grad
    if prev is None:
        # (references: the caller's, this frame's ``g`` and getrefcount's argument, plus the walk's)
        return g if sys.getrefcount(g) <= 3 + walk_refs else _own_object(g)
    if requires_grad(prev) or requires_grad(g) or prev._spec.mesh != g._spec.mesh or prev.shape != g.shape:
        return prev + g  # part of a graph (or not a gradient of this leaf: the add says why)
    if type(prev) is not Tensor:  # a view: the write goes into its root (ops/view_writes.py)
        with set_grad_enabled(False):
            prev.add_(g)
        return prev
    if g._spec != prev._spec:
        g = relayout(g.to(prev.dtype) if g.dtype != prev.dtype else g, prev._spec)
    write_local("autograd.accumulate_grad", _accumulate_grad_kernel, prev, [g])
    return prev


def _own_object(g):
    """A tensor object of its own on ``g``'s blocks (``Runtime.alias``: no copy now)."""
    return Tensor._make(g._spec, g._graph.runtime.alias(g._h, g._spec), g._graph)


def _prefetch(node, buffers) -> None:
    """Let the node after this one gather its fsdp shards now (``KernelNode.prefetch``), when a gradient has
    reached it already (so it will run): the gathers overlap this node's work on asynchronous backends."""
    if not node.released and any((node, k) in buffers for k in range(node.n_out)):
        node.prefetch()


def _run_hooks(meta, g):
    """``g`` through the tensor's ``register_hook`` hooks, in registration order: a hook returning a tensor
    replaces the gradient (of the tensor's shape, as torch requires)."""
    hooks = meta.hooks
    if not hooks:
        return g
    for fn in list(hooks.values()):
        out = fn(g)
        if out is None:
            continue
        if tuple(out.shape) != tuple(g.shape):
            raise RuntimeError(f"hook '{getattr(fn, '__name__', fn)}' has changed the size of value")
        g = _as_dtensor(out, g)
    return g


def filled_like(t, value):
    """A Replicate tensor of ``t``'s shape, dtype and mesh, every element ``value``, in ``t``'s Graph."""
    spec = t._spec
    spec = DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape, spec.dtype)
    full = torch.full(spec.shape, value, dtype=spec.dtype)
    return type(t)._make(spec, t._graph.runtime.from_global(full, spec), t._graph)


def _to_leaf(leaves, leaf, g):
    prev = leaves.get(id(leaf))
    leaves[id(leaf)] = (leaf, g if prev is None else prev[1] + g)


def _reachable(roots) -> list[Node]:
    seen = set()
    stack = list(roots)
    out = []
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        out.append(node)
        for producer, _, _ in node.edges:
            if producer is not None and producer not in seen:
                stack.append(producer)
    out.sort(key=lambda n: n.seq, reverse=True)
    return out


def _as_dtensor(g, like):
    if isinstance(g, Tensor):
        if g.device_mesh != like.device_mesh:
            raise RuntimeError(f"the gradient for a tensor on {like.device_mesh} lives on {g.device_mesh}; "
                               "redistribute it onto the tensor's mesh first")
        return g
    if isinstance(g, torch.Tensor):
        return Tensor(g.to(like.dtype), device_mesh=like.device_mesh)
    raise TypeError(f"gradient must be a dtorch or torch tensor, got {type(g).__name__}")
