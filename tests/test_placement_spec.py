"""Placements (API.md section 2) and the shard arithmetic of DTensorSpec."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import Partial, PlacementError, Replicate, Shard
from dtorch.placement import normalize_placements
from dtorch.spec import DTensorSpec, shard_range


def test_equality_and_hash():
    assert Shard(0) == Shard(0) and hash(Shard(0)) == hash(Shard(0))
    assert Shard(0) != Shard(1)
    assert Replicate() == Replicate() and hash(Replicate()) == hash(Replicate())
    assert Partial() == Partial("sum") and Partial("max") != Partial("min")
    every = [Shard(0), Shard(1), Shard(-1), Replicate(), *(Partial(op) for op in ("sum", "avg", "max", "min"))]
    assert len(set(every)) == len(every)
    for a in every:
        for b in every:
            assert (a == b) == (a is b or repr(a) == repr(b))
    assert Shard(np.int64(1)) == Shard(1) and hash(Shard(np.int64(1))) == hash(Shard(1))


def test_str_and_repr():
    assert [str(p) for p in (Shard(1), Replicate(), Partial(), Partial("avg"))] == ["S(1)", "R", "P(sum)", "P(avg)"]
    assert [repr(p) for p in (Shard(1), Replicate(), Partial("max"))] == ["Shard(dim=1)", "Replicate()", "Partial('max')"]


def test_predicates():
    assert Shard(2).is_shard() and Shard(2).is_shard(2) and not Shard(2).is_shard(1)
    assert Replicate().is_replicate() and not Replicate().is_shard() and not Replicate().is_partial()
    assert Partial("min").is_partial() and Partial("min").reduce_op == "min"


def test_bad_placements():
    with pytest.raises(PlacementError, match=r"one of \('sum', 'avg', 'max', 'min'\), got 'mean'"):
        Partial("mean")
    for bad in (1.0, "0", True, None):
        with pytest.raises(PlacementError, match="needs an int tensor dim"):
            Shard(bad)


def test_negative_shard_normalised_against_tensor_rank():
    assert normalize_placements([Shard(-1), Replicate()], 2, 3) == (Shard(2), Replicate())
    assert normalize_placements(Shard(-2), 1, 2) == (Shard(0),)
    assert normalize_placements(None, 3, 1) == (Replicate(),) * 3
    m = dtorch.init_device_mesh("cpu", (2,))
    x = dtorch.Tensor(torch.ones(3, 4), device_mesh=m, placements=[Shard(-1)])
    assert x.placements == [Shard(1)]
    assert x.redistribute(m, [Shard(-2)]).placements == [Shard(0)]
    assert x.check_placement(0, Shard(-1))


@pytest.mark.parametrize("placements,mesh_ndim,tensor_ndim,words", [
    ([Shard(2)], 1, 2, ["Shard(2) on mesh dim 0", "2-D tensor", "[-2, 1]"]),
    ([Replicate(), Shard(-3)], 2, 2, ["Shard(-3) on mesh dim 1", "[-2, 1]"]),
    ([Shard(0)], 1, 0, ["0-D tensor cannot be sharded", "Replicate()"]),
    ([Shard(0)], 2, 1, ["got 1 placements [S(0)] for a 2-D mesh", "one placement per mesh dim"]),
    ([Replicate()] * 3, 2, 1, ["got 3 placements", "2-D mesh"]),
    ([Replicate(), "S0"], 2, 1, ["placement 1 is 'S0'", "Shard(dim), Replicate() or Partial()"]),
])
def test_placement_errors_say_what_to_change(placements, mesh_ndim, tensor_ndim, words):
    with pytest.raises(PlacementError) as err:
        normalize_placements(placements, mesh_ndim, tensor_ndim)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# -- shard arithmetic: torch.chunk sizes, nested shards outer mesh dim first -------------------------
def _chunk_boxes(size: int, n: int) -> list[tuple[int, int]]:
    """torch.chunk's pieces as (offset, length), padded with empty pieces up to n."""
    pieces = torch.arange(size).chunk(n) if size else ()
    out, off = [], 0
    for p in pieces:
        out.append((off, len(p)))
        off += len(p)
    return out + [(size, 0)] * (n - len(out))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 40), st.integers(1, 9))
