"""x[index] = value and the in-place index writes (ops/index.py) against torch: every index form, sharded
and partial targets on uneven shapes, values as numbers / torch / dtorch tensors (sharded too), identity
and placements kept, the target never gathered (CommLog), autograd, views and bad input."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import CommLog, Partial, Replicate, Shard
from sweep import MESH_1D, MESH_2D, distribute

X = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
LAYOUTS = [(MESH_1D, [Shard(0)]), (MESH_1D, [Shard(1)]), (MESH_1D, [Replicate()]), (MESH_1D, [Partial("sum")]),
           (MESH_2D, [Shard(0), Shard(1)]), (MESH_2D, [Shard(1), Shard(1)]), (MESH_2D, [Partial("max"), Shard(0)])]
IDX = torch.tensor([0, 6, 3])
CASES = [
    ((1,), 5.0),
    ((slice(1, 6, 2), 2), torch.tensor([1.0, 2.0, 3.0])),
    ((slice(None), slice(1, 3)), torch.randn(7, 2)),
    ((None, slice(2, 7), Ellipsis, slice(0, 5, 3)), torch.randn(5, 2)),
    ((Ellipsis, 4), torch.randn(7)),
    ((Ellipsis, 1, Ellipsis), 2),  # several Ellipsis: the first takes the dims (torch)
    ((IDX,), torch.randn(3, 5)),
    ((slice(None), [4, 0]), torch.randn(7, 2)),
    (([1, 2], [0, 4]), torch.tensor([8.0, 9.0])),
    ((slice(2, 6), torch.tensor([[1], [3]])), torch.randn(4, 2, 1)),
    (X > 0, 0.0),
    ((X[:, 0] > 0,), torch.randn(5)),
]


@pytest.mark.parametrize("mesh,pl", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("k", range(len(CASES)))
def test_setitem_matches_torch(mesh, pl, k):
    index, value = CASES[k]
    x = distribute(X, mesh, pl)
    expected = X.clone()
    expected[index] = value
    before = x
    x[index] = value
    assert x is before and list(x.placements) == pl
    torch.testing.assert_close(x.to_torch(), expected)


def test_mask_with_a_value_per_selected_element():
    x = distribute(X, MESH_1D, [Shard(0)])
    m = X > 0
    vals = torch.arange(float(m.sum()))
    x[m] = vals
    e = X.clone()
    e[m] = vals
    torch.testing.assert_close(x.to_torch(), e)


def test_sharded_value_written_without_moving_target_or_value():
    for mesh, pl, vpl in [(MESH_1D, [Shard(0)], [Shard(0)]), (MESH_2D, [Shard(0), Shard(1)], [Shard(0), Replicate()])]:
        x = distribute(X, mesh, pl)
        v = distribute(torch.ones(7, 2), mesh, vpl)
        with CommLog() as log:
            x[:, 1:3] = v
        assert log.counts() == {}, log.table()
        e = X.clone()
        e[:, 1:3] = 1.0
        torch.testing.assert_close(x.to_torch(), e)


@pytest.mark.parametrize("index", [(slice(1, 6, 2),), (IDX,), (X > 0,), (slice(None), [4, 0])], ids=str)
def test_target_is_never_gathered(index):
    # only the (replicated) value and index may travel; the sharded target is written where it lies
    x = distribute(X, MESH_2D, [Shard(0), Shard(1)])
    value = torch.tensor(2.5)
    with CommLog() as log:
        x[index] = value
    target_bytes = X.numel() * X.element_size()
    assert all(r.nbytes < target_bytes for r in log.records), log.table()
    e = X.clone()
    e[index] = value
    torch.testing.assert_close(x.to_torch(), e)


def test_value_types_and_dtype_cast():
    x = distribute(torch.arange(12).reshape(4, 3), MESH_1D, [Shard(0)])
    x[1] = 2.7  # cast to the target's dtype, like torch
    x[2, :] = dtorch.Tensor(torch.tensor([7, 8, 9]), device_mesh=MESH_1D)
    x[3] = torch.tensor(True)
    e = torch.arange(12).reshape(4, 3)
    e[1] = 2.7
    e[2, :] = torch.tensor([7, 8, 9])
    e[3] = torch.tensor(True)
    assert torch.equal(x.to_torch(), e) and x.dtype == torch.int64


def test_index_put_copy_fill_accumulate():
    for mesh, pl in LAYOUTS[:5]:
        src = torch.randn(4, 5)
        x = distribute(X, mesh, pl)
        x.index_put_((torch.tensor([6, 1, 6, 0]),), src, accumulate=True)
        torch.testing.assert_close(x.to_torch(), X.clone().index_put_((torch.tensor([6, 1, 6, 0]),), src, accumulate=True))
        x = distribute(X, mesh, pl)
        x.index_copy_(1, torch.tensor([4, 0]), src[:, :2].T.contiguous().T.repeat(2, 1)[:7])
        torch.testing.assert_close(x.to_torch(), X.clone().index_copy_(1, torch.tensor([4, 0]),
                                                                        src[:, :2].repeat(2, 1)[:7]))
        x = distribute(X, mesh, pl)
        x.index_fill_(0, torch.tensor([5, 2]), -1.0)
        torch.testing.assert_close(x.to_torch(), X.clone().index_fill_(0, torch.tensor([5, 2]), -1.0))
        x = distribute(X, mesh, pl)
        x.masked_scatter_(X > 0, torch.randn(35, generator=torch.Generator().manual_seed(3)))
        torch.testing.assert_close(x.to_torch(), X.clone().masked_scatter_(X > 0, torch.randn(35, generator=torch.Generator().manual_seed(3))))


def test_autograd_records_like_an_inplace_op():
    w = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = w * 2
    y[IDX] = v * 3
    y[:, 1:3] = 0.5
    (y.sin().sum()).backward()
    dw = dtorch.Tensor(w.detach(), device_mesh=MESH_2D, placements=[Shard(0), Shard(1)]).requires_grad_()
    dv = dtorch.Tensor(v.detach(), device_mesh=MESH_2D, placements=[Replicate(), Shard(0)]).requires_grad_()
    dy = dw * 2
    dy[IDX] = dv * 3
    dy[:, 1:3] = 0.5
    dy.sin().sum().backward()
    torch.testing.assert_close(dw.grad.to_torch(), w.grad)
    torch.testing.assert_close(dv.grad.to_torch(), v.grad)
    leaf = dtorch.Tensor(torch.randn(3), device_mesh=MESH_1D).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf"):
        leaf[0] = 1.0


def test_assignment_into_a_view_writes_through_to_its_base():
    x = distribute(X, MESH_1D, [Shard(0)])
    e = X.clone()
    x[1:3][0] = 5.0  # a view of x, as in torch: x changes
    e[1:3][0] = 5.0
    torch.testing.assert_close(x.to_torch(), e)
    y = x[1:3].clone()  # a copy: x does not change
    y[0] = 7.0
    torch.testing.assert_close(x.to_torch(), e)
    x[:][0] = 5.0
    e[:][0] = 5.0
    torch.testing.assert_close(x.to_torch(), e)


def test_bad_assignments_say_what_is_wrong():
    x = distribute(X, MESH_1D, [Shard(0)])
    with pytest.raises(IndexError, match="shape mismatch"):
        x[1:3] = torch.randn(3, 5)
    with pytest.raises(IndexError, match="out of bounds"):
        x[7] = 1.0
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0] = 1.0
    with pytest.raises(dtorch.OpError, match="must be a number or a tensor"):
        x[0] = "a"
