"""dtorch plan: will this layout fit, and how fast will it train? Predicted without the hardware.

    dtorch plan --config llama3-8b --devices 8 --hardware h100 --seq 8192 --global-batch 16
    dtorch plan --config llama3-70b --devices 256 --hardware h100 --tp 8 --activation-checkpointing full
    dtorch plan --config llama3-8b --devices 64 --hardware h200 --search --json
    dtorch plan --calibrate my-machine.json        # measure this machine (GEMM rate, collectives) into a profile

One training step (forward, backward, AdamW) runs on the meta backend: shapes only, the placements, collectives
and memory accounting of a real run. A cost model turns it into time on a hardware profile (docs/plan.md).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .estimate import AC_MODES, SCHEDULES, PlanError, estimate
from .hardware import HardwareError, shipped

GIB = 1 << 30


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, the examples kept as written."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtorch plan", description=__doc__.split("\n\n")[0],
                                epilog="examples:\n" + __doc__.split("\n\n", 1)[1].split("\n\n")[0] +
                                "\n\nThe method, what is modelled and what is not: docs/plan.md.",
                                formatter_class=_HelpFormatter)
    p.add_argument("--config", default="llama3-8b", help="a Hugging Face config.json (or its directory), or a shipped "
                   "one: llama3-8b, llama3-70b, llama3-405b")
    p.add_argument("--devices", type=int, help="GPUs (default: the product of the layout flags)")
    p.add_argument("--hardware", default="h100-sxm-80gb", help=f"a shipped profile ({', '.join(shipped())}) or a "
                   "profile file of your own (.json/.toml)")
    g = p.add_argument_group("layout (as dtorch train's; fsdp takes the devices the others leave)")
    for flag, text in (("dp", "data parallel (replicated weights)"), ("tp", "tensor parallel"),
                       ("pp", "pipeline stages"), ("ulysses-cp", "Ulysses context parallel"),
                       ("ring-cp", "ring-attention context parallel")):
        g.add_argument(f"--{flag}", type=int, default=1, help=text)
    g.add_argument("--fsdp", type=int, default=None, help="fully sharded data parallel (default: the rest)")
    t = p.add_argument_group("training step")
    t.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    t.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: one per data-parallel "
                   "rank per micro-batch)")
    t.add_argument("--micro-batches", type=int, default=None, help="micro-batches per step (default: pp)")
    t.add_argument("--activation-checkpointing", choices=AC_MODES, default="selective",
                   help="selective: torchtitan's per-op policy (attention and every other matmul kept)")
    t.add_argument("--mixed-precision", choices=("bf16", "fp32"), default="bf16",
                   help="bf16: FSDP2's policy (bf16 compute, float32 master weights, reductions and AdamW states)")
    t.add_argument("--float8", action="store_true", help="linear layers' matmuls in float8 (torchtitan's Float8Linear)")
    t.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    t.add_argument("--pp-virtual-stages", type=int, default=None, help="interleaved schedule: model chunks per "
                   "device (default 2; at most the layers per stage); the bubble is 1/v of 1F1B's")
    t.add_argument("--exact", action="store_true", help="trace every layer (default: 1 and 2 per stage, extrapolated)")
    o = p.add_argument_group("output")
    o.add_argument("--search", action="store_true", help="cost every valid layout of --devices; print the best")
    o.add_argument("--top", type=int, default=10, help="rows of the --search table")
    o.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="--search: processes costing layouts "
                   "side by side")
    o.add_argument("--json", action="store_true", help="print JSON instead of a table")
    o.add_argument("--plot", metavar="PNG", help="draw memory and step time per layout (needs matplotlib)")
    o.add_argument("--calibrate", metavar="OUT", help="measure this machine (GEMM rate; cost per kernel, element-wise "
                   "rate and the controller's cost per op from a small Llama step; the process backend's collectives) "
                   "and write a hardware profile to OUT, then exit")
    return p


def _row(e) -> list[str]:
    m = e.memory
    return [str(e.layout), f"{m['params'] / GIB:.1f}", f"{m['grads'] / GIB:.1f}", f"{m['optimizer'] / GIB:.1f}",
            f"{m['activations'] / GIB:.1f}", f"{m['peak'] / GIB:.1f}", "yes" if e.fits else "NO",
            f"{e.step_time:.2f}", f"{e.tokens_per_second_per_device:,.0f}", f"{e.mfu:.1%}"]


HEADER = ["layout", "params", "grads", "optim", "activ", "peak GiB", "fits", "step s", "tok/s/dev", "MFU"]


def table(rows: list[list[str]], header=HEADER) -> str:
    rows = [header] + rows
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def describe(e) -> str:
    lines = [table([_row(e)]), "", f"{e.devices} x {e.hardware}; seq {e.seq}, global batch {e.global_batch} in "
             f"{e.micro_batches} micro-batch(es), activation checkpointing {e.activation_checkpointing}"
             f"{', float8' if e.float8 else ''}",
             f"step {e.step_time:.3f} s = compute {e.compute_time:.3f} s + exposed communication "
             f"{e.exposed_comm_time:.3f} s + pipeline bubble {e.bubble_time:.3f} s"
             + (f" (the controller's issue of its ops: {e.controller_time:.3f} s)" if e.controller_time else ""),
             "communication per device per step:"]
    for dim in sorted(e.comm_bytes):
        lines.append(f"  {dim:10s} {e.comm_bytes[dim] / GIB:8.2f} GiB  {e.comm_time.get(dim, 0.0):7.3f} s")
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)


def plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [str(e.layout) for e in results]
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(6, 0.5 * len(names)), 6), sharex=True)
    a.bar(names, [e.memory["peak"] / GIB for e in results], color=["tab:blue" if e.fits else "tab:red" for e in results])
    a.axhline(results[0].memory["capacity"] / GIB, color="k", lw=1, ls="--")
    a.set_ylabel("peak GiB / device")
    b.bar(names, [e.step_time for e in results])
    b.set_ylabel("step time (s)")
    b.tick_params(axis="x", rotation=75)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def check_args(args) -> None:
    """Flags that describe no plan: a PlanError saying what to change."""
    for flag in ("devices", "top", "workers", "seq", "global_batch", "micro_batches", "dp", "tp", "pp", "ulysses_cp",
                 "ring_cp", "fsdp", "pp_virtual_stages"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            raise PlanError(f"--{flag.replace('_', '-')} {v}: must be at least 1")
    if args.search:
        if args.devices is None:
            raise PlanError("--search needs --devices N: the device count whose layouts to compare")
        fixed = [f"--{f.replace('_', '-')}" for f in ("dp", "tp", "pp", "ulysses_cp", "ring_cp")
                 if getattr(args, f) != 1] + (["--fsdp"] if args.fsdp is not None else [])
        if fixed:
            raise PlanError(f"--search chooses the layout itself: drop {', '.join(fixed)} (or drop --search to cost "
                            "that one layout)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise PlanError("--plot needs matplotlib (pip install matplotlib), or drop --plot") from None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.calibrate:
        from .calibrate import calibrate

        try:
            calibrate(args.calibrate)
        except OSError as exc:
            print(f"dtorch plan --calibrate: cannot write {args.calibrate}: {exc}", file=sys.stderr)
            return 2
        return 0
    kw = dict(seq=args.seq, global_batch=args.global_batch, micro_batches=args.micro_batches,
              activation_checkpointing=args.activation_checkpointing, mixed_precision=args.mixed_precision,
              float8=args.float8, pp_schedule=args.pp_schedule, pp_virtual_stages=args.pp_virtual_stages,
              exact=args.exact)
    t0 = time.perf_counter()
    try:
        check_args(args)
        if args.search:
            from .search import search, why_lost

            results = search(args.config, args.devices, args.hardware, workers=args.workers, **kw)
            fitting = [e for e in results if e.fits]
            best = fitting[0] if fitting else None
            if args.json:
                print(json.dumps({"best": best.to_dict() if best else None,
                                  "layouts": [dict(e.to_dict(), lost_because=None if e is best else why_lost(best, e)
                                                   if best else "memory") for e in results]}, indent=1,
                                 sort_keys=True))
            else:
                print(f"dtorch plan --search: {len(results)} layouts of {args.devices} devices costed in "
                      f"{time.perf_counter() - t0:.0f} s\n")
                rows = []
                for e in results[:args.top]:
                    rows.append(_row(e) + ["best" if e is best else (why_lost(best, e) if best else "memory")])
                print(table(rows, HEADER + ["why not"]))
                if best is None:
                    print("\nno layout fits: more devices, activation checkpointing, or a smaller batch per device")
                else:
                    print("\nbest:\n" + describe(best))
            if args.plot:
                plot(results[:max(args.top, 1)], args.plot)
            return 0
        e = estimate(args.config, args.devices, args.hardware, dp=args.dp, fsdp=args.fsdp, tp=args.tp, pp=args.pp,
                     ulysses_cp=args.ulysses_cp, ring_cp=args.ring_cp, **kw)
    except (PlanError, HardwareError) as exc:
        print(f"dtorch plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(e.to_dict(), indent=1, sort_keys=True))
    else:
        print(describe(e))
    if args.plot:
        plot([e], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
