"""The process backend's controller alone: CPU time per op to issue ops and pickle their records, with a
pool that takes the batches and drops them (no workers, so a loaded machine moves the number little).

    .venv/bin/python bench/process_controller.py
    PYTHONPATH=<other checkout>/src .venv/bin/python bench/process_controller.py   # before, same bench

Each op is a kernel on a 4-device mesh (``(y @ w).relu() + x``, 20 deep, 20 times per sample); the median
and minimum over 15 samples of process CPU time per op (issue, plan lookups, records, pickling, pushes), eager
and under ``dtorch.compile`` (the replay issues the recorded runtime calls: no rules, plans or Tensor objects).
"""
from __future__ import annotations

import statistics
import time

import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.runtime.process import ProcessRuntime


class DroppingPool:
    """Takes every batch (its bytes counted by the runtime) and runs nothing."""

    shm = None
    gen = 0

    def push(self, rank, blob):
        return len(blob)

    def check(self, *args, **kwargs):
        pass


def main() -> None:
    g = dtorch.Graph(backend="process")
    rt = g.runtime = ProcessRuntime(workers=4)
    mesh = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"])
    rt._pool, rt._world, rt._buf = DroppingPool(), 4, {r: [] for r in range(4)}
    rt._ready.add(mesh)
    dtorch.Graph.set_default_graph(g)
    x = dtorch.Tensor(torch.randn(64, 32), device_mesh=mesh, placements=[Shard(0)])
    w = dtorch.Tensor(torch.randn(32, 32), device_mesh=mesh, placements=[Replicate()])

    def step():
        y = x
        for _ in range(20):
            y = (y @ w).relu() + x
        return y

    compiled = dtorch.compile(step)
    for name, fn in (("eager", step), ("dtorch.compile", compiled)):
        for _ in range(50):
            fn()
        per_op = []
        for _ in range(15):
            t, n = time.process_time(), rt.stats["ops"]
            for _ in range(20):
                fn()
            per_op.append((time.process_time() - t) / (rt.stats["ops"] - n) * 1e6)
        ops = (rt.stats["ops"] - n) // 20
        print(f"{name}: controller CPU per op (4 workers): median {statistics.median(per_op):.2f} us, "
              f"min {min(per_op):.2f} us; {ops} ops per step: {statistics.median(per_op) * ops / 1e3:.2f} ms per "
              f"step; {rt.stats['bytes_pushed'] / rt.stats['ops']:.0f} record bytes per op")
    assert compiled.stats["replays"] > 0, compiled.last_reason
    rt._pool = None


if __name__ == "__main__":
    main()
