"""Weight sync of RL post-training: ``dtorch.nn.utils.copy_parameters_`` of a 32 M-parameter Llama (8 layers,
hidden 512, intermediate 1280, vocab 8192, float32: 130 MB) from a trainer in fsdp4 into a rollout model in
dp2 x tp2, on the same 4 devices (colocated) and on 4 others.

    .venv/bin/python bench/rl_weight_sync.py                  # in-process and process backends
    .venv/bin/python bench/rl_weight_sync.py --iters 3 --backends inprocess --threads 0

In-process: the sync time against a torch memcpy (``dst.copy_(src)``, one flat tensor) of the bytes the sync
writes (each distinct destination block once: the in-process backend stores dp replicas once), and of the
bytes CommLog says change device. Process backend (one worker process per device, gloo between them): the
bytes that change device over the sync time, and the controller's Python heap during a sync (tracemalloc
peak). Medians over ``--iters`` syncs after one warm-up; the rollout's weights are checked against the
policy's after each backend.
"""
from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import torch
import transformers

import dtorch
from dtorch import CommLog, DeviceMesh
from dtorch.models import LlamaForCausalLM
from dtorch.nn import skip_init
from dtorch.nn.utils import copy_parameters_


def config() -> transformers.LlamaConfig:
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1280, num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=8192, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    return cfg


def mesh(shape, names, first: int) -> DeviceMesh:
    n = 1
    for s in shape:
        n *= s
    return DeviceMesh("cpu", torch.arange(first, first + n).reshape(shape), mesh_dim_names=names)


def models(cfg):
    policy = LlamaForCausalLM(cfg, mesh((4,), ["fsdp"], 0))
    with skip_init():
        together = LlamaForCausalLM(cfg, mesh((2, 2), ["dp", "tp"], 0))
        apart = LlamaForCausalLM(cfg, mesh((2, 2), ["dp", "tp"], 4))
    return policy, {"colocated": together, "other devices": apart}


def time_syncs(graph, rollout, policy, iters: int):
    copy_parameters_(rollout, policy)  # warm-up: plans made, workers' definitions sent
    graph.sync()
    times = []
    for _ in range(iters):
        with CommLog() as log:
            t0 = time.perf_counter()
            moved = copy_parameters_(rollout, policy)
            graph.sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), moved, log


def check(rollout, policy) -> None:
    want = policy.state_dict()
    for k, v in rollout.state_dict().items():
        if not torch.equal(v, want[k]):
            raise SystemExit(f"{k}: the rollout's weights differ from the policy's after the sync")


def memcpy_s(nbytes: int, iters: int) -> float:
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stored_bytes(model) -> int:
    """Bytes of each distinct destination block (replicas once): what the in-process backend writes."""
    total = 0
    for p in model.parameters():
        total += p._spec.total_bytes() // max(1, _replicas(p))
    return total


def _replicas(p) -> int:
    n = 1
    for size, pl in zip(p.device_mesh.shape, p.placements):
        n *= size if pl.is_replicate() else 1
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--backends", default="inprocess,process", help="comma-separated: inprocess, process")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (0: torch's default); the "
                    "sync and the memcpy it is compared with run with the same")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = config()
    torch.manual_seed(0)
    for backend in args.backends.split(","):
        graph = dtorch.Graph(backend=backend)
        with graph:
            policy, rollouts = models(cfg)
            n = sum(p.numel() for p in policy.parameters())
            print(f"{backend}: {n / 1e6:.1f} M parameters, {n * 4 / 1e6:.0f} MB; fsdp4 -> dp2 x tp2, "
                  f"median of {args.iters}")
            for where, rollout in rollouts.items():
                sync_s, moved, log = time_syncs(graph, rollout, policy, args.iters)
                check(rollout, policy)
                line = (f"  {where:14s} sync {1e3 * sync_s:7.1f} ms  {moved / 1e6:6.1f} MB change device "
                        f"({len(log.records)} batched moves, {moved / sync_s / 1e9:5.2f} GB/s)")
                if backend == "inprocess":
                    written = stored_bytes(rollout)
                    base, base_moved = memcpy_s(written, args.iters), memcpy_s(moved, args.iters)
                    line += (f"; memcpy of the {written / 1e6:.0f} MB written {1e3 * base:6.1f} ms: "
                             f"{sync_s / base:4.2f}x (of the {moved / 1e6:.0f} MB moved {1e3 * base_moved:6.1f} ms: "
                             f"{sync_s / base_moved:4.2f}x)")
                else:
                    tracemalloc.start()
                    copy_parameters_(rollout, policy)
                    graph.sync()
                    _, peak = tracemalloc.get_traced_memory()
                    tracemalloc.stop()
                    line += f"; controller heap peak during a sync {peak / 1e3:.0f} KB"
                print(line, flush=True)
        if backend != "inprocess":
            graph.runtime.shutdown()


if __name__ == "__main__":
    main()
