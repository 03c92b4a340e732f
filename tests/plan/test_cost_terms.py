"""The cost model's terms for a backend that runs eagerly (issue 26: predicted against measured on the process
backend): the forward recomputed in every VJP, each kernel's torch ops' bytes, fused attention at its own rate,
gradient accumulation over micro-batches, and the interleaved schedule's virtual stages. Expected values are
computed from the shapes, not read off the code under test."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.plan import PlanError, estimate, load_hardware
from dtorch.plan.calibrate import llama_config
from dtorch.plan.cost import Options, kernel_time, kernel_work
from dtorch.plan.hardware import from_dict
from dtorch.plan.trace import Layout, trace_step
from dtorch.runtime.kernels import get_kernel
from dtorch.runtime.meta import KernelCall
from dtorch.spec import DTensorSpec

H100 = load_hardware("h100")


def _eager_profile(**efficiency):
    """A CPU-like profile: every kernel's torch ops one by one, every VJP recomputing its forward."""
    raw = H100.to_dict()
    raw["peak_tflops"] = {"float32": 0.05, "bfloat16": 0.05}
    raw["hbm_gbps"] = 5.0
    raw["efficiency"] = {**raw["efficiency"], "matmul": 1.0, "attention": 0.25, "memory": 1.0,
                         "kernel_overhead_us": 0.0, "vjp_overhead_us": 0.0, "vjp_recompute": 1, "eager_kernels": 1,
                         **efficiency}
    return from_dict(raw)


def _linear_call(kind="forward"):
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    x = DTensorSpec(mesh, (Replicate(),), (48, 64), torch.float32)
    w = DTensorSpec(mesh, (Shard(0),), (96, 64), torch.float32)
    y = DTensorSpec(mesh, (Shard(1),), (48, 96), torch.float32)
    return KernelCall(kind, get_kernel("linear"), (x, w), (y,), {"nx": 2})


