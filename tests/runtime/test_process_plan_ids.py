"""The process backend's plan-id tables stay bounded when every step makes new shapes (decoding).

The controller sends each (kernel, specs) / (primitive, specs) definition to its workers once and
refers to it by id; its table of ids is an LRU, and the ids it drops are forgotten by the workers that
got them (a "forget" record, queued after every record that used them).

    .venv/bin/pytest -q tests/runtime/test_process_plan_ids.py
"""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Replicate, Shard
from dtorch._lru import LRU

from .conftest import process_graph, using

MESH = DeviceMesh("cpu", [0, 2, 1], mesh_dim_names=["a"])  # device ids out of mesh order
BOUND = 32


def value(shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_lru_reports_what_it_drops_once():
    dropped = []
    cache = LRU("test.lru_on_evict", 8, on_evict=lambda d: dropped.extend(d.items()))
    for k in range(4):
        cache[k] = k
    cache[4] = 4  # 0-3 become the old generation: nothing dropped yet
    assert dropped == []
    assert cache.get(0) == 0  # moved back to the recent generation
    cache[1] = "again"  # set while in the old generation: it moves, it is not dropped
    for k in range(5, 8):
        cache[k] = k
    assert sorted(dropped) == [(2, 2), (3, 3)]  # the old generation, less what was used again
    assert set(k for k, _ in cache.items()) == {0, 1, 4, 5, 6, 7}
    assert all(k not in cache for k, _ in dropped)
    cache.clear()
    assert sorted(dropped) == [(2, 2), (3, 3)]  # clear() drops without reporting


@pytest.fixture
def bounded(monkeypatch):
    """A process Graph of its own whose plan-id table holds ``BOUND`` entries (the shared pool's table is full
    of other tests' plans, and its workers hold their definitions)."""
    g = process_graph(workers=3)
    monkeypatch.setattr(g.runtime._plans, "maxsize", BOUND)
    yield g
    g.runtime.shutdown()


def test_decode_loop_keeps_plan_ids_bounded_on_controller_and_workers(bounded):
    proc, rt = bounded, bounded.runtime
    steps = 300
    with using(proc):
        q = value((1, 8), seed=1)
        kv_t = value((5, 8), seed=2)
        kv = dtorch.Tensor(kv_t, device_mesh=MESH, placements=[Shard(0)])
        dq = dtorch.Tensor(q, device_mesh=MESH, placements=[Replicate()])
        early, early_t = kv, kv_t
        for step in range(steps):
            new = dq * float(step + 1)  # the same shapes every step: its plan stays in the table
            kv = dtorch.cat([kv, new], dim=0).redistribute(MESH, [Shard(0)])  # a longer sequence every step
            kv_t = torch.cat([kv_t, q * float(step + 1)], dim=0)
            pooled = (kv * 0.5).sum(dim=0)
            if step % 50 == 0 or step == steps - 1:
                # a plan from the first steps: forgotten since, defined again under a fresh id
                torch.testing.assert_close((early * 3.0).to_torch(), early_t * 3.0)
                torch.testing.assert_close(pooled.to_torch(), (kv_t * 0.5).sum(dim=0))
                assert len(rt._plans) <= BOUND
                stats = rt.worker_stats()  # after the queued work, forgets included
                assert all(0 < stats[r]["defs"] <= BOUND for r in MESH.device_ids), (step, stats)
        torch.testing.assert_close(kv.to_torch(), kv_t, rtol=0, atol=0)
    assert next(rt._pid_seq) > 10 * BOUND  # the loop did make many plans: the tables dropped most
