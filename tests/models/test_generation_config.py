"""``model.generation_config``: loaded by ``from_pretrained`` from generation_config.json and used by
``generate`` (its arguments override it), resolved as transformers resolves it: an eos id list (the
Llama-3-Instruct pattern: a row stops at any of them), the pad id, ``max_new_tokens`` / ``max_length``, the
sampling defaults. Greedy tokens equal Hugging Face's ``generate`` on the same checkpoint.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from dtorch.models import generation
from dtorch.models.generation import GenerationError, resolve_generation_config
from dtorch.models.llama import LlamaForCausalLM

from tests.llama_models import hf_model

from .test_generate import mesh_of, prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = (7, 3, 5)
LAYOUTS = [(), (("tp", 2), ("ring_cp", 2)), (("dp", 2), ("pp", 2))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_model("decode_mha").save_pretrained(path)
    return path


def with_generation_config(path, **settings):
    """Write generation_config.json (as a checkpoint on the Hub holds it) and return the directory."""
    (path / "generation_config.json").write_text(json.dumps(settings))
    return path


def load_both(path, dims=()):
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return LlamaForCausalLM.from_pretrained(path, mesh_of(dims)), hf


def eos_ids(greedy: torch.Tensor, prompt: int) -> list:
    """An eos id list that ends every row early: row r's greedy token at new position 2 + r."""
    return sorted({int(greedy[r, prompt + 2 + r]) for r in range(greedy.shape[0])})


@pytest.fixture(scope="module")
def greedy():
    """Hugging Face's greedy continuation of the prompts without any eos id (for picking eos ids)."""
    hf = hf_model("decode_mha")
    ids, mask = prompts(LENGTHS, hf.config.vocab_size)
    with torch.no_grad():
        return hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                           pad_token_id=0)


@pytest.mark.parametrize("dims", LAYOUTS, ids=str)
def test_an_eos_list_in_generation_config_json_stops_each_row(checkpoint, greedy, dims):
    ids, mask = prompts(LENGTHS, 160)
    eos = eos_ids(greedy, ids.shape[1])
    path = with_generation_config(checkpoint, bos_token_id=1, eos_token_id=eos, pad_token_id=0, max_new_tokens=12)
    model, hf = load_both(path, dims)
    assert model.generation_config.to_dict() == hf.generation_config.to_dict()
    got = model.generate(ids, attention_mask=mask)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask)
    assert torch.equal(got, want)
    assert got.shape[1] < ids.shape[1] + 12  # every row reached one of the eos ids
    for r in range(len(LENGTHS)):  # after its eos a row holds the pad id
        new = got[r, ids.shape[1]:].tolist()
        first = next(i for i, t in enumerate(new) if t in eos)
        assert all(t == 0 for t in new[first + 1:])


_SETTINGS = [
    {},
    {"max_new_tokens": 4},
    {"max_length": 11},  # counts the prompt (7): 4 new tokens
    {"max_new_tokens": 3, "max_length": 30},  # max_new_tokens wins
    {"eos_token_id": None},  # no eos: the configured length
    {"pad_token_id": 5},
    {"do_sample": False},
]


@pytest.mark.parametrize("kwargs", _SETTINGS, ids=lambda kw: ",".join(kw) or "no arguments")
def test_arguments_override_the_generation_config(checkpoint, greedy, kwargs):
    ids, mask = prompts(LENGTHS, 160)
    path = with_generation_config(checkpoint, eos_token_id=eos_ids(greedy, ids.shape[1]), pad_token_id=0,
                                  max_length=ids.shape[1] + 9, do_sample=True, temperature=0.6, top_p=0.9)
    model, hf = load_both(path, (("tp", 2),))
    kw = dict(kwargs)
    kw.setdefault("do_sample", False)  # (compare greedy tokens; the sampling settings stay the config's)
    got = model.generate(ids, attention_mask=mask, **kw)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(got, want)


def _hf_resolved(hf, ids, kwargs):
    """transformers' generate's resolution of its settings (its own methods, in its order)."""
    has_default_max_length = kwargs.get("max_length") is None and hf.generation_config.max_length is None
    has_default_min_length = kwargs.get("min_length") is None and hf.generation_config.min_length is None
    cfg, _ = hf._prepare_generation_config(None, **kwargs)
    return hf._prepare_generated_length(cfg, has_default_max_length, has_default_min_length, "input_ids",
                                        ids.shape[1], ids)


@pytest.mark.parametrize("config", [{}, {"do_sample": True}, {"do_sample": True, "temperature": 0.6, "top_p": 0.9},
                                    {"max_length": 40, "top_k": 7, "eos_token_id": [2, 9]}],
                         ids=lambda c: ",".join(c) or "empty")
@pytest.mark.parametrize("kwargs", [{}, {"do_sample": True}, {"top_k": None, "temperature": 0.8},
                                    {"max_new_tokens": 5}, {"max_length": 12, "top_p": 0.5}, {"top_k": 0}],
                         ids=lambda k: ",".join(k) or "none")
