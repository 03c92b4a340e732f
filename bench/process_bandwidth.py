"""Fetch/place bandwidth of the process backend: a large tensor to 2 workers and back, through shared
memory (workers on this host, the default) and through the TCPStore (``DTORCH_PROCESS_SHM=0``, and
workers on other hosts), in one command on the same pool of workers.

    .venv/bin/python bench/process_bandwidth.py            # 256 MB, 5 iterations
    .venv/bin/python bench/process_bandwidth.py --mb 64 --iters 3

Place: the runtime's ``from_global`` then ``sync`` (the workers hold their blocks); fetch: its
``to_global``. That is what ``dtorch.Tensor(x, ...)`` and ``to_torch()`` do after ``dtorch.Tensor``'s own
copy of the user's tensor (about 2 GB/s on the bench machine, the same for both paths). MB/s counts the global tensor's bytes (a Shard(0) layout: each worker holds half; Replicate: the
controller writes one copy that both workers map). Median over the iterations; the values are checked
against the source tensor.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import dtorch
from dtorch import DeviceMesh, Replicate, Shard
from dtorch.runtime.process import ProcessRuntime


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="tensor size in MB (float32)")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args(argv)
    g = dtorch.Graph(backend="process")
    g.runtime = rt = ProcessRuntime(workers=2, timeout=120)
    dtorch.Graph.set_default_graph(g)
    mesh = DeviceMesh("cpu", [0, 1])
    x = torch.randn((args.mb << 20) // 4)
    mb = x.numel() * 4 / 1e6
    dtorch.Tensor(torch.zeros(4), device_mesh=mesh, placements=[Replicate()]).to_torch()  # start the workers
    try:
        for layout in ([Shard(0)], [Replicate()]):
            rates = {}
            for path, shm in (("shm", True), ("store", False)):
                rt.shm = shm
                place, fetch = [], []
                spec = dtorch.Tensor(torch.zeros(x.shape), device_mesh=mesh, placements=layout)._spec
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    h = rt.from_global(x, spec)
                    rt.sync()
                    t1 = time.perf_counter()
                    y = rt.to_global(h, spec)
                    t2 = time.perf_counter()
                    if not torch.equal(x, y):
                        raise SystemExit(f"{path} {layout}: the fetched tensor differs from the placed one")
                    place.append(mb / (t1 - t0))
                    fetch.append(mb / (t2 - t1))
                    del h, y
                rates[path] = (statistics.median(place), statistics.median(fetch))
            (sp, sf), (tp, tf) = rates["shm"], rates["store"]
            print(f"{mb:.0f} MB {layout[0]!s:<12} place: shm {sp:6.0f} MB/s  store {tp:5.0f} MB/s  ({sp / tp:4.1f}x)   "
                  f"fetch: shm {sf:6.0f} MB/s  store {tf:5.0f} MB/s  ({sf / tf:4.1f}x)", flush=True)
        print(f"stats: {rt.stats}")
    finally:
        rt.shutdown()


if __name__ == "__main__":
    main()
