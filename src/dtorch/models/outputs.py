"""What the Llama's forward hands back: Hugging Face's output object, and torch logits that keep their history.

A forward on torch token ids returns torch logits. Under grad mode (and when the model's parameters require
grad) those logits are the end of a torch autograd graph whose one node continues the backward in dtorch's
autograd: ``torch.nn.functional.cross_entropy(model(ids, attention_mask=mask).flatten(0, 1), ...).backward()``
fills the dtorch parameters' ``.grad``, as the same code fills a torch model's.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..autograd.node import requires_grad
from ..placement import Partial, Replicate
from ..tensor import Tensor


@dataclass
class CausalLMOutputWithPast:
    """Hugging Face's ``CausalLMOutputWithPast``: ``loss`` (a 0-d dtorch tensor, with ``labels``), ``logits``
    and ``past_key_values`` (the ``KVCache``, with ``use_cache`` or a cache given). Indexing by name gives a
    field; by position, like Hugging Face's ``ModelOutput``, the fields that are set, in this order."""
    loss: Tensor | None = None
    logits: Tensor | torch.Tensor | None = None
    past_key_values: object | None = None

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)


class _DTorchBackward(torch.autograd.Function):
    """Identity on the logits fetched from the devices; its backward hands the torch gradient to dtorch."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, source: Tensor):
        ctx.source = source
        return source.to_torch()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        source, ctx.source = ctx.source, None
        if source is None:
            raise RuntimeError("the dtorch graph behind these logits was freed by an earlier backward; run the "
                               "forward again (dtorch frees its graph after one backward through torch logits)")
        placements = [Replicate() if isinstance(p, Partial) else p for p in source.placements]
        source.backward(Tensor(grad.contiguous(), device_mesh=source.device_mesh, placements=placements))
        return None, None


def torch_logits(logits: Tensor) -> torch.Tensor:
    """``logits.to_torch()``, with a torch history that runs dtorch's backward when ``logits`` has one."""
    if not (torch.is_grad_enabled() and requires_grad(logits)):
        return logits.to_torch()
    anchor = torch.empty(0, requires_grad=True)  # a torch input that requires grad, so torch records the node
    return _DTorchBackward.apply(anchor, logits)


__all__ = ["CausalLMOutputWithPast", "torch_logits"]


def labels_like(labels, input_ids) -> torch.Tensor:
    """``labels`` (torch, dtorch or a list) as a torch tensor of ``input_ids``' shape."""
    if isinstance(labels, Tensor):
        labels = labels.to_torch()
    labels = torch.as_tensor(labels)
    if tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(f"labels must have the shape of input_ids {list(input_ids.shape)}, got {list(labels.shape)}")
    return labels
