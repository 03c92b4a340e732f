"""dtorch.optim (SGD, Adam, AdamW), torch's own lr schedulers on them, and dtorch.nn.utils clipping against
torch.optim / torch.optim.lr_scheduler / torch.nn.utils.

Given the same gradients, every step updates the weights as torch does (1e-6, float32) for replicated,
row-sharded, uneven column-sharded and 2-D mesh parameters; states have their parameter's placements;
state dicts have torch's structure and round-trip; torch.optim.lr_scheduler's schedulers give the same
learning rates (and momenta) step by step as on a torch optimizer, warn as torch does, and their state dicts
round-trip; the total gradient norm is computed without an all_gather. An end-to-end MLP on a dp x tp mesh trains like the torch MLP.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import dtorch
import dtorch.nn.functional as DF
from dtorch import CommLog, Partial, Replicate, Shard, nn
from dtorch.nn.utils import clip_grad_norm_, clip_grad_value_
from dtorch.optim import SGD, Adam, AdamW

R = Replicate()
MESH_3 = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["a"])
MESH_22 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
SHAPES = [(7, 5), (7,)]  # a weight and a bias: 7 rows and 5 columns split unevenly over 3 devices
# name -> (mesh, placements of the weight, placements of the bias)
LAYOUTS = {
    "replicate": (MESH_3, [R], [R]),
    "shard0": (MESH_3, [Shard(0)], [Shard(0)]),
    "shard1_uneven": (MESH_3, [Shard(1)], [R]),
    "mesh2d": (MESH_22, [Shard(0), Shard(1)], [R, Shard(0)]),
    "mesh2d_nested": (MESH_22, [Shard(1), Shard(1)], [Shard(0), Shard(0)]),
}
STEPS = 4
TOL = {"rtol": 1e-6, "atol": 1e-6}


def _pair(layout: str, seed: int = 0):
    """torch parameters and dtorch parameters with the same values, laid out as ``layout`` says."""
    mesh, *pls = LAYOUTS[layout]
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=g) for s in SHAPES]
    tps = [torch.nn.Parameter(v.clone()) for v in values]
    dps = [nn.Parameter(v.clone(), device_mesh=mesh, placements=pl) for v, pl in zip(values, pls)]
    return tps, dps


def _set_grads(tps, dps, seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    for t, d in zip(tps, dps):
        grad = torch.randn(t.shape, generator=g)
        t.grad = grad.clone()
        d.grad = dtorch.Tensor(grad, device_mesh=d.device_mesh, placements=d.placements)


def _assert_same(tps, dps, what=""):
    for n, (t, d) in enumerate(zip(tps, dps)):
        torch.testing.assert_close(d.to_torch(), t.detach(), **TOL, msg=lambda m: f"param {n} {what}: {m}")


SGD_CONFIGS = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.1, maximize=True),
]
ADAMW_CONFIGS = [
    dict(),
    dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=0.01, amsgrad=True),
    dict(lr=0.02, weight_decay=0.0, maximize=True, amsgrad=True),
]
ADAM_CONFIGS = [  # weight_decay: an L2 term added to the gradient (decoupled only when asked)
    dict(),
    dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    dict(lr=0.01, amsgrad=True, weight_decay=0.05),
    dict(lr=0.02, weight_decay=0.01, maximize=True),
    dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
]
CASES = ([(SGD, torch.optim.SGD, c) for c in SGD_CONFIGS] + [(AdamW, torch.optim.AdamW, c) for c in ADAMW_CONFIGS]
         + [(Adam, torch.optim.Adam, c) for c in ADAM_CONFIGS])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_steps_match_torch(layout, case):
    dcls, tcls, cfg = CASES[case]
    tps, dps = _pair(layout)
    topt, dopt = tcls(tps, **cfg), dcls(dps, **cfg)
    ids, versions = [id(p) for p in dps], [p._version for p in dps]
    for s in range(STEPS):
        _set_grads(tps, dps, s)
        topt.step()
        with CommLog() as log:
            dopt.step()
        assert log.records == [], f"an optimizer step communicates: {log.table()}"
        _assert_same(tps, dps, f"after step {s + 1} of {dcls.__name__}({cfg}) on {layout}")
    # the parameters were written in place: the same objects, with their placements, versions moved on
    assert [id(p) for p in dps] == ids and all(p._version > v for p, v in zip(dps, versions))
    mesh, *pls = LAYOUTS[layout]
    for p, pl in zip(dps, pls):
        assert p.placements == pl
        for name, st in dopt.state[p].items():
            if isinstance(st, dtorch.Tensor):  # states live with their parameter
                assert st.device_mesh == mesh and st.placements == pl, name


def test_partial_parameter_gets_replicate_states():
    w = torch.randn(4, 3)
    p = nn.Parameter(dtorch.Tensor(w, device_mesh=MESH_3, placements=[Partial()]))
    t = torch.nn.Parameter(w.clone())
    opt, topt = AdamW([p], lr=0.1), torch.optim.AdamW([t], lr=0.1)
    for s in range(2):
        _set_grads([t], [p], s)
        opt.step(), topt.step()
    assert opt.state[p]["exp_avg"].placements == [R]
    torch.testing.assert_close(p.to_torch(), t.detach(), **TOL)


def test_param_groups_with_their_own_options():
    tps, dps = _pair("mesh2d")
    topt = torch.optim.SGD([{"params": [tps[0]], "lr": 0.3, "momentum": 0.5}, {"params": [tps[1]]}], lr=0.1)
    dopt = SGD([{"params": [dps[0]], "lr": 0.3, "momentum": 0.5}, {"params": [dps[1]]}], lr=0.1)
    for s in range(3):
        _set_grads(tps, dps, s)
        topt.step(), dopt.step()
    _assert_same(tps, dps)
    assert [g["lr"] for g in dopt.param_groups] == [0.3, 0.1]
    assert dopt.param_groups[1]["momentum"] == 0 and dopt.defaults["lr"] == 0.1
    dopt.param_groups[0]["lr"] = 0.0  # a scheduler changes the group's options in place
    topt.param_groups[0]["lr"] = 0.0
    _set_grads(tps, dps, 9)
    topt.step(), dopt.step()
    _assert_same(tps, dps)


@pytest.mark.parametrize("dcls,tcls,cfg", [(SGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
                                           (AdamW, torch.optim.AdamW, dict(lr=0.01, amsgrad=True)),
                                           (Adam, torch.optim.Adam, dict(lr=0.01, weight_decay=0.1))])
def test_state_dict_has_torchs_structure_and_round_trips(dcls, tcls, cfg):
    tps, dps = _pair("mesh2d")
    topt, dopt = tcls(tps, **cfg), dcls(dps, **cfg)
    for s in range(2):
        _set_grads(tps, dps, s)
        topt.step(), dopt.step()
    tsd, dsd = topt.state_dict(), dopt.state_dict()
    assert dsd["param_groups"] == tsd["param_groups"]
    assert sorted(dsd["state"]) == sorted(tsd["state"]) == [0, 1]
    for k in tsd["state"]:
        assert list(dsd["state"][k]) == list(tsd["state"][k])  # the same names in the same order
        for name, v in tsd["state"][k].items():
            got = dsd["state"][k][name]
            if name == "step":
                assert isinstance(got, torch.Tensor) and got.dtype == v.dtype and got.item() == v.item()
            else:
                assert isinstance(got, dtorch.Tensor) and got.placements == dps[k].placements
                torch.testing.assert_close(got.to_torch(), v, **TOL)

    # a new optimizer (new parameters with the same values, other layouts) continues identically
    _, fresh = _pair("shard1_uneven")
    for f, d in zip(fresh, dps):
        with torch.no_grad():
            f.copy_(d.redistribute(f.device_mesh, f.placements))
    dopt2 = dcls(fresh, **cfg)
    dopt2.load_state_dict(dsd)
    for p in fresh:
        for st in dopt2.state[p].values():
            if isinstance(st, dtorch.Tensor):
                assert st.device_mesh == p.device_mesh and st.placements == p.placements
    for s in range(2, 5):
        _set_grads(tps, dps, s)
        _set_grads(tps, fresh, s)
        topt.step(), dopt.step(), dopt2.step()
    _assert_same(tps, fresh, "loaded optimizer")
    _assert_same(tps, dps, "original optimizer (its states were not shared with the loaded one)")


def test_load_a_torch_optimizers_state_dict():
    tps, dps = _pair("shard0")
    topt = torch.optim.AdamW(tps, lr=0.01, weight_decay=0.05)
    for s in range(2):
        _set_grads(tps, dps, s)  # (only torch's optimizer steps here)
        topt.step()
    for t, d in zip(tps, dps):
        with torch.no_grad():
            d.copy_(dtorch.Tensor(t.detach(), device_mesh=d.device_mesh, placements=d.placements))
    dopt = AdamW(dps)
    dopt.load_state_dict(topt.state_dict())
    assert dopt.param_groups[0]["weight_decay"] == 0.05 and dopt.param_groups[0]["params"] == dps
    for s in range(2, 4):
        _set_grads(tps, dps, s)
        topt.step(), dopt.step()
    _assert_same(tps, dps)


def test_load_state_dict_checks_the_structure():
    _, dps = _pair("replicate")
    opt = SGD(dps, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="different number of parameter groups"):
        opt.load_state_dict({"state": {}, "param_groups": []})
    with pytest.raises(ValueError, match="doesn't match the size"):
        opt.load_state_dict({"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]})


def test_zero_grad():
    tps, dps = _pair("mesh2d")
    opt = SGD(dps, lr=0.1)
    _set_grads(tps, dps, 0)
    grad = dps[0].grad
    opt.zero_grad(set_to_none=False)
    assert dps[0].grad is grad and not dps[0].grad.to_torch().any()
    assert dps[0].grad.placements == dps[0].placements
    opt.zero_grad()
    assert all(p.grad is None for p in dps)
    opt.step()  # parameters without gradients are skipped
    _assert_same(tps, dps)


def test_closure_and_bad_arguments():
    tps, dps = _pair("shard0")
    opt = SGD(dps, lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (dps[0] * dps[0]).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, dtorch.Tensor) and dps[0].grad is not None
    with pytest.raises(ValueError, match="empty parameter list"):
        SGD([], lr=0.1)
    with pytest.raises(TypeError, match="dtorch Tensors"):
        SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    with pytest.raises(ValueError, match="more than one parameter group"):
        SGD([{"params": dps}, {"params": dps[:1]}], lr=0.1)
    with pytest.raises(ValueError, match="non-leaf"):
        SGD([dps[0] * 2], lr=0.1)
    with pytest.raises(ValueError, match="Nesterov"):
        SGD(dps, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="beta"):
        AdamW(dps, betas=(0.9, 1.5))


# -- torch's lr schedulers on dtorch optimizers ---------------------------------------------------------

LRS = torch.optim.lr_scheduler
SCHEDULERS = {  # name -> (optimizer class name, its options, scheduler factory)
    "LambdaLR": ("SGD", dict(lr=0.1, momentum=0.9), lambda o: LRS.LambdaLR(o, lambda e: 0.9 ** e)),
    "LinearLR": ("AdamW", dict(lr=0.01), lambda o: LRS.LinearLR(o, start_factor=0.2, total_iters=7)),
    "CosineAnnealingLR": ("Adam", dict(lr=0.01), lambda o: LRS.CosineAnnealingLR(o, T_max=9, eta_min=1e-4)),
    "OneCycleLR_betas": ("AdamW", dict(lr=0.01), lambda o: LRS.OneCycleLR(o, max_lr=0.05, total_steps=25)),
    "OneCycleLR_momentum": ("SGD", dict(lr=0.1, momentum=0.9),
                            lambda o: LRS.OneCycleLR(o, max_lr=0.3, total_steps=25, anneal_strategy="linear")),
    "SequentialLR": ("AdamW", dict(lr=0.01), lambda o: LRS.SequentialLR(
        o, [LRS.LinearLR(o, start_factor=0.1, total_iters=5), LRS.CosineAnnealingLR(o, T_max=15)], milestones=[5])),
    "StepLR": ("SGD", dict(lr=0.1), lambda o: LRS.StepLR(o, step_size=3, gamma=0.5)),
}
SCHED_STEPS = 20


def _optimizers(opt_name: str, cfg: dict, layout: str = "mesh2d"):
    tps, dps = _pair(layout)
    return tps, dps, getattr(torch.optim, opt_name)(tps, **cfg), {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}[opt_name](
        dps, **cfg)


def _hyper(opt) -> list:
    """What a scheduler writes into each parameter group."""
    return [(g["lr"], g.get("momentum"), g.get("betas")) for g in opt.param_groups]


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_torch_schedulers_drive_dtorch_optimizers(name):
    # they used to refuse them: "AdamW is not an Optimizer"
    opt_name, cfg, make = SCHEDULERS[name]
    tps, dps, topt, dopt = _optimizers(opt_name, cfg)
    assert isinstance(dopt, torch.optim.Optimizer)
    tsched, dsched = make(topt), make(dopt)
    assert _hyper(dopt) == _hyper(topt) and dsched.get_last_lr() == tsched.get_last_lr()
    for s in range(SCHED_STEPS):
        _set_grads(tps, dps, s)
        topt.step(), dopt.step()
        tsched.step(), dsched.step()
        assert dsched.get_last_lr() == tsched.get_last_lr(), f"step {s + 1}"
        assert _hyper(dopt) == _hyper(topt), f"step {s + 1}"
    _assert_same(tps, dps, f"after {SCHED_STEPS} scheduled steps")


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_and_optimizer_state_dicts_resume_a_run(name):
    opt_name, cfg, make = SCHEDULERS[name]
    tps, dps, topt, dopt = _optimizers(opt_name, cfg)
    tsched, dsched = make(topt), make(dopt)
    half = SCHED_STEPS // 2
    for s in range(half):
        _set_grads(tps, dps, s)
        topt.step(), dopt.step(), tsched.step(), dsched.step()
    saved_sched, saved_opt = dsched.state_dict(), dopt.state_dict()
    assert "optimizer" not in saved_sched and saved_sched["last_epoch"] == half
    assert saved_opt["param_groups"] == topt.state_dict()["param_groups"]  # initial_lr, lr, momenta as torch's
    # a resumed run: new parameters with the trained values, a new optimizer and scheduler, then both loaded
    _, fresh = _pair("shard1_uneven")
    for f, d in zip(fresh, dps):
        with torch.no_grad():
            f.copy_(d.redistribute(f.device_mesh, f.placements))
    ropt = type(dopt)(fresh, **cfg)
    rsched = make(ropt)
    rsched.load_state_dict(saved_sched)
    ropt.load_state_dict(saved_opt)
    for s in range(half, SCHED_STEPS):
        _set_grads(tps, fresh, s)
        topt.step(), ropt.step(), tsched.step(), rsched.step()
        assert rsched.get_last_lr() == tsched.get_last_lr(), f"step {s + 1}"
        assert _hyper(ropt) == _hyper(topt), f"step {s + 1}"
    _assert_same(tps, fresh, "resumed run")


def _warnings_of(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("order", ["scheduler_first", "optimizer_first"])
def test_scheduler_step_order_warns_like_torch(order):
    tps, dps, topt, dopt = _optimizers("SGD", dict(lr=0.1))

    def run(opt):
        sched = LRS.StepLR(opt, step_size=1, gamma=0.5)
        if order == "scheduler_first":
            sched.step()
            opt.step()
        else:
            opt.step()
            sched.step()
        return sched

    _set_grads(tps, dps, 0)
    want = _warnings_of(lambda: run(topt))
    got = _warnings_of(lambda: run(dopt))
    assert got == want
    assert any("before `optimizer.step()`" in w for w in got) == (order == "scheduler_first")
    assert dopt._opt_called  # the scheduler's wrapper around step counted the call, as on torch's optimizer


@pytest.mark.parametrize("opt_name", ["SGD", "Adam", "AdamW"])
def test_tensor_lr_is_read_at_each_step_as_in_torch(opt_name):
    """lr may be a 1-element tensor, as torch.optim allows; a scheduler fill_s it in place."""
    cfg = dict(lr=torch.tensor(0.05), foreach=False)
    cfg_d = dict(lr=torch.tensor(0.05))
    tps, dps, topt, _ = _optimizers(opt_name, cfg)
    dopt = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}[opt_name](dps, **cfg_d)
    tsched, dsched = LRS.StepLR(topt, step_size=2, gamma=0.3), LRS.StepLR(dopt, step_size=2, gamma=0.3)
    for s in range(5):
        _set_grads(tps, dps, s)
        topt.step(), dopt.step(), tsched.step(), dsched.step()
    assert isinstance(dopt.param_groups[0]["lr"], torch.Tensor)
    assert dopt.param_groups[0]["lr"].item() == topt.param_groups[0]["lr"].item()
    _assert_same(tps, dps, "with a tensor lr under StepLR")
    with pytest.raises(ValueError, match="1-element"):
        AdamW(dps, lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="learning rate"):
        SGD(dps, lr=-0.1)
    with pytest.raises(TypeError, match="Python number or a 1-element tensor"):
        SGD(dps, lr="0.1")


def test_step_and_state_dict_hooks_run_as_in_torch():
    _, dps = _pair("replicate")
    opt = SGD(dps, lr=0.1)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: seen.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
    opt.register_load_state_dict_pre_hook(lambda o, sd: {k: v for k, v in sd.items() if k != "extra"})
    opt.step()
    assert seen == ["pre", "post"]
    sd = opt.state_dict()
    assert sd["extra"] == 1
    opt.load_state_dict(sd)


# -- clipping ----------------------------------------------------------------------------------------

def _grads_pair(seed=0):
    """Parameters on two meshes (a pipeline's stages): sharded, nested-sharded and replicated gradients."""
    layouts = [((6, 5), MESH_22, [R, Shard(1)]), ((7,), MESH_22, [Shard(0), Shard(0)]), ((3, 4), MESH_3, [Shard(1)]),
               ((2,), MESH_3, [R])]
    g = torch.Generator().manual_seed(seed)
    tps, dps = [], []
    for shape, mesh, pl in layouts:
        w, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        t = torch.nn.Parameter(w.clone())
        t.grad = grad.clone()
        d = nn.Parameter(w.clone(), device_mesh=mesh, placements=pl)
        d.grad = dtorch.Tensor(grad, device_mesh=mesh, placements=pl)
        tps.append(t), dps.append(d)
    return tps, dps


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf, -math.inf, 0.0])
@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_matches_torch(norm_type, max_norm):
    tps, dps = _grads_pair()
    want = torch.nn.utils.clip_grad_norm_(tps, max_norm, norm_type=norm_type)
    grads = [d.grad for d in dps]
    with CommLog() as log:
        got = clip_grad_norm_(dps, max_norm, norm_type=norm_type)
    assert isinstance(got, dtorch.Tensor) and got.ndim == 0 and got.device_mesh == MESH_22
    torch.testing.assert_close(got.to_torch(), want, rtol=1e-6, atol=1e-6)
    for t, d, g in zip(tps, dps, grads):
        assert d.grad is g  # scaled in place
        torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)
    kinds = {r.kind for r in log.records}
    assert "all_gather" not in kinds and kinds <= {"all_reduce", "send_recv"}, log.table()
    # one all-reduce per mesh dim that shards a gradient (a vector of per-gradient norms), whatever the count
    assert log.counts().get(("all_reduce", "dp")) == 1 and log.counts().get(("all_reduce", "tp")) == 1
    assert log.counts().get(("all_reduce", "a")) == 1
    for r in log.records:
        assert r.nbytes <= len(r.devices) * 2 * 4, log.table()  # at most 2 float32 norms per device


