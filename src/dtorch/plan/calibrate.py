"""``dtorch plan --calibrate OUT``: a hardware profile of this machine, measured. The rates are what this machine
achieves (so the profile's efficiencies are 1): a float32 and a bfloat16 GEMM, a memory copy, and the process
backend's collectives between two worker processes (alpha from a tiny all-reduce, beta from a large one)."""
from __future__ import annotations

import json
import os
import time

import torch


def _best(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def gemm_tflops(dtype: torch.dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / _best(lambda: a @ b) / 1e12


def copy_gbps(n: int = 1 << 24) -> float:
    x = torch.empty(n)
    y = torch.empty(n)
    return 2 * x.nbytes / _best(lambda: y.copy_(x)) / 1e9


def collective_link(devices: int = 2) -> dict:
    """Alpha (us) and beta (GB/s) of an all-reduce between ``devices`` process-backend workers."""
    import dtorch
    from dtorch import Partial, Replicate

    with dtorch.Graph(backend="process") as g:
        mesh = dtorch.init_device_mesh("cpu", (devices,), mesh_dim_names=["dp"])

        def reduce(numel):
            x = dtorch.Tensor(torch.ones(numel), device_mesh=mesh, placements=[Partial()])
            g.sync()

            def run():
                x.redistribute(mesh, [Replicate()])
                g.sync()
            return _best(run, 3)

        small = reduce(8)
        numel = 1 << 22
        large = reduce(numel)
        g.runtime.shutdown()
    size = numel * 4
    moved = 2 * (devices - 1) / devices * size
    alpha = small / (2 * (devices - 1))
    return {"name": f"process backend all-reduce ({devices} workers, gloo)", "latency_us": alpha * 1e6,
            "gbps": moved / max(large - small, 1e-9) / 1e9}


def calibrate(out: str) -> dict:
    fp32, bf16 = gemm_tflops(torch.float32), gemm_tflops(torch.bfloat16)
    link = collective_link()
    profile = {"name": f"this machine ({os.cpu_count()} CPUs), measured", "memory_gib": 64, "usable_memory_gib": 64,
               "peak_tflops": {"float32": fp32, "bfloat16": bf16, "float16": bf16, "tf32": fp32},
               "hbm_gbps": copy_gbps(), "gpus_per_node": 1 << 20, "links": {"intra": link, "inter": link},
               "efficiency": {"matmul": 1.0, "attention": 1.0, "memory": 1.0, "collective": 1.0,
                              "kernel_overhead_us": 20.0},
               "memory_overhead_gib": 0.0,
               "sources": ["measured by dtorch plan --calibrate: torch GEMMs, a copy and the process backend's all-reduce"]}
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {out}: GEMM {fp32:.3f} TFLOPS float32, {bf16:.3f} bfloat16; copy {profile['hbm_gbps']:.1f} GB/s; "
          f"all-reduce alpha {link['latency_us']:.0f} us, {link['gbps']:.2f} GB/s")
    return profile
