"""A Llama built from a config has Hugging Face's weights bit for bit for the same seed, in every layout of
the Llama matrix (tied and untied embeddings), and leaves torch's generator where Hugging Face leaves it;
its loss is float32 like Hugging Face's whatever the model's dtype."""
from __future__ import annotations

import pytest
import torch
import transformers

import dtorch
from dtorch.models.llama import LlamaForCausalLM, LlamaModel
from tests.llama_models import make_config

from .test_llama import LAYOUTS
from .test_llama_train import FSDP_LAYOUTS

SEED = 5


def _hf_and_state_after(config, model_cls=transformers.LlamaForCausalLM, dtype=None):
    previous = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(SEED)
        hf = model_cls(config)
        return hf.state_dict(), torch.get_rng_state()
    finally:
        torch.set_default_dtype(previous)


def _check_same(model, expected: dict, rng_after: torch.Tensor) -> None:
    after = torch.randn(4)
    torch.set_rng_state(rng_after)
    assert torch.equal(after, torch.randn(4)), "the generator advanced differently from Hugging Face's"
    got = model.state_dict()
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype, key
        assert torch.equal(got[key], value), f"{key}: max difference {(got[key] - value).abs().max()}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout", LAYOUTS + FSDP_LAYOUTS, ids=lambda lay: lay.name)
def test_seeded_init_equals_hugging_face(layout, tied):
    # a padding row (zeroed after the draw) and HF's default range on the untied runs, 0.1 on the tied ones
    overrides = dict(tie_word_embeddings=tied, pad_token_id=3) if tied else dict(initializer_range=0.02)
    config = make_config(layout.config, **overrides)
    expected, rng_after = _hf_and_state_after(config)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config, layout.mesh())
    _check_same(model, expected, rng_after)


def test_the_init_check_can_fail():
    config = make_config("gqa")
    expected, _ = _hf_and_state_after(config)
    torch.manual_seed(SEED + 1)
    got = LlamaForCausalLM(config, dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])).state_dict()
    assert not torch.equal(got["model.layers.0.self_attn.k_proj.weight"], expected["model.layers.0.self_attn.k_proj.weight"])


def test_init_uses_the_configs_initializer_range():
    config = make_config("base", initializer_range=0.37)
    model = (torch.manual_seed(0), LlamaForCausalLM(config))[1]
    std = model.state_dict()["model.layers.0.mlp.gate_proj.weight"].std().item()
    assert 0.3 < std < 0.45
    assert torch.equal(model.state_dict()["model.layers.0.input_layernorm.weight"], torch.ones(64))


def test_llama_model_alone_equals_hugging_face():
    config = make_config("mqa")  # one kv head held on 4 tp devices, biases
    expected, rng_after = _hf_and_state_after(config, transformers.LlamaModel)
    torch.manual_seed(SEED)
    model = LlamaModel(config, dtorch.init_device_mesh("cpu", (2, 4), mesh_dim_names=["pp", "tp"]))
    _check_same(model, expected, rng_after)
    assert not expected["layers.0.self_attn.k_proj.bias"].any()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bfloat16_init_equals_hugging_face_in_bfloat16(tied):
    config = make_config("gqa", tie_word_embeddings=tied)
    expected, rng_after = _hf_and_state_after(config, dtype=torch.bfloat16)
    with dtorch.default_graph().dtype_guard(torch.bfloat16):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config, dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"]))
    _check_same(model, expected, rng_after)


# -- the loss --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(), (("dp", 2), ("tp", 2)), (("pp", 2), ("ring_cp", 2))], ids=str)
def test_bfloat16_loss_is_float32_like_hugging_face(dims):
    config = make_config("base")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 2] = -100
    with torch.no_grad():
        ref = hf(ids, labels=labels)
    assert ref.logits.dtype == torch.bfloat16 and ref.loss.dtype == torch.float32
    mesh = dtorch.init_device_mesh("cpu", [s for _, s in dims], mesh_dim_names=[n for n, _ in dims]) if dims else None
    with dtorch.default_graph().dtype_guard(torch.bfloat16):
        model = LlamaForCausalLM(config, mesh)
    model.load_state_dict(hf.state_dict())
    out = model(ids, labels=labels)
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    torch.testing.assert_close(out.loss.to_torch(), ref.loss, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out.logits.to_torch(), ref.logits, rtol=2e-2, atol=6e-2)  # a few bf16 ulps
    out.loss.backward()
    assert model.lm_head.weight.grad.dtype == torch.bfloat16
