"""torch tensors that require grad, met by a dtorch op (``x @ w`` with ``w`` a ``torch.nn.Parameter``, a
``torch.nn.Linear`` called on a dtorch tensor, ``x * w[0]``).

The op sees a Replicate dtorch copy of the torch tensor (``ops.rules.to_dtensors``). With grad mode on,
that copy is a dtorch leaf that remembers its torch source. When a backward reaches it, its gradient
(summed over every use of the same torch tensor in the graph) is handed to torch's autograd as a plain
torch tensor: ``torch.autograd.backward(sources, grads)``, once per dtorch backward. A leaf source
accumulates it into its ``.grad`` as torch would; a non-leaf one (``w[0]``, computed by torch before dtorch
saw it) carries it on through torch's own graph, to ``w``.
"""
from __future__ import annotations

import torch

from .node import AutogradMeta


class TorchLeafMeta(AutogradMeta):
    """The autograd metadata of a dtorch leaf copied from ``torch_source`` (a torch tensor requiring grad)."""

    __slots__ = ("torch_source",)

    def __init__(self, source: torch.Tensor):
        super().__init__(requires_grad=True)
        self.torch_source = source


def torch_leaf(t, source: torch.Tensor):
    """``t`` (the dtorch copy of ``source``) made a leaf whose gradient goes to ``source``."""
    t._ag = TorchLeafMeta(source)
    return t


def push_to_torch(pending: dict, retain_graph: bool) -> None:
    """Hand the gradients of dtorch leaves copied from torch tensors to torch's autograd; ``pending``:
    id(source) -> (source, its summed dtorch gradient, laid out Replicate)."""
    sources, grads = _fetched(pending)
    if sources:
        torch.autograd.backward(sources, grads, retain_graph=retain_graph)


def torch_grads(pending: dict, inputs: list, retain_graph: bool) -> list:
    """``dtorch.autograd.grad`` for torch tensors among its inputs: their gradients (torch tensors, None where
    none reached them) from those of the leaves copied from torch tensors (``pending``, as above)."""
    sources, grads = _fetched(pending)
    if not sources:
        return [None] * len(inputs)
    return list(torch.autograd.grad(sources, inputs, grads, retain_graph=retain_graph, allow_unused=True))


def _fetched(pending: dict) -> tuple[list, list]:
    sources, grads = [], []
    for source, g in pending.values():
        if not source.requires_grad:  # switched off since the forward: torch would not fill it either
            continue
        sources.append(source)
        grads.append(g.to_torch().to(device=source.device, dtype=source.dtype))
    return sources, grads
