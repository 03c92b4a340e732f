"""Cold start: from a fresh interpreter to the first op results.

Each run is a fresh subprocess (nothing cached in the interpreter). Baseline: ``import torch``
alone. dtorch: ``import dtorch`` (which imports torch) and then the first ops a user runs, each
fetched with ``.to_torch()``: ``dtorch.randn(8, 8) + 1``, a matmul and a softmax. Prints medians,
the ratio to the baseline, dtorch's own overhead (total minus the torch import) and whether the
first ops pulled in torch's heavy lazy imports (``torch._dynamo``, ``sympy``).

"First Llama forward": ``import dtorch``, build a small ``dtorch.models.llama.LlamaForCausalLM``
(the "base" config of tests/models/test_llama.py: hidden 64, 2 layers, 4 heads, vocab 160; random
weights) on a tp=2 mesh of virtual CPU devices, and run one forward on [3, 7] token ids; a second
forward shows the steady state. The config is a plain namespace, not ``transformers.LlamaConfig``:
importing transformers would dwarf what is measured.

    .venv/bin/python bench/cold_start.py [--runs 7] [--only ops|llama]
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
                  "heavy": [m for m in HEAVY if m in sys.modules]}))
"""

LLAMA = """
import json, sys, time, types
t0 = time.perf_counter()
import torch
t_torch = time.perf_counter()
import dtorch
from dtorch.models.llama import LlamaForCausalLM
t_import = time.perf_counter()
config = types.SimpleNamespace(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, vocab_size=160, max_position_embeddings=64, rms_norm_eps=1e-6,
                               rope_theta=10000.0, attention_bias=False, mlp_bias=False, hidden_act="silu",
                               tie_word_embeddings=False)
torch.manual_seed(0)
torch.set_grad_enabled(False)  # inference: no autograd history (parameters require grad)
model = LlamaForCausalLM(config, dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"]))
ids = torch.randint(0, 160, (3, 7))
t_build = time.perf_counter()
model(ids)
t_first = time.perf_counter()
heavy = [m for m in HEAVY if m in sys.modules]
model(ids)
t_end = time.perf_counter()
print(json.dumps({"torch": t_torch - t0, "dtorch_import": t_import - t_torch, "build": t_build - t_import,
                  "first": t_first - t_build, "second": t_end - t_first, "total": t_first - t0, "heavy": heavy}))
"""


# torch's lazy imports that a first op can pull in (seconds): torch._dynamo (for the _disable_dynamo wrapper
# of torch's Python meta kernels), sympy (every torch._check on symbolic shapes), and what either drags along
HEAVY = ("torch._dynamo", "sympy", "torch._inductor", "torch.fx.experimental.symbolic_shapes", "transformers")
DTORCH, LLAMA = (code.replace("HEAVY", repr(HEAVY)) for code in (DTORCH, LLAMA))


def run(code: str, timeout: float) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7, help="fresh subprocesses per measurement (medians are reported)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one subprocess may take")
    ap.add_argument("--only", choices=("ops", "llama"), help="one measurement only (default: both)")
    args = ap.parse_args()

    base, dt, llama = [], [], []
    for _ in range(args.runs):  # interleaved, so load changes on the machine hit all alike
        base.append(run(TORCH_ONLY, args.timeout)["import"])
        if args.only != "llama":
            dt.append(run(DTORCH, args.timeout))
        if args.only != "ops":
            llama.append(run(LLAMA, args.timeout))
    baseline = statistics.median(base)
    print(f"median of {args.runs} fresh processes, seconds")
    print(f"  {'import torch alone (baseline, its own processes)':<52s} {baseline:7.3f}")
    if dt:
        _report_ops(dt, baseline)
    if llama:
        _report_llama(llama, baseline)


def _medians(results, keys) -> dict:
    return {k: statistics.median(r[k] for r in results) for k in keys}


def _print_rows(rows, med, baseline, heavy):
    for label, v in rows:
        print(f"  {label:<52s} {v:7.3f}")
    print(f"  {'total - baseline (noisier: other processes)':<52s} {med['total'] - baseline:7.3f}")
    print(f"  {'ratio total / baseline':<52s} {med['total'] / baseline:7.2f}x")
    print(f"  heavy lazy torch imports: {', '.join(heavy) if heavy else 'none'}")


def _report_ops(dt, baseline):
    med = _medians(dt, ("torch", "dtorch_import", "add", "matmul", "softmax", "total"))
    own = med["dtorch_import"] + med["add"] + med["matmul"] + med["softmax"]
    print("import dtorch + first ops")
    _print_rows([
        ("total", med["total"]),
        ("  torch import inside it", med["torch"]),
        ("  dtorch import", med["dtorch_import"]),
        ("  first (x + 1).to_torch()", med["add"]),
        ("  first matmul", med["matmul"]),
        ("  first softmax", med["softmax"]),
        ("dtorch-only overhead (dtorch import + first ops)", own),
    ], med, baseline, sorted({m for r in dt for m in r["heavy"]}))


def _report_llama(llama, baseline):
    med = _medians(llama, ("torch", "dtorch_import", "build", "first", "second", "total"))
    own = med["dtorch_import"] + med["build"] + med["first"]
    print("import dtorch + first Llama forward (tp=2, [3, 7] ids)")
    _print_rows([
        ("total (to the first forward's logits)", med["total"]),
        ("  torch import inside it", med["torch"]),
        ("  dtorch import (+ dtorch.models.llama)", med["dtorch_import"]),
        ("  build the model", med["build"]),
        ("  first forward", med["first"]),
        ("second forward (steady state, not in the total)", med["second"]),
        ("dtorch-only overhead (import + build + 1st forward)", own),
    ], med, baseline, sorted({m for r in llama for m in r["heavy"]}))


if __name__ == "__main__":
    main()