def test_shard_range_is_torch_chunk(size, n):
    assert [shard_range(size, n, j) for j in range(n)] == _chunk_boxes(size, n)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=3), st.lists(st.integers(0, 9), min_size=1, max_size=3),
       st.data())
def test_local_box_tiles_the_tensor(mesh_shape, shape, data):
    """Shard mesh dims partition the tensor; replicas along other mesh dims hold the same box."""
    mesh = dtorch.init_device_mesh("cpu", tuple(mesh_shape))
    pl = tuple(data.draw(st.lists(st.one_of(st.just(Replicate()), st.just(Partial()),
                                            st.integers(0, len(shape) - 1).map(Shard)),
                                  min_size=mesh.ndim, max_size=mesh.ndim)))
    spec = DTensorSpec(mesh, pl, tuple(shape), torch.float32)
    cover = torch.zeros(shape, dtype=torch.int64)
    for c in mesh.coordinates():
        box = spec.local_box(c)
        assert spec.local_shape(c) == tuple(n for _, n in box)
        if all(c[i] == 0 for i, p in enumerate(pl) if not isinstance(p, Shard)):
            cover[tuple(slice(o, o + n) for o, n in box)] += 1
        rep = tuple(ci if isinstance(p, Shard) else 0 for ci, p in zip(c, pl))
        assert box == spec.local_box(rep)
    assert bool((cover == 1).all())
    even = all(n == spec.even_local_shape() for n in (spec.local_shape(c) for c in mesh.coordinates()))
    if spec.is_even():
        assert even
    assert spec.grid_shape() == tuple(1 if isinstance(p, Replicate) else s for p, s in zip(pl, mesh.shape))


def test_nested_shards_split_outer_mesh_dim_first():
    mesh = dtorch.init_device_mesh("cpu", (2, 3))
    spec = DTensorSpec(mesh, (Shard(0), Shard(0)), (11,), torch.float32)
    # outer: chunk(11, 2) = [0:6], [6:11]; inner: each chunked by 3
    outer = torch.arange(11).chunk(2)
    expected = []
    for o in outer:
        pieces = list(o.chunk(3)) + [o[:0]] * (3 - len(o.chunk(3)))
        expected += [(int(p[0]) if len(p) else int(o[-1]) + 1, len(p)) for p in pieces]
    assert [spec.local_box(c)[0] for c in mesh.coordinates()] == expected
    assert not spec.is_even()
    assert DTensorSpec(mesh, (Shard(0), Shard(0)), (12,), torch.float32).is_even()


def test_uneven_4x11_on_4_devices():
    mesh = dtorch.init_device_mesh("cpu", (4,))
    spec = DTensorSpec(mesh, (Shard(1),), (4, 11), torch.float32)
    assert [spec.local_shape((j,)) for j in range(4)] == [(4, 3), (4, 3), (4, 3), (4, 2)]


def test_spec_is_frozen_hashable_and_printable():
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    a = DTensorSpec(mesh, (Shard(0), Replicate()), (4, 5), torch.float32)
    b = DTensorSpec(dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"]), (Shard(0), Replicate()),
                    (4, 5), torch.float32)
    assert a == b and hash(a) == hash(b)
    assert a != a.with_placements((Shard(1), Replicate())) and a != DTensorSpec(mesh, a.placements, (4, 5), torch.float16)
    with pytest.raises(AttributeError):
        a.shape = (1,)
    assert str(a) == "[4, 5] float32 on cpu[dp=2, tp=2] [S(0), R]"
    assert a.shard_mesh_dims(0) == [0] and a.partial_dims() == []
    assert DTensorSpec(mesh, (Partial(), Partial("max")), (), torch.float32).partial_dims() == [0, 1]


def test_distributed_spec_alias():
    from dtorch import distributed_spec

    assert distributed_spec.Shard is Shard and distributed_spec.DeviceMesh is dtorch.DeviceMesh
