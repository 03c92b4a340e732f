"""Redistribution: property tests (hypothesis) over random meshes, shapes and placements, plus
planner and CommLog checks for every basic transition.

The definition every check uses: device ``coord`` holds ``full[spec.local_box(coord)]``; a Partial
mesh dim holds terms whose reduction (outer mesh dim first) is that block.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard
from dtorch.redistribute import plan_redistribute
from dtorch.spec import DTensorSpec
from sweep import canonical

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
REDUCE_OPS = ("sum", "avg", "max", "min")
SIZES = st.sampled_from([0, 1, 1, 2, 3, 4, 5, 7])


# -- strategies --------------------------------------------------------------------------------
@st.composite
def meshes(draw, max_devices: int = 16, ndim=None):
    ndim = draw(st.integers(1, 4)) if ndim is None else ndim
    shape, room = [], max_devices
    for _ in range(ndim):
        s = draw(st.integers(1, min(4, room)))
        shape.append(s)
        room //= s
    n = math.prod(shape)
    first = draw(st.integers(0, 20))
    ids = draw(st.permutations(list(range(first, first + n))))
    names = [f"m{i}" for i in range(ndim)] if draw(st.booleans()) else None
    return DeviceMesh("cpu", np.array(ids).reshape(shape), mesh_dim_names=names)


def shapes(min_dims: int = 0):
    return st.lists(SIZES, min_size=min_dims, max_size=3).map(tuple)


def placement(tensor_ndim: int):
    opts = [st.just(Replicate()), st.sampled_from(REDUCE_OPS).map(Partial)]
    if tensor_ndim:
        opts.append(st.integers(-tensor_ndim, tensor_ndim - 1).map(Shard))
    return st.one_of(*opts)


def placements(mesh: DeviceMesh, tensor_ndim: int):
    return st.lists(placement(tensor_ndim), min_size=mesh.ndim, max_size=mesh.ndim)


def value(shape) -> torch.Tensor:
    # small integers keep sums, averages and their inverses exact in float32
    return torch.randint(-8, 9, shape, generator=torch.Generator().manual_seed(hash(shape) % 1000)).float()


# -- the definition, checked block by block ----------------------------------------------------------
def _reduce(op: str, terms: list[torch.Tensor]) -> torch.Tensor:
    s = torch.stack(terms)
    return {"sum": s.sum(0), "avg": s.mean(0), "max": s.amax(0), "min": s.amin(0)}[op]


def assert_blocks_match(x: dtorch.Tensor, full: torch.Tensor) -> None:
    """Every device's block is the slice ``spec.local_box`` defines (partial terms reduce to it)."""
    spec = x.spec
    mesh = spec.mesh
    blocks = dict(zip(mesh.coordinates(), x.local_blocks()))
    assert len(blocks) == mesh.size()
    for coord, b in blocks.items():
        assert tuple(b.shape) == spec.local_shape(coord), (str(spec), coord, tuple(b.shape))
    partial = spec.partial_dims()
    for coord in mesh.coordinates():
        if any(coord[i] for i in partial):
            continue
        # reduce the partial mesh dims one at a time, outer first
        group = {c: blocks[c] for c in mesh.coordinates()
                 if all(c[i] == coord[i] for i in range(mesh.ndim) if i not in partial)}
        for i in partial:
            merged = {}
            for c in group:
                if c[i] == 0:
                    terms = [group[c[:i] + (j,) + c[i + 1:]] for j in range(mesh.shape[i])]
                    merged[c] = _reduce(spec.placements[i].reduce_op, terms)
            group = merged
        want = full[tuple(slice(o, o + n) for o, n in spec.local_box(coord))]
        torch.testing.assert_close(group[coord], want, rtol=0, atol=1e-5, msg=lambda m: f"{spec} device {coord}: {m}")


def snapshot(x: dtorch.Tensor):
    return x.to_torch().clone(), [b.clone() for b in x.local_blocks()], x.placements


