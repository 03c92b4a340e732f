"""Autograd in global view: the backward pass is recorded and run on the controller, as dtorch ops.

Every op that sees an input requiring grad records a node (``node.py``); ``backward()`` walks the nodes
in reverse (``engine.py``) and runs each one's vector-Jacobian product: for a kernel op, torch's own
autograd on each device's blocks, with the gradient layouts following from the placements
(``dispatched.py``). See docs/training.md.
"""
from __future__ import annotations

from .engine import run_backward
from .mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .node import Node

__all__ = ["backward", "grad", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "Node"]


def _seq(x):
    if x is None:
        return None
    return list(x) if isinstance(x, (list, tuple)) else [x]


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph: bool = False) -> None:
    """``torch.autograd.backward``: accumulate the gradients of ``tensors`` into the leaves' ``.grad``."""
    if create_graph:
        raise NotImplementedError("create_graph=True (higher-order gradients) is not supported by dtorch yet")
    outs = _seq(tensors)
    grads = _seq(grad_tensors) or [None] * len(outs)
    run_backward(outs, grads, retain_graph=bool(retain_graph))


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph: bool = False,
         allow_unused: bool = False):
    """``torch.autograd.grad``: the gradients of ``outputs`` with respect to ``inputs`` (a tuple), without
    touching any ``.grad``."""
    if create_graph:
        raise NotImplementedError("create_graph=True (higher-order gradients) is not supported by dtorch yet")
    outs = _seq(outputs)
    grads = _seq(grad_outputs) or [None] * len(outs)
    ins = _seq(inputs)
    return run_backward(outs, grads, retain_graph=bool(retain_graph), inputs=ins, allow_unused=allow_unused)
