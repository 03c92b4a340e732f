"""The meta backend (issue 26): shapes and dtypes only, yet the CommLog (counts and bytes) and every device's
peak memory equal those of an in-process run of the same program: the Llama layout matrix (forward), fsdp
layouts, a training step (forward, backward, AdamW), a pipelined training step and a KV-cache decode step.
Values cannot be read from it (a clear error), and a model builds on it without allocating its weights."""
from __future__ import annotations

import json
import resource

import pytest
import torch
import transformers

import dtorch
from dtorch.errors import MetaBackendError
from dtorch.models.generation import _hidden
from dtorch.models.kv_cache import CachedForward, KVCache
from dtorch.models.llama import LlamaForCausalLM
from tests.llama_models import make_config

from ..models.test_llama import LAYOUTS
from ..models.test_llama_train import FSDP_LAYOUTS

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mesh(dims):
    if not dims:
        return dtorch.DeviceMesh("cpu")
    names, sizes = zip(*dims)
    return dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))


def _run(backend: str, program):
    """``program(graph)`` on a fresh Graph of ``backend`` with memory tracked from the start: (CommLog counts,
    CommLog bytes, {device: peak bytes})."""
    graph = dtorch.Graph(backend=backend)
    with graph:
        torch.manual_seed(0)
        mesh = program(graph, None)
        graph.track_memory()
        with dtorch.CommLog() as log:
            program(graph, mesh)
        peaks = {dev: st["peak"] for dev, st in graph.get_memory_stats().items()}
        graph.track_memory(False)
    return log.counts(), log.bytes(), peaks


def _same_on_meta(program):
    real = _run("inprocess", program)
    meta = _run("meta", program)
    assert real[0] == meta[0], "CommLog counts differ"
    assert real[1] == meta[1], "CommLog bytes differ"
    assert real[2] == meta[2], "peak memory per device differs"
    return real


def _forward_program(layout):
    state = {}

    def program(graph, mesh):
        cfg = make_config(layout.config)
        if mesh is None:  # set-up (not measured): the model
            state["model"] = LlamaForCausalLM(cfg, layout.mesh())
            return state["model"].device_mesh
        ids = torch.randint(0, cfg.vocab_size, (layout.batch, layout.seq), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            state["model"].model(ids)  # hidden states stay dtorch tensors (no fetch)
    return program


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_forward_of_the_layout_matrix_equals_the_in_process_run(layout):
    counts, _, peaks = _same_on_meta(_forward_program(layout))
    assert peaks and all(v > 0 for v in peaks.values())  # (something was measured)


def _train_program(layout, micro_batches: int = 1, checkpointing: bool = False):
    state = {}

    def program(graph, mesh):
        cfg = make_config(layout.config)
        ids = torch.randint(0, cfg.vocab_size, (layout.batch, layout.seq), generator=torch.Generator().manual_seed(1))
        if mesh is None:
            model = state["model"] = LlamaForCausalLM(cfg, layout.mesh())
            if checkpointing:
                model.gradient_checkpointing_enable()
            state["opt"] = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = state["model"], state["opt"]
        if micro_batches > 1:
            dtorch.pipeline.train_step(model, dtorch.pipeline.split_micro_batches(ids, ids, chunks=micro_batches))
        else:
            out = model(ids, labels=ids)
            out.loss.backward()
            del out
        dtorch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return model.device_mesh
    return program


TRAIN_LAYOUTS = [lay for lay in LAYOUTS if lay.name in (
    "no mesh", "dp2 uneven batch", "tp2", "pp2", "ring2 uneven sequence", "ulysses2 x ring2",
    "dp2 x tp2 x pp2 x ulysses2", "gqa 8/2 heads, tp4")] + FSDP_LAYOUTS


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS, ids=lambda lay: lay.name)
def test_training_step_equals_the_in_process_run(layout):
    # the measured step is the second one: optimizer states exist, plans are warm
    counts, _, _ = _same_on_meta(_train_program(layout))
    assert any(kind in ("all_reduce", "reduce_scatter") for kind, _ in counts) or layout.name in ("no mesh", "pp2")