def assert_untouched(x: dtorch.Tensor, snap) -> None:
    full, blocks, pl = snap
    assert x.placements == pl
    torch.testing.assert_close(x.to_torch(), full, rtol=0, atol=0)
    for a, b in zip(x.local_blocks(), blocks):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def roundtrip(full: torch.Tensor, src_mesh, src_pl, dst_mesh, dst_pl):
    x = dtorch.Tensor(full, device_mesh=src_mesh, placements=src_pl)
    torch.testing.assert_close(x.to_torch(), full, rtol=0, atol=1e-5)  # Partial terms reduce to the value
    assert_blocks_match(x, full)
    snap = snapshot(x)
    y = x.redistribute(dst_mesh, dst_pl)
    assert y.device_mesh == dst_mesh
    assert y.placements == list(canonical(dst_mesh, [Shard(p.dim % full.ndim) if isinstance(p, Shard) else p
                                                     for p in dst_pl]))
    torch.testing.assert_close(y.to_torch(), full, rtol=0, atol=1e-5)
    assert_blocks_match(y, full)
    assert_untouched(x, snap)
    return y


# -- properties ---------------------------------------------------------------------------------
@st.composite
def same_mesh_case(draw):
    mesh = draw(meshes())
    shape = draw(shapes())
    return mesh, shape, draw(placements(mesh, len(shape))), draw(placements(mesh, len(shape)))


@SETTINGS
@given(same_mesh_case())
def test_same_mesh_keeps_value_and_source(case):
    mesh, shape, src, dst = case
    roundtrip(value(shape), mesh, src, mesh, dst)


@st.composite
def cross_mesh_case(draw):
    a, b = draw(meshes()), draw(meshes())
    shape = draw(shapes())
    return a, b, shape, draw(placements(a, len(shape))), draw(placements(b, len(shape)))


@SETTINGS
@given(cross_mesh_case())
def test_cross_mesh_keeps_value_and_source(case):
    a, b, shape, src, dst = case
    roundtrip(value(shape), a, src, b, dst)


@st.composite
def nested_case(draw):
    """Several mesh dims shard the same tensor dim, in source, target or both."""
    mesh = draw(meshes(ndim=draw(st.integers(2, 4))))
    shape = draw(shapes(min_dims=1))
    k = draw(st.integers(0, len(shape) - 1))
    nested = st.one_of(st.just(Shard(k)), placement(len(shape)))
    src = draw(st.lists(nested, min_size=mesh.ndim, max_size=mesh.ndim))
    dst = draw(st.lists(nested, min_size=mesh.ndim, max_size=mesh.ndim))
    return mesh, shape, src, dst


@SETTINGS
@given(nested_case())
def test_nested_shards_keep_value(case):
    mesh, shape, src, dst = case
    roundtrip(value(shape), mesh, src, mesh, dst)


@settings(max_examples=60, deadline=None)
@given(meshes(), shapes(), st.data())
def test_no_change_means_no_communication(mesh, shape, data):
    pl = data.draw(placements(mesh, len(shape)))
    x = dtorch.Tensor(value(shape), device_mesh=mesh, placements=pl)
    with dtorch.CommLog() as log:
        y = x.redistribute(mesh, pl)
        z = x.redistribute(mesh, x.placements)
    assert log.counts() == {}
    assert y is x and z is x


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_cross_mesh_same_layout_is_one_send_recv(data):
    a = data.draw(meshes())
    shape = data.draw(shapes())
    pl = data.draw(placements(a, len(shape)))
    used = set(a.device_ids)
    offset = max(used) + 1
    other_ids = data.draw(st.permutations([i + offset for i in a.device_ids]))
    b = DeviceMesh("cpu", np.array(other_ids).reshape(a.shape), mesh_dim_names=a.dim_names)
    full = value(shape)
    with dtorch.CommLog() as log:
        y = roundtrip(full, a, pl, b, pl)
    assert [(k, n) for (k, _), n in log.counts().items()] == [("send_recv", 1)]
    assert y.device_mesh == b


