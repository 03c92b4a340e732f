"""Generation with a KV cache against Hugging Face's ``generate`` (float32) under the layout matrix, plus
the cache's layout, memory, plan reuse, Hugging Face's forward arguments and the process backend.

    .venv/bin/pytest -q tests/models/test_generate.py
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import pytest
import torch
import transformers
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import dtorch
from dtorch import CommLog, Shard
from dtorch.models.generation import GenerationError
from dtorch.ops.sampling import _next_token_kernel
from dtorch.models.kv_cache import KVCache, KVCacheError
from dtorch.models.llama import LlamaForCausalLM
from dtorch.ops import dispatch as op_dispatch
from tests.llama_models import hf_model, make_config

RTOL = ATOL = 1e-4
NEW = 32


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models gain nothing from intra-op threads


def mesh_of(dims):
    if not dims:
        return None
    names, sizes = zip(*dims)
    return dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))


def dtorch_model(name: str, dims=()):
    model = LlamaForCausalLM(hf_model(name).config, mesh_of(dims))
    model.load_state_dict(hf_model(name).state_dict())
    return model


def prompts(lengths, vocab: int, seed: int = 1):
    """Left-padded ids [B, max(lengths)] and their attention mask (None when all lengths are equal)."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.zeros(len(lengths), s, dtype=torch.long)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, s - n:] = torch.randint(3, vocab, (n,), generator=g)  # (not the config's bos/eos ids 1, 2)
        mask[r, s - n:] = 1
    return ids, (None if len(set(lengths)) == 1 else mask)


_REF: dict = {}


def hf_generate(name: str, lengths, new: int = NEW, **kw):
    key = (name, tuple(lengths), new, tuple(sorted(kw.items())))
    if key not in _REF:
        hf = hf_model(name)
        ids, mask = prompts(lengths, hf.config.vocab_size)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                              max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=0, **kw)
        _REF[key] = (ids, mask, out.sequences, out.logits)
    return _REF[key]


@dataclass(frozen=True)
class Case:
    name: str
    dims: tuple
    lengths: tuple = (7, 7)


LAYOUTS = [
    Case("no mesh", ()),
    Case("pp2 (4 layers)", (("pp", 2),)),
    Case("ring_cp2", (("ring_cp", 2),)),  # prompt of 7: left-padded to 8 for an even split (masked)
    Case("ulysess_cp2", (("ulysess_cp", 2),), (8, 8)),  # even: the causal fast path
    Case("ring_cp4 x tp2, even prompt", (("ring_cp", 4), ("tp", 2)), (12, 12)),  # the ring skips hidden blocks (ops/attention/ring.py)
    Case("tp2", (("tp", 2),)),
    Case("dp2, 3 prompts of unequal lengths", (("dp", 2),), (7, 3, 5)),
    Case("dp2 x tp2 x pp2 x ring_cp2, unequal lengths", (("dp", 2), ("tp", 2), ("pp", 2), ("ring_cp", 2)), (6, 9, 2)),
]


