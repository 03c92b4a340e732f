"""Tiny Hugging Face Llama models for the tests: one table of configs, one model per (config, dtype).

Hidden 32-128, intermediate ~2.75 x hidden; initializer_range 0.1 so attention is far from uniform and a
wrong position or a misplaced head shows up well above the tolerances.
"""
from __future__ import annotations

import torch
import transformers

CONFIGS = {
    "base": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=160),
    "three_layers": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=160),
    "gqa": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=128),
    # one kv head (with biases: they are replicated over tp like the weights)
    "mqa": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, vocab_size=160, attention_bias=True),
    # decoding (128 positions): MHA with 4 layers (pp=2 gets two per stage); GQA with 2 kv heads (tp=2 gives
    # each tp device one)
    "decode_mha": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=160, max_position_embeddings=128),
    "decode_gqa": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=128),
    # pipeline schedules: 4 layers (stages of 1-4), GQA, a vocab no mesh divides
    "pipeline": dict(hidden_size=32, intermediate_size=88, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=97),
}


def make_config(name: str = "base", **overrides) -> transformers.LlamaConfig:
    kw = dict(max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-6)
    kw.update(CONFIGS[name])
    kw.update(overrides)
    cfg = transformers.LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


_HF: dict = {}


def hf_model(name: str = "base", dtype: torch.dtype = torch.float32) -> transformers.LlamaForCausalLM:
    """The model of config ``name`` (initialized under seed 0, then cast to ``dtype``), made once per session
    and shared: callers may run it, take gradients (zero them first) and copy its state, not change its weights."""
    if (name, dtype) not in _HF:
        torch.manual_seed(0)
        _HF[name, dtype] = transformers.LlamaForCausalLM(make_config(name)).to(dtype).eval()
    return _HF[name, dtype]
