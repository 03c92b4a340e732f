"""The recorded history: autograd metadata on tensors and the nodes of the backward graph.

A tensor that requires grad carries an ``AutogradMeta`` in its ``_ag`` slot (None otherwise: the hot
path of every op reads one slot). A leaf has ``requires_grad`` and collects ``.grad``; an op output has
``grad_fn`` (the node that made it) and ``output_nr``. A node knows, per differentiable input, the edge
the gradient flows along: the producing node and its output number, or the leaf tensor itself.
"""
from __future__ import annotations

import itertools

_seq = itertools.count()


class AutogradMeta:
    # grad_form: a leaf's gradient -> the gradient stored (a parameter held in another form than it is
    # saved, nn.module.RepeatedRows: the repeated copies share one gradient)
    # hooks: handle id -> fn of ``Tensor.register_hook`` (None until the first)
    __slots__ = ("requires_grad", "grad_fn", "output_nr", "grad", "retains_grad", "grad_form", "hooks")

    def __init__(self, requires_grad: bool = False, grad_fn: "Node | None" = None, output_nr: int = 0):
        self.requires_grad = requires_grad
        self.grad_fn = grad_fn
        self.output_nr = output_nr
        self.grad = None
        self.retains_grad = False
        self.grad_form = None
        self.hooks = None


def requires_grad(t) -> bool:
    ag = t._ag
    return ag is not None and (ag.requires_grad or ag.grad_fn is not None)


class Node:
    """One recorded op. ``edges[i]``: where the gradient of differentiable input i goes, as
    ``(node, output_nr, None)`` or ``(None, 0, leaf_tensor)``. ``apply(grads)`` maps the gradients of the
    outputs (None where an output got none) to one gradient (or None) per edge, as dtorch tensors."""

    __slots__ = ("seq", "edges", "n_out", "released", "retained", "__weakref__")
    name = "Node"
    regathers = False  # (a node that lays saved inputs out again in its backward says so: KernelNode)

    def __init__(self, inputs, n_out: int):
        self.seq = next(_seq)  # later nodes consume earlier ones: reverse creation order is a valid backward order
        self.edges = tuple(edge(t) for t in inputs)
        self.n_out = n_out
        self.released = False
        # output_nr -> AutogradMeta of a non-leaf output that retains its grad or has hooks
        self.retained = None

    def apply(self, grads: list) -> list:
        raise NotImplementedError

    def release(self) -> None:
        """Drop what was saved for the backward (``retain_graph=False``)."""
        self.released = True

    def __repr__(self):
        return f"<{self.name}Backward>"


def edge(t):
    ag = t._ag
    if ag.grad_fn is not None:
        return (ag.grad_fn, ag.output_nr, None)
    return (None, 0, t)


def attach(node: Node, outputs) -> None:
    """Make ``outputs`` (floating-point tensors) the results of ``node``."""
    for k, out in enumerate(outputs):
        if out is not None and (out.dtype.is_floating_point or out.dtype.is_complex):
            out._ag = AutogradMeta(grad_fn=node, output_nr=k)
