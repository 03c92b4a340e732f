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

RTOL = ATOL = 1e-4

# hidden 64-128, intermediate ~2.75 x hidden; initializer_range 0.1 so attention is far from uniform
# and a wrong position or a misplaced head shows up well above the tolerance
CONFIGS = {
    "base": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=160),
    "three_layers": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=160),
    "gqa": dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, vocab_size=128),
}


def make_config(name: str = "base", **overrides) -> transformers.LlamaConfig:
    kw = dict(CONFIGS[name], max_position_embeddings=64, initializer_range=0.1, rms_norm_eps=1e-6)
    kw.update(overrides)
    cfg = transformers.LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


_HF: dict = {}


def hf_model(name: str = "base") -> transformers.LlamaForCausalLM:
    if name not in _HF:
        torch.manual_seed(0)
        _HF[name] = transformers.LlamaForCausalLM(make_config(name)).eval()
    return _HF[name]


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
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
    model = LlamaForCausalLM.from_pretrained(tmp_path, device_mesh=mesh)
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
    ((("tp", 4),), "gqa", r"num_key_value_heads \(2\) is not divisible by tp \(4\)"),
    ((("ulysess_cp", 8),), "base", r"query heads per tp shard .* not divisible by ulysess_cp \(8\)"),
    ((("tp", 2), ("ulysses_cp", 4)), "base", r"query heads per tp shard .* not divisible by ulysess_cp \(4\)"),
    ((("pp", 3),), "base", r"num_hidden_layers \(2\) is smaller than pp \(3\)"),
], ids=str)
def test_head_and_layer_counts_a_layout_cannot_serve(dims, config, message):
    names, sizes = zip(*dims)
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
    with pytest.raises(LlamaLayoutError, match=message):
        LlamaForCausalLM(make_config(config), mesh)


def test_ulysses_needs_a_sequence_it_can_split():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["ulysess_cp"])
    model = LlamaForCausalLM(make_config(), mesh)
    with pytest.raises(dtorch.OpError, match=r"sequence lengths .*5.* divisible by ulysess_cp \(2\)"):
        model(torch.zeros(2, 5, dtype=torch.long))


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
