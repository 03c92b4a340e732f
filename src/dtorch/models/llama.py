"""Llama (Hugging Face's ``LlamaForCausalLM``) under any mix of dp, tp, pp, ulysess_cp and ring_cp.

The user picks a mesh; the model lays itself out by mesh dim name:

    dp          the batch:    activations Shard(0), weights Replicate
    fsdp        the batch too, and every parameter sharded on it, gathered by each module for its forward
                (fully sharded data parallel: autograd/fsdp.py); with dp it is HSDP
    ulysess_cp  the sequence: activations Shard(1) (nested with ring_cp, mesh-dim order outer to inner);
    ring_cp     attention runs Ulysses / Ring on these dims (ops/attention/, chosen in models/layout.py)
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
from ..autograd.checkpoint import checkpoint
from ..context import get_default_device_mesh
from ..graph import Graph
from ..mesh import DeviceMesh, assign_layers_to_stages
from ..placement import Partial, Replicate, Shard
from ..tensor import Tensor
from ..nn import functional as F
from ..nn._layout import on_mesh, with_placement
from ..nn.module import RepeatedRows
from .forward import forward_with_arguments, split_forward_arguments
from .generation import GenerationMixin
from .hf_init import init_weights_like_hf, skip_tied_lm_head_draws
from .kv_cache import KVCache  # noqa: F401  (dtorch.models.llama.KVCache: the API's name)
from .layout import (SUPPORTED_MESH_DIMS, LlamaLayoutError, _head_dim, _num_kv_heads,  # noqa: F401  (re-exported)
                     activation_placements, check_layout, context_parallel, cp_size, dim_size)
from .outputs import CausalLMOutputWithPast, labels_like, torch_logits
from .rotary import LlamaRotaryEmbedding, apply_rotary_pos_emb, rotate_half  # noqa: F401  (HF's names, here as there)


class CausalForward:
    """The attention strategy of a forward over whole sequences (no padding, no cache): rope at positions
    0..S-1, causal attention, context parallel over the mesh's cp dims. The default of every forward;
    ``kv_cache.CachedForward`` is the other kind (padding, each row's positions, a KV cache). A forward
    chooses its kind once and hands it down; layers ask it, never check which it is."""

    fused = False  # (a decode step's fused cache kernels: CachedForward)
    cache = None

    def input_ids(self, mesh: DeviceMesh, input_ids):
        """Token ids ``[B, S]`` (torch or dtorch, any mesh) onto ``mesh``: batch over dp, sequence over cp."""
        if not isinstance(input_ids, (torch.Tensor, Tensor)) or input_ids.ndim != 2 or input_ids.dtype.is_floating_point:
            got = f"{type(input_ids).__name__} {getattr(input_ids, 'dtype', '')} of shape {list(getattr(input_ids, 'shape', []))}"
            raise TypeError(f"input_ids must be an integer tensor [batch, seq] (torch or dtorch), got {got}")
        if isinstance(input_ids, torch.Tensor):
            return Tensor(input_ids, device_mesh=mesh, placements=activation_placements(mesh))
        return input_ids.redistribute(mesh, activation_placements(mesh))

    def rope(self, rotary, mesh: DeviceMesh, dtype: torch.dtype, seq_len: int):
        positions = dtorch.arange(seq_len, device_mesh=mesh, placements=activation_placements(mesh, None, 0))
        return rotary(positions, dtype, seq_len=seq_len)

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
        return apply_rotary_pos_emb(q, k, cos, sin)

    def attention(self, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # GQA: query head i uses held kv head i // (num_heads / kv_heads_held), a copy of kv head
        # i // (num_heads / num_kv_heads), Hugging Face's
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling,
                                              enable_gqa=attn.kv_heads_held != attn.num_heads,
                                              context_parallel=context_parallel(q.device_mesh))


CAUSAL = CausalForward()


def _replicate_kv_heads(proj: nn.Linear, form: RepeatedRows) -> None:
    """Hold each kv head of ``proj`` ``form.repeats`` times in a row, so that with tp Shard(0) every tp device
    holds the one kv head its query heads use; the state dict keeps one copy of each (Hugging Face's)."""
    for name in ("weight", "bias"):
        p = getattr(proj, name)
        if p is not None:
            value = p.to_torch() if p._graph.runtime.holds_values else torch.empty(tuple(p.shape), dtype=p.dtype,
                                                                                   device="meta")
            held = Tensor(form.load(value), device_mesh=p.device_mesh, placements=p.placements)
            param = nn.Parameter(held)
            param._ag.grad_form = form.tie_grad  # the copies of a head are one parameter: one gradient
            proj.register_parameter(name, param)
            proj._saved_forms[name] = form
    proj.out_features *= form.repeats


class LlamaAttention(nn.Module):
    """Heads over tp. With fewer kv heads than tp devices (8 kv heads on 16-way tp), each kv head is
    replicated on the tp / num_key_value_heads devices whose query heads use it (as in Megatron and vLLM):
    k_proj / v_proj hold ``tp`` heads, kv head ``j`` at held heads ``j * r .. j * r + r - 1``
    (``r = tp / num_key_value_heads``), and their state dict entries keep Hugging Face's shapes."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, _num_kv_heads(config), _head_dim(config)
        self.scaling = self.head_dim ** -0.5
        tp = dim_size(get_default_device_mesh(), "tp")
        self.kv_repeats = tp // self.num_kv_heads if self.num_kv_heads < tp else 1
        self.kv_heads_held = self.num_kv_heads * self.kv_repeats
        h, bias = config.hidden_size, getattr(config, "attention_bias", False)
        self.q_proj = nn.ColumnParallelLinear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.ColumnParallelLinear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.ColumnParallelLinear(h, self.num_kv_heads * self.head_dim, bias=bias)
        if self.kv_repeats > 1:
            form = RepeatedRows(self.head_dim, self.kv_repeats)
            _replicate_kv_heads(self.k_proj, form)
            _replicate_kv_heads(self.v_proj, form)
        self.o_proj = nn.RowParallelLinearWithReplicateOutput(self.num_heads * self.head_dim, h, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, step=CAUSAL) -> Tensor:
        if step.fused:  # a decode step: fused cache write and attention (kv_cache.py)
            return self.o_proj(step.decode_attention(self, self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin))
        b, s, _ = x.shape
        # [B, S, H] -> [B, S, n*d] (S(2) on tp) -> [B, S, n, d] -> [B, n, S, d]: heads over tp, S over cp
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads_held, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads_held, self.head_dim).transpose(1, 2)
        q, k = step.rotate(q, k, cos, sin)
        o = step.attention(self, q, k, v)  # causal, or with the padding mask and/or KV cache (kv_cache.py)
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

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, step=CAUSAL) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, step)
        m = self.mlp(self.post_attention_layernorm(h))  # P on tp
        if step.fused:  # a decode step: all-reduced before the add, as o_proj's (no zero-filled Partial copy of h)
            m = with_placement(m, "tp", Replicate())
        return h + m  # R + P -> P on tp (all-reduced by redistribute_output)

    def redistribute_output(self, h: Tensor) -> Tensor:
        return h.redistribute_by_dict(placements_dict={"tp": Replicate()})


class LlamaModel(nn.Module):
    """Embedding (first stage), decoder layers (bound to stages), final norm (last stage).

    ``model(input_ids)`` returns the hidden states ``[B, S, H]`` as a dtorch tensor on the last stage mesh
    (batch over dp, sequence over cp, Replicate on tp).
    """

    def __init__(self, config, device_mesh: DeviceMesh | None = None):
        super().__init__()
        self.gradient_checkpointing = False  # gradient_checkpointing_enable(): recompute layers in backward
        self.checkpoint_every = 1  # ... every layer, or every N-th (selective)
        mesh = get_default_device_mesh(device_mesh)
        check_layout(config, mesh)
        self.config = config
        self.device_mesh = mesh
        self.stage_meshes = mesh.unbind("pp")
        self.layer_stages = assign_layers_to_stages(config.num_hidden_layers, len(self.stage_meshes))
        guard = Graph.default_graph().device_mesh_guard
        with guard(self.stage_meshes[0]):
            # tied to lm_head: vocab over tp like lm_head (Megatron's vocab-parallel embedding), so both can
            # be one parameter
            self.embed_tokens = nn.EmbeddingWithReplicateOutput(config.vocab_size, config.hidden_size,
                                                                getattr(config, "pad_token_id", None),
                                                                vocab_parallel=_tied(config))
            self.rotary_emb = LlamaRotaryEmbedding(config)
        layers = []
        for i, stage in enumerate(self.layer_stages):
            with guard(self.stage_meshes[stage]):
                layers.append(LlamaDecoderLayer(config, i))
        self.layers = nn.ModuleList(layers)
        with guard(self.stage_meshes[-1]):
            self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        init_weights_like_hf(self, config)  # Hugging Face's post_init: the same seed gives its weights

    def _recomputes(self, layer) -> bool:
        """Is ``layer`` checkpointed: every layer (full), or the N-th, 2N-th, ... (selective, torchtitan's)."""
        return self.gradient_checkpointing and (layer.self_attn.layer_idx + 1) % self.checkpoint_every == 0

    def redistribute_input(self, input_ids, step=CAUSAL):
        """Token ids ``[B, S]`` onto the first stage, as the forward's kind lays them out (``step``: a
        ``CausalForward`` or a ``kv_cache.CachedForward``, chosen once by the caller and handed down)."""
        return (step.input_ids(self.stage_meshes[0], input_ids),), {"step": step}

    def forward(self, input_ids: Tensor, step=CAUSAL) -> Tensor:
        h = self.embed_tokens(input_ids)  # [B, S] -> [B, S, H]
        stage = 0
        cos, sin = step.rope(self.rotary_emb, self.stage_meshes[0], h.dtype, input_ids.shape[1])
        for layer, layer_stage in zip(self.layers, self.layer_stages):
            if layer_stage != stage:  # pipeline hand-off: same placements on the next stage's devices
                stage = layer_stage
                mesh = self.stage_meshes[stage]
                h = h.redistribute(mesh, h.placements)
                cos, sin = step.rope(self.rotary_emb, mesh, h.dtype, input_ids.shape[1])
            if step.cache is None and self._recomputes(layer) and self.training \
                    and torch.is_grad_enabled():  # (a cache is written once, not again)
                h = checkpoint(layer, h, cos, sin, step)  # activations recomputed in the backward
            else:
                h = layer(h, cos, sin, step)
        return self.norm(h)


def _tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


class TiedLMHead(nn.Module):
    """lm_head of a ``tie_word_embeddings`` model: its ``weight`` is the embedding's parameter, one object
    under both names as in Hugging Face (``state_dict`` has both keys; loading or casting either changes
    both). The embedding is vocab-parallel, so the weight is Shard(0) on tp like an untied lm_head's and
    the logits leave S(-1) on tp.

    On one pipeline stage the matmul uses the parameter itself. With pp the embedding lives on the first
    stage and lm_head runs on the last: it uses a copy of the parameter on the last stage's devices (like
    Megatron's second copy), sent over once and sent again whenever the parameter holds new values.
    """

    def __init__(self, weight: nn.Parameter, device_mesh: DeviceMesh):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape
        self.device_mesh = device_mesh  # where it runs (the last pipeline stage)
        self._copy = (None, None)  # ((the parameter's handle, its _version) it was made from, the copy)

    def _weight_here(self) -> Tensor:
        w = self.weight
        if w.device_mesh == self.device_mesh:
            return w
        source, copy = self._copy
        # a parameter's values change with a new storage handle (Parameter._set: loading, casting) or an
        # in-place write (which counts in its _version): either makes the copy stale
        if source != (w._h, w._version):
            copy = w.redistribute(self.device_mesh, w.placements)  # stage meshes share their dim names
            self._copy = ((w._h, w._version), copy)
        return copy

    def redistribute_input(self, x, *args, **kwargs):
        return (on_mesh(x, self.device_mesh), *args), kwargs

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self._weight_here())  # [B, S, H] R on tp -> [B, S, vocab] S(-1) on tp

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, tied to the embedding"


class LlamaForCausalLM(GenerationMixin, nn.Module):
    """Hugging Face's ``LlamaForCausalLM`` (inference) on any mesh with dims among dp, tp, pp, ulysess_cp, ring_cp.

    ``model(input_ids)`` with ids ``[B, S]`` as a torch tensor returns torch logits ``[B, S, vocab]``; as a
    dtorch tensor it returns dtorch logits on the ids' mesh, batch and sequence placed like the ids.
    """

    def __init__(self, config, device_mesh: DeviceMesh | None = None, *, mp_policy=None,
                 reshard_after_forward: bool = True):
        super().__init__()
        mesh = get_default_device_mesh(device_mesh)
        self.config = config
        self.model = LlamaModel(config, mesh)
        last = self.model.stage_meshes[-1]
        if _tied(config):
            self.lm_head = TiedLMHead(self.model.embed_tokens.weight, last)
            skip_tied_lm_head_draws(config, self.lm_head.weight.dtype)
        else:
            with Graph.default_graph().device_mesh_guard(last):
                # vocab over tp: logits leave S(-1) on tp and are gathered only when handed back
                self.lm_head = nn.ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=False)
            init_weights_like_hf(self.lm_head, config)
        if mp_policy is not None or not reshard_after_forward or "fsdp" in (mesh.dim_names or ()):
            # FSDP units (autograd/fsdp.py): each module gathers its own weights, the next one's ahead;
            # mp_policy (dtorch.MixedPrecisionPolicy): bf16 compute over float32 master weights
            nn.fully_shard_modules(self, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.model.device_mesh

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, *, selective_ac_option=None) -> None:
        """Recompute each decoder layer's activations in the backward instead of keeping them (training mode).

        ``selective_ac_option=N`` (an int, or its string as torchtitan's ``--activation_checkpoint.selective_ac_option``
        takes it): selective activation checkpointing by layer, only every N-th layer (the N-th, 2N-th, ...) is
        recomputed; the others keep their activations. Op-level selection ("op") is not offered: dtorch's
        backward recomputes each op's local forward anyway, so keeping matmul outputs would save no compute."""
        every = 1
        if selective_ac_option is not None:
            try:
                every = int(selective_ac_option)
            except (TypeError, ValueError):
                every = 0
            if every < 1:
                raise ValueError(f"selective_ac_option must be a layer interval N >= 1 (checkpoint every N-th "
                                 f"layer), got {selective_ac_option!r}")
        self.model.gradient_checkpointing = True
        self.model.checkpoint_every = every

    def gradient_checkpointing_disable(self) -> None:
        self.model.gradient_checkpointing = False

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    def _call(self, input_ids, *args, labels=None, **kwargs):
        # (Module.__call__ runs the forward hooks around this.) Hugging Face's attention_mask / position_ids /
        # past_key_values / use_cache: models/forward.py
        given, args, kwargs = split_forward_arguments(args, kwargs)
        if given:
            return forward_with_arguments(self, input_ids, *args, **given, labels=labels, **kwargs)
        if labels is not None:
            if args or kwargs:
                raise TypeError(f"LlamaForCausalLM(input_ids, labels=...) got unexpected arguments "
                                f"{sorted(kwargs) + ['positional'] * bool(args)}")
            return self._with_loss(input_ids, labels)
        (ids,), _ = self.redistribute_input(input_ids, *args, **kwargs)
        # the caller's ids travel with the call, not on the model: a call inside a call (a hook, another
        # thread) keeps its own
        return self.redistribute_output(self.run_forward((ids,), {}), input_ids)

    def redistribute_input(self, input_ids, *args, **kwargs):
        if args or kwargs:
            raise TypeError("LlamaForCausalLM(input_ids) takes only token ids (no masks, caches or labels)")
        pad = self._even_sequence_padding(input_ids)
        if pad:
            # Attention is causal, so positions appended at the end change nothing before them; with the
            # sequence split evenly over the cp dims every op keeps to the stacked fast path (an uneven
            # split runs each op once per device). The extra logits are cut off in redistribute_output.
            input_ids = torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], pad)], dim=1)
        return (input_ids,), {}

    def _even_sequence_padding(self, input_ids) -> int:
        """Positions to append to torch ids so the cp dims split the sequence evenly (0: none needed).

        Not for rope types whose frequencies depend on the sequence length (dynamic, longrope): extra
        positions would change them. Not for dtorch ids: their logits keep the caller's layout.
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point() \
                or "dynamic" in self.model.rotary_emb.rope_type \
                or self.model.rotary_emb.rope_type == "longrope":
            return 0
        return -input_ids.shape[1] % cp_size(self.model.stage_meshes[0])

    def forward(self, input_ids) -> Tensor:
        return self.lm_head(self.model(input_ids))  # ids laid out by LlamaModel; [B, S, H] -> [B, S, vocab]

    def _with_loss(self, input_ids, labels) -> "CausalLMOutput":
        labels = labels_like(labels, input_ids)
        (ids,), _ = self.redistribute_input(input_ids)
        logits = self.forward(ids)  # [B, S, vocab]: batch over dp/fsdp, sequence over cp, vocab over tp
        return self.causal_lm_loss(logits, labels)

    def causal_lm_loss(self, logits: Tensor, labels: torch.Tensor, front: int = 0) -> "CausalLMOutput":
        """Hugging Face's causal-LM loss: the logits at position i predict ``labels[:, i + 1]``; -100 is
        ignored; the mean over the counted positions. The labels are shifted instead of the logits (HF does
        the same), so the sequence-sharded logits stay as they lie; vocab-sharded logits are never gathered
        (cross_entropy reduces max and sum-exp over the vocab shards). ``logits`` may hold ``front`` columns
        before the labels' and more after them (padding for an even cp split): they count for nothing."""
        back = logits.shape[1] - front - labels.shape[1]
        shifted = torch.nn.functional.pad(labels[:, 1:], (front, back + 1), value=-100)
        placements = [Replicate() if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == 2) else p
                      for p in logits.placements]
        target = Tensor(shifted.to(torch.long), device_mesh=logits.device_mesh, placements=placements)
        # in float32 whatever the model's dtype, as Hugging Face's loss upcasts the logits (they stay as computed)
        loss = F.cross_entropy(logits.float().transpose(1, 2), target, ignore_index=-100)
        if labels.shape[1] != logits.shape[1]:  # (positions added for an even cp split: cut off)
            logits = logits[:, front:front + labels.shape[1]]
        return CausalLMOutput(loss=loss, logits=logits)

    def redistribute_output(self, logits: Tensor, input_ids=None):
        """The logits as the caller of ``model(input_ids)`` gets them: torch logits of the ids' length for torch
        ids (``input_ids``, as the caller passed them), dtorch logits laid out like dtorch ids."""
        if not isinstance(input_ids, Tensor):
            out = torch_logits(logits)  # (with a history that continues in dtorch's backward, under grad mode)
            real = input_ids.shape[1] if input_ids is not None else logits.shape[1]
            return out if real == out.shape[1] else out[:, :real].contiguous()
        return logits.redistribute(input_ids.device_mesh, [Replicate() if isinstance(p, Partial) else p
                                                           for p in input_ids.placements])

    # -- checkpoints -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path, device_mesh: DeviceMesh | None = None, *, dtype: torch.dtype | None = None,
                        progress=None) -> "LlamaForCausalLM":
        """Load a Hugging Face checkpoint directory (config.json + *.safetensors).

        Nothing is initialised randomly; each parameter is read with safetensors' ``get_slice``, one read
        per distinct device block, so a device's data comes only from its own shard of the file.
        ``progress(done, total, name)`` is called after each parameter.
        """
        from ._checkpoint import load_config, load_generation_config, read_sharded

        path = Path(path)
        config = load_config(path)
        if dtype is None:  # like transformers' from_pretrained (dtype "auto"): the dtype the checkpoint names
            dtype = _config_dtype(config)
        graph = Graph.default_graph()
        with nn.skip_init(), graph.dtype_guard(dtype or graph.default_dtype):
            model = cls(config, device_mesh)
        if graph.runtime.holds_values:  # (the meta backend: shapes only, read from config.json alone)
            read_sharded(model, path, progress=progress)
        model.generation_config = load_generation_config(path)
        return model


# ``model(input_ids, labels=...)``: ``loss`` (a 0-d dtorch tensor, ``.backward()`` trains) and ``logits``
# (dtorch, laid out as computed: fetch with ``.to_torch()`` only when needed)
CausalLMOutput = CausalLMOutputWithPast


def _config_dtype(config) -> torch.dtype | None:
    """The config's ``dtype`` (``torch_dtype`` before transformers 5), a torch dtype or its name; None if absent."""
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d.removeprefix("torch."), None)
    return d if isinstance(d, torch.dtype) and d.is_floating_point else None


__all__ = ["LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP",
           "LlamaRotaryEmbedding", "TiedLMHead", "LlamaLayoutError", "check_layout", "activation_placements", "SUPPORTED_MESH_DIMS",
           "CausalForward", "KVCache"]
