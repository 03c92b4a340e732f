"""Training on the process backend: the backward and the optimizer are ordinary dtorch ops, so they run on
worker processes unchanged: loss and gradients equal the in-process backend's and Hugging Face's, with the
same communication."""
from __future__ import annotations

import pytest
import torch

import dtorch
from tests.llama_models import hf_model
from tests.models.test_llama import Layout

from .conftest import using


def _step(layout, make_opt):
    """(loss, {name: grad}, {name: weight after one optimizer step}, comm counts) of one training step."""
    from dtorch.models.llama import LlamaForCausalLM

    hf = hf_model()
    model = LlamaForCausalLM(hf.config, layout.mesh())
    model.load_state_dict(hf.state_dict())
    torch.manual_seed(5)
    ids = torch.randint(0, hf.config.vocab_size, (layout.batch, layout.seq))
    opt = make_opt(model.parameters())
    with dtorch.CommLog() as log:
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
    grads = {n: p.grad.to_torch() for n, p in model.named_parameters()}
    weights = {n: p.to_torch() for n, p in model.named_parameters()}
    return loss.item(), grads, weights, log.counts()


@pytest.mark.parametrize("layout", [Layout("tp2", (("tp", 2),), batch=3, seq=6),
                                    Layout("pp2 x fsdp2", (("pp", 2), ("fsdp", 2)), batch=4, seq=5)],
                         ids=lambda lay: lay.name)
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_train_step_matches_inprocess(proc, ref, layout, optimizer):
    make_opt = {"SGD": lambda ps: dtorch.optim.SGD(ps, lr=0.1, momentum=0.9),
                "AdamW": lambda ps: dtorch.optim.AdamW(ps, lr=1e-2)}[optimizer]
    runs = []
    for g in (ref, proc):
        with using(g):
            runs.append(_step(layout, make_opt))
    (loss, grads, weights, counts), (p_loss, p_grads, p_weights, p_counts) = runs
    assert p_counts == counts
    assert abs(p_loss - loss) < 1e-5
    # Adam's first step is lr * g / (|g| + eps): gradients that differ in their last bits (kernels of the
    # two backends) move tiny-gradient weights by up to lr * 1e-2
    tol = 1e-5 if optimizer == "SGD" else 1e-3
    for name in grads:
        torch.testing.assert_close(p_grads[name], grads[name], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(p_weights[name], weights[name], rtol=tol, atol=tol)


def test_mixed_precision_fsdp_step_matches_inprocess(proc, ref):
    """bf16 gathers over float32 master weights, gradients reduce-scattered in float32 by the workers (the
    in-process backend sums the devices' terms inside one GEMM: the same value at bf16 precision)."""
    from dtorch.models.llama import LlamaForCausalLM

    hf = hf_model()
    policy = dtorch.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layout = Layout("fsdp2", (("fsdp", 2),), batch=4, seq=6)
    runs = []
    for g in (ref, proc):
        with using(g):
            model = LlamaForCausalLM(hf.config, layout.mesh(), mp_policy=policy)
            model.load_state_dict(hf.state_dict())
            ids = torch.randint(0, hf.config.vocab_size, (layout.batch, layout.seq),
                                generator=torch.Generator().manual_seed(5))
            with dtorch.CommLog() as log:
                loss = model(ids, labels=ids).loss
                loss.backward()
            runs.append((loss.item(), {n: p.grad.to_torch() for n, p in model.named_parameters()}, log.counts(),
                         {r.dtype for r in log.records if r.kind == "reduce_scatter"}))
    (loss, grads, counts, dtypes), (p_loss, p_grads, p_counts, p_dtypes) = runs
    assert p_counts == counts and p_dtypes == dtypes == {torch.float32}
    assert abs(p_loss - loss) < 1e-3
    for name, g in grads.items():
        assert p_grads[name].dtype == torch.float32
        torch.testing.assert_close(p_grads[name], g, rtol=2e-2, atol=2e-2 * g.abs().max().item())


def test_worker_stats_report_resident_memory(proc):
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("resident memory comes from /proc (Linux)")
    stats = proc.runtime.worker_stats()
    assert stats and all(st["rss"] > 0 and st["peak_rss"] > 0 for st in stats.values())
