"""dtorch.recovery's ``shrink`` mode on the process backend: a worker SIGKILLed mid-step makes the "dp" dim lose the
lost device's slice (dp4 -> dp3, 4 -> 3 workers; dp4 x tp2 -> dp3 x tp2, 8 -> 6 workers with ``-m slow``); the
snapshot is placed again on the smaller mesh, into the same tensor and mesh objects, and the step re-runs with the
batch re-split. Losses and final weights equal, at 1e-5, an uninterrupted run that switches to the smaller mesh at
the step of the fault (same batches, from the same values).
"""
from __future__ import annotations

import os

import pytest
import torch

import dtorch
from dtorch.recovery import RecoveryError

from .conftest import process_graph, using
from .test_process_faults import wait_gone
from .test_recovery import HEARTBEAT_S, STEPS, Trainer, lose_device_at_second_optimizer_step, random_faults

DP4 = (("dp", 4),)
DP3 = (("dp", 3),)
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _shm_dirs() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"dtorch-{os.getpid()}-")}


class Shrinking(Trainer):
    """``Trainer`` that keeps the mesh object it built its model on (the mesh the user holds)."""

    def __init__(self, graph, dims, every=1):
        real = dtorch.init_device_mesh
        made = []

        def init(*a, **k):
            made.append(real(*a, **k))
            return made[-1]

        dtorch.init_device_mesh = init
        try:
            super().__init__(graph, dims, every)
        finally:
            dtorch.init_device_mesh = real
        (self.mesh,) = made


@pytest.fixture
def shrink_mode():
    dtorch.recovery.configure("shrink")
    yield
    dtorch.recovery.configure("replace")


def reference(graph, before, after, switch_at):
    """The uninterrupted run: steps ``0..switch_at-1`` on mesh ``before``, then the rest on a fresh model and
    optimizer on mesh ``after`` loaded with the values reached so far (weights and AdamW state). Returns (losses,
    weights, the op count at the end of forward / backward / optimizer of a step on ``before``)."""
    t = Shrinking(graph, before)
    with using(graph):
        losses = [t.snap.run_step(t.step, ids) for ids in t.batches[:switch_at]]
        phases = t.phases
        weights = {n: p.to_torch() for n, p in t.model.named_parameters()}
        state = t.opt.state_dict()
        state["state"] = {i: {k: v.to_torch() if isinstance(v, dtorch.Tensor) else v for k, v in s.items()}
                          for i, s in state["state"].items()}
        u = Shrinking(graph, after)
        u.model.load_state_dict(weights)
        u.opt.load_state_dict(state)
        losses += [u.step(ids) for ids in u.batches[switch_at:]]
        return losses, {n: p.to_torch() for n, p in u.model.named_parameters()}, phases


def _close(got, want):
    assert got[0] == pytest.approx(want[0], abs=1e-5, rel=1e-5)
    for name, w in want[1].items():
        torch.testing.assert_close(got[1][name], w, **TOL, msg=name)


@pytest.fixture(scope="module")
def graph():
    g = process_graph(workers=4, heartbeat_timeout_s=HEARTBEAT_S)
    yield g
    g.runtime.shutdown()


