"""dtorch's Llama against Hugging Face's LlamaForCausalLM (float32, rtol = atol = 1e-4) under a declared
matrix of parallel layouts, plus communication and bad-input checks.

    pytest -q tests/models/test_llama.py                          # virtual "cpu" devices
    DTORCH_DTENSOR_IN_SAME_DEVICE=1 DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE=16 \\
        python3 tests/models/test_llama.py                        # the same matrix on simulated "cuda" meshes
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run with a python that lacks torch: use the repository's .venv instead
    import importlib.util

    _venv = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".venv", "bin", "python")
    if importlib.util.find_spec("torch") is None and os.path.exists(_venv):
        os.execv(_venv, [_venv, *sys.argv])

import time
from dataclasses import dataclass

import pytest
import torch
import transformers

import dtorch
from dtorch import CommLog, Replicate, Shard
from dtorch.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaLayoutError, LlamaRotaryEmbedding
from dtorch.nn import StateDictError
from tests.llama_models import CONFIGS, hf_model, make_config

RTOL = ATOL = 1e-4

@dataclass(frozen=True)
class Layout:
    name: str
    dims: tuple = ()  # ((mesh dim name, size), ...) in mesh-dim order; () means no mesh
    batch: int = 2
    seq: int = 8
    config: str = "base"

    @property
    def devices(self) -> int:
        n = 1
        for _, s in self.dims:
            n *= s
        return n

    def mesh(self, device_type: str = "cpu"):
        if not self.dims:
            return None
        names, sizes = zip(*self.dims)
        return dtorch.init_device_mesh(device_type, sizes, mesh_dim_names=list(names))


# the layout matrix (odd batch and sequence sizes wherever the split still divides them)
LAYOUTS = [
    Layout("no mesh", (), batch=3, seq=7),
    Layout("dp2", (("dp", 2),), batch=4, seq=9),
    Layout("dp2 uneven batch", (("dp", 2),), batch=3, seq=5),
    Layout("tp2", (("tp", 2),), batch=3, seq=7),
    Layout("pp2", (("pp", 2),), batch=3, seq=5),
    Layout("ulysses2", (("ulysess_cp", 2),), batch=3, seq=6),
    Layout("ulysses2 (alias spelling)", (("ulysses_cp", 2),), batch=1, seq=10),
    Layout("ring2", (("ring_cp", 2),), batch=3, seq=10),
    Layout("ring2 uneven sequence", (("ring_cp", 2),), batch=1, seq=7),
    Layout("ulysses2 x ring2", (("ulysess_cp", 2), ("ring_cp", 2)), batch=1, seq=12),
    Layout("tp2 x pp2 x ulysses2", (("tp", 2), ("pp", 2), ("ulysess_cp", 2)), batch=3, seq=6),
    Layout("dp2 x tp2 x pp2 x ulysses2", (("dp", 2), ("tp", 2), ("pp", 2), ("ulysess_cp", 2)), batch=2, seq=10),
    Layout("dp2 x tp2 x pp2 x ring2", (("pp", 2), ("dp", 2), ("ring_cp", 2), ("tp", 2)), batch=4, seq=6),
    Layout("dp2 x tp2 x pp2 x ring2, batch 3, seq 7", (("dp", 2), ("tp", 2), ("pp", 2), ("ring_cp", 2)), batch=3, seq=7),
    Layout("tp4", (("tp", 4),), batch=3, seq=7),
    Layout("ring4", (("ring_cp", 4),), batch=1, seq=12),
    Layout("gqa 8/2 heads, tp2 x ulysses2 x ring2", (("tp", 2), ("ulysess_cp", 2), ("ring_cp", 2)), batch=1, seq=8,
           config="gqa"),
    Layout("3 layers on pp2 (uneven split)", (("pp", 2), ("tp", 2)), batch=3, seq=5, config="three_layers"),
    # fewer kv heads than tp: each kv head replicated on the tp devices whose query heads use it
    Layout("gqa 8/2 heads, tp4", (("tp", 4),), batch=3, seq=7, config="gqa"),
    Layout("gqa 8/2 heads, dp2 x tp4", (("dp", 2), ("tp", 4)), batch=3, seq=5, config="gqa"),
    Layout("mqa 4/1 heads, tp2 x ulysses2", (("tp", 2), ("ulysess_cp", 2)), batch=2, seq=6, config="mqa"),
    Layout("mqa 4/1 heads, pp2 x tp4 x ring2", (("pp", 2), ("tp", 4), ("ring_cp", 2)), batch=1, seq=7, config="mqa"),
]


def run_layout(layout: Layout, device_type: str = "cpu"):
    """(dtorch logits, Hugging Face logits) for one layout, torch ids in and torch logits out."""
    hf = hf_model(layout.config)
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (layout.batch, layout.seq))
    model = LlamaForCausalLM(hf.config, layout.mesh(device_type))
    model.load_state_dict(hf.state_dict())
    with torch.no_grad():
        expected = hf(ids).logits
    return model(ids), expected


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_layout_matches_hugging_face(layout):
    got, expected = run_layout(layout)
    assert isinstance(got, torch.Tensor) and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_the_check_can_fail():
    """Local positions on two sequence shards (0..3, 0..3 instead of 0..7: the classic context-parallel
    RoPE bug) move the logits far beyond the tolerance, so the matrix above can detect it."""
    hf = hf_model()
    ids = torch.randint(0, 160, (2, 8))
    with torch.no_grad():
        a = hf(ids).logits
        b = hf(ids, position_ids=torch.arange(4).repeat(2)[None].expand(2, 8)).logits
    assert (a - b).abs().max() > 100 * ATOL


def test_dtorch_ids_come_back_in_the_callers_layout():
    hf = hf_model()
    mesh = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["dp", "pp", "tp"])
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 160, (4, 6))
    dids = dtorch.Tensor(ids, device_mesh=mesh, placements=[Shard(0), Replicate(), Shard(1)])
    out = model(dids)
    assert isinstance(out, dtorch.Tensor) and out.device_mesh == mesh
    assert out.placements == [Shard(0), Replicate(), Shard(1)]
    with torch.no_grad():
        torch.testing.assert_close(out.to_torch(), hf(ids).logits, rtol=RTOL, atol=ATOL)


def test_llama_model_hidden_states():
    hf = hf_model()
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["tp", "ring_cp"])
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 160, (2, 6))
    h = model.model(ids)
    assert h.placements == [Replicate(), Shard(1)]
    with torch.no_grad():
        torch.testing.assert_close(h.to_torch(), hf.model(ids).last_hidden_state, rtol=RTOL, atol=ATOL)


def test_parameter_layout_and_stages():
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "tp"])
    model = LlamaForCausalLM(make_config("three_layers"), mesh)
    stages = mesh.unbind("pp")
    assert model.model.layer_stages == [0, 0, 1]
    assert model.model.embed_tokens.weight.device_mesh == stages[0]
    assert [layer.first_param_device_mesh() for layer in model.model.layers] == [stages[0], stages[0], stages[1]]
    assert model.model.norm.weight.device_mesh == stages[1] and model.lm_head.weight.device_mesh == stages[1]
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, model.lm_head):
        assert lin.weight.placements == [Shard(0)]
    for lin in (attn.o_proj, mlp.down_proj):
        assert lin.weight.placements == [Shard(1)]
    assert model.model.embed_tokens.weight.placements == [Shard(1)]
    hf_names = list(hf_model("three_layers").state_dict())
    assert list(model.state_dict()) == hf_names


# -- communication ---------------------------------------------------------------------------------

def test_tp2_decoder_layer_does_two_all_reduces():
    cfg = make_config()
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    torch.manual_seed(2)
    ref = transformers.models.llama.modeling_llama.LlamaDecoderLayer(cfg, 0).eval()
    with dtorch.default_graph().device_mesh_guard(mesh):
        layer = LlamaDecoderLayer(cfg, 0)
        rope = LlamaRotaryEmbedding(cfg)
    layer.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, cfg.hidden_size)
    cos, sin = rope(dtorch.arange(6, device_mesh=mesh))
    h = dtorch.Tensor(x, device_mesh=mesh)
    with CommLog() as log:
        out = layer(h, cos, sin)
    assert log.counts() == {("all_reduce", "tp"): 2}
    assert out.placements == [Replicate()]
    with torch.no_grad():
        expected = ref(x, position_embeddings=(cos.to_torch()[None], sin.to_torch()[None]))
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(out.to_torch(), expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dims,config", [((("pp", 2),), "base"), ((("pp", 2), ("tp", 2)), "three_layers"),
                                          ((("dp", 2), ("pp", 3)), "three_layers")], ids=str)
def test_pipeline_hand_offs_are_send_recv_on_stage_boundaries(dims, config):
    names, sizes = zip(*dims)
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
    hf = hf_model(config)
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, hf.config.vocab_size, (2, 5))
    with CommLog() as log:
        out = model(ids)
    stages = model.model.layer_stages
    boundaries = [(stages[i], stages[i + 1]) for i in range(len(stages) - 1) if stages[i] != stages[i + 1]]
    moves = [r for r in log.records if r.kind == "send_recv"]
    assert [r.mesh_dim for r in moves] == ["pp"] * len(boundaries)
    stage_meshes = mesh.unbind("pp")
    for rec, (a, b) in zip(moves, boundaries):
        assert set(rec.devices) == set(stage_meshes[a].device_ids) | set(stage_meshes[b].device_ids)
    with torch.no_grad():
        torch.testing.assert_close(out, hf(ids).logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dims,expected_per_layer,expected_once", [
    # Ulysses: q, k, v to heads and the output back; TP: o_proj and the layer output
    ((("dp", 2), ("tp", 2), ("pp", 2), ("ulysess_cp", 2)),
     {("all_reduce", "tp"): 2, ("all_to_all", "ulysess_cp"): 4}, {("all_gather", "tp"): 1, ("send_recv", "pp"): 1}),
    # Ring: k and v passed on once per extra block
    ((("pp", 2), ("dp", 2), ("ring_cp", 2), ("tp", 2)),
     {("all_reduce", "tp"): 2, ("send_recv", "ring_cp"): 2}, {("all_gather", "tp"): 1, ("send_recv", "pp"): 1}),
], ids=["dp2xtp2xpp2xulysses2", "dp2xtp2xpp2xring2"])
def test_sixteen_device_forward_communicates_exactly(dims, expected_per_layer, expected_once):
    """Besides the per-layer collectives: the embedding's all_gather over tp and one pipeline hand-off."""
    names, sizes = zip(*dims)
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
    cfg = make_config()
    model = LlamaForCausalLM(cfg, mesh)
    with CommLog() as log:
        model(torch.randint(0, cfg.vocab_size, (4, 8)))
    expected = {k: v * cfg.num_hidden_layers for k, v in expected_per_layer.items()}
    for k, v in expected_once.items():
        expected[k] = expected.get(k, 0) + v
    assert log.counts() == expected