def test_clip_grad_norm_replicated_grads_communicate_nothing():
    tps, dps = _pair("replicate")
    _set_grads(tps, dps, 0)
    want = torch.nn.utils.clip_grad_norm_(tps, 0.1)
    with CommLog() as log:
        got = clip_grad_norm_(dps, 0.1)
    assert log.records == []
    torch.testing.assert_close(got.to_torch(), want, rtol=1e-6, atol=1e-6)
    _assert_same([t.grad for t in tps], [d.grad for d in dps])


def test_clip_grad_norm_nonfinite_and_no_grads():
    tps, dps = _pair("shard0")
    _set_grads(tps, dps, 0)
    bad = torch.randn(7, 5)
    bad[1, 1] = float("nan")
    dps[0].grad = dtorch.Tensor(bad, device_mesh=MESH_3, placements=[Shard(0)])
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(dps, 1.0, error_if_nonfinite=True)
    assert math.isnan(clip_grad_norm_(dps, 1.0).item())
    for p in dps:
        p.grad = None
    assert clip_grad_norm_(dps, 1.0).item() == 0.0


def test_clip_grad_value_():
    tps, dps = _pair("mesh2d")
    _set_grads(tps, dps, 0)
    torch.nn.utils.clip_grad_value_(tps, 0.3)
    with CommLog() as log:
        clip_grad_value_(dps, 0.3)
    assert log.records == []
    _assert_same([t.grad for t in tps], [d.grad for d in dps])


