"""Simulated Llama train step: dtorch on 16 simulated CPU devices vs the single-device torch train step.

One step = forward with labels (HF's causal-LM loss), backward, AdamW. Same process, same weights, same
batch; the two are timed alternately (best of --repeat) so machine noise hits both. Layout
dp2 x tp2 x pp2 x ulysses2 by default. Also the fsdp memory check: per-device parameters + gradients +
AdamW states under fsdp=4 vs a quarter of the whole model's.

    .venv/bin/python bench/train_step.py [--seq 256] [--repeat 3] [--small]
"""
from __future__ import annotations

import argparse
import time

import torch

import dtorch
from dtorch.models.llama import LlamaForCausalLM


def make_config(small: bool):
    from transformers import LlamaConfig

    kw = dict(vocab_size=512, hidden_size=128, intermediate_size=352) if small else \
        dict(vocab_size=32000, hidden_size=1024, intermediate_size=2752)
    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
                      **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def step_fn(model, opt, ids, sync):
    def step():
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        return out.loss

    return step


def fsdp_memory(cfg, fsdp: int = 4) -> tuple[int, int]:
    """(max per-device bytes of parameters + gradients + AdamW states under fsdp, the whole model's)."""
    from dtorch.models.train_cli import bytes_per_device

    mesh = dtorch.init_device_mesh("cpu", (fsdp,), mesh_dim_names=["fsdp"])
    model = LlamaForCausalLM(cfg, mesh)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (fsdp, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    params = list(model.parameters())
    tensors = params + [p.grad for p in params] + [v for st in opt.state.values() for v in st.values()
                                                  if isinstance(v, dtorch.Tensor)]
    per_dev = bytes_per_device(tensors)
    whole = sum(p.numel() * p.element_size() for p in params) * 4  # weights, grads, exp_avg, exp_avg_sq
    return max(per_dev.values()), whole


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dims", default="dp=2,tp=2,pp=2,ulysess_cp=2")
    args = ap.parse_args(argv)
    import transformers

    torch.manual_seed(0)
    cfg = make_config(args.small)
    hf = transformers.LlamaForCausalLM(cfg)
    names, sizes = zip(*[(kv.split("=")[0], int(kv.split("=")[1])) for kv in args.dims.split(",")])
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
    model = LlamaForCausalLM(cfg, mesh)
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, foreach=False)
    dt_opt = dtorch.optim.AdamW(model.parameters(), lr=1e-4)
    graph = dtorch.default_graph()
    steps = {"torch (1 device)": step_fn(hf, hf_opt, ids, lambda: None),
             f"dtorch ({mesh.size()} simulated devices)": step_fn(model, dt_opt, ids, graph.sync)}
    losses = {}
    for k, f in steps.items():  # warm up (plans, allocator); the first losses must agree
        loss = f()
        losses[k] = loss.item()
    best = {k: float("inf") for k in steps}
    for _ in range(args.repeat):
        for k, f in steps.items():
            t0 = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t0)
    n = sum(p.numel() for p in hf.parameters())
    print(f"Llama {n / 1e6:.1f} M params, batch {args.batch} x seq {args.seq}, layout {mesh}, "
          f"torch threads {torch.get_num_threads()}")
    base = best["torch (1 device)"]
    for k, t in best.items():
        print(f"{k:34s} {t:8.3f} s  {t / base:5.2f}x   first loss {losses[k]:.5f}")
    per_dev, whole = fsdp_memory(cfg)
    print(f"fsdp=4: per-device parameters + grads + AdamW states {per_dev / 2**20:.1f} MiB = "
          f"{per_dev / (whole / 4):.3f}x a quarter of the whole ({whole / 4 / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