@pytest.mark.parametrize("config", ["decode_mha", "decode_gqa"])
@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: c.name)
def test_greedy_matches_hugging_face(case, config):
    ids, mask, want, want_logits = hf_generate(config, case.lengths)
    model = dtorch_model(config, case.dims)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, output_logits=True, pad_token_id=0,
                         return_dict_in_generate=True)
    assert got.sequences.shape == want.shape == (len(case.lengths), max(case.lengths) + NEW)
    assert torch.equal(got.sequences, want)
    assert len(got.logits) == NEW
    for step, (a, b) in enumerate(zip(got.logits, want_logits)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("dims,lengths", [((("ring_cp", 4),), (16, 16)), ((("dp", 2), ("ring_cp", 3)), (9, 9, 9))],
                         ids=["stacked devices", "one device at a time (uneven batch)"])
def test_prefill_ring_skips_the_blocks_causality_hides(dims, lengths, monkeypatch):
    """An even prompt under ring_cp: the prefill's ring attention computes only the block pairs a causal
    mask leaves (ring (ring + 1) / 2 of ring^2), with the same logits as Hugging Face's."""
    from dtorch.ops.attention import context_parallel as cp, ring

    used, computed = [], []
    real_ring, real_flash = cp.ring, ring._flash
    monkeypatch.setattr(cp, "ring", lambda plan, *a: used.append(plan.skips_hidden_blocks) or real_ring(plan, *a))
    monkeypatch.setattr(ring, "_flash", lambda q, *a: computed.append(q.shape[0]) or real_flash(q, *a))
    ids, mask, want, want_logits = hf_generate("decode_mha", lengths, new=2)
    model = dtorch_model("decode_mha", dims)
    with CommLog() as log:
        got = model.generate(ids, max_new_tokens=1, output_logits=True, return_dict_in_generate=True)
    assert used == [True] * model.config.num_hidden_layers  # every layer's prefill skipped hidden blocks
    torch.testing.assert_close(got.logits[0], want_logits[0], rtol=RTOL, atol=ATOL)
    ring = dict(dims)["ring_cp"]
    assert log.counts()[("send_recv", "ring_cp")] == 2 * (ring - 1) * model.config.num_hidden_layers
    # batch rows attended per layer (stacked devices fold into the batch): rows x (ring + (ring - 1) + .. + 1)
    assert sum(computed) == model.config.num_hidden_layers * len(lengths) * ring * (ring + 1) // 2


def test_the_logit_check_can_fail():
    """A cache that ignored the padding mask (every slot seen) moves the logits of a padded row far beyond the
    tolerance: the matrix above would notice a mask bug."""
    ids, mask, _, want_logits = hf_generate("decode_mha", (7, 3, 5))
    model = dtorch_model("decode_mha")
    got = model.generate(ids, max_new_tokens=2, output_logits=True, return_dict_in_generate=True)  # no mask
    assert (got.logits[0][1] - want_logits[0][1]).abs().max() > 100 * ATOL


@pytest.mark.parametrize("dims", [(("ring_cp", 2), ("tp", 2)), (("dp", 2), ("ulysess_cp", 2))], ids=str)
def test_left_padded_rows_get_the_tokens_they_get_alone(dims):
    lengths = (9, 4, 6)
    hf = hf_model("decode_mha")
    ids, mask = prompts(lengths, hf.config.vocab_size, seed=5)
    model = dtorch_model("decode_mha", dims)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=12)
    for r, n in enumerate(lengths):
        alone = ids[r:r + 1, ids.shape[1] - n:]
        with torch.no_grad():
            ref = hf.generate(alone, attention_mask=torch.ones_like(alone), max_new_tokens=12, do_sample=False,
                              pad_token_id=0)
        assert torch.equal(batch[r, ids.shape[1]:], ref[0, n:]), f"row {r}"


def test_eos_pads_finished_rows_and_stops():
    ids, mask, greedy, _ = hf_generate("decode_mha", (7, 3, 5))
    eos = int(greedy[1, ids.shape[1] + 3])  # the 4th new token of row 1
    ids, mask, want, _ = hf_generate("decode_mha", (7, 3, 5), eos_token_id=eos)
    model = dtorch_model("decode_mha", (("dp", 2),))
    got = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want)
    assert (got[1, ids.shape[1] + 4:] == 0).all()
    # every row finished: generation stops before max_new_tokens
    first = int(greedy[0, ids.shape[1]])
    stopped = model.generate(ids[:1], max_new_tokens=NEW, eos_token_id=[first], pad_token_id=0)
    assert stopped.shape == (1, ids.shape[1] + 1)


# -- sampling --------------------------------------------------------------------------------------

SAMPLING = dict(do_sample=True, temperature=0.7, top_k=40, top_p=0.9)


