"""Pooling, adaptive pooling, interpolate, pad and the 2-D norms against torch under batch, channel,
spatial (uneven: 9 rows over 2) and Partial layouts on a 2x2 mesh; the placements each rule promises
(halo exchange for max/avg pool, Partial(sum) from a sharded dim pooled to one value, fallbacks gather);
batch_norm's running statistics and its CommLog (all-reduces of per-channel sums, no gather)."""
from __future__ import annotations

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
