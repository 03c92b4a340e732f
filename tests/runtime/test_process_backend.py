"""The process backend (one worker process per device, gloo) against the in-process backend.

Redistributions move and reduce data as the in-process backend does: results are compared bit for bit,
block by block, wherever the reduction order cannot change the bits (partial terms made from a global
value are the value and zeros; two terms; max/min; integers). Float sums of more than two distinct terms
are torch.distributed's all_reduce / reduce_scatter, which add in their own order: those are compared
within a tolerance (test_float_sums_over_four_devices_are_native_collectives). Kernels run on each worker's own (contiguous) block; torch's kernels may round
differently for differently strided inputs (the in-process backend's grid and per-device paths differ
the same way), so op results are compared to the in-process backend within 1e-5 and to torch.

    .venv/bin/pytest -q tests/runtime/test_process_backend.py
"""
from __future__ import annotations

import gc
import itertools
import random
import time

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import CommLog, DeviceMesh, Partial, Replicate, Shard
from dtorch.models.layout import context_parallel

from . import process_kernels
from .conftest import process_graph, using

# device ids out of mesh order, so group ranks != mesh positions
MESH_1D = DeviceMesh("cpu", [0, 2, 1], mesh_dim_names=["a"])
MESH_2D = DeviceMesh("cpu", [[2, 0], [3, 1]], mesh_dim_names=["a", "b"])
MESH_3D = DeviceMesh("cpu", [[[1], [0]], [[3], [2]]], mesh_dim_names=["a", "b", "c"])


def value(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype)


def redistributed(graph, full, mesh, src, mesh2, dst):
    with using(graph):
        x = dtorch.Tensor(full, device_mesh=mesh, placements=list(src))
        y = x.redistribute(mesh2, list(dst))
        return y.to_torch(), y.local_blocks()


def assert_identical(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{what}: {a} != {b}"


def check_transition(proc, ref, full, mesh, src, dst, mesh2=None):
    what = f"{mesh} {list(map(str, src))} -> {mesh2 or mesh} {list(map(str, dst))} on {tuple(full.shape)}"
    want = redistributed(ref, full, mesh, src, mesh2 or mesh, dst)
    got = redistributed(proc, full, mesh, src, mesh2 or mesh, dst)
    assert_identical(got[0], want[0], what)
    assert len(got[1]) == len(want[1])
    for n, (g, w) in enumerate(zip(got[1], want[1])):
        assert_identical(g, w, f"{what}, block {n}")


def pairs(cases, n, seed):
    """``n`` (src, dst) pairs of ``cases``, a fixed random subset when there are more."""
    every = list(itertools.product(cases, cases))
    return random.Random(seed).sample(every, min(n, len(every)))


def options(ndim, partial=("sum",)):
    return [Replicate()] + [Shard(d) for d in range(ndim)] + [Partial(op) for op in partial]


@pytest.mark.parametrize("mesh", [MESH_1D, MESH_2D], ids=["1d", "2d"])
@pytest.mark.parametrize("shape", [(5, 3), (2, 7)])
def test_every_transition_is_bit_identical(proc, ref, mesh, shape):
    full = value(shape)
    cases = list(itertools.product(options(len(shape)), repeat=mesh.ndim))
    for src, dst in itertools.product(cases, cases):
        check_transition(proc, ref, full, mesh, src, dst)


@pytest.mark.parametrize("op", ["avg", "max", "min"])
def test_partial_reduce_ops(proc, ref, op):
    full = value((5, 3))
    for mesh in (MESH_1D, MESH_2D):
        cases = list(itertools.product(options(2, ("sum", op)), repeat=mesh.ndim))
        for src, dst in pairs(cases, 40, op):
            check_transition(proc, ref, full, mesh, src, dst)


def test_3d_mesh_with_a_size_one_dim(proc, ref):
    full = value((4, 5, 3))
    cases = list(itertools.product(options(3, ("sum", "max")), repeat=3))
    for src, dst in pairs(cases, 60, 3):
        check_transition(proc, ref, full, MESH_3D, src, dst)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(proc, ref, dtype):
    full = value((5, 3), dtype)
    partial = () if dtype == torch.bool else ("sum", "avg", "max")
    cases = list(itertools.product(options(2, partial), repeat=2))
    for src, dst in random.Random(str(dtype)).sample(list(itertools.product(cases, cases)), 30):
        check_transition(proc, ref, full, MESH_2D, src, dst)


@pytest.mark.parametrize("shape", [(), (0, 3), (1,), (3, 0)])
def test_scalars_and_empty_tensors(proc, ref, shape):
    full = value(shape)
    cases = list(itertools.product(options(len(shape)), repeat=2))
    for src, dst in itertools.product(cases, cases):
        check_transition(proc, ref, full, MESH_2D, src, dst)


MOVES = [
    # same layout: device k hands its block to device k of the other mesh
    (MESH_2D, [Shard(0), Partial()], DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["a", "b"]),
     [Shard(0), Partial()]),
    (DeviceMesh("cpu", [0, 1]), [Shard(1)], DeviceMesh("cpu", [2, 3]), [Shard(1)]),
    # different layouts: overlapping regions, one replica each
    (DeviceMesh("cpu", [0, 1]), [Shard(0)], MESH_2D, [Shard(1), Replicate()]),
    (MESH_2D, [Shard(0), Shard(1)], MESH_1D, [Shard(1)]),
    (MESH_2D, [Partial(), Shard(0)], DeviceMesh("cpu", [3, 2]), [Replicate()]),
    (MESH_1D, [Replicate()], DeviceMesh("cpu", [[1, 3]]), [Partial("max"), Shard(0)]),
    (MESH_1D, [Shard(0)], MESH_3D, [Shard(1), Shard(0), Replicate()]),
    (MESH_3D, [Shard(0), Replicate(), Shard(0)], DeviceMesh("cpu", [3]), [Replicate()]),
]


