"""dtorch.recovery without worker processes: snapshots put back exactly what they kept into the same tensor
objects, settings and the fault injector refuse what they cannot do. (Recovery from lost workers:
tests/runtime/test_recovery.py.)"""
from __future__ import annotations

import gc

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.recovery import RecoveryError


@pytest.fixture
def trained():
    """A two-layer model on a 2 x 2 mesh (a Shard, a Partial-free Replicate weight), AdamW after one step."""
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    torch.manual_seed(0)
    model = dtorch.nn.Sequential(dtorch.nn.Linear(6, 4, device_mesh=mesh), dtorch.nn.Linear(4, 3, device_mesh=mesh))
    model[0].weight = dtorch.nn.Parameter(dtorch.Tensor(torch.randn(4, 6), device_mesh=mesh,
                                                        placements=[Replicate(), Shard(0)]))
    opt = dtorch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(5, 6)

    def step(x):
        opt.zero_grad()
        loss = model(dtorch.Tensor(x, device_mesh=mesh)).sum()
        loss.backward()
        opt.step()
        return loss.item()

    step(x)
    return model, opt, step, x


def _values(model, opt):
    return ({n: p.to_torch() for n, p in model.named_parameters()},
            {id(p): {k: (v.to_torch() if isinstance(v, dtorch.Tensor) else v.clone()) for k, v in s.items()}
             for p, s in opt.state.items()})


def test_restore_puts_back_every_value_into_the_same_objects(trained):
    model, opt, step, x = trained
    snap = dtorch.recovery.snapshot(model, opt)
    params, states = _values(model, opt)
    def objects():  # the dtorch tensors (host values such as "step" are copied back, not kept)
        return [id(p) for p in model.parameters()] + [id(v) for s in opt.state.values() for v in s.values()
                                                      if isinstance(v, dtorch.Tensor)]

    before = objects()
    rng = torch.random.get_rng_state()
    step(x)
    torch.randn(3)
    opt.param_groups[0]["lr"] = 0.5
    assert snap.restore() == len(list(model.parameters())) + 2 * len(opt.state)  # params, exp_avg, exp_avg_sq
    got_params, got_states = _values(model, opt)
    assert objects() == before
    for n, p in params.items():
        assert torch.equal(got_params[n], p), n
    for key, s in states.items():
        for k, v in s.items():
            assert torch.equal(got_states[key][k], v), k
    assert opt.param_groups[0]["lr"] == 0.1 and all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert snap.nbytes == sum(v.numel() * 4 for v in params.values()) + sum(
        v.numel() * 4 for s in states.values() for k, v in s.items() if k != "step")


def test_a_restore_drops_optimizer_state_made_after_the_snapshot():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    model = dtorch.nn.Linear(4, 2, device_mesh=mesh)
    opt = dtorch.optim.AdamW(model.parameters(), lr=0.1)
    snap = dtorch.recovery.snapshot(model, opt)  # before the first step: no state yet
    model(dtorch.Tensor(torch.ones(3, 4), device_mesh=mesh)).sum().backward()
    opt.step()
    assert len(opt.state) == 2
    snap.restore()
    assert len(opt.state) == 0


def test_run_step_counts_steps_and_snapshots_every_n(trained):
    model, opt, step, x = trained
    snap = dtorch.recovery.snapshot(model, opt, every=2)
    assert isinstance(dtorch.recovery.run_step(step, x), float)  # what the step returns
    assert (snap.steps, snap.taken_at, len(snap._log)) == (1, 0, 1)  # no snapshot yet: step 1 would be re-run
    snap.run_step(step, x)
    assert (snap.steps, snap.taken_at, snap._log) == (2, 2, [])


def test_settings_and_the_injector_say_what_they_cannot_do():
    with pytest.raises(ValueError, match="choose one of 'replace', 'shrink', 'off'"):
        dtorch.recovery.configure("restart")
    dtorch.recovery.configure("shrink")
    assert dtorch.recovery.mode() == "shrink"
    dtorch.recovery.configure("replace")
    with pytest.raises(ValueError, match="max_faults_per_step=0"):
        dtorch.recovery.configure("replace", max_faults_per_step=0)
    assert dtorch.recovery.mode() == "replace"
    with pytest.raises(dtorch.RuntimeBackendError, match="inprocess backend has no worker processes"):
        dtorch.recovery.inject_fault(0, at_op=1)
    with pytest.raises(ValueError, match="every is a number of steps >= 1"):
        dtorch.recovery.snapshot(dtorch.nn.Linear(2, 2), None, every=0)
    assert issubclass(RecoveryError, dtorch.RuntimeBackendError)


def test_module_run_step_needs_a_live_snapshot():
    with dtorch.Graph(backend="inprocess"):
        model = dtorch.nn.Linear(2, 2)
        snap = dtorch.recovery.snapshot(model)
        assert dtorch.recovery.run_step(lambda: 7) == 7 and snap.steps == 1
        del snap
        gc.collect()
        with pytest.raises(RuntimeError, match="needs a live snapshot"):
            dtorch.recovery.run_step(lambda: 7)


def test_shrink_layouts_drop_the_lost_dp_slice_from_every_mesh():
    """The mesh arithmetic of ``shrink`` (no workers): dp2 x pp2 x tp2 and its pp stage meshes lose device 5's dp
    slice (devices 4..7), the other ids keep their order; meshes that cannot shrink say so."""
    from dtorch.recovery.shrink import layouts

    root = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["dp", "pp", "tp"])
    stages = root.unbind("pp")
    other = dtorch.DeviceMesh("cpu", [8, 9], mesh_dim_names=["tp"])  # no lost device: renumbered past 4..7
    top, gone, new = layouts([root, *stages, other], [5])
    assert top is root and gone == {4, 5, 6, 7}
    assert new[id(root)].tolist() == [[[0, 1], [2, 3]]]
    assert [new[id(s)].tolist() for s in stages] == [[[0, 1]], [[2, 3]]] and new[id(other)].tolist() == [4, 5]
    with pytest.raises(RecoveryError, match="has no data-parallel dim to shrink"):
        layouts([dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"])], [1])
    with pytest.raises(RecoveryError, match="has 1 device on 'dp': shrinking it would leave fewer than 1"):
        layouts([dtorch.init_device_mesh("cpu", (1, 2), mesh_dim_names=["dp", "tp"])], [1])
    tp_across = dtorch.DeviceMesh("cpu", [[0, 4]], mesh_dim_names=["dp", "tp"])  # holds 4 of the slice, not all
    with pytest.raises(RecoveryError, match=r"holds devices \[4\] of the dropped dp slice, but not as whole slices"):
        layouts([root, tp_across], [5])
