"""``Runtime.move_into``: many tensors written into other tensors' storage, each laid out as its target, in one
runtime call. On every backend (in-process grid and blocks, reference, process; the ray backend reruns this
module: test_move_into_ray.py) against torch, and its CommLog bytes against a brute-force count of the
elements whose destination device does not hold them already."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import dtorch
from dtorch import CommLog, DeviceMesh, Partial, Replicate, Shard
from dtorch.errors import PlacementError
from dtorch.ops.copy_tensors import copy_tensors_

from .conftest import using

LINE = DeviceMesh("cpu", [0, 1, 2, 3], mesh_dim_names=["x"])
SQUARE = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["a", "b"])
TURNED = DeviceMesh("cpu", [[3, 1], [2, 0]], mesh_dim_names=["a", "b"])  # the same devices, in another order
PAIR = DeviceMesh("cpu", [2, 3], mesh_dim_names=["x"])
ONE = DeviceMesh("cpu", [1], mesh_dim_names=["x"])

# (source mesh, source placements, target mesh, target placements, shape): uneven shapes, nested shards,
# meshes on the same devices, on some of them, on one
CASES = [
    (LINE, [Shard(0)], SQUARE, [Replicate(), Shard(0)], (5, 7)),
    (LINE, [Shard(0)], SQUARE, [Shard(1), Shard(0)], (5, 7)),
    (SQUARE, [Shard(0), Shard(1)], LINE, [Shard(1)], (5, 7)),
    (SQUARE, [Shard(0), Shard(0)], TURNED, [Shard(0), Replicate()], (9, 2)),
    (SQUARE, [Replicate(), Shard(1)], PAIR, [Shard(0)], (3, 5)),
    (PAIR, [Shard(1)], SQUARE, [Shard(0), Shard(1)], (4, 3)),
    (LINE, [Shard(0)], ONE, [Replicate()], (3,)),
    (ONE, [Replicate()], LINE, [Shard(0)], (6,)),
    (LINE, [Replicate()], SQUARE, [Replicate(), Replicate()], ()),
    (LINE, [Shard(1)], SQUARE, [Shard(0), Replicate()], (0, 4)),
]


def _holders(spec_mesh, placements, shape) -> np.ndarray:
    """[*shape] array of frozensets: which device ids hold each element."""
    spec = dtorch.DTensorSpec(spec_mesh, tuple(placements), tuple(shape), torch.float32)
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        out[idx] = set()
    for dev, coord in zip(spec_mesh.device_ids, spec_mesh.coordinates()):
        box = spec.local_box(coord)
        for idx in np.ndindex(*[n for _, n in box]):
            out[tuple(o + i for (o, _), i in zip(box, idx))].add(dev)
    return out


def changed_owner_bytes(src_mesh, src_pl, dst_mesh, dst_pl, shape, itemsize: int) -> int:
    """Elements times destination devices holding them, where that device does not hold them in the source."""
    have, want = _holders(src_mesh, src_pl, shape), _holders(dst_mesh, dst_pl, shape)
    return itemsize * sum(len(want[idx] - have[idx]) for idx in np.ndindex(*shape))


@pytest.fixture(scope="module")
def reference_graph():
    return dtorch.Graph(backend="reference")


@pytest.fixture(params=["inprocess", "blocks", "reference", "process"])
def graph(request, ref, blocks_ref, reference_graph):
    if request.param == "process":
        return request.getfixturevalue("proc")
    return {"inprocess": ref, "blocks": blocks_ref, "reference": reference_graph}[request.param]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_values_land_in_the_target_in_its_layout(graph, case):
    src_mesh, src_pl, dst_mesh, dst_pl, shape = CASES[case]
    full = torch.randn(shape)
    with using(graph):
        src = dtorch.Tensor(full, device_mesh=src_mesh, placements=src_pl)
        dst = dtorch.Tensor(torch.full(shape, 7.0, dtype=torch.float64), device_mesh=dst_mesh, placements=dst_pl)
        spec = dst._spec
        with CommLog() as log:
            moved = copy_tensors_([dst], [src])
        assert dst._spec == spec  # the target keeps its mesh, placements and dtype
        torch.testing.assert_close(dst.to_torch(), full.double(), rtol=0, atol=0)
        for block, coord in zip(dst.local_blocks(), dst_mesh.coordinates()):
            box = spec.local_box(coord)
            assert torch.equal(block, full.double()[tuple(slice(o, o + n) for o, n in box)])
    want = changed_owner_bytes(src_mesh, src_pl, dst_mesh, dst_pl, shape, 4)
    assert moved == want
    assert [(r.kind, r.nbytes) for r in log.records] == [("send_recv", want)]


def test_many_pairs_one_call_per_bucket(graph):
    shapes = [(5, 7), (8,), (3, 2, 2), (6, 6)]
    fulls = [torch.randn(s) for s in shapes]
    with using(graph):
        srcs = [dtorch.Tensor(f, device_mesh=LINE, placements=[Shard(0)]) for f in fulls]
        dsts = [dtorch.zeros(s, device_mesh=SQUARE, placements=[Replicate(), Shard(len(s) - 1)]) for s in shapes]
        with CommLog() as log:
            copy_tensors_(dsts, srcs)  # one bucket
        assert log.total("send_recv") == 1
        for d, f in zip(dsts, fulls):
            torch.testing.assert_close(d.to_torch(), f, rtol=0, atol=0)
        fulls = [f + 1 for f in fulls]
        srcs = [dtorch.Tensor(f, device_mesh=LINE, placements=[Shard(0)]) for f in fulls]
        with CommLog() as log:
            copy_tensors_(dsts, srcs, bucket_bytes=1)  # a bucket per pair
        assert log.total("send_recv") == len(shapes)
        for d, f in zip(dsts, fulls):
            torch.testing.assert_close(d.to_torch(), f, rtol=0, atol=0)


def test_partial_sources_are_reduced_first_and_dtypes_cast(graph):
    full = torch.randn(4, 6)
    with using(graph):
        src = dtorch.Tensor(full, device_mesh=SQUARE, placements=[Partial(), Shard(1)])
        dst = dtorch.zeros(4, 6, device_mesh=LINE, placements=[Shard(0)], dtype=torch.bfloat16)
        copy_tensors_([dst], [src])
        assert dst.dtype == torch.bfloat16
        torch.testing.assert_close(dst.to_torch(), full.bfloat16(), rtol=0, atol=0)


def test_copy_on_write_keeps_other_holders_unchanged(graph):
    full = torch.randn(5, 3)
    with using(graph):
        src = dtorch.Tensor(full, device_mesh=LINE, placements=[Shard(0)])
        dst = dtorch.zeros(5, 3, device_mesh=SQUARE, placements=[Shard(0), Replicate()])
        alias = dtorch.Tensor(dst)  # a tensor of its own on dst's storage (no view: it must not see the write)
        view_before = dst._version
        copy_tensors_([dst], [src])
        torch.testing.assert_close(dst.to_torch(), full, rtol=0, atol=0)
        assert torch.equal(alias.to_torch(), torch.zeros(5, 3))
        assert dst._version == view_before + 1
        # not shared any more: the next write lands in the same storage
        handle = dst._h
        copy_tensors_([dst], [src * 2])
        torch.testing.assert_close(dst.to_torch(), full * 2, rtol=0, atol=0)
        assert dst._h is handle


def test_a_view_target_is_written_as_copy_writes_it(graph):
    """A view (where the tensor type has them) writes through to its base, as ``copy_`` does."""
    full = torch.randn(4, 4)
    with using(graph):
        src = dtorch.Tensor(full, device_mesh=LINE, placements=[Shard(0)])
        base = dtorch.zeros(6, 4, device_mesh=SQUARE, placements=[Shard(0), Shard(1)])
        twin = dtorch.zeros(6, 4, device_mesh=SQUARE, placements=[Shard(0), Shard(1)])
        view, twin_view = base[1:5], twin[1:5]
        copy_tensors_([view], [src])
        twin_view.copy_(src)
        torch.testing.assert_close(view.to_torch(), full, rtol=0, atol=0)
        assert torch.equal(base.to_torch(), twin.to_torch())


def test_targets_used_before_they_are_read(graph):
    """A target still arriving serves as the next move's source, and a target dropped unread is fine."""
    full = torch.randn(6, 4)
    with using(graph):
        a = dtorch.Tensor(full, device_mesh=LINE, placements=[Shard(1)])
        b = dtorch.zeros(6, 4, device_mesh=SQUARE, placements=[Shard(1), Shard(0)])
        c = dtorch.zeros(6, 4, device_mesh=PAIR, placements=[Shard(0)])
        dropped = dtorch.zeros(6, 4, device_mesh=TURNED, placements=[Replicate(), Shard(0)])
        copy_tensors_([b, dropped], [a, a])
        del dropped
        copy_tensors_([c], [b])
        torch.testing.assert_close(c.to_torch(), full, rtol=0, atol=0)
        torch.testing.assert_close((b + 1).to_torch(), full + 1, rtol=0, atol=0)