@pytest.mark.parametrize("src_mesh,src,dst_mesh,dst", MOVES)
@pytest.mark.parametrize("shape", [(5, 3), (2, 7)])
def test_moves_between_meshes(proc, ref, src_mesh, src, dst_mesh, dst, shape):
    check_transition(proc, ref, value(shape), src_mesh, src, dst, dst_mesh)


def test_pipeline_hand_off_is_one_send_recv_on_pp(proc, ref):
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "tp"])
    s0, s1 = mesh.unbind("pp")
    full = value((3, 5))
    logs = []
    for g in (ref, proc):
        with using(g), CommLog() as log:
            x = dtorch.Tensor(full, device_mesh=s0, placements=[Shard(1)])
            y = x.redistribute(s1, [Shard(1)])
            assert_identical(y.to_torch(), full, "hand-off")
        logs.append((log.counts(), log.bytes()))
    assert logs[0] == logs[1] == ({("send_recv", "pp"): 1}, {("send_recv", "pp"): full.numel() * 4})


def test_commlog_matches_inprocess(proc, ref):
    full = value((5, 4))
    logs = []
    for g in (ref, proc):
        with using(g), CommLog() as log:
            x = dtorch.Tensor(full, device_mesh=MESH_2D, placements=[Partial(), Shard(0)])
            x.redistribute(MESH_2D, [Shard(1), Replicate()]).redistribute(MESH_1D, [Shard(0)])
        logs.append((log.counts(), log.bytes()))
    assert logs[0] == logs[1] and logs[0][0]


@pytest.mark.parametrize("mesh_dim,shift", [(0, 1), (1, 1), (0, -1), (1, 3)])
def test_ring_shift(proc, ref, mesh_dim, shift):
    mesh = DeviceMesh("cpu", [[2, 0, 1], [3, 5, 4]], mesh_dim_names=["a", "ring"])
    full = value((4, 7))
    blocks = []
    for g in (ref, proc):
        with using(g):
            x = dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(0), Shard(1)])
            h = g.runtime.ring_shift(x._h, x.spec, mesh_dim, shift)
            blocks.append(g.runtime.local_blocks(h, x.spec))
    for n, (a, b) in enumerate(zip(*blocks)):
        assert_identical(b, a, f"block {n}")


