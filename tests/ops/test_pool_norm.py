"""Pooling, adaptive pooling, interpolate, pad and the 2-D norms against torch under batch, channel,
spatial (uneven: 9 rows over 2) and Partial layouts on a 2x2 mesh; the placements each rule promises
(halo exchange for max/avg pool, Partial(sum) from a sharded dim pooled to one value, fallbacks gather);
batch_norm's running statistics and its CommLog (all-reduces of per-channel sums, no gather)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard
from sweep import distribute

MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "sp"])
LAYOUTS = [(Shard(0), Shard(2)), (Shard(2), Shard(3)), (Shard(1), Shard(2)), (Partial(), Shard(3)),
           (Partial("max"), Shard(2))]
X = torch.randn(4, 6, 9, 8, generator=torch.Generator().manual_seed(0))
W, B = torch.randn(6), torch.randn(6)
TOL = {"rtol": 1e-4, "atol": 1e-5}

OPS = {
    "max_pool": [(F.max_pool2d, dict(kernel_size=3, stride=2, padding=1)), (F.max_pool2d, dict(kernel_size=2)),
                 (F.max_pool2d, dict(kernel_size=3, stride=2, ceil_mode=True)),
                 (F.max_pool2d, dict(kernel_size=(3, 2), stride=1, padding=(1, 0), dilation=(2, 1)))],
    "avg_pool": [(F.avg_pool2d, dict(kernel_size=3, stride=2, padding=1)), (F.avg_pool2d, dict(kernel_size=2)),
                 (F.avg_pool2d, dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
                 (F.avg_pool2d, dict(kernel_size=3, ceil_mode=True, stride=2))],
    "adaptive": [(F.adaptive_avg_pool2d, dict(output_size=o)) for o in (1, (1, 3), (2, 2))],
    "interpolate": [(F.interpolate, dict(scale_factor=2, mode="bilinear", align_corners=True)),
                    (F.interpolate, dict(size=(5, 11)))],
    "pad": [(F.pad, dict(pad=(1, 2, 0, 1), mode=m)) for m in ("constant", "reflect", "replicate", "circular")],
    "norms": [(F.group_norm, dict(num_groups=3, weight=W, bias=B)), (F.instance_norm, dict(weight=W, bias=B)),
              (F.batch_norm, dict(running_mean=W, running_var=B.abs() + 0.5, weight=W, bias=B))],
}


@pytest.mark.parametrize("family", list(OPS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_matches_torch(family, layout):
    dx = distribute(X, MESH, layout, seed=1)
    for fn, kw in OPS[family]:
        out = fn(dx, **kw)
        torch.testing.assert_close(out.to_torch(), fn(X, **kw), **TOL, msg=lambda m: f"{fn.__name__} {kw}: {m}")


def test_placements():
    dx = dtorch.Tensor(X, device_mesh=MESH, placements=[Shard(0), Shard(2)])
    with dtorch.CommLog() as log:
        assert tuple(F.max_pool2d(dx, 3, 2, 1).placements) == (Shard(0), Shard(2))
    assert {r.kind for r in log.records} == {"send_recv"}
    assert tuple(F.avg_pool2d(dx, 3, 2, 1).placements) == (Shard(0), Shard(2))
    assert tuple(F.adaptive_avg_pool2d(dx, 1).placements) == (Shard(0), Partial("sum"))
    assert tuple(F.avg_pool2d(dx, 3, 2, 1, count_include_pad=False).placements) == (Shard(0), Replicate())
    assert tuple(F.interpolate(dx, scale_factor=2).placements) == (Shard(0), Replicate())
    assert tuple(F.pad(dx, (1, 1)).placements) == (Shard(0), Shard(2))  # W padded, H keeps its shards


@pytest.mark.parametrize("layout", LAYOUTS[:4], ids=str)
def test_batch_norm_training(layout):
    dx = distribute(X, MESH, layout, seed=1)
    rm, rv = torch.randn(6), torch.rand(6) + 0.5
    drm, drv = dtorch.Tensor(rm.clone(), device_mesh=MESH), dtorch.Tensor(rv.clone(), device_mesh=MESH)
    with dtorch.CommLog() as log:
        out = F.batch_norm(dx, drm, drv, W, B, training=True, momentum=0.3)
    torch.testing.assert_close(out.to_torch(), F.batch_norm(X, rm, rv, W, B, training=True, momentum=0.3), **TOL)
    torch.testing.assert_close(drm.to_torch(), rm, **TOL)
    torch.testing.assert_close(drv.to_torch(), rv, **TOL)
    if layout == (Shard(0), Shard(2)):  # statistics: all-reduces of [C] sums on dp and sp, nothing else
        assert [(r.kind, r.nbytes) for r in log.records] == [("all_reduce", 4 * 6 * 4)] * 4


def test_bad_input():
    dx = dtorch.Tensor(X, device_mesh=MESH)
    with pytest.raises(dtorch.OpError, match="mode"):
        F.pad(dx, (1, 1), mode="wrap")
    with pytest.raises(dtorch.OpError, match="num_groups"):
        F.group_norm(dx, 4)
    with pytest.raises(dtorch.OpError, match="torch tensor"):
        F.batch_norm(dx, torch.zeros(6), torch.ones(6), training=True)


@pytest.mark.parametrize("op", [lambda t: F.avg_pool1d(t, 2), lambda t: F.max_pool1d(t, 2),
                                lambda t: F.adaptive_avg_pool1d(t, 3)], ids=["avg", "max", "adaptive"])
def test_1d_pooling_with_an_empty_channel_shard(op):
    # 4 channels over 3 devices: torch.chunk gives 2, 2, 0 (the 1-D kernels checked only 2-D layouts' dims)
    mesh = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["a"])
    x = torch.randn(3, 4, 7, dtype=torch.float64)
    X = dtorch.Tensor(x, device_mesh=mesh, placements=[Shard(1)])
    torch.testing.assert_close(op(X).to_torch(), op(x))


def _pool_configs(kind: str):
    """Every kernel / stride / padding / dilation (max) or count_include_pad (avg) / ceil_mode combination."""
    for k, s, p, ceil in itertools.product((1, 2, 3), (1, 2, 3), (0, 1), (False, True)):
        for extra in ((1, 2) if kind == "max" else (True, False)):
            yield dict(kernel_size=k, stride=s, padding=p, ceil_mode=ceil,
                       **({"dilation": extra} if kind == "max" else {"count_include_pad": extra}))


def _check_like_torch(fn, x, dx, what):
    """``fn`` on the sharded ``dx`` gives torch's value, or both refuse (dtorch with an OpError)."""
    try:
        want = fn(x)
    except RuntimeError:
        with pytest.raises(dtorch.OpError):
            fn(dx)
        return
    torch.testing.assert_close(fn(dx).to_torch(), want, msg=lambda m: f"{what}: {m}")