# -- end to end ---------------------------------------------------------------------------------------

class _MLP(nn.Module):
    def __init__(self, d_in, d_hidden, n_classes, dtype):
        super().__init__()
        self.up = nn.ColumnParallelLinear(d_in, d_hidden, dtype=dtype)  # weight Shard(0) on tp
        self.down = nn.RowParallelLinear(d_hidden, n_classes, dtype=dtype)  # weight Shard(1) on tp

    def forward(self, x):
        return self.down(DF.relu(self.up(x)))  # [b, in] -> [b, hidden] S(-1) on tp -> [b, classes] P on tp


def test_mlp_on_dp_tp_trains_like_torch():
    torch.manual_seed(0)
    d_in, d_hidden, n_classes, batch = 6, 10, 5, 8
    dtype = torch.float64
    ref = torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.ReLU(),
                              torch.nn.Linear(d_hidden, n_classes)).to(dtype)
    with dtorch.default_graph().device_mesh_guard(MESH_22):
        model = _MLP(d_in, d_hidden, n_classes, dtype)
    sd = ref.state_dict()
    model.load_state_dict({"up.weight": sd["0.weight"], "up.bias": sd["0.bias"], "down.weight": sd["2.weight"],
                           "down.bias": sd["2.bias"]})
    topt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
    dopt = SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(batch, d_in, generator=g, dtype=dtype)
        y = torch.randint(0, n_classes, (batch,), generator=g)
        topt.zero_grad()
        want = torch.nn.functional.cross_entropy(ref(x), y)
        want.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        topt.step()

        dopt.zero_grad()
        dx = dtorch.Tensor(x, device_mesh=MESH_22, placements=[Shard(0), R])  # the batch split on dp
        loss = DF.cross_entropy(model(dx), y)
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        dopt.step()
        torch.testing.assert_close(loss.to_torch(), want.detach(), rtol=1e-5, atol=1e-5, msg=f"loss at step {step}")
    for name, (dname, p) in zip(("0.weight", "0.bias", "2.weight", "2.bias"), model.named_parameters()):
        torch.testing.assert_close(p.to_torch(), ref.state_dict()[name], rtol=1e-5, atol=1e-5, msg=dname)
    assert model.up.weight.placements == [R, Shard(0)] and model.down.weight.placements == [R, Shard(1)]
