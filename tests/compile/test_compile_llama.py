"""A compiled Llama training step gives the eager step's bits in every layout: the losses of 10 AdamW steps,
every gradient on the way (checked through the weights they update), and the final weights and optimizer states.
The in-process backend runs the layout matrix (fsdp included); the process and ray backends a representative
layout."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.models.llama import LlamaForCausalLM
from dtorch.pipeline import one_f_one_b, split_micro_batches
from tests.llama_models import hf_model
from tests.models.test_llama import LAYOUTS, Layout
from tests.models.test_llama_train import FSDP_LAYOUTS

STEPS = 10
QUICK = ["dp2 uneven batch", "fsdp4 uneven batch", "dp2 x fsdp2 (HSDP) x tp2"]
MATRIX = [lay for lay in LAYOUTS + FSDP_LAYOUTS if "alias" not in lay.name]


def train_step(model, opt, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def pipelined_step(model, opt, ids):
    loss = one_f_one_b(model, split_micro_batches(ids, ids, chunks=ids.shape[0]))
    opt.step()
    opt.zero_grad()
    return loss


def _twins(layout, mesh):
    hf = hf_model(layout.config)
    out = []
    for _ in range(2):
        m = LlamaForCausalLM(hf.config, mesh)
        m.load_state_dict(hf.state_dict())
        out.append((m, dtorch.optim.AdamW(m.parameters(), lr=1e-2)))
    return out, hf.config.vocab_size


def check_compiled_equals_eager(layout, mesh, step=train_step, steps=STEPS):
    (m1, o1), (m2, o2), = _twins(layout, mesh)[0]
    vocab = m1.config.vocab_size
    compiled = dtorch.compile(step)
    gen = torch.Generator().manual_seed(3)
    for n in range(steps):
        ids = torch.randint(0, vocab, (layout.batch, layout.seq), generator=gen)
        l1, l2 = step(m1, o1, ids), compiled(m2, o2, ids)
        assert torch.equal(l1.to_torch(), l2.to_torch()), f"step {n}: loss {l1.to_torch()} vs {l2.to_torch()}"
    assert compiled.stats["replays"] == steps - 2, (compiled.stats, compiled.last_reason)
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert torch.equal(p1.to_torch(), p2.to_torch()), name
        assert p1.placements == p2.placements
        s1, s2 = o1.state[p1], o2.state[p2]
        assert torch.equal(s1["exp_avg_sq"].to_torch(), s2["exp_avg_sq"].to_torch()), name
        assert float(s1["step"]) == float(s2["step"]) == steps


@pytest.mark.parametrize("layout", [lay for lay in MATRIX if lay.name in QUICK], ids=lambda lay: lay.name)
def test_compiled_training_equals_eager(layout):
    check_compiled_equals_eager(layout, layout.mesh())


@pytest.mark.slow
@pytest.mark.parametrize("layout", [lay for lay in MATRIX if lay.name not in QUICK], ids=lambda lay: lay.name)
def test_compiled_training_equals_eager_layout_matrix(layout):
    check_compiled_equals_eager(layout, layout.mesh())


def test_compiled_pipeline_schedule_equals_eager():
    layout = next(lay for lay in LAYOUTS if lay.name == "3 layers on pp2 (uneven split)")
    check_compiled_equals_eager(layout, layout.mesh(), step=pipelined_step, steps=5)


def gpipe_step(model, opt, ids):
    half = ids.shape[0] // 2
    loss = dtorch.pipeline.train_step(model, [(ids[:half], ids[:half]), (ids[half:], ids[half:])], schedule="gpipe")
    opt.step()
    opt.zero_grad()
    return loss


def test_compiled_pipeline_train_step_equals_eager():
    layout = Layout("pp2 x dp2, batch 4", (("pp", 2), ("dp", 2)), batch=4, seq=6, config="pipeline")
    check_compiled_equals_eager(layout, layout.mesh(), step=gpipe_step, steps=4)