# -- the expected collectives for each basic transition on one mesh dim ----------------------------
def transitions(k: int, j: int):
    """(src, dst, expected collective kind or None) for one mesh dim; tensor dims k != j."""
    out = [(Shard(k), Replicate(), "all_gather"), (Shard(k), Shard(j), "all_to_all"),
           (Replicate(), Shard(k), None), (Replicate(), Replicate(), None), (Shard(k), Shard(k), None)]
    for op in REDUCE_OPS:
        out += [(Partial(op), Replicate(), "all_reduce"), (Replicate(), Partial(op), None),
                (Partial(op), Partial(op), None)]
    out.append((Partial("sum"), Shard(k), "reduce_scatter"))
    out.append((Partial("avg"), Shard(k), "reduce_scatter"))
    return out


@st.composite
def one_dim_transition(draw):
    mesh = draw(meshes())
    shape = draw(shapes(min_dims=2))
    i = draw(st.integers(0, mesh.ndim - 1))
    k, j = draw(st.permutations(range(len(shape))))[:2]
    src_p, dst_p, kind = draw(st.sampled_from(transitions(k, j)))
    # other mesh dims keep their placement; an inner one must not shard k or j (that would force
    # gathers on it first), an outer one may (nested shards)
    others = []
    for m in range(mesh.ndim):
        if m == i:
            others.append(None)
            continue
        dims = [d for d in range(len(shape)) if m < i or d not in (k, j)]
        opts = [st.just(Replicate()), st.just(Partial())] + ([st.sampled_from(dims).map(Shard)] if dims else [])
        others.append(draw(st.one_of(*opts)))
    src = [src_p if m == i else p for m, p in enumerate(others)]
    dst = [dst_p if m == i else p for m, p in enumerate(others)]
    return mesh, shape, i, src, dst, kind


@settings(max_examples=250, deadline=None)
@given(one_dim_transition())
def test_basic_transition_collectives(case):
    mesh, shape, i, src, dst, kind = case
    full = value(shape)
    x = dtorch.Tensor(full, device_mesh=mesh, placements=src)
    with dtorch.CommLog() as log:
        y = x.redistribute(mesh, dst)
    if mesh.shape[i] == 1 and (src[i].is_shard() or dst[i].is_shard()):
        kind = "all_reduce" if src[i].is_partial() else None  # a Shard on a size-1 mesh dim is Replicate()
    expected = {} if kind is None else {(kind, mesh.dim_label(i)): 1}
    if kind == "all_reduce" and src[i].reduce_op in ("max", "min") and mesh.shape[i] > 1:
        # partial mesh dims reduce outer first: an outer P(sum) kept by the target cannot stay partial
        # under a max/min reduction, so it is all-reduced before it (and made partial again, locally)
        for m in range(i):
            if isinstance(src[m], Partial) and mesh.shape[m] > 1:
                expected[("all_reduce", mesh.dim_label(m))] = 1
    assert log.counts() == expected, f"{src} -> {dst} on {mesh}: {log.counts()}"
    torch.testing.assert_close(y.to_torch(), full, rtol=0, atol=1e-5)
    assert_blocks_match(y, full)
    if kind is not None:
        # the payload is every device's input block
        src_bytes = sum(math.prod(x.spec.local_shape(c)) for c in mesh.coordinates()) * full.element_size()
        assert log.bytes()[(kind, mesh.dim_label(i))] == src_bytes  # (the keys are checked above)


def test_commlog_bytes_are_the_input_blocks():
    mesh = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "tp"])
    x = dtorch.Tensor(torch.ones(4, 6), device_mesh=mesh, placements=[Replicate(), Shard(1)])
    with dtorch.CommLog() as log:
        x.redistribute(mesh, [Replicate(), Replicate()])
    # every one of the 6 devices contributes its 4x2 float32 block
    assert log.bytes() == {("all_gather", "tp"): 6 * 4 * 2 * 4}
    assert log.total() == 1 and log.total("all_reduce") == 0
    table = log.table()
    assert "all_gather" in table and "tp" in table and "192 B" in table
    assert dtorch.CommLog().table() == "no communication"


