"""The layouts a kernel node's backward computes from specs alone are kept by the node's signature
(autograd/dispatched.py ``_NodeLayout``): every backward after the first finds them cached. These check
that a cached backward gives torch's gradients and records the same collectives as the first one, and that
one signature met by cotangents in other layouts gets each its own layouts."""
from __future__ import annotations

import os

import torch

import dtorch
from dtorch import CommLog, Replicate, Shard

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _torch_grads(x, w, b, ct):
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = torch.nn.functional.linear(x, w, b).relu()
    y.backward(ct)
    return w.grad, b.grad


def test_repeated_backward_matches_torch_and_records_the_same_collectives():
    # a weight replicated on dp met by dp-sharded rows: the in-process runtime keeps the local graph (even
    # blocks), whose GEMM sums the weight's gradient over dp; the all-reduce the devices would run is recorded
    # from the cached layouts in every step, not only the first
    mesh = dtorch.init_device_mesh("cpu", [2, 2], mesh_dim_names=["dp", "tp"])
    g = torch.Generator().manual_seed(0)
    x_full, w_full, b_full = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    w = dtorch.Tensor(w_full, device_mesh=mesh, placements=[Replicate(), Shard(0)]).requires_grad_()
    b = dtorch.Tensor(b_full, device_mesh=mesh, placements=[Replicate(), Shard(0)]).requires_grad_()
    logs = []
    for step in range(3):
        ct_full = torch.randn(8, 8, generator=g)
        want = _torch_grads(x_full, w_full, b_full, ct_full)
        x = dtorch.Tensor(x_full, device_mesh=mesh, placements=[Shard(0), Replicate()])
        ct = dtorch.Tensor(ct_full, device_mesh=mesh, placements=[Shard(0), Shard(1)])
        w.grad = b.grad = None
        with CommLog() as log:
            y = dtorch.nn.functional.linear(x, w, b)
            if os.environ.get("DTORCH_BACKEND", "inprocess") in ("", "inprocess"):
                assert y._ag.grad_fn.tape is not None  # (the kept local graph: the path that folds the reduction)
            y.relu().backward(ct)
        logs.append(sorted((r.kind, r.mesh_dim, r.nbytes) for r in log.records))
        torch.testing.assert_close(w.grad.to_torch(), want[0], **TOL)
        torch.testing.assert_close(b.grad.to_torch(), want[1], **TOL)
    # the weight's and the bias's gradients, each all-reduced over dp once
    assert [(kind, dim) for kind, dim, _ in logs[0]] == [("all_reduce", "dp")] * 2
    assert logs[1] == logs[0] and logs[2] == logs[0]


def test_one_signature_with_cotangents_in_other_layouts():
    # the same nodes (same specs) differentiated with the cotangent laid out three ways, alternating: each
    # layout gets its own cotangent and gradient layouts, and every backward gives torch's gradients
    mesh = dtorch.init_device_mesh("cpu", [3], mesh_dim_names=["tp"])
    g = torch.Generator().manual_seed(1)
    x_full, w_full, b_full = torch.randn(4, 5, generator=g), torch.randn(7, 5, generator=g), torch.randn(7, generator=g)
    w = dtorch.Tensor(w_full, device_mesh=mesh, placements=[Shard(0)]).requires_grad_()
    b = dtorch.Tensor(b_full, device_mesh=mesh, placements=[Shard(0)]).requires_grad_()
    x = dtorch.Tensor(x_full, device_mesh=mesh, placements=[Replicate()])
    for step, placement in enumerate([Shard(1), Replicate(), Shard(0), Shard(1), Replicate(), Shard(0)]):
        ct_full = torch.randn(4, 7, generator=torch.Generator().manual_seed(10 + step))
        want = _torch_grads(x_full, w_full, b_full, ct_full)
        w.grad = b.grad = None
        dtorch.nn.functional.linear(x, w, b).relu().backward(
            dtorch.Tensor(ct_full, device_mesh=mesh, placements=[placement]))
        torch.testing.assert_close(w.grad.to_torch(), want[0], **TOL)
        torch.testing.assert_close(b.grad.to_torch(), want[1], **TOL)
        assert w.grad.placements == [Shard(0)] and b.grad.placements == [Shard(0)]
