"""Training speed over layouts (issue 22): one AdamW step of the issue's Llama on simulated devices against
Hugging Face + torch.optim.AdamW on one device.

Model: 8 layers, hidden 512, 8 heads / 4 kv heads, MLP 1408, vocab 8192 (32 M parameters), seq 64, batch 8
and 4. Both sides in one process, same weights and batch, timed alternately (median of --repeats), torch on
one thread; the clock is the process's CPU time by default (``--clock wall`` for elapsed time), so other
processes on a shared machine hardly move the ratios. Layouts:

- ``dp2xtp2xpp2``, ``fsdp8``, ``fsdp4xtp2``: ``model(ids, labels=ids).loss.backward()``, AdamW;
- ``pp2_1f1b``, ``dp2xtp2xpp2_1f1b``: ``dtorch.pipeline.one_f_one_b`` over 4 micro-batches, against HF's
  gradient accumulation over the same micro-batches (each micro-batch's loss / 4, backward, then AdamW);
- ``fsdp8_bf16``: fsdp8 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)`` against the
  same policy in plain torch (a bf16 copy of the HF model computes, its gradients land on the float32
  master, which AdamW updates and copies back).

Prints the seconds per step, the ratio, the first losses (they agree) and, per layout, the largest per-device
peak of the logical memory accounting.

    .venv/bin/python bench/train_matrix.py [--layouts fsdp8,pp2_1f1b] [--batches 8,4] [--repeats 3]
"""
from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time

import torch

import dtorch
from dtorch.models.llama import LlamaForCausalLM
from dtorch.pipeline import one_f_one_b, split_micro_batches

MiB = 2 ** 20
LAYOUTS = {
    "dp2xtp2xpp2": (("dp", 2), ("tp", 2), ("pp", 2)),
    "fsdp8": (("fsdp", 8),),
    "fsdp4xtp2": (("fsdp", 4), ("tp", 2)),
    "pp2_1f1b": (("pp", 2),),
    "dp2xtp2xpp2_1f1b": (("dp", 2), ("tp", 2), ("pp", 2)),
    "fsdp8_bf16": (("fsdp", 8),),
}
MICRO_BATCHES = 4


def make_config(args):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab,
                      max_position_embeddings=max(128, args.seq))
    cfg._attn_implementation = "sdpa"
    return cfg


def hf_step(hf, opt, ids, micro: int):
    def step():
        mbs = split_micro_batches(ids, ids, chunks=micro)
        total = 0.0
        for x, y in mbs:
            loss = hf(x, labels=y).loss
            (loss / micro).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return total / micro
    return step


def hf_bf16_step(master, opt, ids):
    """The plain-torch mixed-precision step: a bf16 working copy computes, float32 master weights update."""
    work = copy.deepcopy(master).to(torch.bfloat16)
    pairs = list(zip(master.parameters(), work.parameters()))

    def step():
        loss = work(ids, labels=ids).loss
        loss.backward()
        for pm, pw in pairs:
            pm.grad, pw.grad = pw.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pm, pw in pairs:
                pw.copy_(pm)
        return loss.detach()
    return step


def train_step(model, opt, ids, micro: int):
    if micro > 1:
        loss = one_f_one_b(model, split_micro_batches(ids, ids, chunks=micro))
    else:
        loss = model(ids, labels=ids).loss
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def dt_step(model, opt, ids, micro: int, graph, compiled: bool = False):
    fn = dtorch.compile(train_step) if compiled else train_step

    def step():
        loss = fn(model, opt, ids, micro)
        graph.sync()
        return loss
    return step


