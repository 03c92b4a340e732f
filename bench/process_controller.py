"""The process backend's controller alone: CPU time to issue a step, with a pool that takes the batches and drops
them (no workers, so a loaded machine moves the number little); ``--workers`` also runs the Llama step on 4 real
workers.

    .venv/bin/python bench/process_controller.py
    .venv/bin/python bench/process_controller.py --workers      # + the Llama step on 4 real worker processes
    PYTHONPATH=<other checkout>/src .venv/bin/python bench/process_controller.py   # another tree, same bench

1. An op chain on a 4-device mesh (``(y @ w).relu() + x``, 20 deep, 20 times per sample): the median and minimum
   over 15 samples of process CPU time per op (issue, plan lookups, records, pickling, pushes).
2. The Llama training step of tests/compile (2 layers, hidden 64, AdamW) on dp2 x tp2, batch 4 x 16: controller
   CPU per step to issue it (median and minimum over 15 samples of 5 steps; with workers too, and also
   counting the controller's wait in the ``sync`` that ends each sample).

Each eager, under ``dtorch.compile`` replayed call by call (``DTORCH_COMPILE_PROGRAMS=0``: every op's record
made and sent, the tree before worker programs) and under ``dtorch.compile`` with worker programs (one record
per worker per step), in this one command; the last line of each part is the ratio programs / call by call.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import transformers

import dtorch
from dtorch import Replicate, Shard
from dtorch.models.llama import LlamaForCausalLM
from dtorch.runtime.process import ProcessRuntime

from compile_step import train_step  # (the same step bench/compile_step.py times; bench/ is on sys.path)

VARIANTS = (("eager", None), ("dtorch.compile, call by call", "0"), ("dtorch.compile, worker programs", "1"))


class DroppingPool:
    """Takes every batch (its bytes counted by the runtime) and runs nothing."""

    shm = None
    gen = 0

    def push(self, rank, blob):
        return len(blob)

    def check(self, *args, **kwargs):
        pass


def dropping_graph() -> tuple:
    g = dtorch.Graph(backend="process")
    rt = g.runtime = ProcessRuntime(workers=4)
    rt._pool, rt._world, rt._buf = DroppingPool(), 4, {r: [] for r in range(4)}
    dtorch.Graph.set_default_graph(g)
    return g, rt


def _compiled(fn, programs):
    if programs is None:
        return fn
    os.environ["DTORCH_COMPILE_PROGRAMS"] = programs  # read when a trace is first replayed
    return dtorch.compile(fn)


def op_chain() -> None:
    g, rt = dropping_graph()
    mesh = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"])
    rt._ready.add(mesh)
    x = dtorch.Tensor(torch.randn(64, 32), device_mesh=mesh, placements=[Shard(0)])
    w = dtorch.Tensor(torch.randn(32, 32), device_mesh=mesh, placements=[Replicate()])

    def step():
        y = x
        for _ in range(20):
            y = (y @ w).relu() + x
        return y

    medians = {}
    for name, programs in VARIANTS:
        fn = _compiled(step, programs)
        for _ in range(50):
            fn()
        per_op = []
        for _ in range(15):
            t, n = time.process_time(), rt.stats["ops"]
            for _ in range(20):
                fn()
            per_op.append((time.process_time() - t) / (rt.stats["ops"] - n) * 1e6)
        ops = (rt.stats["ops"] - n) // 20
        medians[programs] = statistics.median(per_op)
        print(f"op chain, {name}: controller CPU per op (4 workers, none running): median {medians[programs]:.2f} "
              f"us, min {min(per_op):.2f} us; {ops} ops per step: {medians[programs] * ops / 1e3:.3f} ms per step")
    print(f"op chain: worker programs / call by call (median): {medians['1'] / medians['0']:.3f}")
    rt._pool = None


def llama(rt, mesh, label: str, samples: int = 15, per_sample: int = 5) -> None:
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=160, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)

    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    medians, losses = {}, {}
    for name, programs in VARIANTS:
        model = LlamaForCausalLM(cfg, mesh)
        model.load_state_dict(hf.state_dict())
        opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
        fn = _compiled(train_step, programs)
        for _ in range(5):
            fn(model, opt, ids)
        rt.sync()
        per_step, with_sync, walls = [], [], []
        for _ in range(samples):
            t, w, n = time.process_time(), time.perf_counter(), rt.stats["ops"]
            for _ in range(per_sample):
                loss = fn(model, opt, ids)
            issued = time.process_time()
            rt.sync()
            per_step.append((issued - t) / per_sample * 1e3)
            with_sync.append((time.process_time() - t) / per_sample * 1e3)
            walls.append((time.perf_counter() - w) / per_sample * 1e3)
        ops = (rt.stats["ops"] - n) // per_sample
        medians[programs] = statistics.median(per_step)
        if rt._pool is not None and not isinstance(rt._pool, DroppingPool):
            losses[programs] = loss.to_torch()
        runs = rt.stats["program_runs"]
        waits = f", {statistics.median(with_sync):.3f} ms with the wait in sync" if losses else ""
        print(f"Llama dp2 x tp2 train step ({label}), {name}: controller CPU per step median {medians[programs]:.3f} "
              f"ms, min {min(per_step):.3f} ms{waits} (wall {statistics.median(walls):.1f} ms); {ops} ops per step; "
              f"program runs so far {runs}")
        if programs is not None:
            assert fn.stats["replays"] > 0, fn.last_reason
    if losses:
        assert all(torch.equal(v, losses["1"]) for v in losses.values()), losses  # the same steps, same bits
    print(f"Llama dp2 x tp2 train step ({label}): worker programs / call by call (median): "
          f"{medians['1'] / medians['0']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", action="store_true", help="also run the Llama step on 4 real worker processes")
    args = ap.parse_args()
    op_chain()
    g, rt = dropping_graph()
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    rt._ready.add(mesh)
    rt.sync = lambda: None
    llama(rt, mesh, "no workers running")
    rt._pool = None
    if args.workers:
        g = dtorch.Graph(backend="process")
        rt = g.runtime = ProcessRuntime(workers=4)
        dtorch.Graph.set_default_graph(g)
        mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
        try:
            llama(rt, mesh, "4 worker processes", samples=15)
        finally:
            rt.shutdown()


if __name__ == "__main__":
    main()