def test_data_parallel_alone_communicates_nothing_but_the_output():
    hf = hf_model()
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids = dtorch.Tensor(torch.randint(0, 160, (4, 5)), device_mesh=mesh, placements=[Shard(0)])
    with CommLog() as log:
        out = model(ids)
    assert log.counts() == {} and out.placements == [Shard(0)]


# -- checkpoints ----------------------------------------------------------------------------------

def test_from_pretrained_reads_only_each_devices_shard(tmp_path, monkeypatch):
    import safetensors

    hf = hf_model()
    hf.save_pretrained(tmp_path)
    reads = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *a, **kw):
            self.h = real_open(*a, **kw)

        def __enter__(self):
            self.f = self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            sl = self.f.get_slice(name)

            class Slice:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, idx):
                    out = sl[idx]
                    reads.append((name, tuple(out.shape)))
                    return out

            return Slice()

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["tp", "pp"])
    seen = []
    model = LlamaForCausalLM.from_pretrained(tmp_path, device_mesh=mesh, progress=lambda i, n, k: seen.append((i, n)))
    assert seen[-1] == (len(hf.state_dict()), len(hf.state_dict()))
    q = [shape for name, shape in reads if name == "model.layers.0.self_attn.q_proj.weight"]
    assert q == [(32, 64), (32, 64)]  # two tp shards, each read once (replicas share the read)
    norm = [shape for name, shape in reads if name == "model.norm.weight"]
    assert norm == [(64,)]
    ids = torch.randint(0, 160, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=RTOL, atol=ATOL)


