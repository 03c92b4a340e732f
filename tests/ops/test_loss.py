"""cross_entropy and mse_loss against torch: values and gradients (float64, 1e-5), every reduction,
ignore_index and label_smoothing, on class-sharded, batch-sharded, both, and uneven layouts (11 classes
over 2 or 3 devices); class-sharded logits are never gathered (CommLog)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import CommLog, Partial, Replicate, Shard
from sweep import distribute

R = Replicate()
MESH_3 = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["tp"])
MESH_2 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
MESH_22 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
TOL = {"rtol": 1e-5, "atol": 1e-5, "equal_nan": True}
N, C = 7, 11


def _data(shape=(N, C), seed=0, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3
    tshape = shape[:1] + shape[2:] if len(shape) > 1 else ()
    t = torch.randint(0, shape[1 if len(shape) > 1 else 0], tshape, generator=g)
    if t.ndim:
        t.view(-1)[1] = ignore_index  # one ignored target
    w = torch.rand(shape[1 if len(shape) > 1 else 0], generator=g, dtype=torch.float64) + 0.2
    return x, t, w


def _torch_ref(x, t, **kw):
    xt = x.clone().requires_grad_()
    out = F.cross_entropy(xt, t, **kw)
    (out.sum() if out.ndim else out).backward()
    return out.detach(), xt.grad


def _check(mesh, x_pl, x, t, t_pl=None, **kw):
    """dtorch's loss and logits gradient equal torch's; the gradient has the logits' placements."""
    weight_pl = kw.pop("weight_pl", None)
    ref, ref_grad = _torch_ref(x, t, **kw)
    dx = distribute(x, mesh, x_pl).requires_grad_()
    dt = dtorch.Tensor(t, device_mesh=mesh, placements=t_pl) if t_pl is not None else t
    if weight_pl is not None:
        kw = dict(kw, weight=dtorch.Tensor(kw["weight"], device_mesh=mesh, placements=weight_pl))
    out = F.cross_entropy(dx, dt, **kw)
    (out.sum() if out.ndim else out).backward()
    where = f"layout {[str(p) for p in x_pl]} {sorted(kw)}"
    torch.testing.assert_close(out.to_torch(), ref, **TOL, msg=lambda m: f"loss, {where}: {m}")
    torch.testing.assert_close(dx.grad.to_torch(), ref_grad, **TOL, msg=lambda m: f"grad, {where}: {m}")
    assert tuple(dx.grad.placements) == tuple(p if not isinstance(p, Partial) else R for p in x_pl)


LAYOUTS = [
    (MESH_3, (R,)), (MESH_3, (Shard(1),)), (MESH_3, (Shard(0),)), (MESH_3, (Partial(),)),
    (MESH_2, (Shard(1),)),
    (MESH_22, (Shard(0), Shard(1))), (MESH_22, (Shard(1), Shard(0))), (MESH_22, (Shard(1), Shard(1))),
    (MESH_22, (Shard(1), R)), (MESH_22, (R, Shard(1))),
    (MESH_22, (Shard(0), Shard(0))),
]
COMBOS = list(itertools.product(("mean", "sum", "none"), (0.0, 0.2), (False, True)))


@pytest.mark.parametrize("reduction,smoothing,weighted", COMBOS)
def test_cross_entropy_every_layout(reduction, smoothing, weighted):
    x, t, w = _data()
    kw = {"reduction": reduction, "label_smoothing": smoothing}
    if weighted:
        kw["weight"] = w
    for mesh, pl in LAYOUTS:
        _check(mesh, pl, x, t, **kw)


@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_cross_entropy_ignore_index(ignore_index):
    # a class index can be the ignored one too; its rows count neither in the loss nor in the mean
    x, t, w = _data(ignore_index=ignore_index)
    t[4] = ignore_index
    for mesh, pl in [(MESH_3, (Shard(1),)), (MESH_22, (Shard(0), Shard(1)))]:
        for kw in ({}, {"weight": w, "label_smoothing": 0.3}, {"reduction": "none", "label_smoothing": 0.1}):
            _check(mesh, pl, x, t, ignore_index=ignore_index, **kw)