def test_one_commlog_record_per_step_like_inprocess(proc, ref):
    # a plan with collectives and local steps: one record per communicating step, on both backends
    from dtorch.redistribute import plan_redistribute

    full = value((5, 4))
    src = [Partial(), Shard(0)]
    dst = [Shard(1), Partial("max")]
    logs = []
    for g in (ref, proc):
        with using(g):
            x = dtorch.Tensor(full, device_mesh=MESH_2D, placements=src)
            plan = plan_redistribute(x.spec, x.spec.with_placements(tuple(dst)))
            with CommLog() as log:
                y = x.redistribute(MESH_2D, dst)
            assert_identical(y.to_torch(), full, "value")
        logs.append([(r.kind, r.mesh_dim, r.nbytes) for r in log.records])
    befores = (x.spec,) + plan.specs[:-1]
    want = [(st.kind, st.label, b.total_bytes()) for st, b in zip(plan.steps, befores) if st.communicates]
    assert len(want) >= 2 and len(want) < len(plan.steps), str(plan)
    assert logs[0] == logs[1] == want


def _terms(mesh, shape, dtype, seed):
    """Distinct partial terms per device (the sum of more than two: the order matters in floating point)."""
    return [value(shape, dtype, seed=seed * 100 + n) * (1 + n) for n in range(mesh.size())]


# Float sums of m > 2 distinct terms: the process backend runs torch.distributed's all_reduce /
# reduce_scatter (half floats accumulate in float32), which adds the terms in the collective's order; the
# in-process backend adds them in mesh order. Both round once per addition, so they may differ by a few
# units in the last place of the partial sums: compared with torch.testing's default tolerance for the
# dtype (float32: rtol 1.3e-6, atol 1e-5; bfloat16: rtol 1.6e-2, atol 1e-5) after scaling atol by the
# terms' magnitude (cancellation makes a small sum of large terms). max/min and integers are exact.
def _close(got, want, terms):
    scale = max(float(t.abs().max()) for t in terms) if terms[0].numel() else 1.0
    atol = {torch.bfloat16: 1e-2, torch.float16: 1e-3}.get(want.dtype, 1e-6) * len(terms) * scale
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_float_sums_over_four_devices_are_native_collectives(proc, ref, dtype, op):
    mesh = DeviceMesh("cpu", [3, 1, 0, 2], mesh_dim_names=["x"])  # 4 terms, group rank order != mesh order
    terms = _terms(mesh, (7, 3), dtype, seed=11)
    exact = op == "max" or not dtype.is_floating_point
    for dst, collective in (([Replicate()], "all_reduce"), ([Shard(0)], "reduce_scatter")):
        outs = []
        for g in (ref, proc):
            with using(g):
                x = dtorch.Tensor.from_blocks(terms, device_mesh=mesh, placements=[Partial(op)], shape=(7, 3))
                if g is proc:
                    before = g.runtime.worker_stats(collectives=True)
                y = x.redistribute(mesh, dst)
                outs.append((y.to_torch(), y.local_blocks()))
                if g is proc:  # a real collective, not all_gather + a local reduction
                    after = g.runtime.worker_stats(collectives=True)
                    for r in mesh.device_ids:
                        calls = {k: after[r]["collectives"].get(k, 0) - before[r]["collectives"].get(k, 0)
                                 for k in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")}
                        assert calls == {**dict.fromkeys(calls, 0), collective: 1}, (r, calls)
        (want, want_blocks), (got, got_blocks) = outs
        if exact:
            assert_identical(got, want, f"{op} {dtype} -> {dst}")
        else:
            _close(got, want, terms)
        for b, w in zip(got_blocks, want_blocks):  # replicas equal, blocks where local_box says
            assert b.shape == w.shape and b.dtype == w.dtype
        if dst == [Replicate()]:
            assert all(torch.equal(b, got_blocks[0]) for b in got_blocks), "replicas differ"
    # the reference: the reduction in float64 of the same terms
    stacked = torch.stack([t.double() for t in terms])
    ref64 = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0)}[op]
    if dtype.is_floating_point:
        _close(got.double(), ref64.to(dtype).double(), terms)


