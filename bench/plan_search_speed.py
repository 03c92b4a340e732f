"""How long ``dtorch plan --search`` takes: the 8B on 64 H100s (158 candidate layouts).

    .venv/bin/python bench/plan_search_speed.py --every 13          # estimate every 13th layout in this process
    PYTHONPATH=<old tree>/src .venv/bin/python bench/plan_search_speed.py --every 13   # the same, another tree
    .venv/bin/python bench/plan_search_speed.py --full --workers 2  # the whole search, as the command runs it

Prints each layout's step time and peak memory (to compare trees) and the CPU and wall seconds; CPU seconds move
less with other jobs' load on a shared machine. ``--full`` counts the worker processes' CPU too.
"""
from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="llama3-8b")
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--every", type=int, default=13, help="estimate every n-th candidate layout")
    ap.add_argument("--full", action="store_true", help="run the whole search instead")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args(argv)
    from dtorch.plan import estimate, load_config, load_hardware
    from dtorch.plan.search import layouts, search

    cfg = load_config(args.config)
    t0, c0 = time.perf_counter(), os.times()
    if args.full:
        res = search(cfg, args.devices, args.hardware, seq=args.seq, workers=args.workers)
        n = len(res)
        for e in res[:5]:
            print(e.layout, round(e.step_time, 4), round(e.peak_memory_gib, 2))
    else:
        cands = layouts(cfg, args.devices, load_hardware(args.hardware).gpus_per_node, args.seq)[::args.every]
        n = len(cands)
        for lay in cands:
            e = estimate(cfg, args.devices, args.hardware, seq=args.seq,
                         global_batch=lay["dp"] * lay["fsdp"] * max(1, lay["pp"]), **lay)
            print(e.layout, round(e.step_time, 4), round(e.peak_memory_gib, 2), flush=True)
    c1 = os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system) + (c1.children_user - c0.children_user) + \
        (c1.children_system - c0.children_system)
    print(f"{n} layouts: wall {time.perf_counter() - t0:.1f} s, CPU {cpu:.1f} s (workers included), load average "
          f"{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