def test_cross_entropy_all_targets_ignored_is_nan_like_torch():
    x, t, _ = _data()
    t[:] = -100
    _check(MESH_3, (Shard(1),), x, t)  # 0 / 0: nan (assert_close compares nan equal) and a zero gradient


def test_cross_entropy_spatial_dims():
    # [N, C, d1, d2], class dim 1 (not last): class, batch and spatial shards
    x, t, w = _data(shape=(3, 5, 4, 2))
    for mesh, pl in [(MESH_3, (Shard(1),)), (MESH_3, (Shard(2),)), (MESH_22, (Shard(2), Shard(1))),
                     (MESH_22, (Shard(0), Shard(3)))]:
        for kw in ({}, {"weight": w, "label_smoothing": 0.2, "reduction": "sum"}, {"reduction": "none"}):
            _check(mesh, pl, x, t, **kw)


@pytest.mark.parametrize("kw", [{}, {"reduction": "none"}, {"reduction": "sum", "label_smoothing": 0.2},
                                {"weight": "w", "ignore_index": 3}])
def test_cross_entropy_of_transposed_language_model_logits(kw):
    # logits [N, S, C] passed as [N, C, S] (the Llama's loss): replicated, the loss runs on rows; any layout
    # gives torch's values and gradients
    x, t, w = _data(shape=(3, 11, 5), ignore_index=kw.get("ignore_index", -100))  # [N, C, S] targets and weights, for logits laid out [N, S, C]:
    x_nsc = x.transpose(1, 2).contiguous()
    kw = dict(kw, weight=w) if kw.get("weight") == "w" else kw
    xt = x_nsc.clone().requires_grad_()
    ref = F.cross_entropy(xt.transpose(1, 2), t, **kw)
    (ref.sum() if ref.ndim else ref).backward()
    for mesh, pl in [(MESH_3, (R,)), (MESH_22, (R, R)), (MESH_3, (Shard(1),)), (MESH_22, (Shard(0), Shard(2)))]:
        dx = distribute(x_nsc, mesh, pl).requires_grad_()
        out = F.cross_entropy(dx.transpose(1, 2), t, **kw)
        (out.sum() if out.ndim else out).backward()
        torch.testing.assert_close(out.to_torch(), ref.detach(), **TOL)
        torch.testing.assert_close(dx.grad.to_torch(), xt.grad, **TOL)


def test_cross_entropy_single_sample_and_empty_class_shard():
    x, t, w = _data(shape=(C,))
    _check(MESH_3, (Shard(0),), x, t, label_smoothing=0.1)
    # 2 classes over 3 devices: one device holds no class at all
    x2, t2, w2 = _data(shape=(5, 2))
    for kw in ({}, {"weight": w2, "label_smoothing": 0.4}):
        _check(MESH_3, (Shard(1),), x2, t2, **kw)


def test_cross_entropy_class_probabilities():
    g = torch.Generator().manual_seed(3)
    x, _, w = _data()
    p = torch.softmax(torch.randn(N, C, generator=g, dtype=torch.float64), 1)
    for reduction, kw in itertools.product(("mean", "sum", "none"), ({}, {"weight": w, "label_smoothing": 0.25})):
        for mesh, pl in [(MESH_3, (Shard(1),)), (MESH_22, (Shard(0), Shard(1)))]:
            _check(mesh, pl, x, p, reduction=reduction, **kw)


def test_cross_entropy_target_and_weight_layouts():
    # targets as dtorch tensors sharded on the batch, a class-sharded weight: laid out as the pick needs
    x, t, w = _data()
    _check(MESH_22, (R, Shard(1)), x, t, t_pl=[Shard(0), R], weight=w, weight_pl=[R, Shard(0)], label_smoothing=0.1)
    _check(MESH_3, (R,), x, t, t_pl=[Shard(0)], reduction="none")