def test_sampling_with_a_seed_gives_the_same_tokens_under_every_layout():
    ids, mask = prompts((7, 4, 6), 160, seed=3)
    runs = {}
    for case in [Case("none", ()), Case("tp2", (("tp", 2),)), Case("pp2 ring2", (("pp", 2), ("ring_cp", 2))),
                 Case("dp2 ulysses2", (("dp", 2), ("ulysess_cp", 2))), Case("dp2 tp2", (("dp", 2), ("tp", 2)))]:
        model = dtorch_model("decode_mha", case.dims)
        runs[case.name] = model.generate(ids, attention_mask=mask, max_new_tokens=16,
                                         generator=torch.Generator().manual_seed(7), **SAMPLING)
    first = runs["none"]
    for name, got in runs.items():
        assert torch.equal(got, first), name
    model = dtorch_model("decode_mha")
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=16)
    other_seed = model.generate(ids, attention_mask=mask, max_new_tokens=16,
                                generator=torch.Generator().manual_seed(8), **SAMPLING)
    assert not torch.equal(first, greedy) and not torch.equal(first, other_seed)
    top1 = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=True, top_k=1,
                          generator=torch.Generator().manual_seed(7))
    assert torch.equal(top1, greedy)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.5, 5, None), (1.3, None, 0.8),
                                                     (0.8, 50, 0.95), (1.0, 3, 0.3)])
