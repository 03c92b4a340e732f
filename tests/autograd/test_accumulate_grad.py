"""Gradient accumulation into an existing ``.grad``, against torch's AccumulateGrad on one device.

torch adds a new gradient into the ``.grad`` tensor in place (create_graph off): a reference the user holds to
it, or a view of it, sees the sum, and ``p.grad`` stays the same object over micro-batches. The first gradient
becomes ``.grad`` unless someone else holds it (a hook kept it): then ``.grad`` is a tensor of its own, which
later accumulation does not share. Checked on uneven shapes, for leaves whose incoming gradient is Partial,
Sharded or Replicate, on every backend, and for a ``.grad`` the user replaced.
"""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from tests.runtime.conftest import using
from tests.autograd.test_retain_graph import _graph

MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
TOL = {"rtol": 1e-6, "atol": 1e-6}
ROUNDS = 3


def _values(seed):
    gen = torch.Generator().manual_seed(seed)
    # uneven on both mesh dims: 7 rows and 5 columns over 2 devices each
    return torch.randn(7, 5, dtype=torch.float64, generator=gen), torch.randn(5, 9, dtype=torch.float64, generator=gen)


def _loss(x, w, k):
    """A micro-batch's loss: a different value per round ``k``, so a lost or doubled round shows."""
    return ((x @ w).tanh() * (k + 1)).sum() + (x * x).sum() * 0.5


# x's layout, w's layout: w meets x's sharded contraction dim (its gradient arrives Partial), x's rows
# (Shard) or neither
LAYOUTS = [
    ([Shard(0), Replicate()], [Replicate(), Replicate()]),   # x: Shard in, w: Partial over dp in, Replicate kept
    ([Replicate(), Shard(1)], [Replicate(), Shard(0)]),      # the contraction sharded on tp: x's grad Shard
    ([Shard(0), Shard(1)], [Replicate(), Replicate()]),      # w's gradient Partial on both mesh dims
    ([Replicate(), Replicate()], [Shard(1), Replicate()]),   # w's columns sharded: its gradient arrives Shard
]


@pytest.mark.parametrize("backend", ["inprocess", "reference", "blocks"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_micro_batches_accumulate_in_place_like_torch(layout, backend):
    xt, wt = _values(1)
    xr, wr = xt.clone().requires_grad_(), wt.clone().requires_grad_()
    held_r = []
    for k in range(ROUNDS):
        _loss(xr, wr, k).backward()
        held_r.append((xr.grad, wr.grad))
    with using(_graph(backend)):
        x = dtorch.Tensor(xt, device_mesh=MESH, placements=layout[0]).requires_grad_()
        w = dtorch.Tensor(wt, device_mesh=MESH, placements=layout[1]).requires_grad_()
        held = []
        first = None
        for k in range(ROUNDS):
            _loss(x, w, k).backward()
            held.append((x.grad, w.grad))
            if first is None:
                first = [g.to_torch() for g in held[0]]
        # torch keeps one .grad object over the rounds: so do we
        assert all(a is held_r[0][0] and b is held_r[0][1] for a, b in held_r)
        assert all(a is held[0][0] and b is held[0][1] for a, b in held)
        assert x.grad.placements == x.placements
        assert tuple(w.grad.placements) == tuple(Replicate() if p.is_partial() else p for p in w.placements)
        got = [g.to_torch() for g in held[0]]  # the first round's reference sees the sum
    torch.testing.assert_close(got[0], xr.grad, **TOL)
    torch.testing.assert_close(got[1], wr.grad, **TOL)
    assert not torch.allclose(first[1], wr.grad)  # (the rounds did add something)


def test_a_view_of_grad_sees_the_sum():
    xt, wt = _values(2)
    xr, wr = xt.clone().requires_grad_(), wt.clone().requires_grad_()
    x = dtorch.Tensor(xt, device_mesh=MESH, placements=[Shard(0), Shard(1)]).requires_grad_()
    w = dtorch.Tensor(wt, device_mesh=MESH, placements=[Replicate(), Shard(1)]).requires_grad_()
    _loss(xr, wr, 0).backward()
    _loss(x, w, 0).backward()
    rows_r, rows = xr.grad[1:6], x.grad[1:6]
    flat_r, flat = wr.grad.view(-1), w.grad.view(-1)
    _loss(xr, wr, 1).backward()
    _loss(x, w, 1).backward()
    torch.testing.assert_close(rows.to_torch(), rows_r, **TOL)
    torch.testing.assert_close(flat.to_torch(), flat_r, **TOL)


@pytest.mark.parametrize("given", [[Shard(0), Replicate()], [Shard(1), Shard(0)], [Replicate(), Replicate()]],
                         ids=str)
def test_a_grad_the_user_replaced_takes_the_sum(given):
    xt, wt = _values(3)
    start = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    xr, wr = xt.clone().requires_grad_(), wt.clone().requires_grad_()
    mine_r = start.clone()
    xr.grad = mine_r
    _loss(xr, wr, 0).backward()
    assert xr.grad is mine_r  # torch writes into the user's tensor
    x = dtorch.Tensor(xt, device_mesh=MESH, placements=[Shard(0), Replicate()]).requires_grad_()
    w = dtorch.Tensor(wt, device_mesh=MESH, placements=[Replicate(), Replicate()]).requires_grad_()
    mine = dtorch.Tensor(start, device_mesh=MESH, placements=given)
    x.grad = mine
    _loss(x, w, 0).backward()
    torch.testing.assert_close(x.grad.to_torch(), mine_r, **TOL)
    assert x.grad.placements == x.placements
    if tuple(given) == tuple(x.placements):  # stored as given (else laid out as x's gradient: a copy)
        assert x.grad is mine
        torch.testing.assert_close(mine.to_torch(), mine_r, **TOL)
    else:
        torch.testing.assert_close(mine.to_torch(), start, **TOL)


def test_a_gradient_a_hook_kept_is_not_changed_by_later_accumulation():
    xt, wt = _values(5)

    def run(x, w, to_host):
        kept = []
        x.register_hook(lambda g: kept.append(g) and None)
        for k in range(ROUNDS):
            _loss(x, w, k).backward()
        return [to_host(g) for g in kept], to_host(x.grad)

    kept_r, grad_r = run(xt.clone().requires_grad_(), wt.clone().requires_grad_(), lambda g: g)
    x = dtorch.Tensor(xt, device_mesh=MESH, placements=[Shard(0), Shard(1)]).requires_grad_()
    w = dtorch.Tensor(wt, device_mesh=MESH, placements=[Replicate(), Replicate()]).requires_grad_()
    kept, grad = run(x, w, lambda g: g.to_torch())
    for a, b in zip(kept, kept_r):
        torch.testing.assert_close(a, b, **TOL)
    torch.testing.assert_close(grad, grad_r, **TOL)


def test_two_leaves_of_one_add_then_one_of_them_alone():
    """Each leaf's ``.grad`` is its own: accumulating into ``a``'s leaves ``b``'s as torch does."""
    at, bt = (torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (6, 7))

    def run(a, b, to_host):
        (a + b).sum().backward()
        (a * 3).sum().backward()
        return to_host(a.grad), to_host(b.grad)

    want = run(at.clone().requires_grad_(), bt.clone().requires_grad_(), lambda g: g)
    pl = [Shard(0), Replicate()]
    got = run(dtorch.Tensor(at, device_mesh=MESH, placements=pl).requires_grad_(),
              dtorch.Tensor(bt, device_mesh=MESH, placements=pl).requires_grad_(), lambda g: g.to_torch())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