def test_pairs_take_effect_in_order(graph):
    """A pair that reads an earlier pair's target, or writes it again, waits for that write (a new bucket)."""
    full = torch.randn(6, 4)
    with using(graph):
        a = dtorch.Tensor(full, device_mesh=LINE, placements=[Shard(1)])
        b = dtorch.zeros(6, 4, device_mesh=SQUARE, placements=[Shard(1), Shard(0)])
        c = dtorch.zeros(6, 4, device_mesh=PAIR, placements=[Shard(0)])
        with CommLog() as log:
            copy_tensors_([b, c, b], [a, b, a * 3])
        assert log.total("send_recv") == 3
        torch.testing.assert_close(c.to_torch(), full, rtol=0, atol=0)
        torch.testing.assert_close(b.to_torch(), full * 3, rtol=0, atol=0)


def test_bad_pairs_are_refused_before_anything_moves(ref):
    with using(ref):
        a = dtorch.zeros(4, 4, device_mesh=LINE, placements=[Shard(0)])
        b = dtorch.ones(4, 5, device_mesh=SQUARE, placements=[Shard(0), Shard(1)])
        p = dtorch.Tensor(torch.ones(4, 4), device_mesh=SQUARE, placements=[Partial(), Replicate()])
        ok = dtorch.zeros(4, 4, device_mesh=SQUARE, placements=[Shard(0), Shard(1)])
        with pytest.raises(PlacementError, match=r"pair 0: source of shape \[4, 5\].*pair 2: the target .* is Partial"):
            copy_tensors_([a, ok, p], [b, a, a])
        assert torch.equal(ok.to_torch(), torch.zeros(4, 4))  # nothing written
        with pytest.raises(ValueError, match="2 targets but 1 sources"):
            copy_tensors_([a, ok], [a])