def test_sampling_filters_are_hugging_faces(temperature, top_k, top_p):
    """The kernel's token is the inverse CDF, at the uniform number, of Hugging Face's warped distribution."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 100, generator=g) * 3
    u = 1.0 - torch.rand(64, generator=g, dtype=torch.float64)
    got = _next_token_kernel(logits, u, sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    probs = scores.softmax(-1)
    cdf = probs.cumsum(-1)
    want = torch.searchsorted(cdf, (u.float() * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
    assert torch.equal(got, want)
    assert (probs.gather(1, got[:, None]) > 0).all()


def test_greedy_next_token_takes_no_uniform_numbers():
    """Greedy: ``next_token`` without ``u`` (generate places none on the devices) is torch's argmax, under an
    uneven batch over dp and vocab over tp; sampling without ``u`` is a clear error."""
    from dtorch.ops.sampling import next_token

    mesh = mesh_of((("dp", 2), ("tp", 2)))
    logits = torch.randn(5, 37, generator=torch.Generator().manual_seed(3))
    x = dtorch.Tensor(logits, device_mesh=mesh, placements=[Shard(0), Shard(1)])
    assert torch.equal(next_token(x, None, False, 1.0, None, None).to_torch(), logits.argmax(-1))
    with pytest.raises(ValueError, match="sampling needs the uniform numbers"):
        next_token(x, None, True, 1.0, None, None)


# -- the cache ---------------------------------------------------------------------------------------

def test_cache_layout_and_bytes_per_device():
    """kv heads over tp, slots over cp, batch over dp, layers on their stage: bytes per device = the ideal
    (every layer's keys and values for prompt + new tokens) / (tp * cp * dp * pp) within 5 %."""
    hf = hf_model("decode_gqa")
    cfg = hf.config
    mesh = mesh_of((("pp", 2), ("dp", 2), ("tp", 2), ("ring_cp", 2)))
    model = dtorch_model("decode_gqa", (("pp", 2), ("dp", 2), ("tp", 2), ("ring_cp", 2)))
    graph = dtorch.default_graph()
    batch, prompt, new = 4, 37, 64
    ids = torch.randint(3, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=2)  # (each stage's rope table is made once, on first use)
    # earlier tests' models hold their kept decode state in a reference cycle (model -> its compiled decode step
    # -> the model): collected now, not between the two readings
    gc.collect()
    before = graph.get_memory_stats(mesh)
    out = model.generate(ids, max_new_tokens=new, eos_token_id=[], return_dict_in_generate=True)
    cache = out.past_key_values
    assert cache.get_seq_length() == prompt + new - 1  # the last token is returned, not run
    k = cache.key_cache[0]
    assert k.placements == [Shard(0), Shard(1), Shard(2)] and k.device_mesh == mesh.unbind("pp")[0]
    assert cache.key_cache[-1].device_mesh == mesh.unbind("pp")[1]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    ideal = 2 * cfg.num_hidden_layers * batch * cfg.num_key_value_heads * (prompt + new) * head_dim * 4
    per_device = cache.memory_per_device()
    assert len(per_device) == 16
    for dev, nbytes in per_device.items():
        assert abs(nbytes / (ideal / 16) - 1) < 0.05, (dev, nbytes, ideal / 16)
    # the Graph's memory statistics see the same bytes (the cache is the only thing this test keeps)
    after = graph.get_memory_stats(mesh)
    for dev, nbytes in per_device.items():
        assert after[dev]["allocated"] - before[dev]["allocated"] == nbytes
    # a second kv head per tp device would double it; a gathered sequence would double it again
    assert 2 * max(per_device.values()) < ideal / 4


def test_decode_step_reuses_its_plans():
    model = dtorch_model("decode_mha", (("tp", 2), ("ring_cp", 2)))
    ids, mask = prompts((7, 4), 160)
    misses = []

    class Recorder:
        def put(self, value):
            misses.append(op_dispatch.stats["plan_misses"])

        def end(self):
            pass

    model.generate(ids, attention_mask=mask, max_new_tokens=12, streamer=Recorder())
    # put: the prompt, then each new token; plans are made by the prefill and the first decode steps
    assert misses[2] > misses[1] > misses[0]
    assert misses[3:] == [misses[3]] * len(misses[3:]), misses


def test_decode_step_never_gathers_the_cache():
    """ring_cp=2 x tp=2: a decode step's communication is the partial outputs of the new token (all_gather on
    ring_cp), the tp all-reduces and the logits' vocab gather; no record comes near a layer's cache."""
    model = dtorch_model("decode_mha", (("tp", 2), ("ring_cp", 2)))
    ids = torch.randint(3, 160, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        with CommLog() as log:
            model(nxt, past_key_values=cache, use_cache=True)
    layers = model.config.num_hidden_layers
    assert log.counts() == {("all_gather", "ring_cp"): 2 * layers, ("all_reduce", "tp"): 2 * layers,
                            ("all_gather", "tp"): 1}
    layer_cache = cache.key_cache[0]._spec.total_bytes()
    assert max(r.nbytes for r in log.records) < layer_cache / 8


def test_cache_made_by_the_user_and_its_errors():
    from dtorch.models.llama import KVCache as api_name

    assert api_name is KVCache
    model = dtorch_model("decode_mha", (("ring_cp", 2),))
    cache = KVCache(model, batch_size=2, max_length=12)
    assert cache.slots == 12 and cache.key_cache[0].placements == [Shard(2)]
    ids = torch.randint(3, 160, (2, 8), generator=torch.Generator().manual_seed(0))
    hf = hf_model("decode_mha")
    with torch.no_grad():
        out = model(ids, past_key_values=cache, use_cache=True)
        ref = hf(ids, use_cache=True)
        torch.testing.assert_close(out.logits, ref.logits, rtol=RTOL, atol=ATOL)
        nxt = ids[:, :3]
        out = model(nxt, past_key_values=cache)
        torch.testing.assert_close(out.logits, hf(nxt, past_key_values=ref.past_key_values).logits, rtol=RTOL, atol=ATOL)
        assert cache.get_seq_length() == 11
        with pytest.raises(KVCacheError, match=r"the KV cache is full: 11 tokens cached, 12 slots .* make it with a larger max_length"):
            model(ids[:, :3], past_key_values=cache)
        with pytest.raises(KVCacheError, match=r"holds 2 rows; this forward has 1"):
            model(ids[:1, :1], past_key_values=KVCache(model, 2, 8))
        with pytest.raises(GenerationError, match=r"past_key_values must be a dtorch.models.kv_cache.KVCache"):
            model(ids, past_key_values=transformers.DynamicCache())
        with pytest.raises(GenerationError, match=r"integer tensor \[batch, seq\] \(torch or dtorch\)"):
            model(ids.float(), use_cache=True)
    with pytest.raises(KVCacheError, match=r"batch_size >= 1 and max_length >= 1"):
        KVCache(model, 0, 8)


# -- Hugging Face's forward arguments -----------------------------------------------------------------

@pytest.mark.parametrize("dims", [(), (("ring_cp", 2), ("tp", 2)), (("pp", 2), ("ulysess_cp", 2))], ids=str)
def test_forward_with_cache_mask_and_positions_matches_hugging_face(dims):
    hf = hf_model("decode_mha")
    model = dtorch_model("decode_mha", dims)
    ids, mask = prompts((9, 5), 160, seed=2)
    with torch.no_grad():
        ref = hf(ids, attention_mask=mask, use_cache=True)
        out = model(ids, attention_mask=mask, use_cache=True)
        real = mask.bool()
        torch.testing.assert_close(out.logits[real], ref.logits[real], rtol=RTOL, atol=ATOL)
        # two more tokens per row, the mask growing with them; then a chunk that outgrows the cache the
        # forward made (it grows: a new slot count, the tokens kept)
        for new in (2, 1, 150):
            nxt = torch.randint(3, 160, (2, new), generator=torch.Generator().manual_seed(new))
            mask = torch.cat([mask, torch.ones(2, new, dtype=torch.long)], dim=1)
            want = hf(nxt, attention_mask=mask, past_key_values=ref.past_key_values, use_cache=True)
            got = model(nxt, attention_mask=mask, past_key_values=out.past_key_values, use_cache=True)
            torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)
            ref, out = want, got
        assert out.past_key_values.get_seq_length() == 9 + 153
        # a padding mask without a cache returns the logits tensor; explicit positions
        pos = torch.arange(3, 12).expand(2, 9)
        plain = model(ids, attention_mask=mask[:, :9], position_ids=pos)
        assert isinstance(plain, torch.Tensor)
        want = hf(ids, attention_mask=mask[:, :9], position_ids=pos).logits
        torch.testing.assert_close(plain[real], want[real], rtol=RTOL, atol=ATOL)


# -- bad input -----------------------------------------------------------------------------------------

def test_generate_bad_input_is_named():
    model = dtorch_model("decode_mha")
    ids = torch.randint(3, 160, (2, 5))
    with pytest.raises(GenerationError, match=r"max_new_tokens must be an int >= 1.*top_p must be a number in \(0, 1\]"):
        model.generate(ids, max_new_tokens=0, do_sample=True, top_p=1.5)
    right_padded = torch.ones(2, 5, dtype=torch.long)
    right_padded[0, -1] = 0
    with pytest.raises(GenerationError, match=r"padding in the last column: pad prompts on the left"):
        model.generate(ids, attention_mask=right_padded)
    with pytest.raises(GenerationError, match=r"token ids in \[0, 160\)"):
        model.generate(ids + 200)
    with pytest.raises(GenerationError, match=r"integer tensor \[batch, seq\] \(torch or dtorch\)"):
        model.generate(torch.randn(2, 5))
    with pytest.raises(GenerationError, match=r"attention_mask must have input_ids' shape"):
        model.generate(ids, attention_mask=torch.ones(2, 4))


# -- the process backend ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dims,lengths", [((("tp", 2),), (6, 3)), ((("ring_cp", 2),), (8, 8))],
                         ids=["tp2, padded", "ring_cp2: per-device writes, causal ring prefill, merge"])