MESH_23 = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["h", "w"])
MESH_13 = dtorch.init_device_mesh("cpu", (1, 3), mesh_dim_names=["h", "w"])


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("hw", [(3, 4), (5, 7)], ids=str)
def test_2d_pooling_sweep_on_spatial_shards(kind, hw):
    # H and W unevenly over 2 and 3 devices (then 3 and 2, then 1 and 3): fewer output rows than devices left a device an empty
    # window that torch refused on the workers (max_pool2d(k=3, s=2, ceil_mode=True) on H=3 over 2, among others)
    x = torch.randn(2, 3, *hw, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    pool = F.max_pool2d if kind == "max" else F.avg_pool2d
    for mesh, placements in ((MESH_23, [Shard(2), Shard(3)]), (MESH_23, [Shard(3), Shard(2)]),
                             (MESH_13, [Shard(2), Shard(3)])):
        dx = dtorch.Tensor(x, device_mesh=mesh, placements=placements)
        for kw in _pool_configs(kind):
            _check_like_torch(lambda t: pool(t, **kw), x, dx, f"{pool.__name__} {kw} {mesh} {placements}")


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("n", [2, 3])
def test_1d_pooling_sweep_on_a_sharded_length(kind, n):
    mesh = dtorch.init_device_mesh("cpu", (n,), mesh_dim_names=["l"])
    pool = F.max_pool1d if kind == "max" else F.avg_pool1d
    for length in (3, 7):
        x = torch.randn(2, 3, length, generator=torch.Generator().manual_seed(length), dtype=torch.float64)
        dx = dtorch.Tensor(x, device_mesh=mesh, placements=[Shard(2)])
        for kw in _pool_configs(kind):
            _check_like_torch(lambda t: pool(t, **kw), x, dx, f"{pool.__name__} {kw} L={length} over {n}")


@pytest.mark.parametrize("pool", [lambda t: F.max_pool2d(t, 3, 2, ceil_mode=True),
                                  lambda t: F.avg_pool2d(t, 3, 2, 1, ceil_mode=True),
                                  lambda t: F.max_pool2d(t, 2, 3, 1, dilation=2)], ids=["max_ceil", "avg_ceil", "max_dil"])
def test_pooling_gradients_with_an_empty_output_shard(pool):
    # H=3 over 2 devices: the second device has no output row; its gradient is zeros, the others' torch's
    x = torch.randn(2, 2, 3, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    dx = dtorch.Tensor(x.detach(), device_mesh=MESH_23, placements=[Shard(2), Shard(3)]).requires_grad_()
    want = pool(x)
    got = pool(dx)
    cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    want.backward(cot)
    got.backward(dtorch.Tensor(cot, device_mesh=MESH_23, placements=got.placements))
    torch.testing.assert_close(got.to_torch(), want.detach())
    torch.testing.assert_close(dx.grad.to_torch(), x.grad)


def test_pooling_refused_on_the_controller():
    # a shape torch refuses (a kernel larger than the padded input) is an OpError from the plan: no kernel ran
    dx = dtorch.Tensor(torch.randn(1, 1, 3, 4), device_mesh=MESH_23, placements=[Shard(2), Shard(3)])
    with pytest.raises(dtorch.OpError, match="max_pool2d"):
        F.max_pool2d(dx, 5)
    with pytest.raises(dtorch.OpError, match="avg_pool2d"):
        F.avg_pool2d(dx, 2, padding=2)