def test_moved_bytes_is_the_brute_force_count():
    """spec.moved_bytes (what CommLog records) on every case and the reversed moves."""
    from dtorch.spec import moved_bytes

    for src_mesh, src_pl, dst_mesh, dst_pl, shape in CASES:
        for a, b in (((src_mesh, src_pl), (dst_mesh, dst_pl)), ((dst_mesh, dst_pl), (src_mesh, src_pl))):
            before = dtorch.DTensorSpec(a[0], tuple(a[1]), shape, torch.float32)
            after = dtorch.DTensorSpec(b[0], tuple(b[1]), shape, torch.float32)
            assert moved_bytes(before, after) == changed_owner_bytes(*a, *b, shape, 4), (before, after)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_redistribute_between_meshes_counts_what_changes_device(ref, case):
    """A plain cross-mesh redistribute (a Move step) records the same bytes: meshes may share devices."""
    src_mesh, src_pl, dst_mesh, dst_pl, shape = CASES[case]
    full = torch.randn(shape)
    with using(ref):
        x = dtorch.Tensor(full, device_mesh=src_mesh, placements=src_pl)
        with CommLog() as log:
            y = x.redistribute(dst_mesh, dst_pl)
        torch.testing.assert_close(y.to_torch(), full, rtol=0, atol=0)
    want = changed_owner_bytes(src_mesh, src_pl, dst_mesh, dst_pl, shape, 4)
    assert [(r.kind, r.nbytes) for r in log.records] == [("send_recv", want)]


def test_other_backends_get_the_default_move_then_write():
    """A backend that does not implement move_into gets the interface's default (move, then an in-place copy)."""
    from dtorch.runtime.inprocess import InProcessRuntime
    from dtorch.runtime.interface import Runtime

    class Plain(InProcessRuntime):
        move_into = Runtime.move_into

    g = dtorch.Graph(backend="inprocess")
    g.runtime = Plain()
    full = torch.randn(5, 7)
    with using(g):
        for src_pl, dst_pl in itertools.product([[Shard(0)], [Shard(1)]], [[Replicate(), Shard(0)], [Shard(1), Shard(0)]]):
            src = dtorch.Tensor(full, device_mesh=LINE, placements=src_pl)
            dst = dtorch.zeros(5, 7, device_mesh=SQUARE, placements=dst_pl, dtype=torch.float64)
            copy_tensors_([dst], [src])
            torch.testing.assert_close(dst.to_torch(), full.double(), rtol=0, atol=0)