def test_commlog_nests_and_stops_recording():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    x = dtorch.Tensor(torch.ones(4), device_mesh=mesh, placements=[Partial()])
    with dtorch.CommLog() as outer:
        with dtorch.CommLog() as inner:
            x.redistribute(mesh, [Replicate()])
        x.redistribute(mesh, [Shard(0)])
    x.redistribute(mesh, [Replicate()])
    assert inner.counts() == {("all_reduce", "tp"): 1}
    assert outer.counts() == {("all_reduce", "tp"): 1, ("reduce_scatter", "tp"): 1}


# -- the planner -------------------------------------------------------------------------------------
def _plan(mesh_shape, src, dst, shape):
    mesh = dtorch.init_device_mesh("cpu", mesh_shape)
    s = DTensorSpec(mesh, tuple(src), shape, torch.float32)
    return [(st.kind, st.mesh_dim) for st in plan_redistribute(s, s.with_placements(tuple(dst))).steps]


S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()


@pytest.mark.parametrize("src,dst,steps", [
    # inner shard of a nested pair goes: one gather on the inner mesh dim
    ([S0, S0], [S0, R], [("all_gather", 1)]),
    # the outer one cannot be gathered first: gather inner, gather outer, re-cut inner
    ([S0, S0], [R, S0], [("all_gather", 1), ("all_gather", 0), ("local_slice", 1)]),
    # nesting a new inner shard under an existing one is a local cut
    ([S0, R], [S0, S0], [("local_slice", 1)]),
    ([R, R], [S0, S0], [("local_slice", 0), ("local_slice", 1)]),
    # the inner shard moves to another tensor dim in place: one all_to_all
    ([S0, S0], [S0, S1], [("all_to_all", 1)]),
    ([S0, S1], [S1, S0], [("all_gather", 1), ("all_to_all", 0), ("local_slice", 1)]),
    # partial sums are reduce-scattered straight into a nested inner shard
    ([S0, P], [S0, S0], [("reduce_scatter", 1)]),
    ([P, P], [R, R], [("all_reduce", 0), ("all_reduce", 1)]),
    ([P, S0], [S0, S0], [("all_gather", 1), ("reduce_scatter", 0), ("local_slice", 1)]),
    ([R, R], [P, S1], [("to_partial", 0), ("local_slice", 1)]),
    ([S1, S0], [S1, S0], []),
])
@pytest.mark.parametrize("shape", [(8, 8), (5, 3), (1, 7)])
def test_planner_nested_and_uneven(src, dst, steps, shape):
    # the plan depends on placements only: uneven and tiny shapes get the same steps
    assert _plan((2, 3), src, dst, shape) == steps


def test_plan_is_printable_and_cached():
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    s = DTensorSpec(mesh, (S0, P), (4, 4), torch.float32)
    d = s.with_placements((R, S1))
    plan = plan_redistribute(s, d)
    assert plan is plan_redistribute(s, d)
    assert str(plan) == "P(sum)->S(1) reduce_scatter on tp; S(0)->R all_gather on dp"
    assert str(plan_redistribute(s, s)) == "no-op"


# -- typed steps and the one executor ------------------------------------------------------------------
class _Recorder:
    """A runtime stand-in that records which primitive each step calls, with which arguments."""

    def __getattr__(self, name):
        return lambda *args: (name, args)


def _step_cases():
    from dtorch.redistribute import AllGather, AllReduce, AllToAll, LocalSlice, ReduceScatter, ToPartial

    return [
        ([S0, R], [R, R], AllGather, "all_gather", True, "S(0)->R all_gather on {}"),
        ([P, R], [R, R], AllReduce, "all_reduce", True, "P(sum)->R all_reduce on {}"),
        ([P, R], [S1, R], ReduceScatter, "reduce_scatter", True, "P(sum)->S(1) reduce_scatter on {}"),
        ([S0, R], [S1, R], AllToAll, "all_to_all", True, "S(0)->S(1) all_to_all on {}"),
        ([R, R], [S1, R], LocalSlice, "local_slice", False, "R->S(1) local_slice on {}"),
        ([R, R], [Partial("max"), R], ToPartial, "to_partial", False, "R->P(max) to_partial on {}"),
    ]


