"""Rotary position embedding as Hugging Face's Llama computes it, at global positions (every rope type
Hugging Face's ``ROPE_INIT_FUNCTIONS`` knows, with its dynamic / longrope updates)."""
from __future__ import annotations

import torch

import dtorch

from .. import nn
from ..context import get_default_device_mesh
from ..mesh import DeviceMesh
from ..tensor import Tensor
from .layout import LlamaLayoutError, _head_dim


def _rope_config(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def _rope_type(config) -> str:
    params = _rope_config(config)
    return params.get("rope_type", params.get("type", "default"))


def _rope_parameters(config, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """float32 inv_freq ``[d/2]`` and the cos/sin scaling, as Hugging Face computes them (``seq_len``: the
    sequence length, for the rope types that depend on it)."""
    rope_type, dim = _rope_type(config), _head_dim(config)
    if rope_type == "default":
        params = _rope_config(config)
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq, scaling = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise LlamaLayoutError(f"rope_type {rope_type!r} is not supported; dtorch's Llama supports 'default' and "
                                   f"Hugging Face's {sorted(ROPE_INIT_FUNCTIONS)}")
        kw = {} if seq_len is None else {"seq_len": seq_len}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kw)
    if tuple(inv_freq.shape) != (dim // 2,):
        raise LlamaLayoutError(f"rope_type {rope_type!r} gives {inv_freq.numel()} frequencies for head_dim {dim}; "
                               f"Llama rotates the whole head ({dim // 2} frequencies): set partial_rotary_factor to 1")
    return inv_freq.float(), float(scaling)


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin tables ``[S, d]`` at GLOBAL positions: the positions come from ``arange`` sharded like the
    sequence, so every device rotates its tokens by where they sit in the whole sequence.

    As in Hugging Face: ``inv_freq`` stays float32 whatever the model's dtype (cos/sin are computed in
    float32, then cast to the activations' dtype), and the rope types "dynamic" (NTK) and "longrope"
    recompute it from the sequence length in forward (``dynamic_rope_update``). "dynamic" keeps Hugging
    Face's state: a table grown for a sequence longer than any before serves until one shorter than
    ``max_position_embeddings`` resets it.
    """

    _float32_buffers = ("inv_freq",)

    def __init__(self, config, device_mesh: DeviceMesh | None = None):
        super().__init__()
        self.config = config
        self.rope_type = _rope_type(config)
        inv_freq, self.attention_scaling = _rope_parameters(config)
        # torch float32 tables: "dynamic" resets to the original one, "longrope" switches short / long
        self.original_inv_freq, self._long_inv_freq, self._in_use = inv_freq, None, inv_freq
        self.original_max_seq_len = self.max_seq_len_cached = config.max_position_embeddings
        self.register_buffer("inv_freq", Tensor(inv_freq, device_mesh=get_default_device_mesh(device_mesh)),
                             persistent=False)
        self._made = self.inv_freq  # the buffer made from ``_in_use`` (its value, without a fetch)
        self._per_mesh = {}

    def _use(self, inv_freq: torch.Tensor) -> None:
        if inv_freq is not self._in_use:
            self.inv_freq = self._made = Tensor(inv_freq, device_mesh=self.inv_freq.device_mesh)
            self._in_use = inv_freq

    def _update(self, seq_len: int) -> None:
        """Hugging Face's dynamic_rope_update for a forward over positions below ``seq_len``."""
        if "dynamic" in self.rope_type:
            if seq_len > self.max_seq_len_cached:  # growth
                inv_freq, self.attention_scaling = _rope_parameters(self.config, seq_len)
                self._use(inv_freq)
                self.max_seq_len_cached = seq_len
            elif seq_len < self.original_max_seq_len < self.max_seq_len_cached:  # back to the original scale
                self._use(self.original_inv_freq)
                self.max_seq_len_cached = self.original_max_seq_len
        elif self.rope_type == "longrope":
            original = _rope_config(self.config)["original_max_position_embeddings"]
            if self._long_inv_freq is None:
                self._long_inv_freq = _rope_parameters(self.config, original + 1)[0]
            self._use(self._long_inv_freq if seq_len > original else self.original_inv_freq)

    def _inv_freq_on(self, mesh: DeviceMesh) -> Tensor:
        # each stage builds its own copy rather than receiving one over "pp"
        if self.inv_freq.device_mesh == mesh:
            return self.inv_freq
        source, version, copy = self._per_mesh.get(mesh, (None, None, None))
        # first use, the buffer replaced (.to(mesh), a new rope length) or written (a recovery puts it back on
        # new workers, where the old copy's blocks are gone)
        if source is not self.inv_freq or version != self.inv_freq._version:
            value = self._in_use if self.inv_freq is self._made else self.inv_freq.to_torch()
            copy = Tensor(value, device_mesh=mesh)
            self._per_mesh[mesh] = (self.inv_freq, self.inv_freq._version, copy)
        return copy

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32, seq_len: int | None = None):
        """cos, sin ``[S, d]`` in ``dtype`` for ``positions`` ``[S]``; ``seq_len`` (one more than the largest
        position) is read from ``positions`` when not given, for the rope types that depend on it."""
        if "dynamic" in self.rope_type or self.rope_type == "longrope":
            self._update(int(positions.max()) + 1 if seq_len is None else seq_len)
        inv_freq = self._inv_freq_on(positions.device_mesh).float()
        freqs = positions.float().unsqueeze(-1) * inv_freq  # [S, 1] * [d/2] -> [S, d/2], float32
        emb = dtorch.cat((freqs, freqs), dim=-1)  # [S, d]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return dtorch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
    if cos.ndim == 2:
        cos, sin = cos.unsqueeze(0).unsqueeze(0), sin.unsqueeze(0).unsqueeze(0)  # [S, d] -> [1, 1, S, d]
    else:  # positions of each row (padding, a KV cache): [B, S, d] -> [B, 1, S, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
