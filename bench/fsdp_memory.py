"""FSDP memory (issue 22): one AdamW step of a Llama on fsdp=8, from the logical per-device accounting
(``Graph.track_memory`` + ``get_memory_breakdown``), against FSDP2's budget.

Default model: the issue's (8 layers, hidden 512, 8 heads / 4 kv heads, MLP 1408, vocab 8192: 32 M
parameters), batch 8 x seq 64 on fsdp=8. Printed:

- the peak per device and what it is made of, against 1.3 x [(params + grads + AdamW states) / 8 + two
  decoder layers unsharded + the device's activations], where the device's activations are what the
  forward holds for the backward (the accounting's "activations" after the forward, before the backward);
- the growth of the peak per added layer (``--layers`` vs half as many), against 1.2 x [a layer's
  (weight + grad + 2 AdamW states) / 8 + its activations];
- frozen decoder layers: what the forward holds (no gathered weight may stay alive);
- ``--rss``: the peak RSS of the simulated step (one process, all 8 devices) against Hugging Face's step on
  one device, each in a fresh process, beyond the process's RSS before the step;
- ``--process``: the same step on the process backend: each worker's peak RSS during the step beyond its
  RSS before it, against the accounting's peak beyond its base for that device (what the accounting does
  not see: the kernels' own temporaries, such as the local graph a backward recomputes).

RSS is read with glibc's free memory handed back first (``malloc_trim``) and a fixed mmap threshold, so it
follows what is live.

    .venv/bin/python bench/fsdp_memory.py [--layers 8] [--hidden 512] [--rss] [--process]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

MiB = 2 ** 20


def make_config(args, layers: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate or args.hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      vocab_size=args.vocab, max_position_embeddings=max(128, args.seq))
    cfg._attn_implementation = "sdpa"
    return cfg


def _step(model, opt, ids):
    out = model(ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()


def _device_max(breakdown: dict, field: str) -> dict:
    """kind -> the largest ``field`` over the devices."""
    out: dict = {}
    for kinds in breakdown.values():
        for kind, v in kinds.items():
            out[kind] = max(out.get(kind, 0), v[field])
    return out


def measure(args, layers: int, frozen: bool = False, backend: str | None = None) -> dict:
    """One warm AdamW step measured: bytes per device (the largest over the devices)."""
    import dtorch
    from dtorch.models.llama import LlamaForCausalLM

    graph = dtorch.Graph(backend=backend) if backend else dtorch.Graph()
    with graph:
        mesh = dtorch.init_device_mesh("cpu", (args.fsdp,), mesh_dim_names=["fsdp"])
        torch.manual_seed(0)
        cfg = make_config(args, layers)
        model = LlamaForCausalLM(cfg, mesh)
        if frozen:
            for layer in model.model.layers:
                layer.requires_grad_(False)
        opt = dtorch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        _step(model, opt, ids)  # warm: optimizer states, plans
        graph.sync()
        graph.track_memory()
        workers_before = graph.runtime.worker_stats() if backend == "process" else None  # (restarts their peaks)
        base_per_device = {dev: st["allocated"] for (_, dev), st in graph.get_memory_stats(mesh).items()}
        base = _device_max(graph.get_memory_breakdown(mesh), "allocated")
        out = model(ids, labels=ids)
        after_forward = _device_max(graph.get_memory_breakdown(mesh), "allocated")
        out.loss.backward()
        del out
        opt.step()
        opt.zero_grad()
        graph.sync()
        stats = graph.get_memory_stats(mesh)
        at_peak = _device_max(graph.get_memory_breakdown(mesh), "at_peak")
        result = {"base": sum(base.values()), "peak": max(s["peak"] for s in stats.values()),
                  "activations": after_forward["activations"] - base["activations"],
                  "gathered_after_forward": after_forward["gathered"], "at_peak": at_peak,
                  "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                  "layer_bytes": sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())}
        if workers_before is not None:  # worker rank r runs device id r
            after = graph.runtime.worker_stats()
            result["workers"] = [{"rss_growth": after[dev]["peak_rss"] - workers_before[dev]["rss"],
                                  "accounted_growth": stats[("cpu", dev)]["peak"] - base_per_device[dev]}
                                 for dev in mesh.device_ids]
        graph.track_memory(False)
    return result


def rss_child(which: str, args) -> dict:
    """In a fresh process: the peak RSS of one warm step beyond the RSS just before it."""
    def status():
        with open("/proc/self/status") as f:
            vals = {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f)
                    if k in ("VmRSS", "VmHWM")}
        return vals["VmRSS"], vals["VmHWM"]

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    from dtorch.runtime.worker_loop import trim_allocator

    torch.manual_seed(0)
    cfg = make_config(args, args.layers)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    if which == "hf":
        import transformers

        model = transformers.LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
        step = lambda: _step(model, opt, ids)  # noqa: E731
    else:
        import dtorch
        from dtorch.models.llama import LlamaForCausalLM

        mesh = dtorch.init_device_mesh("cpu", (args.fsdp,), mesh_dim_names=["fsdp"])
        model = LlamaForCausalLM(cfg, mesh)
        opt = dtorch.optim.AdamW(model.parameters(), lr=1e-4)
        step = lambda: _step(model, opt, ids)  # noqa: E731
    step()
    step()
    gc.collect()
    trim_allocator()  # what the allocator holds free is not the step's
    rss, _ = status()
    reset_peak()
    step()
    _, peak = status()
    return {"rss_before": rss, "peak_growth": peak - rss, "peak": peak}


# glibc raises its mmap threshold as large blocks are freed (up to 32 MiB), after which freed blocks stay
# in the heap and count in RSS: a fixed threshold makes RSS follow what is live (every process measured here)
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _run_child(which: str, argv) -> dict:
    out = subprocess.run([sys.executable, __file__, "--rss-child", which, *argv], capture_output=True, text=True,
                         check=True, env={**os.environ, **FIXED_MMAP_THRESHOLD})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--fsdp", type=int, default=8)
    ap.add_argument("--rss", action="store_true", help="compare the step's process RSS with Hugging Face's")
    ap.add_argument("--process", action="store_true", help="also run on the process backend: worker RSS")
    ap.add_argument("--rss-child", choices=("hf", "dtorch"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args)))
        return
    passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--rss", "--process")]

    t0 = time.perf_counter()
    full = measure(args, args.layers)
    half = measure(args, args.layers // 2)
    P, Lb = full["param_bytes"], full["layer_bytes"]
    state = 4 * P / args.fsdp  # params, grads, exp_avg, exp_avg_sq
    act = full["activations"]
    budget = state + 2 * Lb + act
    print(f"Llama {P / 4 / 1e6:.1f} M parameters, {args.layers} layers (hidden {args.hidden}, vocab {args.vocab}), "
          f"batch {args.batch} x seq {args.seq}, fsdp={args.fsdp}; MiB per device (logical accounting)")
    print(f"  (params + grads + AdamW) / {args.fsdp} = {state / MiB:.2f}, two layers unsharded = {2 * Lb / MiB:.2f}, "
          f"the device's activations (held after the forward) = {act / MiB:.2f}")
    print(f"  peak {full['peak'] / MiB:.2f} = " + " + ".join(f"{k} {v / MiB:.2f}" for k, v in full["at_peak"].items())
          + f"  -> {full['peak'] / budget:.2f} x the budget {budget / MiB:.2f} (acceptance <= 1.3)")
    added = args.layers - args.layers // 2
    growth = (full["peak"] - half["peak"]) / added
    layer_act = (full["activations"] - half["activations"]) / added
    layer_budget = 4 * Lb / args.fsdp + layer_act
    print(f"  growth per added layer ({args.layers // 2} -> {args.layers} layers) {growth / MiB:.2f} -> "
          f"{growth / layer_budget:.2f} x [layer states / {args.fsdp} {4 * Lb / args.fsdp / MiB:.2f} + its activations "
          f"{layer_act / MiB:.2f}] (acceptance <= 1.2)")
    frozen = measure(args, args.layers, frozen=True)
    print(f"  frozen decoder layers: after the forward {frozen['gathered_after_forward'] / MiB:.2f} gathered, "
          f"{frozen['activations'] / MiB:.2f} activations (all trainable: {full['gathered_after_forward'] / MiB:.2f}, "
          f"{act / MiB:.2f})")
    if args.rss:
        ours, hf = _run_child("dtorch", passthrough), _run_child("hf", passthrough)
        print(f"  process RSS of one step, beyond the RSS before it: dtorch (all {args.fsdp} simulated devices) "
              f"{ours['peak_growth'] / MiB:.1f}, Hugging Face (one device) {hf['peak_growth'] / MiB:.1f} -> "
              f"{ours['peak_growth'] / max(hf['peak_growth'], 1):.2f}x (acceptance <= 1.3); peak RSS "
              f"{ours['peak'] / MiB:.0f} vs {hf['peak'] / MiB:.0f}")
    if args.process:
        os.environ.update(FIXED_MMAP_THRESHOLD)  # (the workers inherit it)
        proc = measure(args, args.layers, backend="process")
        rows = proc["workers"]
        print("  process backend, per worker: peak RSS growth during the step / the accounting's peak growth: "
              + ", ".join(f"{w['rss_growth'] / MiB:.1f}/{w['accounted_growth'] / MiB:.1f}" for w in rows))
    print(f"  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
