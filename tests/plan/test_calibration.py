"""dtorch plan's model of this machine (issue 26): the op-mix fit, the process backend's non-overlapped
collectives, per-kind collective links and the controller's dispatch floor."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dtorch.commlog import CommRecord
from dtorch.plan import estimate, load_hardware
from dtorch.plan.calibrate import fit_nonnegative, llama_config
from dtorch.plan.cost import Costs, collective_terms, collective_time
from dtorch.plan.hardware import from_dict
from dtorch.plan.trace import Layout, trace_step

H100 = load_hardware("h100")


def _profile(**efficiency) -> dict:
    raw = H100.to_dict()
    raw["efficiency"] = {**raw["efficiency"], **efficiency}
    return raw


def test_the_op_mix_fit_recovers_the_rates_it_was_made_with():
    rng = np.random.default_rng(0)
    per_kernel, per_byte = 90e-6, 1 / 5e9
    rows = [(372, b) for b in (17e6, 150e6, 450e6)] + [(900, float(rng.uniform(1e6, 1e9)))]
    y = [k * per_kernel + b * per_byte for k, b in rows]
    got = fit_nonnegative(rows, y)
    assert got == pytest.approx([per_kernel, per_byte], rel=1e-9)
    # a term the points contradict is 0, never negative: the rest is refitted alone
    y_bad = [k * per_kernel - b * 1e-12 for k, b in rows]
    got = fit_nonnegative(rows, y_bad)
    assert got[1] == 0 and got[0] > 0
    assert got[0] == pytest.approx(np.dot([k for k, _ in rows], y_bad) / np.dot(*[[k for k, _ in rows]] * 2))


def test_no_overlap_puts_every_collective_on_the_path():
    c = Costs(compute=1.0, exposed_comm=0.2, overlapped_comm=0.5)
    assert c.time(1.0) == pytest.approx(1.2) and c.time(0.0) == pytest.approx(1.7)
    cfg = llama_config(64, 2, 4, 2, 256, 64)
    on = estimate(cfg, 2, H100, fsdp=2, seq=64, global_batch=4, activation_checkpointing="none", mixed_precision="fp32")
    off = estimate(cfg, 2, from_dict(_profile(overlap=0.0)), fsdp=2, seq=64, global_batch=4,
                   activation_checkpointing="none", mixed_precision="fp32")
    assert off.step_time > on.step_time
    # one stage, one micro-batch: the step is its compute plus every collective
    assert off.step_time == pytest.approx(off.compute_time + sum(off.comm_time.values()), rel=1e-9)


def test_a_profile_can_give_one_kind_of_collective_its_own_link():
    raw = _profile()
    raw["collectives"] = {"reduce_scatter": {"name": "gloo", "gbps": 0.5, "latency_us": 700.0}}
    hw = from_dict(raw)
    assert from_dict(hw.to_dict()).collectives == hw.collectives  # round trip
    size = 8 << 20
    lay = Layout(fsdp=2)
    t, moved = collective_time(CommRecord("reduce_scatter", "fsdp", 2 * size, (0, 1)), lay, hw)
    steps, expect_moved = collective_terms("reduce_scatter", 2, size)
    assert moved == expect_moved
    assert t == pytest.approx(steps * 700e-6 + moved / (0.5e9 * hw.efficiency["collective"]))
    # another kind stays on the mesh dim's link
    t_ag, _ = collective_time(CommRecord("all_gather", "fsdp", 2 * size, (0, 1)), lay, hw)
    assert t_ag == pytest.approx(collective_time(CommRecord("all_gather", "fsdp", 2 * size, (0, 1)), lay, H100)[0])


@pytest.mark.parametrize("dims", [{"dp": 2}, {"pp": 2}])
def test_the_controller_issuing_every_op_is_a_floor_on_the_step(dims):
    cfg = llama_config(64, 2, 4, 2, 256, 64)
    m = 2 if dims.get("pp") else 1
    hw = from_dict(_profile(controller_op_us=1e6))  # one second per op: the floor binds
    e = estimate(cfg, None, hw, seq=64, global_batch=4, micro_batches=m, activation_checkpointing="none",
                 mixed_precision="fp32", exact=True, **{"fsdp": 1, **dims})
    # what the controller issues: every kernel and collective of the traced micro-batch's forward and backward,
    # per micro-batch, then the optimizer's once
    tr = trace_step(cfg, Layout(**dims), seq=64, rows=4 // m, param_dtype=torch.float32)
    issued = sum(m if phase in ("forward", "backward") else 1 for phase, _, _, _ in tr.events)
    assert e.controller_time == pytest.approx(issued) and e.step_time == pytest.approx(issued)
    assert any("controller" in n for n in e.notes)
    free = estimate(cfg, None, H100, seq=64, global_batch=4, micro_batches=m, activation_checkpointing="none",
                    mixed_precision="fp32", exact=True, **{"fsdp": 1, **dims})
    assert free.controller_time == 0 and free.step_time < 1e-2  # shipped profiles: not modelled


@pytest.mark.slow
def test_calibrate_writes_a_profile_of_measured_rates(tmp_path):
    from dtorch.plan.calibrate import calibrate

    out = tmp_path / "here.json"
    calibrate(str(out), threads=1)
    hw = load_hardware(str(out))
    assert hw.peak("float32") > 1e9 and hw.peak("bfloat16") > 1e9 and hw.hbm_gbps > 0.1
    assert 0 < hw.efficiency["kernel_overhead_us"] < 1e5 and 0 < hw.efficiency["controller_op_us"] < 1e5
    assert hw.efficiency["overlap"] == 0  # a worker runs its collectives on its kernels' thread
    assert set(hw.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "send_recv"}
    assert all(link.latency_us > 0 and math.isfinite(link.gbps) and link.gbps > 0 for link in hw.collectives.values())
    assert all(hw.efficiency[k] == 1.0 for k in ("matmul", "memory", "collective"))
    # attention runs at its own measured rate (torch's CPU attention kernel, far below the GEMM rate): its
    # efficiency is that rate over the float32 GEMM peak
    assert 0 < hw.efficiency["attention"] < 10 and math.isfinite(hw.efficiency["attention"])
