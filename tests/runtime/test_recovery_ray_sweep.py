"""Issue 27's acceptance sweeps on the ray backend: a device actor ``ray.kill``ed at random ops (forward, backward,
optimizer step, redistribution steps, in turn), 20 runs each for ``replace`` (dp2 x tp2: bit for bit with the
uninterrupted run) and ``shrink`` (dp4 -> dp3: at 1e-5 with the uninterrupted run that switches to dp3 at the
fault's step). The process backend's sweeps are in test_recovery.py and test_recovery_shrink.py.

    .venv/bin/pytest -q -m slow tests/runtime/test_recovery_ray_sweep.py
"""
from __future__ import annotations

import pytest

import dtorch

from .test_process_faults import wait_gone
from .test_recovery import HEARTBEAT_S, SWEEP, Trainer, _same, random_faults
from .test_recovery_shrink import DP3, DP4, Shrinking, _close, reference, shrink_mode  # noqa: F401 (a fixture)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray4(ray_cluster):
    from .conftest import ray_graph

    g = ray_graph(workers=4, heartbeat_timeout_s=HEARTBEAT_S)
    yield g
    g.runtime.shutdown()


@pytest.fixture(scope="module")
def replace_sweep(ray4):
    t = Trainer(ray4)
    losses, weights = t.run()
    return losses, weights, random_faults(t, devices=4, seed=2701)


@pytest.mark.parametrize("run", range(SWEEP))
def test_dp2_tp2_training_survives_a_ray_killed_actor_at_random_ops(ray4, replace_sweep, run):
    step, device, op, phase = replace_sweep[2][run]
    ray4.runtime.min_workers = 4  # (a shrink run before may have left 3)
    t = Trainer(ray4)
    old = ray4.worker_pids()
    got = t.run(fault=(step, device, op, "ray_kill"))
    _same(got, replace_sweep)
    (event,) = t.snap.events
    assert (event.step, event.devices) == (step + 1, (device,)), phase
    # (what is rebuilt depends on the step: the optimizer's states exist after its first step)
    assert f"device actor {device} " in event.reason and 0 < event.rebuilt <= len(t.snap.tensors())
    assert wait_gone([old[device]]) == [] and sorted(ray4.worker_pids()) == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def shrink_sweep(ray4):
    dtorch.recovery.configure("shrink")
    try:
        ray4.runtime.min_workers = 4
        t = Shrinking(ray4, DP4)
        t.run()
        faults = random_faults(t, devices=4, seed=2702)
        wants = {step: reference(ray4, DP4, DP3, switch_at=step)[:2] for step in sorted({f[0] for f in faults})}
    finally:
        dtorch.recovery.configure("replace")
    return faults, wants


@pytest.mark.parametrize("run", range(SWEEP))
def test_dp4_training_on_ray_shrinks_to_dp3_at_random_ops(ray4, shrink_sweep, shrink_mode, run):
    step, device, op, phase = shrink_sweep[0][run]
    ray4.runtime.min_workers = 4  # (the run before shrank the pool)
    t = Shrinking(ray4, DP4)
    got = t.run(fault=(step, device, op, "ray_kill"))
    _close(got, shrink_sweep[1][step])
    assert [(e.step, e.devices, e.mesh) for e in t.snap.events] == [(step + 1, (device,), "cpu[dp=3]")], phase
    assert sorted(ray4.worker_pids()) == [0, 1, 2]