def test_dp4_loses_a_worker_and_goes_on_as_dp3(graph, shrink_mode):
    want = reference(graph, DP4, DP3, switch_at=1)
    fwd, bwd, _ = want[2]
    t = Shrinking(graph, DP4)
    mesh, weight = t.mesh, t.model.model.embed_tokens.weight
    assert weight.device_mesh is mesh
    old, shm_before = graph.worker_pids(), _shm_dirs()
    got = t.run(fault=(1, 1, (fwd + bwd) // 2, "kill"))  # step 2's backward loses device 1
    _close(got, want)
    (event,) = t.snap.events
    assert (event.step, event.devices, event.mesh) == (2, (1,), "cpu[dp=3]") and event.rebuilt > 0
    assert "device 1 lost, mesh shrunk to cpu[dp=3]" in str(event)
    # the objects the user holds: the same, describing the smaller mesh
    assert t.mesh is mesh and mesh.shape == (3,) and mesh.device_ids == [0, 1, 2]
    assert t.model.model.embed_tokens.weight is weight and weight.device_mesh is mesh
    exp_avg = t.opt.state[weight]["exp_avg"]
    assert exp_avg.device_mesh is mesh and torch.equal(weight.to_torch(), got[1]["model.embed_tokens.weight"])
    # every tensor restored has a spec made on the new mesh (a spec caches its hash: one from before would
    # not equal a new one of the same layout), the AdamW states of step 1's snapshot too (made after step 0's)
    for x in [*t.model.parameters(), *(v for s in t.opt.state.values() for v in s.values()
                                       if isinstance(v, dtorch.Tensor))]:
        assert hash(x._spec) == hash((mesh, x._spec.placements, x._spec.shape, x._spec.dtype))
    # a pool of 3 workers; nothing left behind
    assert wait_gone(list(old.values())) == []
    assert sorted(graph.worker_pids()) == [0, 1, 2]
    assert len(_shm_dirs()) == len(shm_before) and _shm_dirs() != shm_before
    # the batch is re-split: Shard(0) rows of a 4-row batch over dp3 are 2, 1, 1
    with using(graph):
        ids = dtorch.Tensor(t.batches[0], device_mesh=mesh, placements=[dtorch.Shard(0)])
        assert [b.shape[0] for b in ids.local_blocks()] == [2, 2, 0]


def test_the_lost_slice_of_dp_x_tp_goes_and_a_dtorch_argument_follows(graph, shrink_mode):
    """dp2 x tp2 (4 workers) loses device 3: its tp pair (devices 2, 3) goes, dp2 x tp2 -> dp1 x tp2 (2 workers).
    A dtorch tensor passed to the step moves to the smaller mesh too."""
    dims, small = (("dp", 2), ("tp", 2)), (("dp", 1), ("tp", 2))
    want = reference(graph, dims, small, switch_at=2)
    t = Shrinking(graph, dims)
    scale_on = []

    def step(ids, scale):
        scale_on.append(scale.device_mesh.shape)
        return t.step(ids) * scale.to_torch().item()

    with using(graph):
        scale = dtorch.Tensor(torch.tensor([1.0]), device_mesh=t.mesh)
        losses = [t.snap.run_step(step, ids, scale) for ids in t.batches[:2]]
        dtorch.recovery.inject_fault(3, at_op=want[2][0] // 2, kind="kill")  # step 3's forward
        losses += [t.snap.run_step(step, t.batches[2], scale)]
        weights = {n: p.to_torch() for n, p in t.model.named_parameters()}
    _close((losses, weights), want)
    assert [(e.step, e.devices, e.mesh) for e in t.snap.events] == [(3, (3,), "cpu[dp=1, tp=2]")]
    assert t.mesh.device_ids == [0, 1] and scale.device_mesh is t.mesh and scale_on[-1] == (1, 2)
    assert sorted(graph.worker_pids()) == [0, 1]


def test_pp_stage_meshes_shrink_with_their_parent(graph, shrink_mode):
    """pp2 x dp2 (4 workers) loses device 3 in the backward: dp's slice {1, 3} goes, and so does each pp stage
    mesh's share of it (the model holds the stage meshes from mesh.unbind("pp")): pp2 x dp1 on 2 workers."""
    dims, small = (("pp", 2), ("dp", 2)), (("pp", 2), ("dp", 1))
    want = reference(graph, dims, small, switch_at=1)
    fwd, bwd, _ = want[2]
    t = Shrinking(graph, dims)
    stages = list(t.model.model.stage_meshes)
    got = t.run(fault=(1, 3, (fwd + bwd) // 2, "kill"))
    _close(got, want)
    assert [(e.step, e.devices, e.mesh) for e in t.snap.events] == [(2, (3,), "cpu[pp=2, dp=1]")]
    assert t.mesh.device_ids == [0, 1] and [s.device_ids for s in stages] == [[0], [1]]
    assert all(a is b for a, b in zip(stages, t.model.model.stage_meshes))
    assert sorted(graph.worker_pids()) == [0, 1]


def test_meshes_that_cannot_shrink_are_a_clear_error(graph, shrink_mode):
    """No dp dim (tp4), dp already 1 (dp1 x tp2 -> dp0), two faults in one step: a RecoveryError that says what
    was lost and to use replace; nothing re-run."""
    for dims, match in [((("tp", 4),), r"device 2 of mesh .* has no data-parallel dim to shrink .*'replace'"),
                        ((("dp", 1), ("tp", 2)), r"has 1 device on 'dp': shrinking it would leave fewer than 1.*"
                                                 r"'replace'")]:
        t = Shrinking(graph, dims)
        with using(graph):
            dtorch.recovery.inject_fault(max(t.mesh.device_ids), at_op=3, kind="kill")
            with pytest.raises(RecoveryError, match=match.replace("device 2", f"device {max(t.mesh.device_ids)}")):
                t.snap.run_step(t.step, t.batches[0])
        assert t.snap.events == [] and t.mesh.shape == tuple(s for _, s in dims)  # unchanged
    t = Shrinking(graph, DP3)
    with using(graph):
        def step(ids):
            if t.snap.events:  # the re-run on dp2 loses another device
                dtorch.recovery.inject_fault(0, at_op=3, kind="kill")
            return t.step(ids)

        dtorch.recovery.inject_fault(1, at_op=3, kind="kill")
        with pytest.raises(RecoveryError, match=r"step 1: 2 device losses in one step \(device ids 1, 0\)"):
            t.snap.run_step(step, t.batches[0])
    assert t.mesh.shape == (2,)  # the first loss shrank it


def test_dtorch_train_recover_shrink_reports_the_new_mesh(graph, monkeypatch, capsys):
    from dtorch.models import train_cli

    small = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq", "16", "--batch", "4",
             "--dp", "4", "--tp", "1", "--pp", "1", "--ulysses-cp", "1", "--steps", "2", "--recover", "shrink"]
    args = train_cli.build_parser().parse_args(small)
    assert train_cli.check_args(args) == []
    calls = lose_device_at_second_optimizer_step(monkeypatch, 2)
    try:
        with using(graph):
            capsys.readouterr()
            losses = train_cli.train(args, progress=False).losses
    finally:
        dtorch.recovery.configure("replace")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))) and len(calls) == 3
    out = capsys.readouterr().out
    assert "dtorch train: recovered step 2: device 2 lost, mesh shrunk to cpu[dp=3]" in out and "s lost" in out


# -- 8 -> 6 workers: dp4 x tp2 loses a worker at ops of forward, backward and optimizer step --------------------
@pytest.fixture(scope="module")
def graph8():
    g = process_graph(workers=8, heartbeat_timeout_s=HEARTBEAT_S)
    yield g
    g.runtime.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("phase,device", [("forward", 5), ("backward", 0), ("optimizer", 2)])
def test_dp4_tp2_shrinks_to_dp3_tp2(graph8, shrink_mode, phase, device):
    dims, small = (("dp", 4), ("tp", 2)), (("dp", 3), ("tp", 2))
    graph8.runtime.min_workers = 8  # (an earlier shrink lowered it)
    want = reference(graph8, dims, small, switch_at=1)
    ends = want[2]
    start, end = {"forward": (0, ends[0]), "backward": (ends[0], ends[1]), "optimizer": (ends[1], ends[2])}[phase]
    t = Shrinking(graph8, dims)
    got = t.run(fault=(1, device, (start + end) // 2, "kill"))
    _close(got, want)
    assert [(e.step, e.devices, e.mesh) for e in t.snap.events] == [(2, (device,), "cpu[dp=3, tp=2]")]
    assert sorted(graph8.worker_pids()) == list(range(6))


@pytest.mark.slow
def test_hsdp_loses_its_replicate_slice(graph, shrink_mode):
    """HSDP dp2 x fsdp2 (4 workers) loses device 0 in the optimizer step: dp (the replicate dim) shrinks, fsdp
    keeps its 2 shards: dp1 x fsdp2 on 2 workers."""
    dims, small = (("dp", 2), ("fsdp", 2)), (("dp", 1), ("fsdp", 2))
    graph.runtime.min_workers = 4  # (an earlier shrink lowered it)
    want = reference(graph, dims, small, switch_at=1)
    _, bwd, end = want[2]
    t = Shrinking(graph, dims)
    got = t.run(fault=(1, 0, (bwd + end) // 2, "kill"))
    _close(got, want)
    assert [(e.step, e.devices, e.mesh) for e in t.snap.events] == [(2, (0,), "cpu[dp=1, fsdp=2]")]
    assert sorted(graph.worker_pids()) == [0, 1]


@pytest.mark.slow
def test_ray_backend_shrinks_dp4_to_dp3(ray_cluster, shrink_mode):
    from .conftest import ray_graph

    g = ray_graph(workers=4, heartbeat_timeout_s=HEARTBEAT_S)
    try:
        want = reference(g, DP4, DP3, switch_at=1)
        t = Shrinking(g, DP4)
        got = t.run(fault=(1, 2, (want[2][0] + want[2][1]) // 2, "ray_kill"))  # ray.kill of actor 2
        _close(got, want)
        assert [(e.step, e.devices, e.mesh) for e in t.snap.events] == [(2, (2,), "cpu[dp=3]")]
        assert "device actor 2 " in t.snap.events[0].reason and t.snap.events[0].rebuilt > 0
        assert sorted(g.worker_pids()) == [0, 1, 2]
    finally:
        g.runtime.shutdown()


# -- the acceptance sweep for shrink: dp4 -> dp3, a worker SIGKILLed at random ops, 20 runs ----------------------
SWEEP = 20


@pytest.fixture(scope="module")
def dp4_sweep(graph):
    """(the faults: (step, device, op within the step, where), {step: the uninterrupted run switching to dp3 at
    that step}); the faults placed in forward, backward, optimizer step and at redistribution steps, in turn."""
    graph.runtime.min_workers = 4
    t = Shrinking(graph, DP4)
    t.run()
    faults = random_faults(t, devices=4, seed=2727, runs=SWEEP)
    wants = {step: reference(graph, DP4, DP3, switch_at=step)[:2] for step in sorted({f[0] for f in faults})}
    return faults, wants


@pytest.mark.slow
@pytest.mark.parametrize("run", range(SWEEP))
def test_dp4_training_shrinks_to_dp3_at_random_ops(graph, shrink_mode, dp4_sweep, run):
    step, device, op, phase = dp4_sweep[0][run]
    graph.runtime.min_workers = 4  # (the run before shrank the pool)
    t = Shrinking(graph, DP4)
    old, shm_before = graph.worker_pids(), _shm_dirs()
    got = t.run(fault=(step, device, op, "kill"))
    _close(got, dp4_sweep[1][step])
    assert [(e.step, e.devices, e.mesh) for e in t.snap.events] == [(step + 1, (device,), "cpu[dp=3]")], phase
    assert wait_gone(list(old.values())) == [] and sorted(graph.worker_pids()) == [0, 1, 2]
    assert len(_shm_dirs()) == len(shm_before)


assert STEPS == 3  # the tests above place faults in steps 2 and 3
