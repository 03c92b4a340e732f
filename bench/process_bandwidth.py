"""Fetch/place bandwidth of the process backend: a large tensor to 2 workers and back, through shared
memory (workers on this host, the default) and through torch.distributed (each worker's gloo pair with
the controller: ``DTORCH_PROCESS_SHM=0``, and workers on other hosts), in one command on the same pool
of workers; with ``--ray``, the ray backend through Ray's object store too.

    .venv/bin/python bench/process_bandwidth.py            # 256 MB, 5 iterations
    .venv/bin/python bench/process_bandwidth.py --mb 64 --iters 3
    .venv/bin/python bench/process_bandwidth.py --ray      # and the ray backend (Ray's object store)

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


def measure(rt, x: torch.Tensor, spec, iters: int) -> tuple[float, float]:
    """Median (place, fetch) MB/s of ``x`` laid out as ``spec`` through the runtime ``rt``."""
    mb = x.numel() * 4 / 1e6
    place, fetch = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        h = rt.from_global(x, spec)
        rt.sync()
        t1 = time.perf_counter()
        y = rt.to_global(h, spec)
        t2 = time.perf_counter()
        if not torch.equal(x, y):
            raise SystemExit(f"{rt.name} {spec}: the fetched tensor differs from the placed one")
        place.append(mb / (t1 - t0))
        fetch.append(mb / (t2 - t1))
        del h, y
    return statistics.median(place), statistics.median(fetch)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="tensor size in MB (float32)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ray", action="store_true", help="also the ray backend (Ray's object store), 2 device actors")
    args = ap.parse_args(argv)
    g = dtorch.Graph(backend="process")
    g.runtime = rt = ProcessRuntime(workers=2, timeout=120)
    dtorch.Graph.set_default_graph(g)
    mesh = DeviceMesh("cpu", [0, 1])
    x = torch.randn((args.mb << 20) // 4)
    mb = x.numel() * 4 / 1e6
    dtorch.Tensor(torch.zeros(4), device_mesh=mesh, placements=[Replicate()]).to_torch()  # start the workers
    layouts = ([Shard(0)], [Replicate()])
    specs = [dtorch.Tensor(torch.zeros(x.shape), device_mesh=mesh, placements=layout)._spec for layout in layouts]
    try:
        for layout, spec in zip(layouts, specs):
            rates = {}
            for path, shm in (("shm", True), ("dist", False)):
                rt.transport.shm = shm
                rates[path] = measure(rt, x, spec, args.iters)
            (sp, sf), (tp, tf) = rates["shm"], rates["dist"]
            print(f"{mb:.0f} MB {layout[0]!s:<12} place: shm {sp:6.0f} MB/s  torch.distributed {tp:5.0f} MB/s   "
                  f"fetch: shm {sf:6.0f} MB/s  torch.distributed {tf:5.0f} MB/s", flush=True)
        print(f"stats: {rt.stats}")
    finally:
        rt.shutdown()
    if args.ray:
        from dtorch.runtime.ray_backend import RayRuntime

        ray_rt = RayRuntime(workers=2, timeout=120)
        try:
            for layout, spec in zip(layouts, specs):
                rp, rf = measure(ray_rt, x, spec, args.iters)
                print(f"{mb:.0f} MB {layout[0]!s:<12} ray backend (object store): place {rp:6.0f} MB/s   "
                      f"fetch {rf:6.0f} MB/s", flush=True)
            print(f"stats: {ray_rt.stats}")
        finally:
            ray_rt.shutdown()


if __name__ == "__main__":
    main()