def test_groups_with_different_rank_orders_keep_replicas_equal():
    # [[0, 1, 2], [5, 3, 4]]: mesh dim 1's groups rank their members in different orders, so a native sum
    # would add the same (replicated) terms in different orders per row; the workers gather instead
    from dtorch.runtime.process_plan import same_rank_order

    assert same_rank_order(DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]]), 1)
    assert not same_rank_order(DeviceMesh("cpu", [[0, 1, 2], [5, 3, 4]]), 1)
    assert same_rank_order(DeviceMesh("cpu", [[0, 1, 2], [5, 3, 4]]), 0)  # groups of two: (0, 5), (1, 3), (2, 4)
    assert same_rank_order(MESH_1D, 0) and same_rank_order(MESH_2D, 0) and same_rank_order(MESH_2D, 1)


# -- operators ------------------------------------------------------------------------------------

A = value((5, 6, 4), seed=1)
B = value((6, 4), seed=2)
W = value((3, 4), seed=3)
Q, K, V = (value((2, 4, 6, 8), seed=s) for s in (4, 5, 6))

OPS = [
    ("add broadcast", lambda a, b: a + b, lambda a, b: a + b, [A, B]),
    ("mul scalar, where", lambda a: dtorch.where(a > 0, a * 2.5, -a), lambda a: torch.where(a > 0, a * 2.5, -a), [A]),
    ("silu, cast", lambda a: F.silu(a).to(torch.float64), lambda a: F.silu(a).to(torch.float64), [A]),
    ("sum over dims", lambda a: a.sum(1), lambda a: a.sum(1), [A]),
    ("mean keepdim", lambda a: a.mean(-1, keepdim=True), lambda a: a.mean(-1, keepdim=True), [A]),
    ("amax", lambda a: a.amax(0), lambda a: a.amax(0), [A]),
    ("softmax", lambda a: a.softmax(-1), lambda a: a.softmax(-1), [A]),
    ("reshape, transpose", lambda a: a.reshape(5, 24).transpose(0, 1), lambda a: a.reshape(5, 24).transpose(0, 1), [A]),
    ("getitem, cat", lambda a: dtorch.cat([a[1:4], a[:2]], 0), lambda a: torch.cat([a[1:4], a[:2]], 0), [A]),
    ("getitem ints (strided one-element blocks)", lambda a: a[:, -1, 1], lambda a: a[:, -1, 1], [A]),
    ("matmul", lambda a, w: a @ w.transpose(0, 1), lambda a, w: a @ w.transpose(0, 1), [A, W]),
    ("linear", lambda a, w: F.linear(a, w), lambda a, w: F.linear(a, w), [A, W]),
    ("rms_norm", lambda a: F.rms_norm(a, (4,)), lambda a: F.rms_norm(a, (4,)), [A]),
    ("sdpa causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [Q, K, V]),
]


def op_cases(inputs, mesh, n, seed):
    per = [list(itertools.product(options(x.ndim, ("sum",)), repeat=mesh.ndim)) for x in inputs]
    combos = list(itertools.product(*per))
    return random.Random(seed).sample(combos, min(n, len(combos)))


@pytest.mark.parametrize("name,dt_fn,torch_fn,inputs", OPS, ids=[o[0] for o in OPS])
def test_ops_match_inprocess_and_torch(proc, ref, name, dt_fn, torch_fn, inputs):
    expected = torch_fn(*inputs)
    for mesh in (MESH_1D, MESH_2D):
        for combo in op_cases(inputs, mesh, 8, name):
            outs = []
            for g in (ref, proc):
                with using(g):
                    dts = [dtorch.Tensor(x, device_mesh=mesh, placements=list(p)) for x, p in zip(inputs, combo)]
                    out = dt_fn(*dts)
                    outs.append((out.placements, out.to_torch()))
                    for d, x, p in zip(dts, inputs, combo):
                        assert d.placements == list(p) and torch.equal(d.to_torch(), x), f"{name} changed an input"
            (p_ref, want), (p_got, got) = outs
            assert p_got == p_ref, f"{name} on {combo}: placements {p_got} != in-process {p_ref}"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} on {combo}: {m}")
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} on {combo}: {m}")