@pytest.mark.parametrize("names", [["dp", "tp"], None], ids=["named", "unnamed"])
@pytest.mark.parametrize("case", range(6))
def test_typed_steps_print_with_the_mesh_dim_name_and_call_one_primitive(names, case):
    src, dst, cls, kind, collective, text = _step_cases()[case]
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    s = DTensorSpec(mesh, tuple(src), (4, 4), torch.float32)
    plan = plan_redistribute(s, s.with_placements(tuple(dst)))
    (step,) = plan.steps
    assert type(step) is cls and step.kind == kind and step.mesh_dim == 0
    assert step.src == src[0] and step.dst == dst[0]
    assert step.is_collective == step.communicates == collective
    assert str(step) == text.format("dp" if names else 0)
    assert step.label == ("dp" if names else 0)
    # run() calls the runtime primitive of the same name, with the specs and the mesh dim
    assert step.run(_Recorder(), "h", s, plan.specs[0]) == (kind, ("h", s, plan.specs[0], 0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.mesh_dim = 1


def test_move_step_prints_and_calls_move():
    from dtorch.redistribute import Move

    stages = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "tp"]).unbind("pp")
    s = DTensorSpec(stages[0], (S0,), (4, 4), torch.float32)
    d = DTensorSpec(stages[1], (S0,), (4, 4), torch.float32)
    (step,) = plan_redistribute(s, d).steps
    assert type(step) is Move and step.kind == "send_recv" and step.same_layout and step.label == "pp"
    assert step.communicates and not step.is_collective
    assert str(step).endswith("(block to block) send_recv on pp")
    assert step.run(_Recorder(), "h", s, d) == ("move", ("h", s, d, True))
    other = DTensorSpec(DeviceMesh("cpu", [5, 6, 7]), (R,), (4, 4), torch.float32)
    steps = plan_redistribute(s, other).steps
    assert [type(st) for st in steps] == [Move] and steps[0].label is None and not steps[0].same_layout
    assert str(steps[0]).endswith("(regions) send_recv")


@pytest.mark.parametrize("shape", [(8, 6), (5, 3)], ids=["even", "uneven"])
def test_executor_records_one_commlog_record_per_communicating_step(shape):
    # every step of a long plan: kind, mesh dim name and the bytes of the spec before it, once each
    mesh = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "tp"])
    x = dtorch.Tensor(value(shape), device_mesh=mesh, placements=[Partial(), Shard(0)])
    dst = DTensorSpec(mesh, (S1, Partial("max")), shape, torch.float32)
    plan = plan_redistribute(x.spec, dst)
    befores = (x.spec,) + plan.specs[:-1]
    want = [(st.kind, st.label, b.total_bytes()) for st, b in zip(plan.steps, befores) if st.communicates]
    assert len(want) >= 2 and len(want) < len(plan.steps), str(plan)  # collectives and local steps
    with dtorch.CommLog() as log:
        y = x.redistribute(mesh, list(dst.placements))
    assert [(r.kind, r.mesh_dim, r.nbytes) for r in log.records] == want
    assert all(r.devices == tuple(mesh.device_ids) for r in log.records)
    assert_blocks_match(y, x.to_torch())


def test_ring_shift_goes_through_the_executor():
    from dtorch.redistribute.executor import ring_shift

    mesh = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "ring"])
    x = dtorch.Tensor(value((4, 7)), device_mesh=mesh, placements=[Shard(0), Shard(1)])
    with dtorch.CommLog() as log:
        h = ring_shift(x.graph.runtime, x._h, x.spec, 1, 1)
    assert [(r.kind, r.mesh_dim, r.nbytes) for r in log.records] == [("send_recv", "ring", x.spec.total_bytes())]
    blocks, shifted = x.local_blocks(), x.graph.runtime.local_blocks(h, x.spec)
    for coord, b in zip(mesh.coordinates(), shifted):  # device (a, j) holds block (a, j - 1)
        src = mesh.coordinates().index((coord[0], (coord[1] - 1) % 3))
        assert torch.equal(b, blocks[src])