def test_process_backend_generates_the_same_and_fetches_only_token_ids(dims, lengths):
    from tests.runtime.conftest import process_graph, using

    ids, mask = prompts(lengths, 128, seed=4)
    ref = dtorch_model("decode_gqa", dims).generate(ids, attention_mask=mask, max_new_tokens=8)
    graph = process_graph(workers=2)
    try:
        with using(graph):
            model = dtorch_model("decode_gqa", dims)
            fetched = []
            rt = graph.runtime
            real = rt.to_global

            def recording(h, spec):
                fetched.append(spec)
                return real(h, spec)

            rt.to_global = recording
            got = model.generate(ids, attention_mask=mask, max_new_tokens=8)
            rt.to_global = real
    finally:
        graph.runtime.shutdown()
    assert torch.equal(got, ref)
    assert len(fetched) == 8 and all(s.shape == (2,) and s.dtype == torch.int64 for s in fetched), fetched


# -- dtorch generate -------------------------------------------------------------------------------------

def _checkpoint_with_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello dtorch", "once upon a time"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "<s>", "</s>"]))
    tok.save(str(path / "tokenizer.json"))
    hf_model("decode_gqa").save_pretrained(path)
    return tok


def test_generate_cli_with_a_checkpoint_matches_hugging_face(tmp_path, capsys):
    from dtorch.cli import main

    tok = _checkpoint_with_tokenizer(tmp_path)
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "hello world", "--prompt", "the lazy dog jumps",
               "--tp", "2", "--pp", "1", "--ring-cp", "2", "--max-new-tokens", "6", "--check"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "PASS, the same tokens" in out and "cpu[tp=2, ring_cp=2]" in out
    assert "prefill 2 x 4 tokens" in out and "tokens/s" in out and "decode  5 steps x 2 rows" in out
    assert "KV cache" in out and "(1/4.0 of it)" in out  # kv heads over tp, slots over ring_cp
    hf = hf_model("decode_gqa")
    ids = torch.tensor([tok.encode("hello world").ids])
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert tok.decode(want[0, ids.shape[1]:].tolist()) in out  # row 0 streamed as text