def test_cross_entropy_float32_and_entry_points():
    x, t, _ = _data()
    x = x.float()
    dx = dtorch.Tensor(x, device_mesh=MESH_3, placements=[Shard(1)])
    want = F.cross_entropy(x, t)
    for fn in (F.cross_entropy, dtorch.nn.functional.cross_entropy, torch.nn.CrossEntropyLoss()):
        got = fn(dx, t)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.to_torch(), want, rtol=1e-5, atol=1e-6)


def test_cross_entropy_bfloat16_computes_the_log_softmax_in_float32_like_torch():
    x, t, _ = _data(shape=(9, 50))
    x = x.bfloat16()
    xt = x.clone().requires_grad_()
    want = F.cross_entropy(xt, t, label_smoothing=0.1)
    want.backward()
    dx = dtorch.Tensor(x, device_mesh=MESH_3, placements=[Shard(1)]).requires_grad_()
    got = F.cross_entropy(dx, t, label_smoothing=0.1)
    got.backward()
    assert got.dtype == dx.grad.dtype == torch.bfloat16
    # bfloat16 sums in another order: within a rounding step of torch's
    torch.testing.assert_close(got.to_torch(), want.detach(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dx.grad.to_torch(), xt.grad, rtol=2e-2, atol=2e-3)


def test_cross_entropy_vocab_sharded_never_gathers_the_logits():
    # the HF causal-LM layout [B*S, V], V sharded on tp and the rows on dp
    B, S, V = 2, 5, 11
    x = torch.randn(B * S, V, dtype=torch.float64)
    t = torch.randint(0, V, (B * S,))
    for kw in ({}, {"label_smoothing": 0.1}, {"reduction": "none"}):
        dx = dtorch.Tensor(x, device_mesh=MESH_22, placements=[Shard(0), Shard(1)]).requires_grad_()
        with CommLog() as log:
            loss = F.cross_entropy(dx, t, **kw)
            (loss.sum() if loss.ndim else loss).backward()
        kinds = {r.kind for r in log.records}
        assert kinds <= {"all_reduce"}, log.table()
        assert any(r.mesh_dim == "tp" for r in log.records)
        for r in log.records:  # [B*S]-sized at most (each device: its dp rows), never [B*S, V]
            assert r.nbytes <= len(r.devices) * (B * S // 2) * 8, log.table()
        assert tuple(dx.grad.placements) == (Shard(0), Shard(1))
        ref, ref_grad = _torch_ref(x, t, **kw)
        torch.testing.assert_close(loss.to_torch(), ref, **TOL)
        torch.testing.assert_close(dx.grad.to_torch(), ref_grad, **TOL)


def test_cross_entropy_keeps_batch_shards_until_the_final_sum():
    x, t, _ = _data()
    dx = dtorch.Tensor(x, device_mesh=MESH_3, placements=[Shard(0)])
    with CommLog() as log:
        per_row = F.cross_entropy(dx, t, reduction="none")
        total = F.cross_entropy(dx, t, reduction="sum")
    assert log.records == [] and per_row.placements == [Shard(0)] and total.placements == [Partial()]


@pytest.mark.parametrize("bad,match", [
    ({"t": torch.tensor([0, 11, 2, 3, 4, 5, 6])}, "target 11 is out of bounds for 11 classes"),
    ({"t": torch.zeros(6, dtype=torch.long)}, "expected a target of shape \\[7\\]"),
    ({"weight": torch.ones(10, dtype=torch.float64)}, "weight must be 1-D with one entry per class \\(11\\)"),
    ({"reduction": "avg"}, "reduction='avg' is not valid"),
    ({"label_smoothing": 1.5}, "label_smoothing must be between"),
])
def test_cross_entropy_bad_input_raises(bad, match):
    x, t, _ = _data()
    t = bad.pop("t", t)
    dx = dtorch.Tensor(x, device_mesh=MESH_3, placements=[Shard(1)])
    with pytest.raises(dtorch.OpError, match=match):
        F.cross_entropy(dx, t, **bad)


def test_cross_entropy_dtorch_target_out_of_range_raises():
    x, t, _ = _data()
    t[0] = 11
    dx = dtorch.Tensor(x, device_mesh=MESH_3, placements=[Shard(1)])
    # dtorch targets: the pick kernel checks them (on the process backend its error comes back as the
    # WorkerError that stops the workers, with the kernel's message)
    with pytest.raises((IndexError, dtorch.OpError, dtorch.RuntimeBackendError), match="target 11 is out of bounds"):
        F.cross_entropy(dx, dtorch.Tensor(t, device_mesh=MESH_3)).to_torch()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(reduction):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    y = torch.randn(7, 5, generator=g, dtype=torch.float64)
    w = torch.rand(7, 5, generator=g, dtype=torch.float64)
    for weight in (None, w):
        xt = x.clone().requires_grad_()
        ref = F.mse_loss(xt, y, reduction=reduction, weight=weight)
        (ref.sum() if ref.ndim else ref).backward()
        for mesh, pl in [(MESH_3, (R,)), (MESH_3, (Shard(0),)), (MESH_3, (Shard(1),)), (MESH_3, (Partial(),)),
                         (MESH_22, (Shard(0), Shard(1)))]:
            dx = distribute(x, mesh, pl).requires_grad_()
            out = F.mse_loss(dx, y, reduction=reduction, weight=weight)
            (out.sum() if out.ndim else out).backward()
            torch.testing.assert_close(out.to_torch(), ref.detach(), **TOL)
            torch.testing.assert_close(dx.grad.to_torch(), xt.grad, **TOL)


def test_mse_loss_broadcast_warns_like_torch():
    x, y = torch.randn(4, 1, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    dx = dtorch.Tensor(x, device_mesh=MESH_2, placements=[Shard(0)])
    with pytest.warns(UserWarning, match="different to the input size"):
        got = dtorch.nn.functional.mse_loss(dx, y)
    with pytest.warns(UserWarning):
        want = F.mse_loss(x, y)
    torch.testing.assert_close(got.to_torch(), want, **TOL)


def test_sum_exp_pick_kernel_writes_torchs_gradient_once_in_the_logits_layout():
    # the class-sharded loss's kernel on one block: logits [N, C, S] laid out [N, S, C] (a language model's,
    # transposed), one target ignored, one outside this class shard; torch's derivatives of the separate
    # kernels (exp(x - m).sum(C), the pick) summed give the same bits, but as two terms in another layout
    from dtorch.ops.loss import _SumExpPick
    n, c, s, cd = 3, 6, 5, -2
    x0 = torch.randn(n, s, c).transpose(1, 2)
    m = x0.amax(cd, keepdim=True)
    t = torch.randint(0, c, (n, s))
    keep = torch.ones(n, s, dtype=torch.bool)
    keep[0, 1] = keep[2, 3] = False
    idx = torch.where(keep, t, 0).unsqueeze(cd)
    d_se, d_pick = torch.randn(n, 1, s), torch.randn(n, s)
    x = x0.clone().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()  # (x0's layout, a leaf)
    se_ref = torch.exp(x - m).sum(cd, keepdim=True)
    pick_ref = torch.where(keep, torch.take_along_dim(x, idx, dim=cd).squeeze(cd), torch.zeros(()))
    want = torch.autograd.grad((se_ref, pick_ref), x, (d_se, d_pick))[0]
    se, pick = _SumExpPick.apply(x, m, idx, keep, cd)
    assert torch.equal(se, se_ref) and torch.equal(pick, pick_ref)
    got = torch.autograd.grad((se, pick), x, (d_se, d_pick))[0]
    assert torch.equal(got, want)
    assert got.stride() == x.stride()
