"""``dtorch plan --calibrate OUT``: a hardware profile of this machine, measured on the process backend's workers
(two worker processes, the workers' torch thread count), so the profile's efficiencies are 1:

- the GEMM rate (float32 and bfloat16): a chain of row-sharded matmuls, FLOPs per device over the busiest worker
  thread's CPU seconds;
- the cost per kernel and the element-wise rate (the profile's "HBM" bandwidth), from the op mix of a real step:
  a small Llama's training step (forward, backward, clipping, AdamW; ``OP_MIX``, three sizes) on two workers. Its
  busiest worker's CPU seconds less its matmuls at the GEMM rate are ``kernels x cost + bytes / rate``, the
  kernel count and the bytes of the non-matmul kernels from the cost model's own trace of the same step: three
  equations, two rates, a non-negative least squares (a tiny multiply or a 4 MiB copy undercounted a real op:
  more arguments, autograd bookkeeping, allocations of many sizes);
- the controller's cost per op (the estimate's dispatch floor): its CPU seconds over the tiny step per kernel
  and collective it issued;
- each collective's alpha and beta as the workers run it inside a stream of ops (all_reduce and all_gather
  through shared memory, reduce_scatter and the ring's send_recv through gloo): chains of 32 B and of 4 MiB ones,
  inverted through the cost model's own ring terms (``cost.collective_terms``); a worker runs them on the thread
  that runs its kernels, so the profile's ``overlap`` is 0.

Every time is the wall time less what the workers' busiest thread spent runnable but waiting for a core
(/proc/<pid>/task/<tid>/schedstat), or that thread's CPU time, so other jobs on a shared machine change the
profile less. Every number is measured on programs of its own, none on the layouts a profile is checked against
(``bench/plan_vs_measured.py``).
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


def _best(clock: WorkerClock, fn, repeat: int = 3, key: str = "unloaded") -> float:
    """The least of ``repeat`` timings of ``fn`` (after one to warm up): ``key`` "unloaded" (wall less the busiest
    worker thread's run-queue wait: what includes waits on a peer) or "cpu" (that thread's CPU seconds: compute
    alone, which other jobs' load moves least)."""
    fn()
    return min(clock.time(fn)[key] for _ in range(repeat))


# -- the measurements ------------------------------------------------------------------------------------------

# the op mix: a small Llama's step at three sizes, on two workers (dp2): per-kernel bound (tiny), then more and more
# element-wise bytes (activations of many tokens; a wide model's AdamW)
OP_MIX = ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 256, "seq": 32, "rows": 4},
          {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "vocab_size": 128, "seq": 256, "rows": 16},
          {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
           "vocab_size": 256, "seq": 32, "rows": 4})