def test_generate_cli_random_model_and_bad_flags(capsys):
    from dtorch.cli import main

    rc = main(["generate", "--prompt", "ab", "--prompt", "abcd", "--dp", "2", "--pp", "1", "--tp", "1",
               "--layers", "2", "--hidden", "32", "--heads", "2", "--kv-heads", "2", "--vocab", "64",
               "--max-new-tokens", "4", "--do-sample", "--top-k", "5"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "sampling, up to 4 new tokens" in out and "[1] abcd" in out and "tokens/s" in out
    rc = main(["generate", "--tp", "3", "--top-p", "1.5", "--max-new-tokens", "0", "--check", "--do-sample"])
    err = capsys.readouterr().err
    assert rc == 2
    for msg in ("--max-new-tokens 0 must be at least 1", "--top-p 1.5 must be in (0, 1]",
                "--check compares greedy tokens", "num_attention_heads (8) is not divisible by tp (3)"):
        assert msg in err
    rc = main(["generate", "--model", "/nonexistent/dir"])
    assert rc == 2 and "tokenizer.json" in capsys.readouterr().err


@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}],
                         ids=lambda r: r["rope_type"])
def test_rope_types_past_max_position_embeddings(rope):
    """max_position_embeddings 32, 24 prompt tokens + 16 new: "dynamic" grows its frequencies past 32 in the
    decode steps, as Hugging Face's does."""
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(make_config("decode_mha", max_position_embeddings=32,
                                                   rope_scaling=dict(rope))).eval()
    model = LlamaForCausalLM(hf.config, mesh_of((("ring_cp", 2),)))
    model.load_state_dict(hf.state_dict())
    ids, _ = prompts((24, 24), 160)
    with torch.no_grad():
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    got = model.generate(ids, max_new_tokens=16, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
