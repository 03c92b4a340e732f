"""Cold start: from a fresh interpreter to the first op results.

Each run is a fresh subprocess (nothing cached in the interpreter). Baseline: ``import torch``
alone. dtorch: ``import dtorch`` (which imports torch) and then the first ops a user runs, each
fetched with ``.to_torch()``: ``dtorch.randn(8, 8) + 1``, a matmul and a softmax. Prints medians,
the ratio to the baseline, dtorch's own overhead (total minus the torch import) and whether the
first ops pulled in torch's heavy lazy imports (``torch._dynamo``, ``sympy``).

    .venv/bin/python bench/cold_start.py [--runs 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

TORCH_ONLY = """
import json, time
t0 = time.perf_counter()
import torch
print(json.dumps({"import": time.perf_counter() - t0}))
"""

DTORCH = """
import json, sys, time
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
import dtorch
t_import = time.perf_counter()
x = dtorch.randn(8, 8)
(x + 1).to_torch()
t_add = time.perf_counter()
(x @ x).to_torch()
t_matmul = time.perf_counter()
dtorch.softmax(x, -1).to_torch()
t_end = time.perf_counter()
print(json.dumps({"torch": t_torch - t0, "dtorch_import": t_import - t_torch, "add": t_add - t_import,
                  "matmul": t_matmul - t_add, "softmax": t_end - t_matmul, "total": t_end - t0,
                  "heavy": [m for m in ("torch._dynamo", "sympy") if m in sys.modules]}))
"""


def run(code: str, timeout: float) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="fresh subprocesses per measurement (medians are reported)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one subprocess may take")
    args = ap.parse_args()

    base, dt = [], []
    for _ in range(args.runs):  # interleaved, so load changes on the machine hit both alike
        base.append(run(TORCH_ONLY, args.timeout)["import"])
        dt.append(run(DTORCH, args.timeout))
    keys = ("torch", "dtorch_import", "add", "matmul", "softmax", "total")
    med = {k: statistics.median(r[k] for r in dt) for k in keys}
    baseline = statistics.median(base)
    own = med["dtorch_import"] + med["add"] + med["matmul"] + med["softmax"]
    heavy = sorted({m for r in dt for m in r["heavy"]})
    rows = [
        ("import torch alone (baseline, its own processes)", baseline),
        ("import dtorch + first ops: total", med["total"]),
        ("  torch import inside it", med["torch"]),
        ("  dtorch import", med["dtorch_import"]),
        ("  first (x + 1).to_torch()", med["add"]),
        ("  first matmul", med["matmul"]),
        ("  first softmax", med["softmax"]),
        ("dtorch-only overhead (dtorch import + first ops)", own),
        ("total - baseline (noisier: other processes)", med["total"] - baseline),
    ]
    print(f"median of {args.runs} fresh processes, seconds")
    for label, v in rows:
        print(f"  {label:<52s} {v:7.3f}")
    print(f"  {'ratio total / baseline':<52s} {med['total'] / baseline:7.2f}x")
    print(f"  heavy lazy torch imports after the first ops: {', '.join(heavy) if heavy else 'none'}")

if __name__ == "__main__":
    main()
