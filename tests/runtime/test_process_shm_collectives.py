"""Same-host all_reduce / all_gather through shared memory (``worker._Slots``) against the in-process backend.

Workers on the controller's host exchange collective terms through files in its /dev/shm directory and
reduce them in mesh order with the in-process backend's function, so every result equals the in-process
backend's bit for bit, float sums of more than two terms included. ``DTORCH_PROCESS_SHM=0`` sends them
through torch.distributed (gloo) instead; both paths are checked here.

    .venv/bin/pytest -q tests/runtime/test_process_shm_collectives.py
"""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard

from .conftest import process_graph, using

MESH_3 = DeviceMesh("cpu", [0, 2, 1], mesh_dim_names=["a"])  # group rank order != mesh order
MESH_2 = DeviceMesh("cpu", [1, 0], mesh_dim_names=["a"])
MESH_2D = DeviceMesh("cpu", [[2, 0], [3, 1]], mesh_dim_names=["a", "b"])  # every rank in two groups


@pytest.fixture(scope="module")
def shm(proc):
    """The default process Graph (conftest's ``proc``): its workers exchange through shared memory."""
    return proc


@pytest.fixture(scope="module")
def gloo():
    mp = pytest.MonkeyPatch()
    mp.setenv("DTORCH_PROCESS_SHM", "0")  # read by the workers when they start (below)
    g = process_graph(workers=4)
    with using(g):
        dtorch.Tensor(torch.zeros(4), device_mesh=MESH_2).to_torch()  # start the workers under the setting
    mp.undo()
    yield g
    g.runtime.shutdown()


@pytest.fixture(scope="module")
def ref():
    return dtorch.Graph(backend="inprocess")


def terms(n, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        if not dtype.is_floating_point:
            out.append(torch.randint(-50, 50, shape, generator=g, dtype=dtype))
        else:  # distinct magnitudes: the order of a float sum of 3 terms shows in the bits
            out.append((torch.randn(shape, generator=g) * 10 ** k).to(dtype))
    return out


def shm_calls(graph) -> int:
    return sum(s["collectives"].get("shm", 0) for s in graph.runtime.worker_stats(collectives=True).values())


def reduced(graph, blocks, mesh, placements, shape, dst):
    with using(graph):
        x = dtorch.Tensor.from_blocks(blocks, device_mesh=mesh, placements=placements, shape=shape)
        y = x.redistribute(mesh, dst)
        return y.to_torch(), y.local_blocks()


def check(graph, ref, blocks, mesh, placements, shape, dst, what):
    want, want_blocks = reduced(ref, blocks, mesh, placements, shape, dst)
    got, got_blocks = reduced(graph, blocks, mesh, placements, shape, dst)
    assert got.dtype == want.dtype and torch.equal(got, want), f"{what}: {got} != {want}"
    for b, w in zip(got_blocks, want_blocks):
        assert b.dtype == w.dtype and torch.equal(b, w), what


@pytest.mark.parametrize("mesh", [MESH_2, MESH_3], ids=["2", "3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_all_reduce_equals_the_inprocess_backend_bit_for_bit(shm, gloo, ref, mesh, dtype, op):
    blocks = terms(mesh.size(), (7, 3), dtype, seed=3)
    before = shm_calls(shm)
    check(shm, ref, blocks, mesh, [Partial(op)], (7, 3), [Replicate()], f"shm {op} {dtype}")
    assert shm_calls(shm) == before + mesh.size(), "the all_reduce did not go through shared memory"
    exact = mesh.size() <= 2 or op == "max" or not dtype.is_floating_point
    if exact:  # gloo adds 3 float terms in its own order (test_process_backend's tolerance)
        check(gloo, ref, blocks, mesh, [Partial(op)], (7, 3), [Replicate()], f"gloo {op} {dtype}")


@pytest.mark.parametrize("mesh", [MESH_2, MESH_3], ids=["2", "3"])
@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_of_uneven_shards(shm, gloo, ref, mesh, dim):
    full = torch.randn(7, 5, generator=torch.Generator().manual_seed(dim))
    for graph in (shm, gloo):
        before = shm_calls(graph)
        with using(graph):
            x = dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(dim)])
            y = x.redistribute(mesh, [Replicate()])
            got = y.to_torch()
            blocks = y.local_blocks()
        assert torch.equal(got, full) and all(torch.equal(b, full) for b in blocks)
        assert (shm_calls(graph) > before) == (graph is shm)


def test_slots_grow_and_alternate_on_a_2d_mesh(shm, ref):
    """Back-to-back collectives on both mesh dims, growing past the first slot size (64 KiB) and back:
    each reads its slots before the members rewrite them two exchanges later."""
    for n, rows in enumerate([3, 9000, 5, 40000, 7, 7, 7]):
        blocks = terms(4, (rows, 2), torch.float32, seed=n)
        check(shm, ref, blocks, MESH_2D, [Partial("sum"), Partial("sum")], (rows, 2), [Replicate(), Replicate()],
              f"rows {rows}")
        check(shm, ref, blocks, MESH_2D, [Partial("max"), Shard(0)], (rows * 2, 2), [Replicate(), Replicate()],
              f"rows {rows}, max then gather")


def test_chained_all_reduces_inside_one_batch(shm, ref):
    """Twelve collectives queued without a wait between them (the workers run them back to back): the two
    slot sets alternate, and each result is read before its slots are written again."""
    values = [terms(3, (11, 4), torch.float32, seed=20 + k) for k in range(12)]
    outs = []
    for graph in (ref, shm):
        with using(graph):
            xs = [dtorch.Tensor.from_blocks(b, device_mesh=MESH_3, placements=[Partial()], shape=(11, 4))
                  for b in values]
            ys = [x.redistribute(MESH_3, [Replicate()]) for x in xs]
            outs.append([y.to_torch() for y in ys])
    for k, (w, g) in enumerate(zip(*outs)):
        assert torch.equal(g, w), f"collective {k}"