@pytest.mark.parametrize("shape,pl", [((8, 6), [S0, S1]), ((5, 3), [S0, S1]), ((5, 3), [P, R]), ((), [R, P])])
def test_spec_byte_counts(shape, pl):
    mesh = dtorch.init_device_mesh("cpu", (2, 3))
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        s = DTensorSpec(mesh, tuple(pl), shape, dtype)
        want = [math.prod(s.local_shape(c)) * dtype.itemsize for c in mesh.coordinates()]
        assert s.device_bytes().tolist() == want and s.total_bytes() == sum(want)
        assert s.device_bytes() is s.device_bytes() and not s.device_bytes().flags.writeable


def test_uneven_blocks_follow_torch_chunk():
    mesh = dtorch.init_device_mesh("cpu", (4,))
    full = torch.arange(4 * 11.0).reshape(4, 11)
    x = dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(1)])
    expected = torch.chunk(full, 4, dim=1)
    assert [tuple(b.shape) for b in x.local_blocks()] == [tuple(c.shape) for c in expected]
    for b, c in zip(x.local_blocks(), expected):
        assert torch.equal(b, c)
    # 3 rows over 4 devices: torch.chunk gives 3 chunks, the last device holds an empty block
    y = dtorch.Tensor(torch.ones(3, 2), device_mesh=mesh, placements=[Shard(0)])
    assert [b.shape[0] for b in y.local_blocks()] == [1, 1, 1, 0]


def test_unbind_stages_hand_on_with_send_recv_on_the_parent_dim():
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "tp"])
    s0, s1 = mesh.unbind("pp")
    full = value((5, 3))
    x = dtorch.Tensor(full, device_mesh=s0, placements=[Shard(0)])
    with dtorch.CommLog() as log:
        y = x.redistribute(s1, [Shard(0)])
    assert log.counts() == {("send_recv", "pp"): 1}
    assert_blocks_match(y, full)


@pytest.mark.parametrize("src,dst", list(itertools.product([Shard(0), Replicate(), Partial()], repeat=2)))
def test_cpu_one_device_to_mesh_and_back(src, dst):
    one = DeviceMesh("cpu")
    mesh = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["tp"])
    full = value((7, 2))
    y = roundtrip(full, one, [src], mesh, [dst])
    roundtrip(full, mesh, [dst], one, [src])
    assert y.device_mesh == mesh


# -- dtypes: reductions of partial terms keep the tensor's dtype ----------------------------------------
DTYPES = [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8, torch.bool]


@pytest.mark.parametrize("n", [4, 5], ids=["even", "uneven"])
@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_partial_reductions_keep_dtype(dtype, op, n):
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    full = (torch.arange(n) % 3).to(dtype)
    x = dtorch.Tensor(full, device_mesh=mesh, placements=[Partial(op)])
    for y in (x, x.redistribute(mesh, [Replicate()]), x.redistribute(mesh, [Shard(0)])):
        got = y.to_torch()
        assert got.dtype == dtype and all(b.dtype == dtype for b in y.local_blocks()), (str(y.spec), got.dtype)
        assert torch.equal(got, full)


# -- partial terms that differ per device (sweep.distribute): the reductions themselves are checked ---------
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)], ids=str)
def test_reducing_distinct_partial_terms(op, mesh_shape):
    from sweep import distribute

    mesh = dtorch.init_device_mesh("cpu", mesh_shape)
    full = torch.randn(5, 4, generator=torch.Generator().manual_seed(3))
    src = [Partial(op)] + [Replicate()] * (len(mesh_shape) - 1)
    x = distribute(full, mesh, src)
    assert len({tuple(b.flatten().tolist()) for b in x.local_blocks()}) > 1, "terms must differ per device"
    for dst in ([Replicate()], [Shard(0)], [Shard(1)]):
        dst = dst + [Replicate()] * (len(mesh_shape) - 1)
        y = x.redistribute(mesh, dst)
        for block, coord in zip(y.local_blocks(), mesh.coordinates()):  # blocks, not to_torch: no second reduction
            box = y.spec.local_box(coord)
            torch.testing.assert_close(block, full[tuple(slice(o, o + n) for o, n in box)], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [4, 5], ids=["grid", "blocks"])  # 5 rows over S(0) x 2: uneven -> per-device blocks