def test_settings_resolve_as_in_transformers(checkpoint, config, kwargs):
    path = with_generation_config(checkpoint, **config)
    model, hf = load_both(path)
    ids, _ = prompts((7,), 160)
    ours = resolve_generation_config(model, ids.shape[1], **kwargs)
    theirs = _hf_resolved(hf, ids, kwargs)
    for field in ("do_sample", "temperature", "top_k", "top_p", "max_length", "eos_token_id", "pad_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_no_length_anywhere_is_twenty_new_tokens_within_max_position_embeddings(checkpoint):
    path = with_generation_config(checkpoint, eos_token_id=None)
    model, hf = load_both(path)
    for length in (7, 120):  # max_position_embeddings 128: 20 new tokens, then 8
        ids = torch.randint(3, 160, (1, length), generator=torch.Generator().manual_seed(length))
        got = model.generate(ids)
        with torch.no_grad(), pytest.warns(UserWarning, match="default `max_length`"):
            want = hf.generate(ids)
        assert torch.equal(got, want) and got.shape[1] == min(length + 20, 128)


def test_sampling_defaults_come_from_the_generation_config(checkpoint, monkeypatch):
    """The Llama-3-Instruct settings (do_sample, temperature 0.6, top_p 0.9) with transformers' top_k 50 reach
    the sampler; arguments override them; the same seed gives the tokens of the same explicit settings."""
    chosen = []
    real = generation._choose
    monkeypatch.setattr(generation, "_choose", lambda logits, u, sampling: chosen.append(sampling) or real(logits, u, sampling))
    path = with_generation_config(checkpoint, do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=None)
    model = LlamaForCausalLM.from_pretrained(path)
    ids, mask = prompts(LENGTHS, 160)

    def run(**kw):
        chosen.clear()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, generator=torch.Generator().manual_seed(3), **kw)
        return out, chosen[0]

    from_config, sampling = run()
    assert sampling == (True, 0.6, 50, 0.9)
    explicit, _ = run(do_sample=True, temperature=0.6, top_k=50, top_p=0.9)
    assert torch.equal(from_config, explicit)
    assert run(top_k=0)[1] == (True, 0.6, None, 0.9)  # 0 (or None): no top-k filter, as in transformers
    assert run(temperature=1.2, top_p=None)[1] == (True, 1.2, 50, None)
    assert run(do_sample=False)[1] == (False, 1.0, None, None)
    plain = LlamaForCausalLM(hf_model("decode_mha").config)  # built from a config: transformers' defaults
    chosen.clear()
    plain.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True)
    assert chosen[0] == (True, 1.0, 50, 1.0)


def test_the_pad_id_marks_padding_when_no_mask_is_given(checkpoint, greedy):
    """transformers' generate without an attention mask: the pad id's places are padding when the prompt holds
    it and it is not an eos id."""
    ids, mask = prompts(LENGTHS, 160)  # left-padded with 0
    path = with_generation_config(checkpoint, eos_token_id=eos_ids(greedy, ids.shape[1]), pad_token_id=0,
                                  max_new_tokens=8)
    model, hf = load_both(path, (("dp", 2),))
    got = model.generate(ids)
    with torch.no_grad():
        want = hf.generate(ids)
    assert torch.equal(got, want)
    assert torch.equal(got, model.generate(ids, attention_mask=mask))


def test_generation_config_from_the_model_config(checkpoint):
    """A model built from a config gets transformers' generation config for it; a checkpoint without
    generation_config.json gets one made from config.json, as transformers' from_pretrained does."""
    hf = hf_model("decode_mha")
    assert LlamaForCausalLM(hf.config).generation_config.to_dict() == hf.generation_config.to_dict()
    (checkpoint / "generation_config.json").unlink()
    model, ref = load_both(checkpoint)
    assert model.generation_config.to_dict() == ref.generation_config.to_dict()
    assert model.generation_config.eos_token_id == hf.config.eos_token_id == 2


def test_settings_generate_cannot_honour_are_named(checkpoint):
    path = with_generation_config(checkpoint, repetition_penalty=1.3)
    model = LlamaForCausalLM.from_pretrained(path)
    ids = torch.randint(3, 160, (1, 5))
    with pytest.raises(GenerationError, match=r"repetition_penalty=1.3 is not supported.*model.generation_config"):
        model.generate(ids)
    model.generation_config.repetition_penalty = 1.0
    assert model.generate(ids, max_new_tokens=2).shape == (1, 7)
    with pytest.raises(GenerationError, match=r"num_beams=2 is not supported"):
        model.generate(ids, num_beams=2)
    with pytest.raises(GenerationError, match=r"takes no argument colour"):
        model.generate(ids, colour="red")
    with pytest.raises(GenerationError, match=r"the prompt has 5 tokens but max_length is 4.*set max_new_tokens"):
        model.generate(ids, max_length=4)