def llama_config(hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size, seq):
    """A Llama config of these sizes (intermediate 2.6875 x hidden, Llama 3's ratio, a multiple of 8)."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=hidden_size, intermediate_size=int(hidden_size * 2.6875) // 8 * 8,
                                   num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                                   num_key_value_heads=num_key_value_heads, vocab_size=vocab_size,
                                   max_position_embeddings=max(seq, 64), rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    return cfg


def measure_step(cfg, layout, *, seq: int, rows: int, micro_batches: int = 1, steps: int = 5, warmup: int = 2,
                 graph=None) -> dict:
    """One training step (forward with labels, backward, gradient clipping, AdamW; a pipelined layout runs
    ``dtorch.pipeline.train_step`` over ``micro_batches``) of ``cfg``'s Llama on the process backend in ``layout``
    (a ``trace.Layout``), float32: the median step's wall seconds, its busiest worker thread's CPU seconds and
    run-queue wait, and the controller thread's CPU seconds. ``graph``: a process-backend graph to run it in (its
    workers stay up; default: a new one, shut down after)."""
    import statistics

    import dtorch
    from dtorch.models.llama import LlamaForCausalLM
    from dtorch.pipeline import split_micro_batches, train_step

    ids = torch.randint(0, cfg.vocab_size, (rows, seq), generator=torch.Generator().manual_seed(1))
    own = graph is None
    graph = dtorch.Graph(backend="process") if own else graph
    with graph:
        model = LlamaForCausalLM(cfg, layout.mesh())
        params = [p for p in model.parameters() if p.requires_grad]
        opt = dtorch.optim.AdamW(params, lr=1e-4)
        mbs = split_micro_batches(ids, ids, chunks=micro_batches) if layout.pp > 1 else None

        def step():
            if mbs is not None:
                train_step(model, mbs)
            else:
                model(ids, labels=ids).loss.backward()
            dtorch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
            graph.sync()

        for _ in range(warmup):
            step()
        clock = WorkerClock()
        runs = []
        for _ in range(steps):
            c = time.thread_time()
            r = clock.time(step)
            r["controller"] = time.thread_time() - c
            runs.append(r)
        if own:
            graph.runtime.shutdown()
    runs.sort(key=lambda r: r["wall"])
    return dict(runs[len(runs) // 2], cpu=statistics.median(r["cpu"] for r in runs),
                controller=statistics.median(r["controller"] for r in runs))


def step_counts(cfg, layout, *, seq: int, rows: int, collectives: dict | None = None) -> dict:
    """What the cost model sees of that step (one micro-batch of ``rows``), on its busiest device, as the process
    backend runs it (every backward a recomputing VJP): kernel calls, recomputing VJPs among them, the FLOPs of
    its matmuls (fused attention kernels apart: "attention_flops") and the bytes of its eager torch ops that do
    no matmul (fused attention kernels apart); the ops the controller issues (kernels and collectives, every stage);
    and, given ``collectives`` (kind -> {gbps, latency_us}, as measured), the seconds of its collectives
    ("comm_s": a worker runs them on the thread that runs its kernels, so they are in its CPU time too)."""
    from ..commlog import CommRecord
    from .cost import Options, collective_time, is_recomputing_vjp, kernel_work
    from .hardware import Link
    from .trace import trace_step

    tr = trace_step(cfg, layout, seq=seq, rows=rows, ac="none", param_dtype=torch.float32)
    options = Options(native_backward=False)
    out = {"kernels": 0, "vjps": 0, "flops": 0.0, "attention_flops": 0.0, "bytes": 0.0, "issued": 0, "comm_s": 0.0}
    links = None
    if collectives:
        from types import SimpleNamespace

        any_link = Link(**next(iter(collectives.values())))
        links = SimpleNamespace(gpus_per_node=1 << 20, intra=any_link, inter=any_link, efficiency={"collective": 1.0},
                                collectives={k: Link(**v) for k, v in collectives.items()})
    for _, _, stage, item in tr.events:
        out["issued"] += 1
        if isinstance(item, CommRecord):
            if links is not None and stage == 0:
                out["comm_s"] += collective_time(item, tr.layout, links)[0]
            continue
        if stage != 0:
            continue
        flops, _, cls, work = kernel_work(item, options)
        out["kernels"] += 1
        out["vjps"] += is_recomputing_vjp(item, options)
        out["attention_flops" if cls == "attention" else "flops"] += flops
        if cls != "attention":
            out["bytes"] += work.eager_bytes
    return out


def fit_nonnegative(rows, y) -> list:
    """The least-squares ``x >= 0`` of ``rows @ x = y`` (few unknowns: the best of the unconstrained fits on every
    subset of them whose solution is non-negative; an unknown the points cannot tell from 0 is 0)."""
    import itertools

    import numpy as np

    a, y = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    n = a.shape[1]
    best = (float(y @ y), np.zeros(n))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (sol < 0).any():
                continue
            x = np.zeros(n)
            x[list(cols)] = sol
            r = y - a @ x
            if float(r @ r) < best[0] - 1e-18:
                best = (float(r @ r), x)
    return [float(v) for v in best[1]]


def measure(devices: int = 2, steps: int = 5) -> dict:
    """Every rate of the profile, on ``devices`` process-backend workers."""
    import dtorch
    from dtorch import Partial, Replicate, Shard

    from ..redistribute.executor import ring_shift
    from .cost import collective_terms
    from .trace import Layout

    out = {}
    with dtorch.Graph(backend="process") as g:
        mesh = dtorch.init_device_mesh("cpu", (devices,), mesh_dim_names=["dp"])

        def sharded(t):
            return dtorch.Tensor(t, device_mesh=mesh, placements=[Shard(0)])

        def chain(x, op, n):
            def run():
                y = x
                for _ in range(n):
                    y = op(y)
                g.sync()
            return run

        sharded(torch.ones(devices, 8))
        g.sync()  # the workers start with the first block
        clock = WorkerClock()
        for dtype in (torch.float32, torch.bfloat16):
            n, k = 512, 10
            x = sharded(torch.randn(devices * n, n, dtype=dtype))
            w = dtorch.Tensor(torch.randn(n, n, dtype=dtype) / n ** 0.5, device_mesh=mesh, placements=[Replicate()])
            t = _best(clock, chain(x, lambda y: y @ w, k), key="cpu")
            out[str(dtype).split(".")[1]] = 2 * n ** 3 * k / max(t, 1e-9) / 1e12

        # fused attention (torch's SDPA, causal, a Llama's head size) at its own rate: FLOPs as the cost model
        # counts them (two matmuls of the scores, half of them masked)
        from ..nn import functional as F

        b, h, sq, d, k = 2, 8, 256, 32, 10
        q = dtorch.Tensor(torch.randn(devices * b, h, sq, d), device_mesh=mesh, placements=[Shard(0)])
        t = _best(clock, chain(q, lambda y: F.scaled_dot_product_attention(y, q, q, is_causal=True), k), key="cpu")
        out["attention"] = 0.5 * 4 * b * h * sq * sq * d * k / max(t, 1e-9) / 1e12
        # what a recomputing VJP costs beyond its forward's work: the backward of a chain of reshapes (each a
        # VJP kernel that builds the forward's graph again and calls autograd on it; the forward reshapes are
        # views the workers do not run), at two lengths, so the backward's fixed work (the sum, the gradient's
        # accumulation) cancels
        per_vjp = []
        for n in (8, 32):
            leaf = sharded(torch.randn(devices * 4, 6)).requires_grad_()

            def backward(n=n, leaf=leaf):
                y = leaf
                for i in range(n):
                    y = y.reshape(-1, 6 if i % 2 else 4)
                y.sum().backward()
                g.sync()
            per_vjp.append(_best(clock, backward, key="cpu"))
        out["vjp_us"] = max(0.0, (per_vjp[1] - per_vjp[0]) / 24 * 1e6)  # per VJP kernel, its own cost included

        # each kind of collective inside a stream: k of them, one wait at the end
        def make(kind, numel):
            if kind == "all_reduce":
                x = dtorch.Tensor(torch.ones(numel), device_mesh=mesh, placements=[Partial()])
                return lambda: x.redistribute(mesh, [Replicate()])
            if kind == "reduce_scatter":
                x = dtorch.Tensor(torch.ones(devices * numel), device_mesh=mesh, placements=[Partial()])
                return lambda: x.redistribute(mesh, [Shard(0)])
            x = sharded(torch.ones(devices * numel))
            if kind == "all_gather":
                return lambda: x.redistribute(mesh, [Replicate()])
            return lambda: ring_shift(g.runtime, x._h, x._spec, 0, 1)

        small, large = 8, 1 << 20  # floats per device: 32 B (the latency), 4 MiB (the bandwidth)
        out["collectives"] = {}
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
            times, moved = [], []
            for numel, k in ((small, 20), (large, 5)):
                op = make(kind, numel)
                g.sync()
                times.append(_best(clock, lambda: ([op() for _ in range(k)], g.sync())) / k)
                block = 4 * numel * (devices if kind == "reduce_scatter" else 1)  # each device's input block
                steps_, b = collective_terms(kind, devices, block)
                moved.append(b)
            extra = times[1] - times[0]
            out["collectives"][kind] = {
                "name": f"process backend {kind} in a stream ({devices} workers)",
                "latency_us": times[0] / steps_ * 1e6,
                # (noise that makes the large one no slower: its bytes over its whole time, a lower bound)
                "gbps": (moved[1] - moved[0]) / extra / 1e9 if extra > 0.2 * times[1] else moved[1] / times[1] / 1e9}
        # the op mix: a real step's kernels at three sizes; CPU seconds less its matmuls at the GEMM rate, its
        # attention at the attention rate, its collectives (the gradients' all-reduce) and its VJPs' fixed cost = other kernels x cost + bytes / rate (a VJP's
        # fixed cost is the kernel's plus vjp_overhead_us)
        lay = Layout(dp=devices)
        rows, y, controller = [], [], []
        for size in OP_MIX:
            sizes = {k: v for k, v in size.items() if k not in ("seq", "rows")}
            cfg = llama_config(seq=size["seq"], **sizes)
            got = measure_step(cfg, lay, seq=size["seq"], rows=size["rows"], steps=steps, graph=g)
            counts = step_counts(cfg, lay, seq=size["seq"], rows=size["rows"], collectives=out["collectives"])
            rows.append((counts["kernels"] - counts["vjps"], counts["bytes"]))
            y.append(got["cpu"] - counts["flops"] / (out["float32"] * 1e12)
                     - counts["attention_flops"] / (out["attention"] * 1e12) - counts["vjps"] * out["vjp_us"] * 1e-6
                     - counts["comm_s"])
            controller.append(got["controller"] / counts["issued"])
        g.runtime.shutdown()
    # each size's equation relative to its time, so that the largest step does not decide both rates alone
    per_kernel, per_byte = fit_nonnegative([(k / t, b / t) for (k, b), t in zip(rows, y)], [1.0] * len(y))
    out["kernel_us"] = per_kernel * 1e6
    out["vjp_overhead_us"] = max(0.0, out["vjp_us"] - out["kernel_us"])
    out["elementwise_gbps"] = 1 / per_byte / 1e9 if per_byte else float("inf")
    out["controller_op_us"] = max(controller) * 1e6  # the per-kernel-bound size's (a larger step's waits add none)
    out["op_mix"] = [{"kernels_less_vjps": k, "bytes": b, "cpu_less_matmuls_attention_vjps_s": t}
                     for (k, b), t in zip(rows, y)]
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
    link = got["collectives"]["all_reduce"]
    fp32, bf16 = got["float32"], got["bfloat16"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    profile = {"name": f"this machine ({os.cpu_count()} CPUs, process backend, {threads} thread(s) per worker), measured",
               "memory_gib": 64, "usable_memory_gib": 64,
               "peak_tflops": {"float32": fp32, "bfloat16": bf16, "float16": bf16, "tf32": fp32},
               "hbm_gbps": got["elementwise_gbps"], "gpus_per_node": 1 << 20, "links": {"intra": link, "inter": link},
               "collectives": got["collectives"],
               # torch's fused attention on the CPU runs at its own rate, a fraction of the GEMM rate's; every
               # backward recomputes its forward (the workers keep no local graphs); every kernel runs its torch
               # ops eagerly (ring attention's block steps too)
               "efficiency": {"matmul": 1.0, "attention": got["attention"] / fp32, "memory": 1.0, "collective": 1.0,
                              "kernel_overhead_us": got["kernel_us"],
                              "vjp_recompute": 1, "vjp_overhead_us": got["vjp_overhead_us"],
                              "eager_kernels": 1, "overlap": 0.0,
                              "controller_op_us": got["controller_op_us"]},
               "memory_overhead_gib": 0.0, "threads_per_worker": threads,
               "sources": [f"measured by dtorch plan --calibrate on {devices} process-backend workers "
                           f"({time.strftime('%Y-%m-%d %H:%M')}, load average {load:.1f}): chains of 512^3 matmuls; "
                           "a small Llama's training step at two sizes (the cost per kernel, the element-wise rate "
                           "and the controller's cost per op, fitted to the cost model's counts of that step); "
                           "chains of each collective at 32 B and 4 MiB; times less the workers' run-queue waits, "
                           "or the busiest worker thread's CPU time"],
               "op_mix": got["op_mix"]}
    with open(out, "w") as f:
        json.dump(profile, f, indent=1)
    print(f"wrote {out}: GEMM {fp32 * 1e3:.0f} GFLOPS float32, {bf16 * 1e3:.0f} bfloat16 per worker; elementwise "
          f"{profile['hbm_gbps']:.1f} GB/s; attention {got['attention'] * 1e3:.0f} GFLOPS; {got['kernel_us']:.0f} us per kernel, "
          f"{got['vjp_overhead_us']:.0f} more per recomputing VJP; controller {got['controller_op_us']:.0f} us "
          "per op; " + ", ".join(f"{k} {v['latency_us']:.0f} us + {v['gbps']:.2f} GB/s"
                                 for k, v in got["collectives"].items()))
    return profile
