"""Predicted against measured: ``dtorch plan``'s step time of a small Llama training step, calibrated on this
machine, against the same step run on the process backend (one worker process per device), for 5 layouts.

    .venv/bin/python bench/plan_vs_measured.py                       # calibrate, then dp2 fsdp2 tp2 pp2 ring_cp2
    .venv/bin/python bench/plan_vs_measured.py --profile here.json   # reuse a profile from dtorch plan --calibrate

The profile comes from ``dtorch plan --calibrate`` (``dtorch.plan.calibrate``: this machine's GEMM rate at the
workers' thread count; the cost per kernel, the element-wise rate and the controller's cost per op from a small
Llama's step at three other sizes on dp2; each collective's alpha and beta in a stream of ops): nothing in it is
fitted to these layouts or this model's size. One step = forward with labels, backward, gradient clipping, AdamW
(float32, no activation checkpointing), as ``dtorch.plan.trace`` traces it; a pipelined layout runs
``dtorch.pipeline.train_step`` (1F1B) over ``--micro-batches``. Measured: the median of ``--steps`` steps after
``--warmup`` (each ends with ``graph.sync()``). Target: every ratio within 25%.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

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
    from dtorch.plan.calibrate import llama_config

    return llama_config(args.hidden, args.layers, args.heads, args.heads // 2, args.vocab, args.seq)


def measure(cfg, dims: dict, args) -> dict:
    """One training step of ``cfg`` on the process backend in layout ``dims`` (``dtorch.plan.calibrate.measure_step``,
    the code calibration times its op mix with): the median wall seconds, and per step the busiest worker thread's
    CPU seconds, the seconds it waited, runnable, for a core (other jobs' load), and the controller's CPU seconds."""
    from dtorch.plan.calibrate import measure_step
    from dtorch.plan.trace import Layout

    lay = Layout(**dims)
    return measure_step(cfg, lay, seq=args.seq, rows=args.batch, micro_batches=args.micro_batches if lay.pp > 1 else 1,
                        steps=args.steps, warmup=args.warmup)


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
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
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
    print(f"\nload average at the start {load0:.1f}, at the end {load:.1f}")
    print(f"Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads, vocab {args.vocab}; batch "
          f"{args.batch} x seq {args.seq} (pipelined: {args.micro_batches} micro-batches); float32; "
          f"{args.threads} thread(s) per worker; median of {args.steps} steps")
    print("| layout | predicted s (compute / exposed comm / bubble; controller) | measured wall s | predicted / wall | "
          "less run-queue wait s | predicted / that | busiest worker CPU s | predicted compute / CPU | controller CPU s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    worst = worst_unloaded = 0.0
    for name, e, got in rows:
        ratio, ratio_u, ratio_c = e.step_time / got["wall"], e.step_time / got["unloaded"], e.compute_time / got["cpu"]
        worst, worst_unloaded = max(worst, abs(ratio - 1)), max(worst_unloaded, abs(ratio_u - 1))
        print(f"| {name} | {e.step_time:.3f} ({e.compute_time:.3f} / {e.exposed_comm_time:.3f} / {e.bubble_time:.3f}; "
              f"{e.controller_time:.3f}) | {got['wall']:.3f} | {ratio:.2f} | {got['unloaded']:.3f} | {ratio_u:.2f} | "
              f"{got['cpu']:.3f} | {ratio_c:.2f} | {got['controller']:.3f} |")
    print(f"WORST |predicted / measured - 1| = {worst:.0%} on the wall clock, {worst_unloaded:.0%} less the run-queue "
          "wait (target <= 25%)")
    return 0 if worst <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
