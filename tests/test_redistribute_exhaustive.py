"""Exhaustive redistribution sweep: every placement pair on small meshes and uneven shapes (slow)."""
import itertools

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard


def _options(ndim):
    return [Replicate(), Partial("sum"), Partial("max")] + [Shard(d) for d in range(ndim)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2, 2), (3, 2), (2, 1, 2)], ids=str)
@pytest.mark.parametrize("shape", [(4, 6), (5, 3), (1, 7)], ids=str)
def test_every_placement_pair_same_mesh(mesh_shape, shape):
    mesh = dtorch.init_device_mesh("cpu", mesh_shape)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    placements = list(itertools.product(_options(len(shape)), repeat=len(mesh_shape)))
    for src in placements:
        x = dtorch.Tensor(full, device_mesh=mesh, placements=list(src))
        for dst in placements:
            y = x.redistribute(mesh, list(dst))
            torch.testing.assert_close(y.to_torch(), full, rtol=0, atol=1e-6, msg=f"{src} -> {dst}")
            if not any(p.is_partial() for p in dst):
                for block, coord in zip(y.local_blocks(), mesh.coordinates()):
                    box = y.spec.local_box(coord)
                    assert torch.equal(block, full[tuple(slice(o, o + n) for o, n in box)]), f"{src} -> {dst} at {coord}"
        torch.testing.assert_close(x.to_torch(), full, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_every_placement_pair_across_meshes():
    meshes = [dtorch.DeviceMesh("cpu", [[0, 1], [2, 3]]), dtorch.DeviceMesh("cpu", [4, 5, 6]),
              dtorch.DeviceMesh("cpu", [[[7], [8]]]), dtorch.DeviceMesh("cpu", [0])]
    full = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    opts = [Replicate(), Partial("sum"), Partial("avg"), Shard(0), Shard(1)]
    for ma, mb in itertools.permutations(meshes, 2):
        for src in itertools.product(opts, repeat=ma.ndim):
            x = dtorch.Tensor(full, device_mesh=ma, placements=list(src))
            for dst in itertools.product(opts, repeat=mb.ndim):
                y = x.redistribute(mb, list(dst))
                torch.testing.assert_close(y.to_torch(), full, rtol=0, atol=1e-6, msg=f"{ma}{src} -> {mb}{dst}")