def test_a_recomputing_backward_counts_the_forward_again():
    mnk = 48 * (96 // 2) * 64
    kept = kernel_work(_linear_call("backward"), Options())[0]
    recomputed = kernel_work(_linear_call("backward"), Options(native_backward=False))[0]
    assert kept == 2 * 2 * mnk  # the input's and the weight's gradients
    assert recomputed == 3 * 2 * mnk  # and the forward's product again
    assert Options.of(_eager_profile()).native_backward is False and Options.of(H100).native_backward is True


def test_the_vjp_overhead_is_charged_once_per_recomputing_backward():
    base = _eager_profile()
    more = _eager_profile(vjp_overhead_us=250.0)
    call = _linear_call("backward")
    opts = Options.of(base)
    assert kernel_time(call, more, opts)[0] - kernel_time(call, base, opts)[0] == pytest.approx(250e-6)
    fwd = _linear_call("forward")
    assert kernel_time(fwd, more, opts)[0] == pytest.approx(kernel_time(fwd, base, opts)[0])


def test_eager_kernels_pay_for_every_torch_op_they_run():
    # rms_norm on a float32 [r, h] block B runs x.pow(2) (B in, B out), .mean(-1) (B in, r floats out), + eps and
    # rsqrt (r in, r out each), x * that (B and r in, B out), * weight (B and h in, B out): 7 B + 24 r + 4 h bytes;
    # a fused kernel reads x and the weight and writes y once: 2 B + 4 h
    mesh = dtorch.init_device_mesh("cpu", (1,), mesh_dim_names=["dp"])
    r, h = 64, 128
    x = DTensorSpec(mesh, (Replicate(),), (r, h), torch.float32)
    w = DTensorSpec(mesh, (Replicate(),), (h,), torch.float32)
    call = KernelCall("forward", get_kernel("rms_norm"), (x, w), (x,), {"eps": 1e-6, "k": 1})
    _, moved, _, work = kernel_work(call, Options())
    block = r * h * 4
    assert moved == 2 * block + 4 * h
    assert work.eager_bytes == 7 * block + 24 * r + 4 * h
    eager = _eager_profile()
    fused = from_dict({**eager.to_dict(), "efficiency": {**eager.efficiency, "eager_kernels": 0}})
    assert kernel_time(call, eager, Options())[0] == pytest.approx(work.eager_bytes / 5e9)
    assert kernel_time(call, fused, Options())[0] == pytest.approx(moved / 5e9)


def test_a_matmul_moves_no_element_wise_bytes_and_views_none():
    call = _linear_call("forward")
    flops, moved, cls, work = kernel_work(call, Options())
    assert cls == "linear" and work.eager_bytes == 0 and work.flops == flops
    hw = _eager_profile()
    assert kernel_time(call, hw, Options.of(hw))[0] == pytest.approx(flops / 0.05e12)


def test_fused_attention_runs_at_the_attention_rate():
    b, h, seq, d = 2, 4, 64, 16
    tr = trace_step(llama_config(h * d, 1, h, 2, 256, seq), Layout(), seq=seq, rows=b, param_dtype=torch.float32)
    call = next(c for phase, _, _, c in tr.events if phase == "forward" and getattr(c, "kernel", None) is not None
                and c.kernel.name == "sdpa")
    flops, moved, cls, _ = kernel_work(call, Options())
    assert cls == "attention" and flops == 0.5 * 2 * (2 * b * h * seq * seq * d)  # QK^T and PV, half masked
    hw = _eager_profile(attention=0.25)
    assert kernel_time(call, hw, Options.of(hw))[0] == pytest.approx(max(flops / (0.25 * 0.05e12), moved / 5e9))


def test_micro_batches_after_the_first_add_their_gradients_into_the_sum():
    from dtorch.plan.estimate import _stage_summaries

    cfg = llama_config(64, 2, 4, 2, 256, 32)
    hw = _eager_profile(kernel_overhead_us=10.0)
    # the model's parameters, counted here: per layer q, k, v, o, gate, up, down and two norms; the embedding,
    # the final norm and the head; each gradient float32 on the one stage's first device
    hd, inter, v = 64, int(64 * 2.6875) // 8 * 8, 256
    per_layer = hd * hd * 2 + hd * (hd // 2) * 2 + 3 * hd * inter + 2 * hd
    tr = trace_step(cfg, Layout(dp=2), seq=32, rows=2, param_dtype=torch.float32)
    assert sum(tr.grad_bytes[0]) == 4 * (2 * per_layer + hd + 2 * v * hd) and len(tr.grad_bytes[0]) == 9 * 2 + 3
    adds = (9 * 2 + 3) * 10e-6 + 3 * 4 * (2 * per_layer + hd + 2 * v * hd) / 5e9  # read both, write one
    st = _stage_summaries(tr, hw, Options.of(hw))[0]
    four = estimate(cfg, 2, hw, dp=2, seq=32, global_batch=8, micro_batches=4, activation_checkpointing="none",
                    mixed_precision="fp32")
    assert four.compute_time == pytest.approx(4 * (st["fwd"].compute + st["bwd"].compute) + 3 * adds
                                              + st["step"].compute, rel=1e-9)
    # a fused stack accumulates inside the weight-gradient GEMM: no pass of its own
    fused = from_dict({**hw.to_dict(), "efficiency": {**hw.efficiency, "eager_kernels": 0}})
    st = _stage_summaries(tr, fused, Options.of(fused))[0]
    assert st["accumulate"] == 0


def test_interleaving_divides_the_pipeline_fill_by_the_virtual_stages():
    kw = dict(seq=1024, global_batch=8, micro_batches=8, activation_checkpointing="none")
    plain = estimate("llama3-8b", 4, "h100", pp=4, **kw).step_time
    step = {v: estimate("llama3-8b", 4, "h100", pp=4, pp_schedule="interleaved", pp_virtual_stages=v, **kw).step_time
            for v in (1, 2, 4)}
    assert step[1] == pytest.approx(plain, rel=1e-12)  # one chunk per device: 1F1B
    # the fill, (p - 1) stage-slots in 1F1B, is 1/v of that interleaved: what v = 4 saves is 3/2 what v = 2 does
    assert plain - step[4] == pytest.approx(1.5 * (plain - step[2]), rel=1e-9)
    assert step[4] < step[2] < plain


@pytest.mark.parametrize("kw, message", [
    (dict(pp_virtual_stages=2), "is for --pp-schedule interleaved"),
    (dict(pp_schedule="interleaved", pp_virtual_stages=9), "at most 8 chunks"),
])
def test_virtual_stages_that_do_not_fit_say_what_to_change(kw, message):
    with pytest.raises(PlanError, match=message):
        estimate("llama3-8b", 4, "h100", pp=4, seq=1024, global_batch=8, activation_checkpointing="none", **kw)