def test_pipelined_and_checkpointed_training_steps_equal_the_in_process_run():
    layout = next(lay for lay in LAYOUTS if lay.name == "dp2 x tp2 x pp2 x ulysses2")
    _same_on_meta(_train_program(layout, micro_batches=2))
    _same_on_meta(_train_program(layout, checkpointing=True))


def _decode_program(dims):
    state = {}

    def program(graph, mesh):
        if mesh is None:
            model = state["model"] = LlamaForCausalLM(make_config("gqa"), _mesh(dims))
            ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
            cache = state["cache"] = KVCache(model, 2, 12)
            with torch.no_grad():  # the prefill (not measured)
                _hidden(model, CachedForward(model, ids, torch.ones(2, 6, dtype=torch.bool),
                                             torch.arange(6).expand(2, 6), cache), last_only=True)
            return model.device_mesh
        model, cache = state["model"], state["cache"]
        tok = torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            step = CachedForward(model, tok, torch.ones(2, 1, dtype=torch.bool), torch.full((2, 1), 6), cache)
            model.lm_head(_hidden(model, step, last_only=True))
    return program


@pytest.mark.parametrize("dims", [(("tp", 2),), (("dp", 2), ("ring_cp", 2)), (("pp", 2), ("tp", 2))],
                         ids=lambda d: " x ".join(f"{n}{s}" for n, s in d))
def test_decode_step_equals_the_in_process_run(dims):
    _same_on_meta(_decode_program(dims))


def test_the_comparison_can_fail():
    """A program that differs between the two runs is told apart (the helper compares, it does not pass)."""
    layout = LAYOUTS[1]
    real = _run("inprocess", _train_program(layout))
    meta = _run("meta", _forward_program(layout))
    assert real[0] != meta[0] and real[2] != meta[2]


def test_values_cannot_be_read_and_the_error_names_the_backend():
    with dtorch.Graph(backend="meta"):
        mesh = _mesh((("dp", 2), ("tp", 2)))
        x = dtorch.randn(5, 7, device_mesh=mesh, placements=[dtorch.Shard(0), dtorch.Replicate()])
        y = (x @ x.t()).sum()
        assert tuple(y.shape) == () and x.placements == [dtorch.Shard(0), dtorch.Replicate()]
        for read in (x.to_torch, y.item, x.tolist, lambda: float(y)):
            with pytest.raises(MetaBackendError, match="meta backend holds shapes and dtypes only"):
                read()
        assert [tuple(b.shape) for b in x.local_blocks()] == [(3, 7), (3, 7), (2, 7), (2, 7)]


def test_env_var_selects_it(monkeypatch):
    monkeypatch.setenv("DTORCH_BACKEND", "meta")
    assert dtorch.Graph().runtime.name == "meta"


def test_a_big_model_builds_without_allocating_and_from_pretrained_reads_the_config_only(tmp_path):
    """A 70B-shaped Llama (280 GB of float32 weights) builds on 64 simulated devices; the process's memory
    hardly grows. ``from_pretrained`` of a directory holding only config.json builds the same shapes."""
    cfg = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with dtorch.Graph(backend="meta") as graph:
        mesh = _mesh((("fsdp", 8), ("tp", 8)))
        model = LlamaForCausalLM(cfg, mesh)
        n = sum(p.numel() for p in model.parameters())
        assert 70e9 < n < 71e9
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
        loaded = LlamaForCausalLM.from_pretrained(tmp_path, mesh, dtype=torch.bfloat16)
        local = loaded.model.layers[3].mlp.up_proj.weight._spec.local_shape((0, 0))
        assert local[0] * local[1] == 28672 * 8192 // 64
        assert loaded.lm_head.weight.dtype == torch.bfloat16
        stats = graph.get_memory_stats(mesh)
        assert stats[("cpu", 0)]["allocated"] > 70e9 * 4 / 64  # the accounting sees them all the same
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 1 << 20, f"building grew the process by {grown} KiB"
