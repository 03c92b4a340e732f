"""Llama (Hugging Face's ``LlamaForCausalLM``) under any mix of dp, tp, pp, ulysess_cp and ring_cp.

The user picks a mesh; the model lays itself out by mesh dim name:

    dp          the batch:    activations Shard(0), weights Replicate
    ulysess_cp  the sequence: activations Shard(1) (nested with ring_cp, mesh-dim order outer to inner);
    ring_cp     attention switches to Ulysses / Ring on these dims (ops/attention.py)
    tp          heads and MLP features (Megatron): q/k/v, gate/up column parallel, o/down row parallel
    pp          layers: mesh.unbind("pp") gives one stage mesh per stage; each stage's modules live on
                its mesh and activations cross stages with a cross-mesh redistribute (send_recv on "pp")

Shapes: ``B`` batch, ``S`` sequence, ``H`` hidden, ``nh``/``nkv`` query/kv heads, ``d`` head dim.
Parameter names are Hugging Face's, so ``model.load_state_dict(hf_model.state_dict())`` works.
"""
from __future__ import annotations

from pathlib import Path

import torch

import dtorch

from .. import nn
from ..errors import DTorchError
from ..graph import Graph
from ..mesh import DeviceMesh, assign_layers_to_stages, get_default_device_mesh
from ..placement import Partial, Replicate, Shard
from ..tensor import Tensor
from ..nn import functional as F

SUPPORTED_MESH_DIMS = ("dp", "tp", "pp", "ulysess_cp", "ulysses_cp", "ring_cp")
CP_DIMS = ("ulysess_cp", "ulysses_cp", "ring_cp")


class LlamaLayoutError(DTorchError, ValueError):
    """The config and the mesh do not fit together (head counts, layer counts, mesh dim names)."""


def dim_size(mesh: DeviceMesh, name: str) -> int:
    idx = mesh.dim_name_index(name)
    return 1 if idx is None else mesh.shape[idx]


