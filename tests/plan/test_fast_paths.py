"""dtorch plan's shortcuts give the numbers of the long way: short traces (1 and 2 layers per stage, at most 3
stages) against tracing every layer of every stage, a search in worker processes against one in this process,
and the kernel costs shared between layouts (keyed by a device's block shapes) against fresh ones."""
from __future__ import annotations

import math

import pytest
import transformers

from dtorch.commlog import CommRecord
from dtorch.plan import cost, estimate
from dtorch.plan.cost import Options, kernel_work
from dtorch.plan.search import search
from dtorch.plan.trace import Layout, trace_step


def tiny(layers=8):
    return transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                    max_position_embeddings=1024)


@pytest.mark.parametrize("layout", [Layout(dp=2), Layout(fsdp=2)], ids=str)
def test_the_backward_counts_twice_the_forwards_matmul_flops(layout):
    # a kept graph's backward (dp2: kind "backward") reported by the meta runtime carries its forward's arguments
    # (a missing one made every such backward matmul count 0 FLOPs); a recomputing VJP (fsdp2: "vjp:linear")
    # counts its backward only
    tr = trace_step(tiny(2), layout, seq=64, rows=2, param_dtype=None)
    flops = {"forward": 0.0, "backward": 0.0}
    for phase, _, _, item in tr.events:
        if phase in flops and not isinstance(item, CommRecord) and item.kernel.name in ("linear", "vjp:linear"):
            flops[phase] += kernel_work(item, Options())[0]
    assert flops["forward"] > 0
    assert flops["backward"] == pytest.approx(2 * flops["forward"])


def _close(a: dict, b: dict, rel: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert math.isclose(a[k], b[k], rel_tol=rel, abs_tol=1e-12), (k, a[k], b[k])


@pytest.mark.parametrize("layout", [dict(pp=4, fsdp=2), dict(pp=4, tp=2, micro_batches=8), dict(dp=2, ring_cp=2)],
                         ids=lambda d: "_".join(f"{k}{v}" for k, v in d.items()))
def test_short_traces_equal_tracing_every_layer(layout):
    layout = dict(layout)
    kw = dict(seq=128, micro_batches=layout.pop("micro_batches", None), activation_checkpointing="selective")
    exact = estimate(tiny(), None, "h100", exact=True, **layout, **kw)
    fast = estimate(tiny(), None, "h100", **layout, **kw)
    assert fast.memory == exact.memory and fast.fits == exact.fits
    # the pipeline's step-phase scalars (the gradient norm's pieces) cross every stage: a few bytes and one
    # alpha each per stage apart, where a 3-stage trace stands for more stages
    _close(fast.comm_bytes, exact.comm_bytes, 1e-4)
    for name in ("step_time", "compute_time", "bubble_time", "mfu"):
        assert math.isclose(getattr(fast, name), getattr(exact, name), rel_tol=2e-3), name


def test_search_in_worker_processes_equals_one_process():
    cfg = tiny(4)
    cost._KERNEL_CACHE.clear()
    pooled = search(cfg, 4, "h100", seq=128, workers=2)
    cost._KERNEL_CACHE.clear()
    alone = search(cfg, 4, "h100", seq=128, workers=1)
    assert len(pooled) == len(alone) >= 8
    for a, b in zip(pooled, alone):
        assert a.layout == b.layout
        assert a.to_dict() == b.to_dict()
