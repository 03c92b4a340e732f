"""Ring attention on uneven sequence splits against the next even length, same process.

For each (mesh, uneven seq, even seq) the context-parallel SDPA runs on Q/K/V already laid out
Shard(2) on the cp dims (GQA 8/2 heads, head dim 64, batch 2, causal); prints the time per call of
both and their ratio. An uneven split (torch.chunk blocks, some possibly empty) should cost about
what the next even length costs: goal <= 1.3x. ``--llama`` adds the forward of the small Llama of
bench/llama_simulation.py on ring_cp=3 (every op of the model on the uneven layout, not only attention).
``--backward`` times forward + backward instead (Q/K/V require grad, the output gradient given), reports
the largest gradient error against torch.autograd and the backward's share as fwd+bwd / fwd.

    .venv/bin/python bench/ring_attention.py [--reps 30] [--threads 1] [--llama] [--backward]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import dtorch
from dtorch import Shard
from dtorch.models.layout import context_parallel

# (mesh dim names, mesh shape, uneven seq, even seq)
CASES = [
    (("ring_cp",), (2,), 7, 8),
    (("ring_cp",), (3,), 10, 12),
    (("ring_cp",), (4,), 6, 8),      # blocks 2, 2, 2, 0
    (("ring_cp",), (4,), 13, 16),
    (("ring_cp",), (3,), 250, 252),
    (("ulysess_cp", "ring_cp"), (2, 3), 22, 24),
    (("ring_cp", "ulysess_cp"), (3, 2), 22, 24),
]


def make_case(names, shape, seq, causal=True, backward=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, seq, 64, generator=g)
    k, v = (torch.randn(2, 2, seq, 64, generator=g) for _ in range(2))
    mesh = dtorch.init_device_mesh("cpu", shape, mesh_dim_names=list(names))
    pl = [Shard(2)] * len(shape)
    qd, kd, vd = (dtorch.Tensor(x, device_mesh=mesh, placements=pl) for x in (q, k, v))
    cp = context_parallel(mesh)  # Ulysses / Ring on the dims of those names, as the Llama chooses it
    fn = lambda: dtorch.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=True,  # noqa: E731
                                                     context_parallel=cp)
    if backward:
        return backward_case(fn, mesh, pl, (q, k, v), (qd, kd, vd), causal)
    out = fn()  # plans once; also checks the result
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    err = (out.to_torch() - ref).abs().max().item()
    return fn, err


def backward_case(forward, mesh, pl, ts, ds, causal):
    """forward + backward of the laid-out case; the error is the largest gradient difference to torch's."""
    ts = [x.clone().requires_grad_() for x in ts]
    ref = F.scaled_dot_product_attention(*ts, is_causal=causal, enable_gqa=True)
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    ref.backward(go)
    for d in ds:
        d.requires_grad_()
    gd = dtorch.Tensor(go, device_mesh=mesh, placements=pl)

    def fn():
        for d in ds:
            d.grad = None
        forward().backward(gd)

    fn()
    err = max((d.grad.to_torch() - t.grad).abs().max().item() for d, t in zip(ds, ts))
    return fn, err


def best_ms_interleaved(fa, fb, reps: int):
    """Best single-call time of ``fa`` and of ``fb`` in ms, calls alternating so that load from other
    processes on the machine hits both sides alike."""
    best = [float("inf"), float("inf")]
    for _ in range(reps):
        for j, fn in enumerate((fa, fb)):
            t0 = time.perf_counter()
            fn()
            best[j] = min(best[j], time.perf_counter() - t0)
    return best[0] * 1e3, best[1] * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30, help="timed calls of each side (best one counts)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: tiny kernels on a busy machine time far more steadily)")
    ap.add_argument("--llama", action="store_true", help="also the small Llama forward on ring_cp=3")
    ap.add_argument("--backward", action="store_true",
                    help="time forward + backward (gradients of Q/K/V) instead of the forward alone")
    args = ap.parse_args(argv)
    if args.backward:
        return backward_table(args.reps, args.threads)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    header = f"{'mesh':24} {'seq uneven/even':>15} {'uneven ms':>10} {'even ms':>8} {'ratio':>6} {'max err':>8}"
    print(header)
    print("-" * len(header))
    for names, shape, uneven, even in CASES:
        mesh_s = " x ".join(f"{n}{s}" for n, s in zip(names, shape))
        even_fn, _ = make_case(names, shape, even)
        try:
            fn, err = make_case(names, shape, uneven)
        except Exception as exc:  # the "before" runs: empty blocks used to crash
            print(f"{mesh_s:24} {f'{uneven}/{even}':>15} {'error':>10} {'':>8} {'':>6} {type(exc).__name__}")
            continue
        t, t_even = best_ms_interleaved(fn, even_fn, args.reps)
        print(f"{mesh_s:24} {f'{uneven}/{even}':>15} {t:10.2f} {t_even:8.2f} {t / t_even:6.2f} {err:8.1e}")
    if args.llama:
        llama_forward(args.reps)


def backward_table(reps: int, threads: int):
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; forward + backward\n")
    header = (f"{'mesh':24} {'seq uneven/even':>15} {'uneven ms':>10} {'even ms':>8} {'ratio':>6} "
              f"{'fwd+bwd/fwd':>11} {'torch ms':>8} {'max grad err':>12}")
    print(header)
    print("-" * len(header))
    for names, shape, uneven, even in CASES:
        mesh_s = " x ".join(f"{n}{s}" for n, s in zip(names, shape))
        even_fn, _ = make_case(names, shape, even, backward=True)
        fn, err = make_case(names, shape, uneven, backward=True)
        fwd_fn, _ = make_case(names, shape, even)
        t, t_even = best_ms_interleaved(fn, even_fn, reps)
        t_fwd, t_torch = best_ms_interleaved(fwd_fn, torch_case(even), reps)
        print(f"{mesh_s:24} {f'{uneven}/{even}':>15} {t:10.2f} {t_even:8.2f} {t / t_even:6.2f} "
              f"{t_even / t_fwd:11.2f} {t_torch:8.2f} {err:12.1e}")


def torch_case(seq, causal=True):
    """Single-device torch forward + backward on the even case's full tensors (the scale of the work)."""
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(2, h, seq, 64, generator=g).requires_grad_() for h in (8, 2, 2)]
    go = torch.randn(2, 8, seq, 64, generator=g)

    def fn():
        for t in ts:
            t.grad = None
        F.scaled_dot_product_attention(*ts, is_causal=causal, enable_gqa=True).backward(go)

    return fn


def llama_forward(reps: int):
    from llama_simulation import make_config  # same directory: the benchmark's small Llama
    from transformers import LlamaForCausalLM as HFLlama

    from dtorch.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    config = make_config(small=True)
    hf = HFLlama(config).eval()
    mesh = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["ring_cp"])
    model = LlamaForCausalLM(config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    print("\nsmall Llama forward (bench/llama_simulation.py --small), batch 2, ring_cp3")
    for uneven, even in ((10, 12), (13, 15)):
        ids = {n: torch.randint(0, config.vocab_size, (2, n)) for n in (uneven, even)}
        with torch.no_grad():
            err = (model(ids[uneven]) - hf(ids[uneven]).logits).abs().max().item()
        t, t_even = best_ms_interleaved(lambda: model(ids[uneven]), lambda: model(ids[even]), reps)
        name, seqs = "llama small ring_cp3", f"{uneven}/{even}"
        print(f"{name:24} {seqs:>15} {t:10.2f} {t_even:8.2f} {t / t_even:6.2f} {err:8.1e}")


if __name__ == "__main__":
    main()