def test_from_pretrained_tied_embeddings(tmp_path):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(make_config(tie_word_embeddings=True)).eval()
    hf.save_pretrained(tmp_path)
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "tp"])
    model = LlamaForCausalLM.from_pretrained(tmp_path, device_mesh=mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 160, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=RTOL, atol=ATOL)


def test_checkpoint_with_a_mismatched_shape_leaves_the_model_unchanged(tmp_path):
    from dtorch.models._checkpoint import read_sharded

    base = make_config()
    torch.manual_seed(1)  # only the MLP width differs: the attention weights before it would load fine
    transformers.LlamaForCausalLM(make_config(intermediate_size=base.intermediate_size + 8)).save_pretrained(tmp_path)
    model = LlamaForCausalLM(base, dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"]))
    model.load_state_dict(hf_model().state_dict())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateDictError, match=r"size mismatch for model\.layers\.0\.mlp\.gate_proj\.weight"):
        read_sharded(model, tmp_path)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# -- bad input --------------------------------------------------------------------------------------

def test_unsupported_mesh_dims_are_named():
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["tp", "sp"])
    with pytest.raises(ValueError, match=r"\['sp'\] are not supported.*'dp'.*'ring_cp'.*'tp'.*'ulysess_cp'"):
        LlamaForCausalLM(make_config(), mesh)


