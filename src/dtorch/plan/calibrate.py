"""``dtorch plan --calibrate OUT``: a hardware profile of this machine, measured on the process backend's workers
(two worker processes, the workers' torch thread count), so the profile's efficiencies are 1:

- the GEMM rate (float32 and bfloat16): a chain of row-sharded matmuls, FLOPs per device over the time;
- the elementwise rate (the profile's "HBM" bandwidth): a chain of multiplies of activation-sized blocks, bytes
  read and written per device over the time;
- the cost per op (the cost model's per-kernel overhead): a chain of tiny multiplies (the controller's issue and
  a worker's dispatch);
- the all-reduce's alpha (a tiny one) and beta (a large one, less the tiny one).

Every time is the wall time less what the workers' busiest thread spent runnable but waiting for a core
(/proc/<pid>/task/<tid>/schedstat), so other jobs on a shared machine change the profile little. Every number is
measured; none is fitted to a model.
"""
from __future__ import annotations

import json
import os
import time

import torch


# -- timing the workers ----------------------------------------------------------------------------------------


def descendants(root: int | None = None) -> list[int]:
    """Process ids below ``root`` (default: this process; the process backend's workers), read from /proc."""
    root = os.getpid() if root is None else root
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def thread_times(pids) -> dict:
    """(pid, thread id) -> (seconds on a CPU, seconds runnable but waiting for one), from /proc schedstat."""
    out = {}
    for pid in pids:
        try:
            for t in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                    a, b, _ = f.read().split()
                    out[pid, t] = (int(a) * 1e-9, int(b) * 1e-9)
        except OSError:
            pass
    return out


class WorkerClock:
    """Times a callable by the wall clock, and reads what the workers' busiest thread (the one running kernels)
    did meanwhile: its CPU seconds and the seconds it waited for a core (load from other jobs)."""

    def __init__(self):
        self.pids = descendants()

    def time(self, fn) -> dict:
        before = thread_times(self.pids)
        t = time.perf_counter()
        fn()
        wall = time.perf_counter() - t
        busiest = (0.0, 0.0)
        for key, (run, wait) in thread_times(self.pids).items():
            run0, wait0 = before.get(key, (0.0, 0.0))
            busiest = max(busiest, (run - run0, wait - wait0))
        cpu, queued = busiest
        return {"wall": wall, "cpu": cpu, "queued": queued, "unloaded": max(wall - queued, cpu)}


def _best(clock: WorkerClock, fn, repeat: int = 3) -> float:
    fn()
    return min(clock.time(fn)["unloaded"] for _ in range(repeat))


# -- the measurements ------------------------------------------------------------------------------------------


def measure(devices: int = 2) -> dict:
    """Every rate of the profile, on ``devices`` process-backend workers."""
    import dtorch
    from dtorch import Partial, Replicate, Shard

    out = {}
    with dtorch.Graph(backend="process") as g:
        mesh = dtorch.init_device_mesh("cpu", (devices,), mesh_dim_names=["dp"])
        clock = None

        def chain(x, op, n):
            def run():
                y = x
                for _ in range(n):
                    y = op(y)
                g.sync()
            return run

        def sharded(t):
            return dtorch.Tensor(t, device_mesh=mesh, placements=[Shard(0)])

        tiny = sharded(torch.ones(devices, 8))
        g.sync()
        clock = WorkerClock()
        ops = 200
        out["op_us"] = _best(clock, chain(tiny, lambda y: y * 1.0, ops)) / ops * 1e6
        for dtype in (torch.float32, torch.bfloat16):
            n, k = 512, 10
            x = sharded(torch.randn(devices * n, n, dtype=dtype))
            w = dtorch.Tensor(torch.randn(n, n, dtype=dtype) / n ** 0.5, device_mesh=mesh, placements=[Replicate()])
            t = _best(clock, chain(x, lambda y: y @ w, k))
            out[str(dtype).split(".")[1]] = 2 * n ** 3 * k / max(t - k * out["op_us"] * 1e-6, 1e-9) / 1e12
        numel, k = 1 << 20, 10
        x = sharded(torch.randn(devices * numel))
        t = _best(clock, chain(x, lambda y: y * 1.0001, k))
        out["elementwise_gbps"] = 2 * 4 * numel * k / max(t - k * out["op_us"] * 1e-6, 1e-9) / 1e9

        def all_reduce(numel):
            x = dtorch.Tensor(torch.ones(numel), device_mesh=mesh, placements=[Partial()])
            g.sync()
            return _best(clock, lambda: (x.redistribute(mesh, [Replicate()]), g.sync()))

        small = all_reduce(8)
        numel = 1 << 22
        large = all_reduce(numel)
        size = numel * 4
        moved = 2 * (devices - 1) / devices * size
        out["link"] = {"name": f"process backend all-reduce ({devices} workers)",
                       "latency_us": small / (2 * (devices - 1)) * 1e6, "gbps": moved / max(large - small, 1e-9) / 1e9}
        g.runtime.shutdown()
    return out


def calibrate(out: str, threads: int | None = None, devices: int = 2) -> dict:
    """Measure this machine on ``devices`` process-backend workers of ``threads`` torch threads each (default: the
    process backend's, cores / devices) and write the profile to ``out``."""
    threads = threads or max(1, (os.cpu_count() or 1) // devices)
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the workers' (inherited)
    try:
        got = measure(devices)
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before
    link = got["link"]
    fp32, bf16 = got["float32"], got["bfloat16"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    profile = {"name": f"this machine ({os.cpu_count()} CPUs, process backend, {threads} thread(s) per worker), measured",
               "memory_gib": 64, "usable_memory_gib": 64,
               "peak_tflops": {"float32": fp32, "bfloat16": bf16, "float16": bf16, "tf32": fp32},
               "hbm_gbps": got["elementwise_gbps"], "gpus_per_node": 1 << 20, "links": {"intra": link, "inter": link},
               "efficiency": {"matmul": 1.0, "attention": 1.0, "memory": 1.0, "collective": 1.0,
                              "kernel_overhead_us": got["op_us"]},
               "memory_overhead_gib": 0.0, "threads_per_worker": threads,
               "sources": [f"measured by dtorch plan --calibrate on {devices} process-backend workers "
                           f"({time.strftime('%Y-%m-%d %H:%M')}, load average {load:.1f}): chains of 512^3 matmuls, "
                           "of multiplies of 4 MiB blocks, of tiny multiplies, and all-reduces of 32 B and 16 MiB; "
                           "times less the workers' run-queue waits"]}
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {out}: GEMM {fp32 * 1e3:.0f} GFLOPS float32, {bf16 * 1e3:.0f} bfloat16 per worker; elementwise "
          f"{profile['hbm_gbps']:.1f} GB/s; {got['op_us']:.0f} us per op; all-reduce alpha {link['latency_us']:.0f} us, "
          f"{link['gbps']:.2f} GB/s")
    return profile