@pytest.mark.parametrize("cp", ["ring_cp", "ulysess_cp"])
def test_context_parallel_attention(proc, ref, cp):
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=[cp])
    expected = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
    outs = []
    for g in (ref, proc):
        with using(g), CommLog() as log:
            q, k, v = (dtorch.Tensor(x, device_mesh=mesh, placements=[Shard(2)]) for x in (Q, K, V))
            out = dtorch.scaled_dot_product_attention(q, k, v, is_causal=True, context_parallel=context_parallel(mesh))
            outs.append((out.to_torch(), log.counts()))
    assert outs[0][1] == outs[1][1] == {("send_recv" if cp == "ring_cp" else "all_to_all", cp): 2 if cp == "ring_cp" else 4}
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1][0], expected, rtol=1e-4, atol=1e-5)


def test_byte_views_of_strided_blocks():
    from dtorch.runtime.process_plan import as_bytes, from_bytes

    x = torch.arange(24.0).reshape(2, 3, 4)
    for t in (x[:, 1], x[1, 2, 2:3], x[0, 0], x.transpose(0, 2), x[:, :1, -1], x[1, 1, 1], torch.empty(0, 3)):
        assert torch.equal(from_bytes(as_bytes(t), t.dtype, t.shape), t)


def test_blobs_of_strided_blocks_of_every_dtype():
    """``to_blob`` (small blocks inside records: numpy's bytes where numpy has the dtype) gives as_bytes's bytes."""
    from dtorch.runtime.process_plan import as_bytes, from_blob, to_blob

    x = torch.arange(24.0).reshape(2, 3, 4)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.int64,
                  torch.int8, torch.uint8, torch.bool):
        y = x.to(dtype)
        for t in (y[:, 1], y[1, 2, 2:3], y[0, 0], y.transpose(0, 2), y[:, :1, -1], y[1, 1, 1], y[0, :1, :1].expand(3, 5),
                  torch.empty(0, 3, dtype=dtype)):
            blob = to_blob(t)
            assert blob == as_bytes(t.contiguous()).numpy().tobytes()
            assert torch.equal(from_blob(blob, dtype, t.shape), t)
    w = torch.randn(3, 4, requires_grad=True)
    assert torch.equal(from_blob(to_blob(w.t()), w.dtype, (4, 3)), w.detach().t())


def test_placement_sweep_on_the_process_backend(proc):
    from promises import mul, reduction
    from sweep import run_sweep

    with using(proc):
        assert run_sweep(dtorch.mul, torch.mul, [A, B], limit=12, placements=mul) > 0
        assert run_sweep(lambda a: a.sum(-1), lambda a: a.sum(-1), [A], limit=12,
                         placements=lambda m, a: reduction(m, a, "sum", -1)) > 0


# -- execution model ------------------------------------------------------------------------------


def test_records_are_batched_and_the_controller_does_not_wait(proc):
    from dtorch.runtime.kernels import get_kernel

    rt = proc.runtime
    with using(proc):
        x = dtorch.Tensor(torch.arange(16.0).reshape(4, 4), device_mesh=MESH_2D, placements=[Shard(0), Shard(1)])
        proc.sync()
        before = dict(rt.stats)
        t0 = time.perf_counter()
        y = x
        for _ in range(6):  # 6 x 0.25 s of work on every worker
            y = process_kernels.run(proc, get_kernel("test_sleep"), y, seconds=0.25)
        for _ in range(200):
            y = y + 1
        issued = time.perf_counter() - t0
        proc.sync()
        waited = time.perf_counter() - t0
        assert issued < 0.8 < 1.4 < waited, (issued, waited)
        assert torch.equal(y.to_torch(), x.to_torch() + 200)
    ops = rt.stats["ops"] - before["ops"]
    flushes = rt.stats["flushes"] - before["flushes"]
    assert ops >= 206 and flushes <= ops // 10, (ops, flushes)


def test_to_torch_async(proc):
    with using(proc):
        full = value((6, 5))
        x = dtorch.Tensor(full, device_mesh=MESH_1D, placements=[Partial()])
        futures = [(x * n).to_torch_async() for n in range(1, 4)]
        for n, f in enumerate(futures, 1):
            torch.testing.assert_close(f.get(timeout=30), full * n)
            assert f.is_ready()


