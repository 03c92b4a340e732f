"""Mutable storage: in-place ops write into a tensor's own blocks, copy-on-write when shared.

The values are checked against torch; "in place" is checked by the blocks' storage staying where it
was (in-process backend, whose blocks are torch tensors of this process); copy-on-write by the other
holders keeping their values.
"""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.ops.inplace import InplaceError

MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["a", "b"])
LAYOUTS = [[Shard(0), Replicate()], [Replicate(), Shard(1)], [Shard(0), Shard(1)], [Partial(), Shard(0)],
           [Replicate(), Replicate()]]
SHAPES = [(8, 4), (7, 3)]  # even (stacked grid storage) and uneven (per-device blocks)


@pytest.fixture(autouse=True)
def inprocess():
    with dtorch.Graph(backend="inprocess") as g:
        yield g


def _ptrs(t):
    return [b.untyped_storage().data_ptr() for b in t.local_blocks() if b.numel()]


def _fresh(shape, placements, seed=0):
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    x = dtorch.Tensor(full, device_mesh=MESH, placements=placements)
    x.mul_(1.0)  # a first write: the blocks become the tensor's own (placing may leave views of the input)
    return x, full


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("placements", LAYOUTS, ids=str)
def test_writes_land_in_the_tensors_own_storage(shape, placements):
    x, full = _fresh(shape, placements)
    y = torch.randn(shape[-1])
    ident, before = id(x), _ptrs(x)
    x.add_(dtorch.Tensor(y, device_mesh=MESH))
    x.mul_(0.5)
    x += 2
    x.sub_(torch.ones(shape))
    expected = ((full * 1.0 + y) * 0.5 + 2) - 1
    assert id(x) == ident and x.placements == placements
    torch.testing.assert_close(x.to_torch(), expected)
    if not any(isinstance(p, Partial) for p in placements):
        assert _ptrs(x) == before, "an exclusive tensor was copied instead of written in place"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("share", ["clone", "Tensor", "view_of_blocks"])
def test_copy_on_write_keeps_other_holders_unchanged(shape, share):
    x, full = _fresh(shape, [Shard(0), Replicate()])
    if share == "clone":
        other = x.clone()
    elif share == "Tensor":
        other = dtorch.Tensor(x)
    else:
        other = x.local_blocks()  # views a user holds: they must not change under them
    snapshot = [b.clone() for b in other] if share == "view_of_blocks" else other.to_torch()
    x.add_(1.0)
    torch.testing.assert_close(x.to_torch(), full + 1)
    if share == "view_of_blocks":
        for b, s in zip(other, snapshot):
            torch.testing.assert_close(b, s)
    else:
        torch.testing.assert_close(other.to_torch(), snapshot)
        other.mul_(3.0)  # and the other way round
        torch.testing.assert_close(x.to_torch(), full + 1)
        torch.testing.assert_close(other.to_torch(), snapshot * 3)


@pytest.mark.parametrize("make", [lambda x: x.view(4, 8), lambda x: x.detach(), lambda x: x.data, lambda x: x[1:3]],
                         ids=["view", "detach", "data", "slice"])
def test_a_view_and_its_base_see_each_others_writes(make):
    # as in torch: views (detach() and .data too) share their base's storage
    x, full = _fresh((8, 4), [Shard(0), Replicate()])
    v = make(x)
    twin = make(full)
    v.to_torch()  # read before the write: the next read must see it anyway
    x.mul_(2.0)
    full.mul_(2.0)
    torch.testing.assert_close(v.to_torch(), twin)
    v.add_(1.0)
    twin.add_(1.0)
    torch.testing.assert_close(x.to_torch(), full)
    torch.testing.assert_close(v.to_torch(), twin)


def test_replicas_stored_once_are_written_once():
    # uneven Replicate blocks: replicas share one tensor object; adding once per device would add 4x
    x = dtorch.Tensor(torch.zeros(7, 3), device_mesh=MESH, placements=[Replicate(), Replicate()])
    x.add_(1.0)
    x.add_(1.0)
    assert torch.equal(x.to_torch(), torch.full((7, 3), 2.0))
    for b in x.local_blocks():
        assert torch.equal(b, torch.full((7, 3), 2.0))


