"""Activation checkpointing: run a block without keeping its activations; recompute them in the backward.

``checkpoint(fn, *args)`` runs ``fn`` under no_grad and records one node for the whole block. Its backward
runs ``fn`` again with grad enabled on detached copies of the inputs and backpropagates through that fresh
graph: the parameters inside receive their gradients directly (like torch's reentrant checkpoint), the
inputs' gradients flow on. Memory between the forward and the backward: the block's inputs only.
"""
from __future__ import annotations

import torch

from .engine import run_backward
from .node import Node, attach, requires_grad


class CheckpointNode(Node):
    __slots__ = ("fn", "args", "kwargs", "positions")
    name = "checkpoint"

    def __init__(self, fn, args, kwargs, positions, n_out):
        super().__init__([args[i] for i in positions], n_out)
        self.fn, self.args, self.kwargs, self.positions = fn, args, kwargs, positions

    def release(self):
        super().release()
        self.args = self.kwargs = None

    def apply(self, grads):
        args = list(self.args)
        detached = []
        for i in self.positions:
            d = args[i].detach().requires_grad_()
            args[i] = d
            detached.append(d)
        with torch.enable_grad():
            out = self.fn(*args, **self.kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and requires_grad(o)]
        if pairs:
            run_backward([o for o, _ in pairs], [g for _, g in pairs])
        return [d.grad for d in detached]


def checkpoint(fn, *args, use_reentrant=None, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` for dtorch blocks: ``fn(*args, **kwargs)`` whose activations are
    recomputed in the backward instead of kept."""
    from ..tensor import Tensor

    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    positions = [i for i, a in enumerate(args) if isinstance(a, Tensor) and requires_grad(a)]
    with torch.no_grad():
        out = fn(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    # a block with parameters inside records a node even when no input requires grad (the first layer)
    node = CheckpointNode(fn, tuple(args), kwargs, positions, len(outs))
    attach(node, [o if isinstance(o, Tensor) else None for o in outs])
    return out
