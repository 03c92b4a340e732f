"""What ``replace`` recovery would save by keeping the surviving workers (issue 27), and where a pool's start goes.

Today a lost worker stops every worker and ``replace`` starts a whole new pool. Keeping the survivors would start
one worker and re-form the process groups instead. This times, on the process backend, in alternating rounds:

- fresh N: a new pool of N workers (forked from the zygote, joined, each with its data pair to the controller)
  and a first op on all of them, as after a fault;
- N-1 + 1: N-1 running workers take one new worker: every worker re-joins a new process-group generation (what
  keeping the survivors would still have to do), and a first op on all N;
- store connects: new client connections to a TCPStore (``clone``), as each worker and each data pair makes
  several at a pool start; those over 1 s are counted (c10d's connect looks up the peer's name: where the
  resolver drops a query, the connect waits out its 5 s timeout).

    .venv/bin/python bench/pool_restart.py [--workers 8] [--rounds 5] [--connects 80]
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import torch.distributed as dist

import dtorch


def first_op(n: int) -> None:
    mesh = dtorch.init_device_mesh("cpu", (n,))
    dtorch.Tensor(torch.ones(4), device_mesh=mesh).to_torch()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connects", type=int, default=80)
    args = ap.parse_args()
    n = args.workers
    graph = dtorch.Graph(backend="process")
    dtorch.Graph.set_default_graph(graph)
    rt = graph.runtime
    fresh, grow = [], []
    try:
        for _ in range(args.rounds):
            rt.min_workers = n
            rt._teardown("bench: a fresh pool")
            t0 = time.perf_counter()
            first_op(n)
            fresh.append(time.perf_counter() - t0)
            rt.min_workers = n - 1
            rt._teardown("bench: a pool of n-1")
            first_op(n - 1)
            t0 = time.perf_counter()
            first_op(n)  # (grows the running pool by one: every worker re-joins)
            grow.append(time.perf_counter() - t0)
    finally:
        rt.shutdown()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    connects = []
    for _ in range(args.connects):
        t0 = time.perf_counter()
        store.clone()
        connects.append(time.perf_counter() - t0)
    slow = [c for c in connects if c > 1.0]

    def show(xs):
        return f"median {statistics.median(xs):.2f} s  ({', '.join(f'{x:.2f}' for x in xs)})"

    print(f"fresh {n}:        {show(fresh)}")
    print(f"{n - 1} + 1 re-join:  {show(grow)}")
    print(f"ratio fresh / re-join (medians): {statistics.median(fresh) / statistics.median(grow):.1f}")
    print(f"store connects: {len(slow)} of {len(connects)} over 1 s ({', '.join(f'{c:.2f}' for c in slow)}); "
          f"median {statistics.median(connects) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
