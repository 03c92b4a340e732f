"""Embedding, normalisation, dropout and activation modules."""
from __future__ import annotations

import numbers

import torch

from ..graph import Graph
from ..ops.nn import check_token_ids
from ..placement import Replicate, Shard
from . import functional as F
from ._layout import init_device, init_enabled, make_param, module_mesh, on_mesh, placements_on, with_placement
from .module import Module


class Embedding(Module):
    """``torch.nn.Embedding`` with the weight ``[num, dim]`` sharded on the embedding dim over ``tp_dim``:
    every device looks up every token and produces its slice of the features (``[..., dim]`` S(-1) on tp).

    ``vocab_parallel=True`` shards the vocab instead (Megatron's VocabParallelEmbedding, the layout of a
    column-parallel output projection, so the two can share one weight): each device looks up the tokens in
    its vocab range and the output is Partial (sum) on tp."""

    output_tp_placement = None

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None, max_norm=None,
                 norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False, _weight=None,
                 _freeze: bool = False, device=None, dtype=None, device_mesh=None, *, tp_dim: str = "tp",
                 vocab_parallel: bool = False):
        super().__init__()
        if max_norm is not None:
            raise NotImplementedError("Embedding(max_norm=...) renormalises the weight in place; dtorch does not support it")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx {padding_idx} must be within num_embeddings ({num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.tp_dim, self.vocab_parallel = tp_dim, vocab_parallel
        mesh = module_mesh(device_mesh, device)
        if _weight is None:
            w = torch.empty(num_embeddings, embedding_dim, dtype=dtype or Graph.default_graph().default_dtype,
                            device=init_device())
            if init_enabled():
                torch.nn.init.normal_(w)
            if padding_idx is not None:
                w[padding_idx] = 0
        else:
            w = _weight.to_torch() if hasattr(_weight, "to_torch") else torch.as_tensor(_weight)
        self.weight = make_param(w, mesh, placements_on(mesh, tp_dim, Shard(0 if vocab_parallel else 1)))

    def redistribute_input(self, ids, *args, **kwargs):
        if isinstance(ids, torch.Tensor) and ids.device.type == "cpu":
            check_token_ids(ids, self.num_embeddings)  # still on the controller: no device waits for it
        # token ids are never split over tp: every tp device needs every token for its feature slice
        ids = with_placement(on_mesh(ids, self.weight.device_mesh), self.tp_dim, Replicate())
        return (ids, *args), kwargs

    def forward(self, ids):
        return F.embedding(ids, self.weight, self.padding_idx)  # [...] -> [..., dim]

    def redistribute_output(self, y):
        return with_placement(y, self.tp_dim, self.output_tp_placement)

    def extra_repr(self):
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        vocab = ", vocab_parallel=True" if self.vocab_parallel else ""
        return f"{self.num_embeddings}, {self.embedding_dim}{pad}{vocab}"


class EmbeddingWithReplicateOutput(Embedding):
    """Embedding whose output is Replicate on tp, so every device holds all features (all-gathered, or
    all-reduced when ``vocab_parallel``)."""

    output_tp_placement = Replicate()


def _shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(s) for s in normalized_shape)


class RMSNorm(Module):
    """``torch.nn.RMSNorm``; the weight is replicated on every mesh dim."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, device=None,
                 dtype=None, device_mesh=None):
        super().__init__()
        self.normalized_shape, self.eps, self.elementwise_affine = _shape(normalized_shape), eps, elementwise_affine
        mesh = module_mesh(device_mesh, device)
        if elementwise_affine:
            w = torch.ones(self.normalized_shape, dtype=dtype or Graph.default_graph().default_dtype)
            self.weight = make_param(w, mesh, None)
        else:
            self.register_parameter("weight", None)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(Module):
    """``torch.nn.LayerNorm``; weight and bias are replicated on every mesh dim."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device=None, dtype=None, device_mesh=None):
        super().__init__()
        self.normalized_shape, self.eps, self.elementwise_affine = _shape(normalized_shape), eps, elementwise_affine
        mesh = module_mesh(device_mesh, device)
        dtype = dtype or Graph.default_graph().default_dtype
        self.register_parameter("weight", None)
        self.register_parameter("bias", None)
        if elementwise_affine:
            self.weight = make_param(torch.ones(self.normalized_shape, dtype=dtype), mesh, None)
            if bias:
                self.bias = make_param(torch.zeros(self.normalized_shape, dtype=dtype), mesh, None)

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Dropout(Module):
    def __init__(self, p: float = 0.5, inplace: bool = False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        self.p, self.inplace = p, inplace

    def forward(self, x):
        return F.dropout(x, self.p, self.training)

    def extra_repr(self):
        return f"p={self.p}, inplace={self.inplace}"


class SiLU(Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return F.silu(x)


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self):
        return f"approximate={self.approximate!r}"


class ReLU(Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return F.relu(x)


class Identity(Module):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x
