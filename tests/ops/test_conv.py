"""Convolutions against torch: random placements (batch, channel, spatial, Partial) on 1-D/2-D meshes,
uneven spatial shards, stride/dilation/padding ("same", "valid"), groups, transposed, gradients; the
halo exchange's CommLog (send_recv of the overlap rows only, never an all_gather)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard
from sweep import distribute

MESH3 = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["sp"])
MESH22 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "sp"])
TOL = {"rtol": 1e-4, "atol": 1e-4}


def _rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _layouts(ndim: int, mesh, rnd: random.Random, partial=True, n=6):
    opts = [Replicate()] + [Shard(d) for d in range(ndim)] + ([Partial("sum"), Partial("avg"), Partial("max")] if partial else [])
    return [tuple(rnd.choice(opts) for _ in range(mesh.ndim)) for _ in range(n)]


def _run(fn, ref, x, w, b, mesh, xl, wl, bl, grad=False, **kw):
    expected = ref(x, w, b, **kw)
    dx, dw = distribute(x, mesh, xl, seed=1), distribute(w, mesh, wl, seed=2)
    db = None if b is None else distribute(b, mesh, bl, seed=3)
    where = f"{fn.__name__} {kw} x {list(map(str, xl))} w {list(map(str, wl))} on {mesh}"
    if grad:
        for t in (dx, dw, db):
            if t is not None:
                t.requires_grad_()
    out = fn(dx, dw, db, **kw)
    torch.testing.assert_close(out.to_torch(), expected, **TOL, msg=lambda m: f"{where}: {m}")
    if grad:
        tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
        tb = None if b is None else b.clone().requires_grad_()
        ct = _rand(*expected.shape, seed=9, dtype=x.dtype)
        ref(tx, tw, tb, **kw).backward(ct)
        out.backward(distribute(ct, mesh, out.placements if not any(isinstance(p, Partial) for p in out.placements)
                                else [Replicate()] * mesh.ndim))
        for d, t, name in ((dx, tx, "x"), (dw, tw, "w"), (db, tb, "b")):
            if t is not None:
                torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL, msg=lambda m: f"{where} grad {name}: {m}")
    return out


CONV2D = [dict(), dict(stride=2, padding=1), dict(padding="same"), dict(padding="valid"),
          dict(stride=2, padding=2, dilation=2), dict(padding=(1, 0), stride=(1, 2)), dict(padding="same", dilation=(2, 1))]


def _conv2d_sweep(kw, mesh, nx, nw):
    rnd = random.Random(str(kw) + str(mesh.shape) + str(nx))
    x, w, b = _rand(4, 3, 7, 8), _rand(5, 3, 3, 3, seed=1), _rand(5, seed=2)
    for xl in _layouts(4, mesh, rnd, n=nx):
        for wl in _layouts(4, mesh, rnd, n=nw):
            bl = tuple(rnd.choice([Replicate(), Shard(0)]) for _ in range(mesh.ndim))
            _run(F.conv2d, F.conv2d, x, w, b, mesh, xl, wl, bl, **kw)


@pytest.mark.parametrize("kw", CONV2D, ids=str)
@pytest.mark.parametrize("mesh", [MESH3, MESH22], ids=["mesh3", "mesh22"])
def test_conv2d_random_layouts(kw, mesh):
    _conv2d_sweep(kw, mesh, 3, 1)


@pytest.mark.slow
@pytest.mark.parametrize("kw", CONV2D, ids=str)
@pytest.mark.parametrize("mesh", [MESH3, MESH22], ids=["mesh3", "mesh22"])
def test_conv2d_random_layouts_many(kw, mesh):
    _conv2d_sweep(kw, mesh, 12, 4)


@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding="valid"), dict(padding="same", dilation=2)], ids=str)
def test_conv1d_conv3d_spatial(kw):
    rnd = random.Random(1)
    x, w, b = _rand(2, 4, 11), _rand(6, 4, 3, seed=1), _rand(6, seed=2)
    for xl in [(Shard(2),), (Shard(0),), (Shard(1),)] + _layouts(3, MESH3, rnd, n=3):
        _run(F.conv1d, F.conv1d, x, w, b, MESH3, xl, (Replicate(),), (Replicate(),), **kw)
    x3, w3 = _rand(2, 2, 5, 6, 7), _rand(3, 2, 3, 3, 3, seed=1)
    for xl in [(Shard(2), Shard(4)), (Shard(3), Shard(1)), (Shard(0), Shard(2))]:
        _run(F.conv3d, F.conv3d, x3, w3, None, MESH22, xl, (Replicate(), Replicate()), None, **kw)


@pytest.mark.parametrize("groups", [2, 4])
def test_grouped_and_depthwise(groups):
    x, w, b = _rand(2, 4, 6, 6), _rand(8, 4 // groups, 3, 3, seed=1), _rand(8, seed=2)
    for xl, wl in [((Shard(1),), (Replicate(),)), ((Replicate(),), (Shard(0),)), ((Shard(2),), (Replicate(),)),
                   ((Shard(1),), (Shard(0),))]:
        for mesh in (MESH3, dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])):
            _run(F.conv2d, F.conv2d, x, w, b, mesh, xl, wl, (Replicate(),), padding=1, groups=groups)


def test_channel_sharding_layouts():
    """tp: out-channel sharded weight -> output channels sharded; in-channel sharded -> Partial."""
    x, w, b = _rand(4, 4, 8, 8), _rand(6, 4, 3, 3, seed=1), _rand(6, seed=2)
    out = _run(F.conv2d, F.conv2d, x, w, b, MESH22, (Shard(0), Replicate()), (Replicate(), Shard(0)),
               (Replicate(), Shard(0)), padding=1)
    assert tuple(out.placements) == (Shard(0), Shard(1))
    out = _run(F.conv2d, F.conv2d, x, w, b, MESH22, (Shard(0), Shard(1)), (Replicate(), Shard(1)),
               (Replicate(), Replicate()), padding=1)
    assert tuple(out.placements) == (Shard(0), Partial("sum"))


def test_uneven_spatial_exact_and_fallback():
    """7 rows over 3 (3, 3, 1): halos of one row fit; a 5x5 kernel needs two rows from a 1-row block:
    that dim is gathered instead (output Replicate there) and still equals torch."""
    x, w = _rand(2, 3, 7, 5), _rand(4, 3, 3, 3, seed=1)
    with dtorch.CommLog() as log:
        out = _run(F.conv2d, F.conv2d, x, w, None, MESH3, (Shard(2),), (Replicate(),), None, padding=1)
    assert tuple(out.placements) == (Shard(2),)
    assert {r.kind for r in log.records} == {"send_recv"}
    w5 = _rand(4, 3, 5, 5, seed=1)
    with dtorch.CommLog() as log:
        out = _run(F.conv2d, F.conv2d, x, w5, None, MESH3, (Shard(2),), (Replicate(),), None, padding=2)
    assert tuple(out.placements) == (Replicate(),)
    assert [r.kind for r in log.records] == ["all_gather"]
    # 3 rows over 3 devices and a stride that leaves one device without output rows
    x3 = _rand(1, 2, 4, 4)
    _run(F.conv2d, F.conv2d, x3, _rand(2, 2, 3, 3, seed=1), None, MESH3, (Shard(2),), (Replicate(),), None,
         stride=3, padding=1)


def test_halo_commlog_sends_only_overlap_rows():
    """A 3x3 conv on [2, 3, 8, 6] sharded on H over 2: two send_recv of one row each way, nothing else."""
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["sp"])
    x, w = _rand(2, 3, 8, 6), _rand(4, 3, 3, 3, seed=1)
    dx = dtorch.Tensor(x, device_mesh=mesh, placements=[Shard(2)])
    dw = dtorch.Tensor(w, device_mesh=mesh)
    with dtorch.CommLog() as log:
        out = F.conv2d(dx, dw, padding=1)
    row = 2 * 3 * 1 * 6 * 4  # one row of every (n, c) per device, float32
    assert [(r.kind, r.mesh_dim, r.nbytes) for r in log.records] == [("send_recv", "sp", 2 * row)] * 2
    assert tuple(out.placements) == (Shard(2),)
    torch.testing.assert_close(out.to_torch(), F.conv2d(x, w, padding=1), **TOL)
    # 5x5 with dilation 1: two rows each way; a 1x1 conv: none
    with dtorch.CommLog() as log:
        F.conv2d(dx, dtorch.Tensor(_rand(4, 3, 5, 5), device_mesh=mesh), padding=2)
    assert [(r.kind, r.nbytes) for r in log.records] == [("send_recv", 4 * row)] * 2
    with dtorch.CommLog() as log:
        F.conv2d(dx, dtorch.Tensor(_rand(4, 3, 1, 1), device_mesh=mesh), stride=2)
    assert log.records == []


@pytest.mark.parametrize("kw", [dict(padding=1), dict(stride=2, padding=1), dict(padding="same", dilation=2)], ids=str)
def test_conv2d_gradients(kw):
    x = _rand(3, 2, 7, 6, dtype=torch.float64)
    w, b = _rand(4, 2, 3, 3, seed=1, dtype=torch.float64), _rand(4, seed=2, dtype=torch.float64)
    for mesh, xl, wl, bl in [(MESH3, (Shard(2),), (Replicate(),), (Replicate(),)),
                             (MESH22, (Shard(2), Shard(3)), (Replicate(), Replicate()), (Replicate(), Replicate())),
                             (MESH22, (Shard(0), Shard(2)), (Replicate(), Shard(0)), (Replicate(), Shard(0))),
                             (MESH22, (Shard(1), Shard(0)), (Shard(1), Replicate()), (Replicate(), Replicate()))]:
        _run(F.conv2d, F.conv2d, x, w, b, mesh, xl, wl, bl, grad=True, **kw)


@pytest.mark.parametrize("kw", [dict(), dict(stride=2, padding=1, output_padding=1), dict(groups=2, dilation=2)], ids=str)
def test_conv_transpose2d(kw):
    rnd = random.Random(3)
    x, w, b = _rand(3, 4, 5, 6), _rand(4, 3, 3, 3, seed=1), _rand(3 * kw.get("groups", 1), seed=2)
    if kw.get("groups"):
        w = _rand(4, 3, 3, 3, seed=1)
    for mesh in (MESH3, MESH22):
        for xl in _layouts(4, mesh, rnd, n=4) + [(Shard(1),) * mesh.ndim]:
            wl = tuple(rnd.choice([Replicate(), Shard(0), Shard(1)]) for _ in range(mesh.ndim))
            _run(F.conv_transpose2d, F.conv_transpose2d, x, w, b, mesh, xl, wl, (Replicate(),) * mesh.ndim, **kw)


def test_unbatched_and_torch_spellings():
    x, w = _rand(3, 6, 6), _rand(2, 3, 3, 3, seed=1)
    dx = dtorch.Tensor(x, device_mesh=MESH3, placements=[Shard(1)])
    torch.testing.assert_close(torch.conv2d(dx, w, padding=1).to_torch(), F.conv2d(x, w, padding=1), **TOL)
    torch.testing.assert_close(dtorch.nn.functional.conv2d(dx, w, None, 1, 1).to_torch(), F.conv2d(x, w, None, 1, 1), **TOL)


def test_bad_input():
    x = dtorch.Tensor(_rand(2, 3, 6, 6), device_mesh=MESH3)
    with pytest.raises(dtorch.OpError, match="padding"):
        F.conv2d(x, _rand(2, 3, 3, 3), padding="full")
    with pytest.raises(dtorch.OpError, match="conv2d"):
        F.conv2d(x, _rand(2, 4, 3, 3))  # 3 input channels, the weight wants 4
    with pytest.raises(dtorch.OpError, match="4-D"):
        F.conv2d(dtorch.Tensor(_rand(6, 6), device_mesh=MESH3), _rand(2, 3, 3, 3))