def test_device_args_reach_each_device(proc):
    import numpy as np
    from dtorch.runtime.kernels import get_kernel

    with using(proc):
        x = dtorch.Tensor(torch.zeros(2, 2), device_mesh=MESH_2D, placements=[Shard(0), Shard(1)])
        y = process_kernels.run(proc, get_kernel("test_add_rank"), x,
                                device_args={"value": np.arange(4.0).reshape(2, 2)})
        assert [b.item() for b in y.local_blocks()] == [0.0, 1.0, 2.0, 3.0]


def test_blocks_are_freed_when_tensors_die(proc):
    rt = proc.runtime
    with using(proc):
        gc.collect()

        def held():  # blocks and their bytes (plan definitions are made along the way and stay)
            return {r: (s["blocks"], s["bytes"]) for r, s in rt.worker_stats().items()}

        base = held()
        xs = [dtorch.Tensor(value((8, 8)), device_mesh=MESH_2D, placements=[Shard(0), Replicate()]) for _ in range(5)]
        ys = [x.redistribute(MESH_2D, [Replicate(), Shard(1)]) * 2 for x in xs]
        grown = held()
        assert all(grown[r][0] >= base[r][0] + 10 for r in MESH_2D.device_ids)
        del xs, ys
        gc.collect()
        assert held() == base


def test_large_values_and_large_batches(proc):
    with using(proc):
        full = value((1100, 1100))  # 4.8 MB: chunked through the store, one copy for both replicas
        x = dtorch.Tensor(full, device_mesh=DeviceMesh("cpu", [1, 3]), placements=[Replicate()])
        assert_identical(x.to_torch(), full, "large replicated value")
        y = dtorch.Tensor(full, device_mesh=MESH_2D, placements=[Shard(1), Partial()])
        assert_identical(y.redistribute(MESH_2D, [Replicate(), Replicate()]).to_torch(), full, "large partial")
    big = torch.arange(2_000_000.0)  # an 8 MB kernel argument: the batch goes to the store by key
    with using(proc):
        z = process_kernels.run(proc, process_kernels.get_kernel("test_add_const"), x, const=big)
        assert_identical(z.to_torch(), full + big[:1100], "big batch")


def test_pool_grows_and_keeps_blocks(ref):
    g = process_graph()
    try:
        with using(g):
            small = DeviceMesh("cpu", [0, 1])
            x = dtorch.Tensor(value((5, 3)), device_mesh=small, placements=[Shard(0)])
            assert g.runtime._world == 2
            y = x.redistribute(MESH_1D, [Shard(1)])  # needs device 2: a third worker joins
            assert g.runtime._world == 3
            assert_identical(x.to_torch(), value((5, 3)), "block kept across the re-formed group")
            assert_identical(y.to_torch(), value((5, 3)), "moved onto the grown pool")
            both = y + x.redistribute(MESH_1D, [Partial()])
            assert_identical(both.to_torch(), 2 * value((5, 3)), "ops after growing")
    finally:
        g.runtime.shutdown()


def test_simulated_cuda_mesh():
    from dtorch.runtime.devices import DeviceConfig

    g = process_graph()
    g.runtime.config = DeviceConfig(same_device=True, num_simulated_gpus=4)
    try:
        with using(g):
            mesh = dtorch.init_device_mesh("cuda", (2,), mesh_dim_names=["tp"])
            x = dtorch.Tensor(value((3, 4)), device_mesh=mesh, placements=[Shard(1)])
            assert_identical((x * 2).redistribute(mesh, [Replicate()]).to_torch(), value((3, 4)) * 2, "cuda mesh")
            with pytest.raises(dtorch.DeviceUnavailableError, match="simulated"):
                dtorch.Tensor(value((3, 4)), device_mesh=dtorch.init_device_mesh("cuda", (6,)))
    finally:
        g.runtime.shutdown()


def test_meshes_larger_than_the_worker_limit_are_refused():
    g = process_graph(max_workers=8)
    refused = r"needs 9 worker processes.*DTORCH_PROCESS_MAX_WORKERS"
    with using(g), pytest.raises(dtorch.DeviceUnavailableError, match=refused):
        dtorch.Tensor(torch.ones(3), device_mesh=DeviceMesh("cpu", [0, 8]))
    assert g.runtime._pool is None  # refused before starting anything