def check_layout(config, mesh: DeviceMesh) -> None:
    """Raise one error naming every way ``mesh`` cannot serve ``config``."""
    if mesh.dim_names is None and mesh.size() > 1:
        raise LlamaLayoutError(f"the mesh {mesh!r} has unnamed dims; name them with mesh_dim_names from "
                               f"{list(SUPPORTED_MESH_DIMS[:3]) + ['ulysess_cp', 'ring_cp']}")
    mesh.check_all_dim_names_in_set(SUPPORTED_MESH_DIMS)
    nh, nkv = config.num_attention_heads, _num_kv_heads(config)
    tp, ulysses, pp = dim_size(mesh, "tp"), dim_size(mesh, "ulysess_cp"), dim_size(mesh, "pp")
    problems = []
    if nh % nkv:
        problems.append(f"num_attention_heads ({nh}) is not a multiple of num_key_value_heads ({nkv})")
    if nh % tp:
        problems.append(f"num_attention_heads ({nh}) is not divisible by tp ({tp})")
    if nkv % tp:
        problems.append(f"num_key_value_heads ({nkv}) is not divisible by tp ({tp})")
    if nh % tp == 0 and (nh // tp) % ulysses:
        problems.append(f"the {nh // tp} query heads per tp shard (num_attention_heads {nh} / tp {tp}) are not "
                        f"divisible by ulysess_cp ({ulysses})")
    if config.num_hidden_layers < pp:
        problems.append(f"num_hidden_layers ({config.num_hidden_layers}) is smaller than pp ({pp}); every stage needs a layer")
    if problems:
        raise LlamaLayoutError(f"mesh {mesh} cannot serve this Llama config: " + "; ".join(problems)
                               + ". Choose tp / ulysess_cp / pp sizes that divide these counts.")


def _num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def activation_placements(mesh: DeviceMesh, batch_dim: int | None = 0, seq_dim: int = 1) -> list:
    """Batch over dp (``batch_dim=None``: no batch dim), sequence over the cp dims, Replicate elsewhere."""
    out = []
    for name in mesh.dim_names or [None] * mesh.ndim:
        if name == "dp" and batch_dim is not None:
            out.append(Shard(batch_dim))
        elif name in CP_DIMS:
            out.append(Shard(seq_dim))
        else:
            out.append(Replicate())
    return out


def _rope_parameters(config) -> tuple[torch.Tensor, float]:
    """inv_freq ``[d/2]`` and the cos/sin scaling, as Hugging Face computes them."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[rope_type](config, None)
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = _head_dim(config)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


class LlamaRotaryEmbedding(nn.Module):
    """cos/sin tables ``[S, d]`` at GLOBAL positions: the positions come from ``arange`` sharded like the
    sequence, so every device rotates its tokens by where they sit in the whole sequence."""

    def __init__(self, config, device_mesh: DeviceMesh | None = None):
        super().__init__()
        inv_freq, self.attention_scaling = _rope_parameters(config)
        self.register_buffer("inv_freq", Tensor(inv_freq, device_mesh=get_default_device_mesh(device_mesh)),
                             persistent=False)
        self._per_mesh = {}

    def _inv_freq_on(self, mesh: DeviceMesh) -> Tensor:
        # each stage builds its own copy rather than receiving one over "pp"
        if self.inv_freq.device_mesh == mesh:
            return self.inv_freq
        source, copy = self._per_mesh.get(mesh, (None, None))
        if source is not self.inv_freq:  # first use, or the buffer was replaced (.to(dtype), loading)
            copy = Tensor(self.inv_freq.to_torch(), device_mesh=mesh)
            self._per_mesh[mesh] = (self.inv_freq, copy)
        return copy

    def forward(self, positions: Tensor, dtype: torch.dtype = torch.float32):
        freqs = positions.float().unsqueeze(-1) * self._inv_freq_on(positions.device_mesh)  # [S, 1] * [d/2] -> [S, d/2]
        emb = dtorch.cat((freqs, freqs), dim=-1)  # [S, d]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return dtorch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
    cos, sin = cos.unsqueeze(0).unsqueeze(0), sin.unsqueeze(0).unsqueeze(0)  # [S, d] -> [1, 1, S, d]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, _num_kv_heads(config), _head_dim(config)
        self.scaling = self.head_dim ** -0.5
        h, bias = config.hidden_size, getattr(config, "attention_bias", False)
        self.q_proj = nn.ColumnParallelLinear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.ColumnParallelLinear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.ColumnParallelLinear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.RowParallelLinearWithReplicateOutput(self.num_heads * self.head_dim, h, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, s, _ = x.shape
        # [B, S, H] -> [B, S, n*d] (S(2) on tp) -> [B, S, n, d] -> [B, n, S, d]: heads over tp, S over cp
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling,
                                           enable_gqa=self.num_kv_heads != self.num_heads)
        o = o.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)  # [B, n, S, d] -> [B, S, n*d]
        return self.o_proj(o)  # partial sums over tp all-reduced: R on tp


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise LlamaLayoutError(f"hidden_act {act!r} is not supported; dtorch's Llama uses 'silu'")
        self.gate_proj = nn.ColumnParallelLinear(h, i, bias=bias)
        self.up_proj = nn.ColumnParallelLinear(h, i, bias=bias)
        self.down_proj = nn.RowParallelLinear(i, h, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        # [B, S, H] -> [B, S, I] (S(2) on tp) -> [B, S, H] Partial on tp
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; with TP exactly two all-reduces (o_proj, layer output)."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))  # R + P -> P on tp

    def redistribute_output(self, h: Tensor) -> Tensor:
        return h.redistribute_by_dict(placements_dict={"tp": Replicate()})


class LlamaModel(nn.Module):
    """Embedding (first stage), decoder layers (bound to stages), final norm (last stage).

    ``model(input_ids)`` returns the hidden states ``[B, S, H]`` as a dtorch tensor on the last stage mesh
    (batch over dp, sequence over cp, Replicate on tp).
    """

    def __init__(self, config, device_mesh: DeviceMesh | None = None):
        super().__init__()
        mesh = get_default_device_mesh(device_mesh)
        check_layout(config, mesh)
        self.config = config
        self.device_mesh = mesh
        self.stage_meshes = mesh.unbind("pp")
        self.layer_stages = assign_layers_to_stages(config.num_hidden_layers, len(self.stage_meshes))
        guard = Graph.default_graph().device_mesh_guard
        with guard(self.stage_meshes[0]):
            self.embed_tokens = nn.EmbeddingWithReplicateOutput(config.vocab_size, config.hidden_size,
                                                                getattr(config, "pad_token_id", None))
            self.rotary_emb = LlamaRotaryEmbedding(config)
        layers = []
        for i, stage in enumerate(self.layer_stages):
            with guard(self.stage_meshes[stage]):
                layers.append(LlamaDecoderLayer(config, i))
        self.layers = nn.ModuleList(layers)
        with guard(self.stage_meshes[-1]):
            self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def redistribute_input(self, input_ids):
        """Token ids ``[B, S]`` (torch or dtorch, any mesh) onto the first stage: batch over dp, sequence over cp."""
        if not isinstance(input_ids, (torch.Tensor, Tensor)) or input_ids.ndim != 2 or input_ids.dtype.is_floating_point:
            got = f"{type(input_ids).__name__} {getattr(input_ids, 'dtype', '')} of shape {list(getattr(input_ids, 'shape', []))}"
            raise TypeError(f"input_ids must be an integer tensor [batch, seq] (torch or dtorch), got {got}")
        first = self.stage_meshes[0]
        if isinstance(input_ids, torch.Tensor):
            return (Tensor(input_ids, device_mesh=first, placements=activation_placements(first)),), {}
        return (input_ids.redistribute(first, activation_placements(first)),), {}

    def rope(self, mesh: DeviceMesh, seq_len: int, dtype: torch.dtype):
        positions = dtorch.arange(seq_len, device_mesh=mesh, placements=activation_placements(mesh, None, 0))
        return self.rotary_emb(positions, dtype)

    def forward(self, input_ids: Tensor) -> Tensor:
        h = self.embed_tokens(input_ids)  # [B, S] -> [B, S, H]
        stage = 0
        cos, sin = self.rope(self.stage_meshes[0], input_ids.shape[1], h.dtype)
        for layer, layer_stage in zip(self.layers, self.layer_stages):
            if layer_stage != stage:  # pipeline hand-off: same placements on the next stage's devices
                stage = layer_stage
                mesh = self.stage_meshes[stage]
                h = h.redistribute(mesh, h.placements)
                cos, sin = self.rope(mesh, input_ids.shape[1], h.dtype)
            h = layer(h, cos, sin)
        return self.norm(h)


class LlamaForCausalLM(nn.Module):
    """Hugging Face's ``LlamaForCausalLM`` (inference) on any mesh with dims among dp, tp, pp, ulysess_cp, ring_cp.

    ``model(input_ids)`` with ids ``[B, S]`` as a torch tensor returns torch logits ``[B, S, vocab]``; as a
    dtorch tensor it returns dtorch logits on the ids' mesh, batch and sequence placed like the ids.
    """

    def __init__(self, config, device_mesh: DeviceMesh | None = None):
        super().__init__()
        mesh = get_default_device_mesh(device_mesh)
        self.config = config
        self.model = LlamaModel(config, mesh)
        with Graph.default_graph().device_mesh_guard(self.model.stage_meshes[-1]):
            # vocab over tp: logits leave S(-1) on tp and are gathered only when handed back
            self.lm_head = nn.ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=False)
        self._caller = None

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.model.device_mesh

    def redistribute_input(self, input_ids, *args, **kwargs):
        if args or kwargs:
            raise TypeError("LlamaForCausalLM(input_ids) takes only token ids (no masks, caches or labels)")
        # remembered for redistribute_output: logits go back the way the ids came
        self._caller = (input_ids.device_mesh, input_ids.placements) if isinstance(input_ids, Tensor) else None
        return (input_ids,), {}

    def forward(self, input_ids) -> Tensor:
        return self.lm_head(self.model(input_ids))  # ids laid out by LlamaModel; [B, S, H] -> [B, S, vocab]

    def redistribute_output(self, logits: Tensor):
        caller, self._caller = self._caller, None
        if caller is None:
            return logits.to_torch()
        mesh, placements = caller
        return logits.redistribute(mesh, [Replicate() if isinstance(p, Partial) else p for p in placements])

    # -- checkpoints -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, device_mesh: DeviceMesh | None = None, *, dtype: torch.dtype | None = None,
                        progress=None) -> "LlamaForCausalLM":
        """Load a Hugging Face checkpoint directory (config.json + *.safetensors).

        Nothing is initialised randomly; each parameter is read with safetensors' ``get_slice``, one read
        per distinct device block, so a device's data comes only from its own shard of the file.
        ``progress(done, total, name)`` is called after each parameter.
        """
        from ._checkpoint import load_config, read_sharded

        path = Path(path)
        config = load_config(path)
        with nn.skip_init():
            model = cls(config, device_mesh)
        if dtype is not None:
            model.to(dtype)
        read_sharded(model, path, progress=progress)
        return model


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP",
           "LlamaRotaryEmbedding", "LlamaLayoutError", "check_layout", "activation_placements", "SUPPORTED_MESH_DIMS"]