@pytest.mark.parametrize("dims,config,message", [
    ((("tp", 3),), "base", r"num_attention_heads \(4\) is not divisible by tp \(3\)"),
    ((("tp", 4),), dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6),
     r"num_key_value_heads \(6\) and tp \(4\) do not divide one another"),
    ((("tp", 4),), dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=3),
     r"num_key_value_heads \(3\) and tp \(4\) do not divide one another"),
    ((("ulysess_cp", 8),), "base", r"query heads per tp shard .* not divisible by ulysess_cp \(8\)"),
    ((("tp", 2), ("ulysses_cp", 4)), "base", r"query heads per tp shard .* not divisible by ulysess_cp \(4\)"),
    ((("pp", 3),), "base", r"num_hidden_layers \(2\) is smaller than pp \(3\)"),
], ids=str)
def test_head_and_layer_counts_a_layout_cannot_serve(dims, config, message):
    names, sizes = zip(*dims)
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
    with pytest.raises(LlamaLayoutError, match=message):
        LlamaForCausalLM(make_config(config) if isinstance(config, str) else make_config(**config), mesh)


def test_ulysses_needs_a_sequence_it_can_split():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["ulysess_cp"])
    model = LlamaForCausalLM(make_config(), mesh)
    ids = torch.randint(0, 160, (2, 5), generator=torch.Generator().manual_seed(0))
    # dtorch ids keep their layout: the uneven split is refused with the fix spelled out
    with pytest.raises(dtorch.OpError, match=r"sequence lengths .*5.* divisible by ulysess_cp \(2\)"):
        model(dtorch.Tensor(ids, device_mesh=mesh))
    # torch ids are padded at the end to an even split (causal: the real positions do not see the padding)
    model.load_state_dict(hf_model().state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf_model()(ids).logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dims,seq", [((("ring_cp", 3),), 10), ((("ulysess_cp", 2), ("ring_cp", 2)), 6),
                                      ((("ring_cp", 4),), 3)], ids=str)