@pytest.mark.slow
def test_operator_suites_on_the_process_backend():
    """The operator, nn, tensor and graph test files, unchanged, with DTORCH_BACKEND=process (~4 minutes).

    (tests/test_redistribute.py is left out: its hypothesis meshes name device ids up to 36, i.e. 37
    worker processes; test_every_transition_is_bit_identical above covers its transitions.)
    """
    import faulthandler
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = [f"tests/ops/{n}" for n in ("test_pointwise.py", "test_view.py", "test_reduce.py", "test_matrix.py",
                                        "test_nn_ops.py", "test_attention.py")] + ["tests/nn", "tests/test_tensor.py",
                                                                                   "tests/test_graph.py"]
    env = dict(os.environ, DTORCH_BACKEND="process", DTORCH_PROCESS_WORKERS="4", DTORCH_PROCESS_TIMEOUT="60")
    faulthandler.dump_traceback_later(960, exit=True)  # longer than the per-test guard; the run has its own
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *files], cwd=repo,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_tensors_of_two_graphs_never_meet(proc, ref):
    """Each process Graph has its own workers and handle ids: an op over tensors of two Graphs raises
    (it used to read one Graph's handle ids on the other's workers: x + y gave 2x). Torch operands join
    the Graph of the op's dtorch operands; two in-process Graphs share storage and may mix."""
    one = DeviceMesh("cpu", [0])
    xs, ys = torch.arange(4.0), torch.ones(4)
    other = process_graph(workers=1)
    try:
        with using(proc):
            x = dtorch.Tensor(xs, device_mesh=one)
        with using(other):
            y = dtorch.Tensor(ys, device_mesh=one)
        mixed = (r"dtorch\.{op}: input #0 belongs to Graph #\d+ \(backend '{a}'.*\) but input #1 to Graph #\d+ "
                 r"\(backend '{b}'.*with g:.*set_default_graph\(g\).*dtorch\.Tensor\(y\.to_torch\(\)")
        for fn, op in ((lambda: x + y, "add"), (lambda: y + x, "add"), (lambda: x * y, "mul")):
            with pytest.raises(dtorch.OpError, match=mixed.format(op=op, a="process", b="process")):
                fn()
        with using(ref):
            z = dtorch.Tensor(ys, device_mesh=one)
            with pytest.raises(dtorch.OpError, match=mixed.format(op="add", a="process", b="inprocess")):
                x + z
            with pytest.raises(dtorch.OpError, match=mixed.format(op="add", a="inprocess", b="process")):
                z + x
            torch.testing.assert_close((x + ys).to_torch(), xs + ys)  # in x's Graph, not this thread's default
        with using(proc):  # the copy the message suggests
            y2 = dtorch.Tensor(y.to_torch(), device_mesh=y.device_mesh, placements=y.placements)
            torch.testing.assert_close((x * y2).to_torch(), xs * ys)
        # context-parallel attention runs its ring outside the generic dispatch: checked too
        cp = DeviceMesh("cpu", [0, 1], mesh_dim_names=["ring_cp"])
        q = value((1, 1, 4, 2))
        with using(proc):
            qp = dtorch.Tensor(q, device_mesh=cp, placements=[Shard(2)])
        with using(ref):
            qr = dtorch.Tensor(q, device_mesh=cp, placements=[Shard(2)])
        with pytest.raises(dtorch.OpError, match=mixed.format(op="scaled_dot_product_attention", a="process",
                                                               b="inprocess")):
            F.scaled_dot_product_attention(qp, qr, qr)
    finally:
        other.runtime.shutdown()
    mesh = DeviceMesh("cpu", [0, 1])
    with using(ref):
        a = dtorch.Tensor(xs, device_mesh=mesh, placements=[Shard(0)])
    with using(dtorch.Graph(backend="inprocess")):
        b = dtorch.Tensor(ys, device_mesh=mesh, placements=[Shard(0)])
    torch.testing.assert_close((a + b).to_torch(), xs + ys)
    torch.testing.assert_close((b * a).to_torch(), ys * xs)


