"""Advanced indexing reads, gather/scatter family, index_select, take_along_dim, masked_select/scatter,
nonzero (ops/index.py) against torch on sharded, replicated and partial layouts (7 rows over 3 or 2x2)."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import CommLog, Partial, Replicate, Shard
from sweep import MESH_1D, MESH_2D, distribute

X = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
S = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
I = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(2))
J = torch.randint(0, 5, (7, 3), generator=torch.Generator().manual_seed(3))
LAYOUTS = [(MESH_1D, (Shard(0),)), (MESH_1D, (Shard(1),)), (MESH_1D, (Replicate(),)), (MESH_1D, (Partial("sum"),)),
           (MESH_2D, (Shard(0), Shard(1))), (MESH_2D, (Shard(1), Shard(0))), (MESH_2D, (Shard(0), Shard(0)))]
READS = [torch.tensor([0, 3, 6, 3]), ([1, 2], [0, 4]), (slice(None), [4, 0]), X[:, 0] > 0, X > 0,
         (Ellipsis, 1, Ellipsis), (slice(1, 6, 2), torch.tensor([[1], [2]])), (None, slice(None), [3, 1], None),
         (torch.tensor([[0, 6]]), slice(None), None), (1, [0, 0, 4])]


@pytest.mark.parametrize("mesh,pl", LAYOUTS, ids=str)
def test_getitem_matches_torch(mesh, pl):
    x = distribute(X, mesh, pl)
    for index in READS:
        torch.testing.assert_close(x[index].to_torch(), X[index], msg=lambda m: f"{index}: {m}")
    ipl = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)  # a sharded dtorch index tensor
    idx = dtorch.Tensor(torch.tensor([6, 0, 2, 5]), device_mesh=mesh, placements=ipl)
    torch.testing.assert_close(x[idx].to_torch(), X[torch.tensor([6, 0, 2, 5])])


def test_index_keeps_the_shards_of_other_dims():
    x = distribute(X, MESH_1D, [Shard(0)])
    with CommLog() as log:
        y = x[:, [4, 0, 2]]
    assert log.counts() == {} and y.placements == [Shard(0)]
    y = x[None, :, torch.tensor([[1, 2]])]  # torch puts the index dims where the indexed dim was
    assert y.placements == [Shard(1)]
    torch.testing.assert_close(y.to_torch(), X[None, :, torch.tensor([[1, 2]])])


@pytest.mark.parametrize("mesh,pl", LAYOUTS, ids=str)
def test_gather_scatter_family(mesh, pl):
    ipl = pl if not isinstance(pl[0], Partial) else (Shard(0),)
    x, s = distribute(X, mesh, pl), distribute(S, mesh, pl)
    for p in ((Replicate(),) * mesh.ndim, ipl):
        i, j = dtorch.Tensor(I, device_mesh=mesh, placements=p), dtorch.Tensor(J, device_mesh=mesh, placements=p)
        torch.testing.assert_close(dtorch.gather(x, 0, i).to_torch(), torch.gather(X, 0, I))
        torch.testing.assert_close(x.gather(1, j).to_torch(), X.gather(1, J))
        torch.testing.assert_close(dtorch.scatter_add(x, 0, i, s).to_torch(), torch.scatter_add(X, 0, I, S))
        torch.testing.assert_close(dtorch.scatter(x, 1, j, 2.5).to_torch(), torch.scatter(X, 1, J, 2.5))
        for r in ("sum", "prod", "mean", "amax", "amin"):
            for inc in (True, False):
                torch.testing.assert_close(dtorch.scatter_reduce(x, 0, i, s, r, include_self=inc).to_torch(),
                                           torch.scatter_reduce(X, 0, I, S, r, include_self=inc))
        torch.testing.assert_close(dtorch.take_along_dim(x, i, 0).to_torch(), torch.take_along_dim(X, I, 0))
        x2 = distribute(X, mesh, pl)
        x2.scatter_add_(0, i, s)
        assert tuple(x2.placements) == pl
        torch.testing.assert_close(x2.to_torch(), X.clone().scatter_add_(0, I, S))
    torch.testing.assert_close(x.index_select(0, torch.tensor([6, 0, 3])).to_torch(),
                               X.index_select(0, torch.tensor([6, 0, 3])))
    torch.testing.assert_close(dtorch.take_along_dim(x, torch.tensor([3, 30])).to_torch(),
                               torch.take_along_dim(X, torch.tensor([3, 30])))
    torch.testing.assert_close(dtorch.masked_select(x, X > 0).to_torch(), X.masked_select(X > 0))
    torch.testing.assert_close(dtorch.masked_scatter(x, X[0] > 0, S).to_torch(), X.masked_scatter(X[0] > 0, S))
    torch.testing.assert_close(dtorch.nonzero(x > 0).to_torch(), torch.nonzero(X > 0))
    for a, b in zip((x > 0).nonzero(as_tuple=True), (X > 0).nonzero(as_tuple=True)):
        torch.testing.assert_close(a.to_torch(), b)


def test_scatter_into_a_sharded_dim_never_gathers_the_target():
    x = distribute(X, MESH_2D, [Shard(0), Shard(1)])
    i = dtorch.Tensor(I, device_mesh=MESH_2D, placements=[Replicate(), Shard(1)])
    s = distribute(S[:4], MESH_2D, [Replicate(), Shard(1)])
    with CommLog() as log:
        out = dtorch.scatter_add(x, 0, i, s)
    assert log.counts() == {}, log.table()  # index and src sharded like x's dim 1, replicated over dim 0
    assert out.placements == [Shard(0), Shard(1)]
    torch.testing.assert_close(out.to_torch(), torch.scatter_add(X, 0, I, S[:4]))


def test_bad_indices():
    x = distribute(X, MESH_1D, [Shard(0)])
    with pytest.raises(IndexError, match="must be long, int, byte or bool"):
        x[torch.tensor([0.5])]
    with pytest.raises(IndexError, match="shape of the mask"):
        x[torch.ones(3, dtype=torch.bool)]
    with pytest.raises(IndexError, match="could not be broadcast"):
        x[torch.tensor([0, 1]), torch.tensor([0, 1, 2])]
    with pytest.raises(dtorch.OpError, match="Expected dtype int64"):
        dtorch.gather(x, 0, torch.zeros(2, 5, dtype=torch.int32))
