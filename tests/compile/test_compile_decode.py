"""generate's decode steps run under dtorch.compile: the tokens and every step's logits equal the eager decode's
bit for bit (and Hugging Face's tokens), with the KV cache's slot table replayed as live Python state."""
from __future__ import annotations

import pytest
import torch

import dtorch
import dtorch.models.generation as generation
from dtorch.models.kv_cache import KVCache
from dtorch.models.llama import LlamaForCausalLM
from tests.llama_models import hf_model

LAYOUTS = [(), (("tp", 2),), (("ring_cp", 2),), (("dp", 2), ("tp", 2), ("pp", 2)),
           (("pp", 2), ("ring_cp", 2), ("tp", 2))]


def _generate(model, ids, mask, compiled: bool, **kw):
    before, generation.COMPILE_DECODE = generation.COMPILE_DECODE, compiled
    try:
        return model.generate(ids, attention_mask=mask, max_new_tokens=9, return_dict_in_generate=True,
                              output_logits=True, **kw)
    finally:
        generation.COMPILE_DECODE = before


@pytest.mark.parametrize("dims", LAYOUTS, ids=lambda d: " x ".join(f"{n}{s}" for n, s in d) or "one device")
def test_compiled_decode_equals_eager_decode(dims):
    hf = hf_model("decode_mha")
    mesh = dtorch.init_device_mesh("cpu", [s for _, s in dims], mesh_dim_names=[n for n, _ in dims]) if dims else None
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 150, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    got, want = _generate(model, ids, mask, True), _generate(model, ids, mask, False)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))
    assert got.timings["decode_replays"] == 7  # 8 decode steps: the first traced, the others replayed
    assert torch.equal(got.sequences, hf.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False))


def test_compiled_decode_with_sampling_draws_as_eager():
    hf = hf_model("decode_gqa")
    model = LlamaForCausalLM(hf.config, dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"]))
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 120, (2, 5), generator=torch.Generator().manual_seed(1))
    outs = [_generate(model, ids, None, c, do_sample=True, top_k=20, generator=torch.Generator().manual_seed(5))
            for c in (True, False)]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert outs[0].timings["decode_replays"] == 7


def test_generate_keeps_its_traced_decode_step_for_the_next_call_of_the_same_shape():
    """A second generate of the same batch size and length reuses the model's KV cache (emptied and zeroed) and
    replays its decode step from the first token on: the tokens of other prompts are Hugging Face's; a caller
    who takes the cache (return_dict_in_generate) gets one of its own."""
    hf = hf_model("decode_gqa")
    model = LlamaForCausalLM(hf.config, dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "tp"]))
    model.load_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(2)
    first, second = (torch.randint(0, 120, (2, 5), generator=g) for _ in range(2))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    for ids in (first, second):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=7)
        assert torch.equal(got, hf.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False))
    step = model.__dict__["_generate_kept"][2]
    assert step.stats["traces"] == 1 and step.stats["replays"] == 5 + 6  # the second call: every step replayed
    out = model.generate(second, attention_mask=mask, max_new_tokens=7, return_dict_in_generate=True)
    assert out.past_key_values is not model.__dict__["_generate_kept"][1] and torch.equal(out.sequences, got)
    longer = model.generate(second, attention_mask=mask, max_new_tokens=9)  # another length: a new cache and trace
    assert torch.equal(longer[:, :12], got) and model.__dict__["_generate_kept"][2] is not step


def test_decode_attends_the_used_slots_rounded_up_with_the_bits_of_attending_every_slot(monkeypatch):
    """A decode step without cp attends the first ``KVCache.attended_slots`` slots (a trace per size): the tokens
    are Hugging Face's and the logits those of attending every slot of the cache, bit for bit (masked slots add
    exact zeros); under cp it attends every slot."""
    hf = hf_model("decode_gqa")
    model = LlamaForCausalLM(hf.config, dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"]))
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 120, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=14, return_dict_in_generate=True, output_logits=True)
    got = model.generate(ids, **kw)  # 19 slots: the steps attend 16, then 19
    assert torch.equal(got.sequences, hf.generate(ids, max_new_tokens=14, do_sample=False))
    assert got.timings["decode_replays"] == 13 - 2
    monkeypatch.setattr(KVCache, "attended_slots", lambda self, n: None)
    every = model.generate(ids, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, every.logits))

    cache = KVCache(model, 2, 1000)
    monkeypatch.undo()
    sizes = set()
    for used in range(1000):
        cache.fill = [used]
        got = cache.attended_slots(1)
        assert used + 1 <= got <= max(16 * -(-(used + 1) // 16), (used + 1) * 5 // 4) and got <= 1000
        sizes.add(got)
    assert len(sizes) <= 8 + 4 * 3  # 16 ... 128, then 4 per doubling up to 1024
    cache.cp = 2  # (each cp block fills from its own front)
    assert cache.attended_slots(1) is None