def test_graph_as_context_manager_doc_snippet(ref):
    """The snippet in docs/process-backend.md runs as written; ``with graph:`` restores the default."""
    import os
    import re

    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "process-backend.md")
    with open(doc) as f:
        snippets = [s for s in re.findall(r"```python\n(.*?)```", f.read(), re.S) if "with dtorch.Graph(" in s]
    assert len(snippets) == 1
    with using(ref):
        ns: dict = {}
        try:
            exec(compile(snippets[0], "docs/process-backend.md", "exec"), ns)
            assert ns["graph"].backend == "process" and ns["y"].graph is ns["graph"]
            assert dtorch.Graph.default_graph() is ref
            with ns["graph"] as g:  # nested: the inner one wins, each exit restores the previous
                assert g is ns["graph"] and dtorch.Graph.default_graph() is g
                with ref:
                    assert dtorch.Graph.default_graph() is ref
                assert dtorch.Graph.default_graph() is g
            assert dtorch.Graph.default_graph() is ref
        finally:
            if "graph" in ns:
                ns["graph"].runtime.shutdown()


@pytest.mark.parametrize("shape", [(8, 4), (7, 3)])
def test_in_place_writes_and_copy_on_write_on_the_workers(proc, shape):
    mesh = dtorch.init_device_mesh("cpu", (2, 2))
    full = torch.randn(shape)
    with using(proc):
        x = dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(0), Replicate()])
        c = x.clone()  # an alias on the workers: the write below must copy first there
        handle = x._h
        x.add_(torch.ones(shape[-1]))
        x.mul_(2.0)
        x += 1
        assert x._h is handle  # written under the same block ids
        torch.testing.assert_close(x.to_torch(), (full + 1) * 2 + 1)
        torch.testing.assert_close(c.to_torch(), full)
        p = dtorch.Tensor(full, device_mesh=mesh, placements=[Partial(), Shard(1)])
        p.exp_()  # not linear: computed out of place, laid out like p again
        assert p.placements == [Partial(), Shard(1)]
        torch.testing.assert_close(p.to_torch(), full.exp())
        x.copy_(torch.arange(shape[-1], dtype=torch.float64))
        assert torch.equal(x.to_torch(), torch.arange(shape[-1], dtype=torch.float32).expand(shape))


def test_an_empty_strided_block_is_fetched(proc):
    # a column of a [5, 3] tensor sharded 2,2,1,0 over 4 devices: device 3's block is empty with stride 3
    mesh = dtorch.init_device_mesh("cpu", (4,))
    full = torch.arange(15.0).reshape(5, 3)
    with using(proc):
        x = dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(0)])
        col = x.unbind(1)[1]
        assert torch.equal(col.to_torch(), full[:, 1])
        assert [tuple(b.shape) for b in col.local_blocks()] == [(2,), (2,), (1,), (0,)]


def test_pooling_with_an_empty_output_shard_and_a_refused_shape(proc):
    # max_pool2d(k=3, s=2, ceil_mode=True) on H=3 over 2: the second device has no output row. Its empty window
    # used to reach the workers, where torch refused it and stopped every worker; a shape torch refuses fails in
    # the plan, on the controller, and the user's other tensors stay usable
    mesh = dtorch.init_device_mesh("cpu", (2,))
    full = torch.randn(2, 3, 3, 5)
    with using(proc):
        x = dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(2)])
        other = dtorch.Tensor(torch.arange(6.0), device_mesh=mesh, placements=[Shard(0)]) * 2
        torch.testing.assert_close(F.max_pool2d(x, 3, 2, ceil_mode=True).to_torch(),
                                   F.max_pool2d(full, 3, 2, ceil_mode=True))
        with pytest.raises(dtorch.OpError, match="max_pool2d"):
            F.max_pool2d(x, 7)
        torch.testing.assert_close(F.max_pool2d(x, 2, 1, 1).to_torch(), F.max_pool2d(full, 2, 1, 1))
        assert torch.equal(other.to_torch(), torch.arange(6.0) * 2)
