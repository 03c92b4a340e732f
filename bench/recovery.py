"""Recovery on the process backend (issue 27): the snapshot's cost against the step, and the time from a fault to
the next step's start.

Model: the issue's 32 M Llama (8 layers, hidden 512, 8 heads / 4 kv heads, MLP 1408, vocab 8192), AdamW, batch
8 x seq 64, on a dp2 x tp2 mesh (4 workers; ``--mesh dp2xfsdp2xtp2`` for 8). Reports:

- step: median wall seconds of a training step under ``snap.run_step`` with ``every`` so large that no snapshot
  is taken (the step and its closing ``sync``);
- snapshot: median seconds of ``snap.take()`` (a sync, then the fetch of every parameter and optimizer state),
  and its ratio to the step: the overhead of ``every=1``;
- fault to next step: a worker is SIGKILLed halfway through a step (a timer, by its pid); the seconds from the
  kill to the start of the step's re-run (detection, stopping the workers, new workers, the snapshot placed).

    .venv/bin/python bench/recovery.py [--steps 4] [--mesh dp2xtp2] [--layers 8]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time

import torch

import dtorch
from dtorch.models.llama import LlamaForCausalLM

MESHES = {"dp2xtp2": (("dp", 2), ("tp", 2)), "dp2xfsdp2xtp2": (("dp", 2), ("fsdp", 2), ("tp", 2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mesh", choices=list(MESHES), default="dp2xtp2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    graph = dtorch.Graph(backend="process")
    dtorch.Graph.set_default_graph(graph)
    names, sizes = zip(*MESHES[args.mesh])
    mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, mesh)
    opt = dtorch.optim.AdamW(model.parameters(), lr=1e-3)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    starts: list = []

    def step(ids):
        starts.append(time.perf_counter())
        opt.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        return loss.item()

    snap = dtorch.recovery.snapshot(model, opt, every=10 ** 9)  # snapshots taken by hand below
    step(ids)  # warm: the optimizer's states exist, plans are cached
    snap.take()
    steps, takes = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        snap.run_step(step, ids)
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        snap.take()
        takes.append(time.perf_counter() - t0)
    step_s, take_s = statistics.median(steps), statistics.median(takes)
    print(f"{n_params / 1e6:.1f} M parameters, {args.mesh} ({mesh.size()} workers), AdamW, batch {args.batch} x seq "
          f"{args.seq}, {os.cpu_count()} cores")
    print(f"step            {step_s:.3f} s (median of {args.steps})")
    print(f"snapshot        {take_s:.3f} s, {snap.nbytes / 2 ** 20:.0f} MiB kept on the host: {take_s / step_s:.2f} of "
          "a step (the overhead of every=1)")

    victim = graph.worker_pids()[1]
    killed: list = []

    def kill():
        killed.append(time.perf_counter())
        os.kill(victim, signal.SIGKILL)

    timer = threading.Timer(step_s / 2, kill)
    starts.clear()
    timer.start()
    snap.run_step(step, ids)
    timer.join()
    (event,) = snap.events
    rerun = [s for s in starts if s > killed[0]]
    print(f"fault to next step {rerun[0] - killed[0]:.2f} s (worker 1 SIGKILLed {step_s / 2:.2f} s into a step; "
          f"rebuilding {event.rebuilt} tensors on new workers: {event.seconds:.2f} s of it)")
    graph.runtime.shutdown()


if __name__ == "__main__":
    main()