def test_mixed_partial_ops_reduce_in_mesh_dim_order(rows):
    # [P(max), P(sum), S(0)]: the value is sum over mesh dim 1 of (max over mesh dim 0), whatever the storage
    mesh = dtorch.init_device_mesh("cpu", (2, 2, 2))
    g = torch.Generator().manual_seed(5)
    terms = torch.randn(2, 2, rows, 3, generator=g)  # [mesh dim 0, mesh dim 1, rows, cols]
    spec_pl = [Partial("max"), Partial("sum"), Shard(0)]
    blocks = []
    for a, b, c in mesh.coordinates():
        cut = torch.tensor_split(terms[a, b], [-(-rows // 2)])[c]
        blocks.append(cut.clone())
    x = dtorch.Tensor.from_blocks(blocks, device_mesh=mesh, placements=spec_pl, shape=(rows, 3))
    expected = terms.amax(0).sum(0)
    torch.testing.assert_close(x.to_torch(), expected)
    torch.testing.assert_close(x.redistribute(mesh, [Replicate()] * 3).to_torch(), expected)


# -- mixed-op partials from distinct per-device terms: one reduction order everywhere ---------------------
def _reduce_terms(op: str, s: torch.Tensor) -> torch.Tensor:
    """Reduce dim 0 of ``s`` as a collective does: in s's dtype, integer avg is the floored mean."""
    if op == "avg" and not s.is_floating_point():
        return s.sum(0).div(s.shape[0], rounding_mode="floor")
    return {"sum": lambda: s.sum(0, dtype=s.dtype), "avg": lambda: s.mean(0), "max": lambda: s.amax(0),
            "min": lambda: s.amin(0)}[op]()


def reference_from_blocks(blocks: dict, mesh: DeviceMesh, pl, shape, dtype) -> torch.Tensor:
    """The value the documented order gives, computed from the blocks alone: for each device that holds
    a distinct block region (index 0 on Replicate mesh dims, 0 on Partial mesh dims), stack the terms
    of its Partial mesh dims and reduce them one mesh dim at a time, mesh dim 0 (outer) first."""
    spec = DTensorSpec(mesh, tuple(pl), tuple(shape), dtype)
    partial = [i for i, p in enumerate(pl) if isinstance(p, Partial)]
    out = torch.empty(shape, dtype=dtype)
    for coord in mesh.coordinates():
        if any(coord[i] for i, p in enumerate(pl) if not isinstance(p, Shard)):
            continue
        terms = torch.stack([blocks[tuple(c)] for c in _partial_group(coord, partial, mesh.shape)])
        terms = terms.reshape(tuple(mesh.shape[i] for i in partial) + terms.shape[1:])
        for i in partial:  # the leading dim of `terms` is always the outermost mesh dim not yet reduced
            terms = _reduce_terms(pl[i].reduce_op, terms)
        out[tuple(slice(o, o + n) for o, n in spec.local_box(coord))] = terms
    return out


def _partial_group(coord, partial, mesh_shape):
    """``coord`` with every combination of indices on the ``partial`` mesh dims, outer dims varying slowest."""
    for idx in itertools.product(*[range(mesh_shape[i]) for i in partial]):
        c = list(coord)
        for i, j in zip(partial, idx):
            c[i] = j
        yield tuple(c)


@st.composite
def mixed_partial_case(draw):
    ndim = draw(st.sampled_from([2, 3]))
    # two partial mesh dims a < b of size > 1 with different ops; the other mesh dim (3-D) anything
    a, b = sorted(draw(st.permutations(range(ndim)))[:2])
    mesh_shape = tuple(draw(st.integers(2, 3)) if i in (a, b) else draw(st.integers(1, 2)) for i in range(ndim))
    ids = draw(st.permutations(range(math.prod(mesh_shape))))
    mesh = DeviceMesh("cpu", np.array(ids).reshape(mesh_shape))
    tensor_ndim = draw(st.integers(0, 2))
    op_a, op_b = draw(st.permutations(REDUCE_OPS))[:2]
    pl = [draw(placement(tensor_ndim)) for _ in range(ndim)]
    pl[a], pl[b] = Partial(op_a), Partial(op_b)
    pl = [Shard(p.dim % tensor_ndim) if isinstance(p, Shard) else p for p in pl]
    # even shapes: every sharded dim a multiple of its mesh factor (grid storage); uneven: one is not (blocks)
    uneven = draw(st.booleans()) and any(isinstance(p, Shard) and mesh_shape[i] > 1 for i, p in enumerate(pl))
    factor = [math.prod(mesh_shape[i] for i, p in enumerate(pl) if isinstance(p, Shard) and p.dim == d)
              for d in range(tensor_ndim)]
    shape = [f * draw(st.integers(1, 2)) for f in factor]
    if uneven:
        d = draw(st.sampled_from([d for d in range(tensor_ndim) if factor[d] > 1]))
        shape[d] += draw(st.integers(1, factor[d] - 1))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.int64]))
    dst = draw(placements(mesh, tensor_ndim))
    return mesh, pl, tuple(shape), dtype, uneven, dst, draw(st.integers(0, 2**16))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mixed_partial_case())
