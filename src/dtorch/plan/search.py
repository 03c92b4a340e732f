"""``--search``: every valid layout of a device count, estimated; the best by predicted throughput among those that
fit, and why each runner-up lost (memory, pipeline bubble, communication, compute)."""
from __future__ import annotations

import multiprocessing

from .estimate import PlanError, estimate, load_config
from .hardware import load as load_hardware

LAYOUT_TIMEOUT_S = 900  # one layout's estimate takes seconds; a worker that takes this long is stuck


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg, devices: int, gpus_per_node: int, seq: int) -> list[dict]:
    """Layouts worth costing: tp within a node dividing the heads, pp dividing the layers' count reasonably,
    ring cp dividing the sequence, the rest data parallel as fsdp, dp, or both (HSDP: dp across nodes)."""
    nh = cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nh
    out = []
    for tp in _divisors(devices):
        if tp > gpus_per_node or nh % tp or (nkv % tp if nkv >= tp else tp % nkv):
            continue
        for pp in _divisors(devices // tp):
            if pp > 1 and cfg.num_hidden_layers < 2 * pp:
                continue
            for cp in _divisors(devices // tp // pp):
                if cp > 8 or seq % cp:
                    continue
                rest = devices // tp // pp // cp
                splits = {(1, rest), (rest, 1)}
                for dp in _divisors(rest):
                    if 1 < dp < rest and (rest // dp) * tp * cp >= gpus_per_node:
                        splits.add((dp, rest // dp))  # HSDP: shards within a node group, replicas across
                for dp, fsdp in sorted(splits):
                    out.append(dict(dp=dp, fsdp=fsdp, tp=tp, pp=pp, ring_cp=cp))
    return out


def why_lost(best, other) -> str:
    """The main reason ``other`` (an Estimate) trains fewer tokens per device than ``best``, or cannot run: the
    part of its time per token (bubble, exposed communication, compute) that grew the most."""
    if not other.fits:
        return f"memory: {other.memory['peak'] / 2**30:.1f} GiB > {other.memory['capacity'] / 2**30:.1f} GiB"

    def per_token(e, t):
        return t / (e.global_batch * e.seq / e.devices)

    extra = {"bubble": per_token(other, other.bubble_time) - per_token(best, best.bubble_time),
             "communication": per_token(other, other.exposed_comm_time) - per_token(best, best.exposed_comm_time),
             "compute": per_token(other, other.compute_time) - per_token(best, best.compute_time)}
    reason = max(extra, key=extra.get)
    share = {"bubble": other.bubble_time, "communication": other.exposed_comm_time, "compute": other.compute_time}
    slower = best.tokens_per_second_per_device / other.tokens_per_second_per_device - 1
    return f"{reason} ({share[reason] / other.step_time:.0%} of its step); {slower:.0%} slower"


def _estimate_one(job):
    """One layout's estimate, or None when the batch does not split over it (a process pool's task)."""
    cfg, devices, hw, lay, kw = job
    try:
        return estimate(cfg, devices, hw, **lay, **kw)
    except PlanError:
        return None


def search(config, devices: int, hardware, *, seq: int = 8192, global_batch: int | None = None,
           micro_batches: int | None = None, limit: int | None = None, progress=None, workers: int = 1,
           **kw) -> list:
    """Estimates of every valid layout, best first (fitting ones by tokens/s, then the rest by memory).
    ``workers``: processes estimating layouts side by side (spawned: a script calling this with workers > 1 needs
    the ``if __name__ == "__main__":`` guard; ``dtorch plan --search`` uses one per CPU)."""
    cfg = load_config(config)
    hw = load_hardware(hardware)
    cands = layouts(cfg, devices, hw.gpus_per_node, seq)
    if limit:
        cands = cands[:limit]
    jobs = []
    for lay in cands:
        gb = global_batch
        if gb is None:  # one sequence per data-parallel rank per micro-batch
            gb = lay["dp"] * lay["fsdp"] * (micro_batches or max(1, lay["pp"]))
        jobs.append((cfg, devices, hw, lay, dict(seq=seq, global_batch=gb, micro_batches=micro_batches, **kw)))
    workers = max(1, min(len(jobs), workers))
    results = []
    if workers > 1:
        from concurrent.futures import ProcessPoolExecutor

        # spawned: a forked child of a process with threads can wait forever on a lock one of them held
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_estimate_one, job) for job in jobs]
            for n, fut in enumerate(futures):
                results.append(fut.result(timeout=LAYOUT_TIMEOUT_S))
                if progress:
                    progress(n + 1, len(jobs))
    else:
        for n, job in enumerate(jobs):
            results.append(_estimate_one(job))
            if progress:
                progress(n + 1, len(jobs))
    results = [e for e in results if e is not None]
    if not results:
        raise PlanError(f"no layout of {devices} devices can run this config with --global-batch {global_batch}")
    results.sort(key=lambda e: (not e.fits, -e.tokens_per_second_per_device if e.fits else e.memory["peak"]))
    return results