def test_uneven_sequences_are_padded_to_an_even_split(dims, seq):
    names, sizes = zip(*dims)
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
    model = LlamaForCausalLM(make_config(), mesh)
    model.load_state_dict(hf_model().state_dict())
    ids = torch.randint(0, 160, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(ids)
        torch.testing.assert_close(got, hf_model()(ids).logits, rtol=RTOL, atol=ATOL)
    assert got.shape == (2, seq, 160) and got.is_contiguous()
    # the dynamic rope's frequencies depend on the length: no padding there (exactness over speed)
    dyn = LlamaForCausalLM(make_config(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), mesh)
    assert dyn._even_sequence_padding(ids) == 0 and model._even_sequence_padding(ids) == -seq % mesh.size()


def test_state_dict_mismatches():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    model = LlamaForCausalLM(make_config(), mesh)
    sd = hf_model().state_dict()
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(StateDictError, match=r'Missing key\(s\) in state_dict: "model.layers.1.mlp.up_proj.weight"'):
        model.load_state_dict(missing)
    with pytest.raises(StateDictError, match=r'Unexpected key\(s\) in state_dict: "model.layers.2.mlp.up_proj.weight"'):
        model.load_state_dict(dict(sd, **{"model.layers.2.mlp.up_proj.weight": torch.zeros(176, 64)}))
    other = transformers.LlamaForCausalLM(make_config(vocab_size=150)).state_dict()
    with pytest.raises(StateDictError, match=r"size mismatch for model.embed_tokens.weight: copying a param with "
                                             r"shape torch.Size\(\[150, 64\]\) from checkpoint, the shape in current "
                                             r"model is torch.Size\(\[160, 64\]\)"):
        model.load_state_dict(other)


def test_bad_input_ids():
    model = LlamaForCausalLM(make_config())
    with pytest.raises(TypeError, match=r"integer tensor \[batch, seq\]"):
        model(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"integer tensor \[batch, seq\]"):
        model(torch.zeros(4, dtype=torch.long))


# -- rope types ------------------------------------------------------------------------------------

HEAD_DIM = CONFIGS["base"]["hidden_size"] // CONFIGS["base"]["num_attention_heads"]
ROPE_TYPES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 16, "attention_factor": 1.1,
                 "short_factor": [1.0 + i / 16 for i in range(HEAD_DIM // 2)],
                 "long_factor": [1.5 + i / 4 for i in range(HEAD_DIM // 2)]},
}


def rope_models(rope: dict, mesh=None):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(make_config(max_position_embeddings=32, rope_scaling=dict(rope))).eval()
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    return model, hf


@pytest.mark.parametrize("rope_type", list(ROPE_TYPES))
def test_rope_types_match_hugging_face_beyond_max_position_embeddings(rope_type):
    """max_position_embeddings 32; sequences of 40, 36, 12 and 40 tokens in that order: "dynamic" grows its
    table at 40, keeps it for 36 (> 32, not longer than before) and resets at 12, like Hugging Face;
    "longrope" switches between its short and long factors at original_max_position_embeddings."""
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["tp", "ring_cp"])
    model, hf = rope_models(ROPE_TYPES[rope_type], mesh)
    torch.manual_seed(1)
    for seq in (40, 36, 12, 40):
        ids = torch.randint(0, 160, (1, seq))
        with torch.no_grad():
            torch.testing.assert_close(model(ids), hf(ids).logits, rtol=RTOL, atol=ATOL)


def test_dynamic_rope_check_can_fail():
    """Without the recomputation (the table for max_position_embeddings at 40 tokens) the logits are far off."""
    model, hf = rope_models(ROPE_TYPES["dynamic"])
    ids = torch.randint(0, 160, (1, 40))
    with torch.no_grad():
        expected = hf(ids).logits
        hf.model.rotary_emb.inv_freq.copy_(hf.model.rotary_emb.original_inv_freq)
        hf.model.rotary_emb.max_seq_len_cached = 40  # keep it from growing again
        assert (hf(ids).logits - expected).abs().max() > 100 * ATOL


def test_unsupported_rope_settings_are_named():
    cfg = make_config(rope_scaling=dict(ROPE_TYPES["linear"]))
    cfg.rope_parameters["rope_type"] = "bogus"
    with pytest.raises(LlamaLayoutError, match=r"rope_type 'bogus' is not supported.*'dynamic'.*'linear'.*'llama3'.*'yarn'"):
        LlamaForCausalLM(cfg)
    cfg = make_config(rope_scaling=dict(ROPE_TYPES["linear"], partial_rotary_factor=0.5))
    with pytest.raises(LlamaLayoutError, match=r"gives 4 frequencies for head_dim 16; .*\(8 frequencies\): set partial_rotary_factor to 1"):
        LlamaForCausalLM(cfg)


# -- bfloat16 ---------------------------------------------------------------------------------------

def test_bfloat16_keeps_rope_in_float32(tmp_path):
    """Hugging Face's bf16 model keeps inv_freq float32 and computes cos/sin in float32: at position 2000 a
    bf16 inv_freq is off by up to ~0.35 in cos. A bf16 checkpoint loads as bf16 by default (dtype "auto")."""
    cfg = make_config(max_position_embeddings=4096, rope_theta=500000.0, initializer_range=0.3)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path)
    hf_bf16 = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    hf_fp32 = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf_bf16.dtype == torch.bfloat16 and hf_bf16.model.rotary_emb.inv_freq.dtype == torch.float32

    loaded = LlamaForCausalLM.from_pretrained(tmp_path)  # dtype=None: the checkpoint's
    cast = LlamaForCausalLM(hf_fp32.config)
    cast.load_state_dict(hf_fp32.state_dict())
    cast.to(torch.bfloat16)
    positions = torch.arange(1990, 2010)
    x = torch.zeros(1, dtype=torch.bfloat16)
    with torch.no_grad():
        cos_ref, sin_ref = hf_bf16.model.rotary_emb(x, positions[None])
    for model in (loaded, cast):
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        cos, sin = model.model.rotary_emb(dtorch.Tensor(positions), torch.bfloat16)
        assert cos.dtype == torch.bfloat16
        torch.testing.assert_close(cos.to_torch(), cos_ref[0], rtol=0, atol=0)
        torch.testing.assert_close(sin.to_torch(), sin_ref[0], rtol=0, atol=0)

    # the logits drift from float32 no further than Hugging Face's bf16 model's (a bf16 inv_freq: ~1.8x the
    # mean drift at 256 tokens)
    ids = torch.randint(0, 160, (1, 256))
    with torch.no_grad():
        ref = hf_fp32(ids).logits
        hf_drift = (hf_bf16(ids).logits.float() - ref).abs().mean()
    out = loaded(ids)
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().mean() < 1.2 * hf_drift
    torch.testing.assert_close(cast(ids), out, rtol=0, atol=0)


# -- kv heads replicated over tp ----------------------------------------------------------------------

def test_kv_heads_fewer_than_tp_are_replicated(tmp_path):
    """tp4 with 2 kv heads: every tp device holds exactly the kv head its query heads use (the state dict
    and checkpoints keep Hugging Face's shapes)."""
    hf = hf_model("gqa")  # 8 query heads, 2 kv heads of 16
    mesh = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"])
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    for proj in ("k_proj", "v_proj"):
        held = getattr(model.model.layers[0].self_attn, proj).weight
        ref = getattr(hf.model.layers[0].self_attn, proj).weight.detach()
        assert held.placements == [Shard(0)] and tuple(held.shape) == (4 * 16, 128)
        for rank, block in enumerate(held.local_blocks()):
            kv_head = rank // 2  # query heads 2r, 2r+1 use kv head (2r) // 4
            assert torch.equal(block, ref[kv_head * 16:(kv_head + 1) * 16])
    sd, ref_sd = model.state_dict(), hf.state_dict()
    assert list(sd) == list(ref_sd) and all(torch.equal(sd[k], ref_sd[k]) for k in sd)

    hf.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, device_mesh=mesh)
    ids = torch.randint(0, hf.config.vocab_size, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), hf(ids).logits, rtol=RTOL, atol=ATOL)
    with pytest.raises(StateDictError, match=r"size mismatch for model.layers.0.self_attn.k_proj.weight: .*"
                                             r"torch.Size\(\[16, 128\]\) from checkpoint, .* torch.Size\(\[32, 128\]\)"):
        model.load_state_dict(dict(ref_sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 128)}))