def run_layout(name: str, batch: int, args, hf_base) -> dict:
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    cfg = hf_base.config
    micro = MICRO_BATCHES if name.endswith("_1f1b") else 1
    bf16 = name.endswith("_bf16")
    hf = copy.deepcopy(hf_base)
    mesh = dtorch.init_device_mesh("cpu", [n for _, n in LAYOUTS[name]],
                                   mesh_dim_names=[d for d, _ in LAYOUTS[name]])
    kw = {"mp_policy": dtorch.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    model = LlamaForCausalLM(cfg, mesh, **kw)
    model.load_state_dict(hf.state_dict())
    if args.compile:  # a second model for the compiled step (its own optimizer states)
        model_c = LlamaForCausalLM(cfg, mesh, **kw)
        model_c.load_state_dict(hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (batch, args.seq), generator=torch.Generator().manual_seed(1))
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, foreach=False)
    dt_opt = dtorch.optim.AdamW(model.parameters(), lr=1e-4)
    graph = dtorch.default_graph()
    steps = {"hf": hf_bf16_step(hf, hf_opt, ids) if bf16 else hf_step(hf, hf_opt, ids, micro),
             "dtorch": dt_step(model, dt_opt, ids, micro, graph)}
    if args.compile:
        steps["compiled"] = dt_step(model_c, dtorch.optim.AdamW(model_c.parameters(), lr=1e-4), ids, micro, graph,
                                    compiled=True)
    first = {k: float(f().item()) for k, f in steps.items()}  # warm: plans, optimizer states
    if args.compile:
        for _ in range(2):  # the compiled step traces its first two calls (the optimizer's first step makes state)
            steps["compiled"]()
    times = {k: [] for k in steps}
    collector = {k: GcTime(clock) for k in steps}
    for _ in range(args.repeats):
        for k, f in steps.items():
            t0 = clock()
            with collector[k]:
                f()
            times[k].append(clock() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    peak = None
    if args.memory:
        graph.track_memory()
        steps["dtorch"]()
        peak = max(s["peak"] for s in graph.get_memory_stats(mesh).values())
        graph.track_memory(False)
    return {"hf": med["hf"], "dtorch": med["dtorch"], "ratio": med["dtorch"] / med["hf"], "first": first,
            "peak": peak, "compiled": med.get("compiled"),
            "gc": {k: (c.runs / args.repeats, c.seconds / args.repeats) for k, c in collector.items()}}


class GcTime:
    """The cyclic collector's runs and time inside the ``with`` blocks (``gc.callbacks``)."""

    def __init__(self, clock):
        self.clock, self.runs, self.seconds, self._t0, self._on = clock, 0, 0.0, 0.0, False

    def _callback(self, phase, info):
        if not self._on:
            return
        if phase == "start":
            self._t0 = self.clock()
        else:
            self.runs += 1
            self.seconds += self.clock() - self._t0

    def __enter__(self):
        self._on = True
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def __exit__(self, *exc):
        self._on = False


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--batches", default="8,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="cpu: the process's CPU time (one torch thread: robust to other processes on a shared "
                         "machine); wall: elapsed time")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory-tracked step")
    ap.add_argument("--compile", action="store_true",
                    help="also time the step under dtorch.compile (a second model, the same weights): eager and "
                         "compiled in one command")
    ap.add_argument("--gc", action="store_true", help="print the cyclic collector's runs and seconds per step")
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            ap.error(f"unknown layout {name!r}; pick from {', '.join(LAYOUTS)}")
    torch.set_num_threads(args.threads)
    import transformers

    torch.manual_seed(0)
    hf_base = transformers.LlamaForCausalLM(make_config(args))
    n = sum(p.numel() for p in hf_base.parameters())
    print(f"Llama {n / 1e6:.1f} M params, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
          f"torch threads {torch.get_num_threads()}, median of {args.repeats}, {args.clock} time")
    extra = " compiled s | compiled / HF |" if args.compile else ""
    print(f"| layout | batch | HF s | dtorch s | dtorch / HF |{extra} first loss HF / dtorch | peak MiB/device |")
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if args.compile else "") + "---:|---:|")
    for batch in [int(b) for b in args.batches.split(",")]:
        for name in layouts:
            r = run_layout(name, batch, args, hf_base)
            peak = "" if r["peak"] is None else f"{r['peak'] / MiB:.1f}"
            comp = "" if r["compiled"] is None else f" {r['compiled']:.3f} | {r['compiled'] / r['hf']:.2f} |"
            print(f"| {name} | {batch} | {r['hf']:.3f} | {r['dtorch']:.3f} | {r['ratio']:.2f} |{comp} "
                  f"{r['first']['hf']:.4f} / {r['first']['dtorch']:.4f} | {peak} |", flush=True)
            if args.gc:
                print("    cyclic collector per step (runs, seconds): " +
                      ", ".join(f"{k} {n:.1f}, {t:.3f} s" for k, (n, t) in r["gc"].items()), flush=True)


if __name__ == "__main__":
    main()