@pytest.mark.parametrize("placements", [[Partial(), Replicate()], [Partial("max"), Shard(0)]], ids=str)
def test_an_op_that_cannot_run_where_the_target_lies_keeps_its_layout(placements):
    # exp of a partial sum is not the sum of exps: computed out of place, laid out like x again
    x = dtorch.Tensor(torch.randn(6, 4), device_mesh=MESH, placements=placements)
    full = x.to_torch()
    x.exp_()
    assert x.placements == placements
    torch.testing.assert_close(x.to_torch(), full.exp())


@pytest.mark.parametrize("placements", LAYOUTS, ids=str)
def test_copy_fill_zero(placements):
    x, full = _fresh((7, 3), placements)
    x.copy_(torch.arange(3.0))
    assert torch.equal(x.to_torch(), torch.arange(3.0).expand(7, 3)) and x.placements == placements
    x.fill_(2.5)
    assert torch.equal(x.to_torch(), torch.full((7, 3), 2.5))
    x.zero_()
    assert torch.equal(x.to_torch(), torch.zeros(7, 3))
    src = dtorch.Tensor(torch.randn(7, 3, dtype=torch.float64), device_mesh=MESH, placements=[Shard(1), Shard(0)])
    x.copy_(src)  # another layout and dtype: moved and cast like torch
    torch.testing.assert_close(x.to_torch(), src.to_torch().float())
    assert x.dtype == torch.float32 and x.placements == placements


def test_errors_name_the_problem_and_leave_the_target_usable():
    x, full = _fresh((4, 3), [Shard(0), Replicate()])
    with pytest.raises(InplaceError, match="doesn't match the broadcast shape"):
        x.add_(torch.ones(2, 4, 3))
    with pytest.raises(InplaceError, match="can't be cast"):
        dtorch.Tensor(torch.arange(4), device_mesh=MESH).add_(0.5)
    with pytest.raises(InplaceError, match="cannot be broadcast"):
        x.copy_(torch.ones(5))
    for exc, call in [(RuntimeError, lambda: torch.ones(4, 3).add_(torch.ones(2, 4, 3))),
                      (RuntimeError, lambda: torch.arange(4).add_(0.5))]:
        with pytest.raises(exc):  # torch refuses the same calls
            call()
    other = dtorch.Tensor(torch.ones(4, 3), device_mesh=dtorch.DeviceMesh("cpu", [[4, 5], [6, 7]]))
    with pytest.raises(dtorch.OpError, match="different meshes"):
        x.add_(other)
    torch.testing.assert_close(x.to_torch(), full * 1.0)
    x.add_(1)
    torch.testing.assert_close(x.to_torch(), full + 1)


def test_a_decode_style_loop_writes_in_place():
    cache, full = _fresh((8, 4), [Shard(0), Replicate()])
    before = _ptrs(cache)
    for step in range(50):
        cache.mul_(0.9)
        cache.add_(float(step))
        full = full * 0.9 + step
    assert _ptrs(cache) == before
    torch.testing.assert_close(cache.to_torch(), full, rtol=1e-4, atol=1e-4)


def test_reference_backend_writes_and_copies_on_write():
    with dtorch.Graph(backend="reference"):
        x = dtorch.Tensor(torch.randn(7, 3), device_mesh=MESH, placements=[Shard(0), Replicate()])
        full = x.to_torch()
        c = x.clone()
        x.add_(1.0)
        x.copy_(x * 2)
        torch.testing.assert_close(x.to_torch(), (full + 1) * 2)
        torch.testing.assert_close(c.to_torch(), full)


def test_version_counts_writes_and_memory_stats_follow_a_copy_on_write():
    g = dtorch.Graph.default_graph()
    g.track_memory()
    try:
        x = dtorch.Tensor(torch.zeros(8, 4), device_mesh=MESH, placements=[Shard(0), Replicate()])
        assert x._version == 0
        c = x.clone()
        # the clone's handle counts as its own storage from the start (an upper bound until a write copies)
        before = g.get_memory_stats(MESH)
        x.add_(1.0)  # shared with c: x's blocks are copied first; x's old handle dies, its copy is counted
        after = g.get_memory_stats(MESH)
        assert x._version == 1 and c._version == 0
        assert after == before
        x.add_(1.0)  # now its own: in place, nothing new
        assert g.get_memory_stats(MESH) == after and x._version == 2
        del c
        per_device = 8 * 4 * 4 // 2  # [4, 4] float32 per device (Shard(0) over 2, Replicate over 2)
        assert all(g.get_memory_stats(MESH)[k]["allocated"] == after[k]["allocated"] - per_device for k in after)
    finally:
        g.track_memory(False)
