"""Autograd in global view: the backward pass is recorded and run on the controller, as dtorch ops.

Every op that sees an input requiring grad records a node (``node.py``); ``backward()`` walks the nodes
in reverse (``engine.py``) and runs each one's vector-Jacobian product: for a kernel op, torch's own
autograd on each device's blocks, with the gradient layouts following from the placements
(``dispatched.py``). See docs/training.md.
"""
from __future__ import annotations

import torch

from .engine import filled_like, run_backward
from .mode import enable_grad, is_grad_enabled, no_grad, set_grad_enabled
from .node import Node

__all__ = ["backward", "grad", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled", "Node"]


def _seq(x):
    if x is None:
        return None
    return list(x) if isinstance(x, (list, tuple)) else [x]


def backward(tensors, grad_tensors=None, retain_graph=None, create_graph: bool = False, grad_variables=None,
             inputs=None) -> None:
    """``torch.autograd.backward`` (also reached as ``torch.autograd.backward(dtorch_loss)``): accumulate the
    gradients of ``tensors`` into the leaves' ``.grad``."""
    if create_graph:
        raise NotImplementedError("create_graph=True (higher-order gradients) is not supported by dtorch yet")
    if inputs is not None:
        raise NotImplementedError("backward(inputs=...) is not supported by dtorch yet; take the gradients with "
                                  "dtorch.autograd.grad(outputs, inputs) and add them to .grad yourself")
    outs = _seq(tensors)
    grads = _seq(grad_tensors if grad_tensors is not None else grad_variables) or [None] * len(outs)
    run_backward(outs, grads, retain_graph=bool(retain_graph))


def grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph: bool = False, only_inputs: bool = True,
         allow_unused=None, is_grads_batched: bool = False, materialize_grads: bool = False):
    """``torch.autograd.grad`` (also reached as ``torch.autograd.grad(dtorch_loss, ...)``): the gradients of
    ``outputs`` with respect to ``inputs`` (a tuple), without touching any ``.grad``. ``materialize_grads``:
    zeros for inputs the outputs do not depend on, as torch's."""
    if create_graph:
        raise NotImplementedError("create_graph=True (higher-order gradients) is not supported by dtorch yet")
    if is_grads_batched:
        raise NotImplementedError("is_grads_batched=True is not supported by dtorch; call grad once per grad_outputs")
    outs = _seq(outputs)
    grads = _seq(grad_outputs) or [None] * len(outs)
    ins = _seq(inputs)
    got = run_backward(outs, grads, retain_graph=bool(retain_graph), inputs=ins,
                       allow_unused=bool(allow_unused) or materialize_grads)
    if materialize_grads:
        got = tuple(zeros_like(t) if g is None else g for t, g in zip(ins, got))
    return got


def zeros_like(t):
    """A zero gradient for ``t`` (a dtorch or torch tensor), laid out like it."""
    if isinstance(t, torch.Tensor):
        return torch.zeros_like(t)
    return filled_like(t, 0)
