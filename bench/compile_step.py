"""dtorch.compile against eager dtorch and torch, in one process (issue 24's speed figures).

- ``add``: a loop of element-wise adds on a small tensor (1-device and 8-device meshes), eager dtorch and a
  ``dtorch.compile``d loop, each against the same loop in torch.
- ``train``: the ``dtorch train`` default model (4 layers, hidden 128, 8 heads / 4 kv heads, vocab 256: 0.8 M
  parameters; batch 8 x seq 64): forward with labels, backward, AdamW, zero_grad. Hugging Face + torch.optim.AdamW
  on one device = 1; dtorch eager and compiled, on one device and on 16 simulated devices (dp2 x tp2 x pp2 x
  ulysses2). Each compiled step is checked to give the eager step's loss bit for bit.

Timed alternately (median of --repeats windows), torch on one thread, process CPU time (other processes on a
shared machine hardly move the ratios).

- ``memory``: peak resident memory of 4 steps of the 32 M Llama (8 layers) on fsdp8, eager and compiled, each in
  a process of its own.

``--backend inductor`` adds a column: the same loop or step under ``dtorch.compile(fn, backend="inductor")`` (its
local calls compiled by torch.compile, docs/compile.md), warmed up until its segments are compiled (the compile
time is not in the figure; it is printed), checked against torch/eager within assert_close's float32 tolerance.

    .venv/bin/python bench/compile_step.py [--only add|train|memory] [--repeats 5] [--backend inductor]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import dtorch
from dtorch.models.llama import LlamaForCausalLM

CLOCK = time.process_time


def timed(fns: dict, repeats: int, n: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = CLOCK()
            for _ in range(n):
                f()
            times[k].append((CLOCK() - t0) / n)
    return {k: statistics.median(v) for k, v in times.items()}


def _inductor_warm(compiled, call, steps: int = 14) -> float:
    """Call ``compiled`` until its segments are compiled and measured (a replay rebuilds at its 2nd call, a segment
    compiles at its 2nd and keeps the faster way from its 9th): the seconds that took, wall clock."""
    t0 = time.perf_counter()
    for _ in range(steps):
        call()
    if compiled.inductor.fallbacks or not compiled.inductor.segments:
        raise RuntimeError(f"inductor segments did not compile: {compiled.inductor.describe()}")
    return time.perf_counter() - t0


def bench_add(repeats: int, inductor: bool = False) -> None:
    adds = 50
    print(f"\n## tiny add: a loop of {adds} adds on a [8, 8] float32 tensor, seconds per loop (ratio to torch)\n")
    print("| mesh | torch | dtorch eager | dtorch.compile |" + (" dtorch.compile inductor |" if inductor else ""))
    print("|---|---:|---:|---:|" + ("---:|" if inductor else ""))
    x = torch.randn(8, 8)

    def loop(a, b):
        for _ in range(adds):
            a = a + b
        return a

    for name, mesh in (("1 device", dtorch.DeviceMesh("cpu")),
                       ("8 devices (Shard(0))", dtorch.init_device_mesh("cpu", (8,), mesh_dim_names=["dp"]))):
        placements = [dtorch.Shard(0)] * mesh.ndim if mesh.size() > 1 else [dtorch.Replicate()]
        a = dtorch.Tensor(x, device_mesh=mesh, placements=placements)
        b = dtorch.Tensor(x, device_mesh=mesh, placements=placements)
        compiled = dtorch.compile(loop)
        assert torch.equal(compiled(a, b).to_torch(), loop(a, b).to_torch())
        assert torch.equal(compiled(a, b).to_torch(), loop(x, x))
        fns = {"torch": lambda: loop(x, x), "eager": lambda: loop(a, b), "compiled": lambda: compiled(a, b)}
        extra = ""
        if inductor:
            fused = dtorch.compile(loop, backend="inductor")
            warm = _inductor_warm(fused, lambda: fused(a, b))
            torch.testing.assert_close(fused(a, b).to_torch(), loop(x, x))
            fns["inductor"] = lambda: fused(a, b)
        t = timed(fns, repeats, 200)
        if inductor:
            extra = f" {t['inductor'] * 1e6:.0f} us ({t['inductor'] / t['torch']:.2f}x; compiled in {warm:.0f} s) |"
        print(f"| {name} | {t['torch'] * 1e6:.0f} us | {t['eager'] * 1e6:.0f} us ({t['eager'] / t['torch']:.2f}x) | "
              f"{t['compiled'] * 1e6:.0f} us ({t['compiled'] / t['torch']:.2f}x) |" + extra, flush=True)


def train_step(model, opt, ids):
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def bench_train(repeats: int, inductor: bool = False) -> None:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=256, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    n = sum(p.numel() for p in hf.parameters())
    ids = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, foreach=False)
    print(f"\n## train step: Llama {n / 1e6:.2f} M parameters, batch 8 x seq 64, seconds per step (ratio to HF)\n")
    print("| mesh | HF + torch AdamW | dtorch eager | dtorch.compile | compiled loss == eager loss |"
          + (" dtorch.compile inductor |" if inductor else ""))
    print("|---|---:|---:|---:|---|" + ("---:|" if inductor else ""))
    meshes = (("1 device", dtorch.DeviceMesh("cpu")),
              ("16 devices: dp2 x tp2 x pp2 x ulysses2",
               dtorch.init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=["dp", "tp", "pp", "ulysess_cp"])))
    for name, mesh in meshes:
        models = []
        for _ in range(3 if inductor else 2):
            m = LlamaForCausalLM(cfg, mesh)
            m.load_state_dict(hf.state_dict())
            models.append((m, dtorch.optim.AdamW(m.parameters(), lr=1e-4)))
        (m_e, o_e), (m_c, o_c) = models[:2]
        compiled = dtorch.compile(train_step)
        fused = dtorch.compile(train_step, backend="inductor") if inductor else None
        same, warm = True, 0.0
        for n in range(14 if inductor else 4):
            want = train_step(m_e, o_e, ids).to_torch()
            same = same and torch.equal(want, compiled(m_c, o_c, ids).to_torch())
            if inductor:  # warm-ups and traces, then the segments compile and are measured (compile/inductor.py)
                t0 = time.perf_counter()
                got = fused(*models[2], ids).to_torch()
                warm += time.perf_counter() - t0
                torch.testing.assert_close(got, want)
        h = copy.deepcopy(hf)
        h_opt = torch.optim.AdamW(h.parameters(), lr=1e-4, foreach=False)
        fns = {"hf": lambda: train_step(h, h_opt, ids), "eager": lambda: train_step(m_e, o_e, ids),
               "compiled": lambda: compiled(m_c, o_c, ids)}
        extra = ""
        if inductor:
            if fused.inductor.fallbacks or not fused.inductor.segments:
                raise RuntimeError(f"inductor segments did not compile: {fused.inductor.describe()}")
            fns["inductor"] = lambda: fused(*models[2], ids)
        t = timed(fns, repeats, 3)
        if inductor:
            sizes = [len(s.calls) for s in fused.inductor.segments]
            kept = [len(s.calls) for s in fused.inductor.segments if s.compiled is not None]
            extra = (f" {t['inductor'] * 1e3:.1f} ms ({t['inductor'] / t['hf']:.2f}x; segments of {sizes} calls, "
                     f"{kept} kept compiled; {warm:.0f} s to compile) |")
        print(f"| {name} | {t['hf'] * 1e3:.1f} ms | {t['eager'] * 1e3:.1f} ms ({t['eager'] / t['hf']:.2f}x) | "
              f"{t['compiled'] * 1e3:.1f} ms ({t['compiled'] / t['hf']:.2f}x) | {same} "
              f"({compiled.stats['replays']} replays, {compiled.stats['traces']} traces) |" + extra, flush=True)
    del hf_opt


def memory_child(mode: str) -> None:
    """One process: the issue-22 Llama (32 M parameters, 8 layers) on fsdp8, 4 AdamW steps eager or compiled;
    prints the process's peak resident memory."""
    import resource

    import transformers

    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=4, vocab_size=8192, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, dtorch.init_device_mesh("cpu", (8,), mesh_dim_names=["fsdp"]))
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (8, 64), generator=torch.Generator().manual_seed(1))
    step = dtorch.compile(train_step) if mode == "compiled" else train_step
    for _ in range(4):
        step(model, opt, ids)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)


