"""Pipeline overlap on the process backend: a pp=2 Llama training step (forward + backward) over m
micro-batches, stages running concurrently, against the same step run stage after stage.

    .venv/bin/python bench/pipeline_overlap.py                      # defaults below (~2-4 min on 2 cores)
    .venv/bin/python bench/pipeline_overlap.py --reps 3 --hidden 128   # quicker

Modes, on the same workers, weights and micro-batches (each device is one worker with --threads torch
threads; the 2 workers are the 2 stages):
  sequential  for each micro-batch: forward, ``(loss / m).backward()``, ``graph.sync()``. Within one
              micro-batch the stages cannot overlap (stage 1 needs stage 0's activation, stage 0 needs
              stage 1's gradient), so with a sync between micro-batches the step runs stage after stage:
              exactly the work of the other modes, without overlap.
  1f1b        ``dtorch.pipeline.train_step(model, micro_batches)``: 1F1B order, no wait until the end.
  gpipe       ``train_step(..., schedule="gpipe")``: all forwards, then all backwards.
Every step ends with ``graph.sync()`` (all workers done). Modes run interleaved, ``--reps`` rounds, so
load from other processes hits all of them; the report gives per mode the median and the best step
time, and the ratio to sequential as the median of the per-round ratios (target <= 0.75; with m
micro-batches on p stages and nothing else running, the ideal is (m + p - 1) / (m * p) = 0.625 for
m=4, p=2). The controller's issue time per step (building every op, no waiting) is printed too. The
gradients of every mode are checked against the sequential ones.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import transformers


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds of every mode")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (one core per device)")
    ap.add_argument("--modes", default="sequential,1f1b,gpipe")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the workers' torch threads (inherited)
    import dtorch
    from dtorch.models.llama import LlamaForCausalLM
    from dtorch.pipeline import split_micro_batches, train_step

    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875) // 8 * 8,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, vocab_size=args.vocab,
                                   max_position_embeddings=max(args.seq, 64), rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    m = args.micro_batches
    ids = torch.randint(0, args.vocab, (m * args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    mbs = split_micro_batches(ids, ids, chunks=m)

    graph = dtorch.Graph(backend="process")
    with graph:
        mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
        model = LlamaForCausalLM(cfg, mesh)
        model.load_state_dict(hf.state_dict())

        def sequential():
            for x, y in mbs:
                (model(x, labels=y).loss / m).backward()
                graph.sync()

        runs = {"sequential": sequential,
                "1f1b": lambda: train_step(model, mbs),
                "gpipe": lambda: train_step(model, mbs, schedule="gpipe")}
        modes = [s.strip() for s in args.modes.split(",")]
        unknown = [x for x in modes if x not in runs]
        if unknown or "sequential" not in modes:
            raise SystemExit(f"--modes takes sequential (required: the baseline), 1f1b, gpipe; got {args.modes!r}")

        grads = {}

        def step(mode):
            model.zero_grad()
            graph.sync()
            t0 = time.perf_counter()
            runs[mode]()
            t1 = time.perf_counter()
            graph.sync()
            t2 = time.perf_counter()
            grads[mode] = [p.grad for p in model.parameters()]
            return t2 - t0, t1 - t0

        for _ in range(args.warmup):
            for mode in modes:
                step(mode)
        times = {mode: [] for mode in modes}
        issue = {mode: [] for mode in modes}
        for _ in range(args.reps):
            for mode in modes:
                wall, ctl = step(mode)
                times[mode].append(wall)
                issue[mode].append(ctl)
        worst = {}
        ref = [g.to_torch() for g in grads["sequential"]]
        for mode in modes:
            got = [g.to_torch() for g in grads[mode]]
            worst[mode] = max((a - b).abs().max().item() for a, b in zip(got, ref))

    print(f"pp=2 Llama training step: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, "
          f"{m} micro-batches of {args.batch} x {args.seq}, {args.threads} torch thread(s) per worker, "
          f"{args.reps} interleaved rounds")
    print(f"{'mode':<11} {'median s':>9} {'best s':>8} {'ratio':>6} {'controller s':>13} {'grad diff':>10}")
    base = times["sequential"]
    for mode in modes:
        ratios = [a / b for a, b in zip(times[mode], base)]
        print(f"{mode:<11} {statistics.median(times[mode]):9.3f} {min(times[mode]):8.3f} "
              f"{statistics.median(ratios):6.2f} {statistics.median(issue[mode]):13.3f} {worst[mode]:10.1e}")
    print(f"ideal ratio with no other load: (m + p - 1) / (m * p) = {(m + 1) / (2 * m):.3f}; target <= 0.75")
    for mode in modes:
        if mode != "sequential":
            r = statistics.median([a / b for a, b in zip(times[mode], base)])
            print(f"RATIO {mode} / sequential = {r:.3f}")


if __name__ == "__main__":
    main()