def test_replicated_kv_heads_start_equal():
    """Random initialisation draws each kv head once: its copies agree, so the model equals itself unsharded."""
    cfg = make_config("mqa")
    model = LlamaForCausalLM(cfg, dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"]))
    single = LlamaForCausalLM(cfg)
    single.load_state_dict(model.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    torch.testing.assert_close(model(ids), single(ids), rtol=RTOL, atol=ATOL)


# -- tied embeddings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(("tp", 2),), (("pp", 2), ("tp", 2))], ids=str)
def test_tied_embeddings_are_one_parameter(dims):
    names, sizes = zip(*dims)
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(make_config(tie_word_embeddings=True)).eval()
    model = LlamaForCausalLM(hf.config, mesh)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.check_placement("tp", Shard(0))  # vocab over tp
    # like Hugging Face: both names in the state dict, the parameter listed once
    assert list(model.state_dict()) == list(hf.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in hf.named_parameters()]
    sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert model.load_state_dict(sd) == ([], [])
    ids = torch.randint(0, 160, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=RTOL, atol=ATOL)
    # new values through either name show in both (the pp copy on the last stage is refreshed)
    torch.manual_seed(3)
    other = transformers.LlamaForCausalLM(make_config(tie_word_embeddings=True)).eval()
    sd = {k: v for k, v in other.state_dict().items() if k != "model.embed_tokens.weight"}
    model.load_state_dict(sd)
    torch.testing.assert_close(model.model.embed_tokens.weight.to_torch(), other.model.embed_tokens.weight.detach())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), other(ids).logits, rtol=RTOL, atol=ATOL)
    # in-place writes (the first may copy on write; later ones keep the parameter's handle): the pp copy
    # must notice them all the same
    for scale in (0.5, 3.0):
        with dtorch.no_grad():
            model.model.embed_tokens.weight.mul_(scale)
        with torch.no_grad():
            other.model.embed_tokens.weight.mul_(scale)
            torch.testing.assert_close(model(ids), other(ids).logits, rtol=RTOL, atol=ATOL)