def test_mixed_partial_terms_reduce_outer_mesh_dim_first_everywhere(case):
    mesh, pl, shape, dtype, uneven, dst, seed = case
    spec = DTensorSpec(mesh, tuple(pl), shape, dtype)
    g = torch.Generator().manual_seed(seed)
    blocks = {}
    for coord in mesh.coordinates():  # distinct terms per device; replicas (Replicate mesh dims) share one
        home = tuple(0 if isinstance(p, Replicate) else c for c, p in zip(coord, pl))
        if home not in blocks:
            blocks[home] = torch.randint(-8, 9, spec.local_shape(home), generator=g).to(dtype)
        blocks[coord] = blocks[home]
    t = dtorch.Tensor.from_blocks([blocks[c] for c in mesh.coordinates()], device_mesh=mesh, placements=pl, shape=shape)
    if t.graph.backend == "inprocess":  # the in-process backend's two storage forms (other backends have one)
        assert (t._h.grid is None) == uneven, "the case must exercise the storage form it was drawn for"
    want = reference_from_blocks(blocks, mesh, pl, shape, dtype)
    close = dict(rtol=1e-5, atol=1e-5)  # avg over 3 terms rounds differently per (commuting) order
    torch.testing.assert_close(t.to_torch(), want, **close)
    torch.testing.assert_close((t * 1).to_torch(), want, **close)
    torch.testing.assert_close(t.redistribute(mesh, [Replicate()] * mesh.ndim).to_torch(), want, **close)
    torch.testing.assert_close(t.redistribute(mesh, dst).to_torch(), want, **close)
    torch.testing.assert_close(t.sum().to_torch(), want.sum(), **close)
    assert_untouched(t, (want, [blocks[c] for c in mesh.coordinates()], list(canonical(mesh, pl))))


def test_mixed_partial_terms_on_the_process_backend():
    # the workers run the same planner steps, and to_torch reduces the fetched terms in the same order
    from dtorch.runtime.process import ProcessRuntime

    g = dtorch.Graph(backend="process")
    g.runtime = ProcessRuntime(workers=4, timeout=60)
    try:
        with g:
            mesh = dtorch.init_device_mesh("cpu", (2, 2))
            pl = [Partial("sum"), Partial("max")]
            gen = torch.Generator().manual_seed(7)
            blocks = {c: torch.randint(-8, 9, (5, 3), generator=gen).float() for c in mesh.coordinates()}
            t = dtorch.Tensor.from_blocks([blocks[c] for c in mesh.coordinates()], device_mesh=mesh, placements=pl,
                                          shape=(5, 3))
            want = reference_from_blocks(blocks, mesh, pl, (5, 3), torch.float32)
            assert not torch.equal(want, torch.stack(list(blocks.values())).reshape(2, 2, 5, 3).amax(1).sum(0))
            for got in (t, t * 1, t.redistribute(mesh, [Replicate(), Replicate()]),
                        t.redistribute(mesh, [Partial(), Replicate()])):
                torch.testing.assert_close(got.to_torch(), want)
            torch.testing.assert_close(t.sum().to_torch(), want.sum())
    finally:
        g.runtime.shutdown()
