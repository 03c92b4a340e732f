"""Predicted against measured: ``dtorch plan``'s step time of a small Llama training step, calibrated on this
machine, against the same step run on the process backend (one worker process per device), for 5 layouts.

    .venv/bin/python bench/plan_vs_measured.py                       # calibrate, then dp2 fsdp2 tp2 pp2 ring_cp2
    .venv/bin/python bench/plan_vs_measured.py --profile here.json   # reuse a profile from dtorch plan --calibrate

The profile comes from ``dtorch plan --calibrate`` (``dtorch.plan.calibrate``: this machine's GEMM rate at the
workers' thread count, a memory copy, the process backend's cost per op and its all-reduce's alpha and beta):
nothing in it is fitted to these layouts. One step = forward with labels, backward, gradient clipping, AdamW
(float32, no activation checkpointing), as ``dtorch.plan.trace`` traces it; a pipelined layout runs
``dtorch.pipeline.train_step`` (1F1B) over ``--micro-batches``. Measured: the median of ``--steps`` steps after
``--warmup`` (each ends with ``graph.sync()``). Target: every ratio within 25%.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

LAYOUTS = "dp2,fsdp2,tp2,pp2,ring_cp2"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="a profile written by dtorch plan --calibrate (default: calibrate now)")
    ap.add_argument("--layouts", default=LAYOUTS, help="comma-separated, each dims like dp2 or dp2xtp2")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--micro-batches", type=int, default=4, help="for pipelined layouts")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    return ap.parse_args(argv)


def parse_layout(text: str) -> dict:
    import re

    out = {}
    for part in text.split("x"):
        m = re.fullmatch(r"(dp|fsdp|tp|pp|ulysses_cp|ring_cp)(\d+)", part.strip())
        if not m:
            raise SystemExit(f"--layouts: cannot read {part!r} in {text!r}; write dims like dp2, tp2, dp2xtp2")
        out[m.group(1)] = int(m.group(2))
    return out


def make_config(args):
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875) // 8 * 8,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads // 2, vocab_size=args.vocab,
                                   max_position_embeddings=max(args.seq, 64), rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    return cfg


def measure(cfg, dims: dict, args) -> dict:
    """One training step of ``cfg`` on the process backend in layout ``dims``: the median wall seconds, and per step
    the busiest worker thread's CPU seconds and the seconds it waited, runnable, for a core (other jobs' load)."""
    import torch

    import dtorch
    from dtorch.models.llama import LlamaForCausalLM
    from dtorch.pipeline import split_micro_batches, train_step
    from dtorch.plan.calibrate import WorkerClock
    from dtorch.plan.trace import Layout

    lay = Layout(**dims)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    graph = dtorch.Graph(backend="process")
    with graph:
        model = LlamaForCausalLM(cfg, lay.mesh())
        params = [p for p in model.parameters() if p.requires_grad]
        opt = dtorch.optim.AdamW(params, lr=1e-4)
        mbs = split_micro_batches(ids, ids, chunks=args.micro_batches) if lay.pp > 1 else None

        def step():
            if mbs is not None:
                train_step(model, mbs)
            else:
                model(ids, labels=ids).loss.backward()
            dtorch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
            graph.sync()

        for _ in range(args.warmup):
            step()
        clock = WorkerClock()
        runs = sorted((clock.time(step) for _ in range(args.steps)), key=lambda r: r["wall"])
        graph.runtime.shutdown()
    return dict(runs[len(runs) // 2], cpu=statistics.median(r["cpu"] for r in runs))  # the median step


def predict(cfg, dims: dict, profile: str, args):
    from dtorch.plan import estimate

    m = args.micro_batches if dims.get("pp", 1) > 1 else 1
    return estimate(cfg, None, profile, seq=args.seq, global_batch=args.batch, micro_batches=m,
                    activation_checkpointing="none", mixed_precision="fp32", **{"fsdp": 1, **dims})


def main(argv=None) -> int:
    args = parse(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the workers' torch threads (inherited)
    import torch

    torch.set_num_threads(args.threads)
    profile = args.profile
    if profile is None:
        from dtorch.plan.calibrate import calibrate

        profile = os.path.join(tempfile.mkdtemp(), "here.json")
        calibrate(profile, threads=args.threads)
    cfg = make_config(args)
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    rows = []
    for name in layouts:
        dims = parse_layout(name)
        e = predict(cfg, dims, profile, args)
        measured = measure(cfg, dims, args)
        rows.append((name, e, measured))
        print(f"  {name}: predicted {e.step_time:.3f} s, measured {measured}", file=sys.stderr, flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nLlama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; batch "
          f"{args.batch} x seq {args.seq} (pipelined: {args.micro_batches} micro-batches); float32; "
          f"{args.threads} thread(s) per worker; median of {args.steps} steps; load average {load:.1f}")
    print("| layout | predicted s (compute / exposed comm / bubble) | measured wall s | predicted / wall | "
          "less run-queue wait s | predicted / that | busiest worker CPU s | predicted compute / CPU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    worst = worst_unloaded = 0.0
    for name, e, got in rows:
        ratio, ratio_u, ratio_c = e.step_time / got["wall"], e.step_time / got["unloaded"], e.compute_time / got["cpu"]
        worst, worst_unloaded = max(worst, abs(ratio - 1)), max(worst_unloaded, abs(ratio_u - 1))
        print(f"| {name} | {e.step_time:.3f} ({e.compute_time:.3f} / {e.exposed_comm_time:.3f} / {e.bubble_time:.3f}) "
              f"| {got['wall']:.3f} | {ratio:.2f} | {got['unloaded']:.3f} | {ratio_u:.2f} | {got['cpu']:.3f} | "
              f"{ratio_c:.2f} |")
    print(f"WORST |predicted / measured - 1| = {worst:.0%} on the wall clock, {worst_unloaded:.0%} less the run-queue "
          "wait (target <= 25%)")
    return 0 if worst <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