def bench_memory() -> None:
    import subprocess
    import sys

    print("\n## peak resident memory: 4 AdamW steps of the 32 M Llama (8 layers) on fsdp8, batch 8 x seq 64, "
          "one process each\n")
    peaks = {}
    for mode in ("eager", "compiled"):
        out = subprocess.run([sys.executable, __file__, "--memory-child", mode], capture_output=True, text=True,
                             timeout=900, check=True)
        peaks[mode] = int(out.stdout.split()[-1])
    print(f"| eager | compiled | compiled / eager |\n|---:|---:|---:|\n| {peaks['eager']} MiB | {peaks['compiled']} MiB "
          f"| {peaks['compiled'] / peaks['eager']:.2f} |")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=("add", "train", "memory"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", choices=("eager", "inductor"), default="eager",
                    help="inductor: add a dtorch.compile(backend='inductor') column (add and train)")
    ap.add_argument("--memory-child", choices=("eager", "compiled"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.memory_child:
        memory_child(args.memory_child)
        return
    if args.only in (None, "add"):
        bench_add(args.repeats, args.backend == "inductor")
    if args.only in (None, "train"):
        bench_train(args.repeats, args.backend == "inductor")
    if args.only in (None, "memory"):
        bench_memory()


if __name__ == "__main__":
    main()
