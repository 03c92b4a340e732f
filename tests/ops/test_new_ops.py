"""Reductions with indices combined from per-device candidates (no gather of the input: CommLog), whole-dim
ops (sort, median, cummax, flip, roll, unfold), nansum/count_nonzero, and the misc ops, against torch on
uneven layouts (7 rows over 3, 4 and 2x2 devices) incl. Partial inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import CommLog, Partial, Replicate, Shard
from sweep import MESH_1D, MESH_2D, distribute

X = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
Y = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
MESH_4 = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["a"])  # 5 columns over 4: uneven, 7 rows: one empty
LAYOUTS = [(m, p) for m in (MESH_1D, MESH_4) for p in [(Shard(0),), (Shard(1),), (Replicate(),), (Partial("sum"),)]] + \
    [(MESH_2D, p) for p in [(Shard(0), Shard(1)), (Shard(1), Shard(0)), (Shard(0), Shard(0)), (Partial("sum"), Shard(0))]]


def _check(a, b):
    if isinstance(b, tuple):
        for u, w in zip(a, b):
            _check(u, w)
        return
    torch.testing.assert_close(a.to_torch(), b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh,pl", LAYOUTS, ids=str)
def test_reductions_and_scans(mesh, pl):
    x = distribute(X, mesh, pl)
    for d in (0, 1):
        _check(dtorch.max(x, d), tuple(torch.max(X, d)))
        _check(dtorch.min(x, d, True), tuple(torch.min(X, d, True)))
        _check(dtorch.argmax(x, d), torch.argmax(X, d))
        _check(x.argmin(d, keepdim=True), X.argmin(d, keepdim=True))
        _check(dtorch.logsumexp(x, d), torch.logsumexp(X, d))
        _check(dtorch.prod(x, d), torch.prod(X, d))
        _check(dtorch.topk(x, 2, d), tuple(torch.topk(X, 2, d)))
        _check(x.topk(3, d, largest=False), tuple(X.topk(3, d, largest=False)))
        _check(dtorch.sort(x, d), tuple(torch.sort(X, d)))
        _check(dtorch.argsort(x, d, descending=True), torch.argsort(X, d, descending=True))
        _check(dtorch.median(x, d), tuple(torch.median(X, d)))
        _check(dtorch.cummax(x, d), tuple(torch.cummax(X, d)))
        _check(dtorch.cummin(x, d), tuple(torch.cummin(X, d)))
        _check(dtorch.cumprod(x, d), torch.cumprod(X, d))
        _check(dtorch.nansum(x, d), torch.nansum(X, d))
        _check(dtorch.count_nonzero(x > 0, d), torch.count_nonzero(X > 0, d))
        _check(dtorch.flip(x, (d,)), torch.flip(X, (d,)))
        _check(dtorch.roll(x, 2, d), torch.roll(X, 2, d))
        _check(x.unfold(d, 2, 1), X.unfold(d, 2, 1))
    _check(dtorch.argmax(x), torch.argmax(X))
    _check(dtorch.logsumexp(x, (0, 1)), torch.logsumexp(X, (0, 1)))
    _check(dtorch.prod(x), torch.prod(X))
    _check(dtorch.median(x), torch.median(X))
    _check(dtorch.roll(x, 3), torch.roll(X, 3))


def test_ties_pick_the_first_index_like_torch():
    t = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 3.0]])
    for mesh, pl in [(MESH_1D, [Shard(1)]), (MESH_4, [Shard(1)])]:
        x = distribute(t, mesh, pl)
        assert torch.equal(x.argmax(1).to_torch(), t.argmax(1))
        assert torch.equal(x.max(1).indices.to_torch(), t.max(1).indices)


@pytest.mark.parametrize("op", ["argmax", "max", "topk", "logsumexp", "prod"])
def test_candidates_cross_devices_not_the_input(op):
    big = torch.randn(6, 300, generator=torch.Generator().manual_seed(4))
    x = distribute(big, MESH_2D, [Shard(1), Shard(1)])
    fn = {"argmax": lambda: x.argmax(1), "max": lambda: x.max(1), "topk": lambda: x.topk(3, 1),
          "logsumexp": lambda: x.logsumexp(1), "prod": lambda: x.prod(1)}[op]
    with CommLog() as log:
        fn()
    assert log.records, "the candidates are gathered"
    assert all(r.kind == "all_gather" for r in log.records), log.table()
    # the collectives move the candidates (6 rows x 4 devices x k values and indices), never the 6 x 300 input
    assert sum(r.nbytes for r in log.records) < big.numel() * big.element_size() / 2, log.table()


def test_sum_like_reductions_stay_partial():
    x = distribute(X, MESH_1D, [Shard(0)])
    with CommLog() as log:
        n = dtorch.count_nonzero(x > 0, 0)
        s = dtorch.nansum(x, 0)
    assert log.counts() == {} and n.placements == [Partial("sum")] and s.placements == [Partial("sum")]


@pytest.mark.parametrize("mesh,pl", LAYOUTS, ids=str)
def test_misc_ops(mesh, pl):
    x, y = distribute(Y, mesh, pl), distribute(Y.flip(0), mesh, pl)
    _check(dtorch.nn.functional.normalize(x), F.normalize(Y))
    _check(dtorch.nn.functional.normalize(x, 1.0, 0), F.normalize(Y, 1.0, 0))
    _check(dtorch.nn.functional.cosine_similarity(x, y), F.cosine_similarity(Y, Y.flip(0)))
    _check(F.cosine_similarity(x, y, 0), F.cosine_similarity(Y, Y.flip(0), 0))
    _check(dtorch.nn.functional.glu(x), F.glu(Y))
    assert x.equal(x.clone()) and not dtorch.equal(x, y) and torch.equal(x, x)
    ids = torch.randint(0, 4, (7, 3), generator=torch.Generator().manual_seed(5))
    i = dtorch.Tensor(ids, device_mesh=mesh, placements=[Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    _check(dtorch.nn.functional.one_hot(i), F.one_hot(ids))
    _check(F.one_hot(i, 6), F.one_hot(ids, 6))
    _check(x.repeat(repeats=(2, 1)), Y.repeat(repeats=(2, 1)))
    _check(x.view(size=(42,)), Y.view(size=(42,)))
    _check(x.permute(dims=(1, 0)), Y.permute(dims=(1, 0)))
    _check(x.expand(size=(2, 7, 6)), Y.expand(size=(2, 7, 6)))


def test_gradients_through_combined_reductions():
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    (w.max(1).values.sum() + w.logsumexp(0).sum() + w.topk(2, 1).values.sum() + w.prod(0).sum()).backward()
    dw = dtorch.Tensor(w.detach(), device_mesh=MESH_2D, placements=[Shard(1), Shard(0)]).requires_grad_()
    (dw.max(1).values.sum() + dw.logsumexp(0).sum() + dw.topk(2, 1).values.sum() + dw.prod(0).sum()).backward()
    torch.testing.assert_close(dw.grad.to_torch(), w.grad)


def test_bad_arguments():
    x = distribute(X, MESH_1D, [Shard(1)])
    with pytest.raises(dtorch.OpError, match="out of range"):
        x.topk(6, 1)
    with pytest.raises(dtorch.OpError, match="Halving dimension must be even"):
        dtorch.nn.functional.glu(x, 1)
    with pytest.raises(dtorch.OpError, match="repeats="):
        x.repeat(sizes=(2, 1))