# -- the documented script: the same matrix on simulated "cuda" meshes -------------------------------

def main() -> int:
    from dtorch.runtime.devices import NUM_GPU_VAR, SAME_DEVICE_VAR

    device_type = "cuda"
    if not os.environ.get(SAME_DEVICE_VAR) and not torch.cuda.is_available():
        print(f"no GPU and {SAME_DEVICE_VAR} unset: running on virtual cpu meshes "
              f"(set {SAME_DEVICE_VAR}=1 {NUM_GPU_VAR}=16 to simulate cuda meshes)")
        device_type = "cpu"
    graph = dtorch.default_graph()
    failures = 0
    for layout in LAYOUTS:
        mesh = layout.mesh(device_type)
        if mesh is not None and not graph.satisfy(mesh):
            print(f"SKIP  {layout.name:40s} needs {layout.devices} GPUs (raise {NUM_GPU_VAR})")
            continue
        t0 = time.perf_counter()
        got, expected = run_layout(layout, device_type)
        err = (got.cpu() - expected).abs().max().item()
        ok = torch.allclose(got.cpu(), expected, rtol=RTOL, atol=ATOL)
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {layout.name:40s} devices={layout.devices:2d}  max|err|={err:.2e}  "
              f"{time.perf_counter() - t0:.2f}s")
    print(f"{len(LAYOUTS) - failures}/{len(LAYOUTS)} layouts match Hugging Face within rtol=atol={RTOL}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
