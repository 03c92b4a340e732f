"""Recovery on the process backend (issue 27): the snapshot's cost against the step, and the time from a fault to
the next step's start.

Model: the issue's 32 M Llama (8 layers, hidden 512, 8 heads / 4 kv heads, MLP 1408, vocab 8192), AdamW, batch
8 x seq 64, on a dp2 x tp2 mesh (4 workers; ``--mesh dp2xfsdp2xtp2`` for 8). Reports:

- step: median wall seconds of a training step under ``snap.run_step``, with ``every`` so large that no snapshot
  is taken (the step and its closing ``sync``), and with ``every=1`` (each step's snapshot fetched while the
  next step runs): their ratio is the snapshots' overhead;
- snapshot: the seconds of one ``snap.take()`` alone (a sync, then the fetch of every parameter and optimizer
  state, waited for), and its ratio to the step;
- fault to next step: a worker is SIGKILLed halfway through a step (a timer, by its pid); the seconds from the
  kill to the start of the step's re-run (detection, stopping the workers, new workers, the snapshot placed).

Before / after in one command: ``--fetch`` keeps the snapshot as before (values fetched to the controller each
snapshot) instead of the workers' mirror files; ``DTORCH_PROCESS_ZYGOTE=0`` starts each worker as its own Python
process instead of forking it from the zygote:

    DTORCH_PROCESS_ZYGOTE=0 .venv/bin/python bench/recovery.py --fetch --mesh dp2xfsdp2xtp2 && \
        .venv/bin/python bench/recovery.py --mesh dp2xfsdp2xtp2

    .venv/bin/python bench/recovery.py [--steps 3] [--block 3] [--mesh dp2xtp2] [--layers 8] [--fetch]
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
    ap.add_argument("--steps", type=int, default=3, help="rounds: a block of steps without, then with snapshots")
    ap.add_argument("--block", type=int, default=3, help="steps per block")
    ap.add_argument("--mesh", choices=list(MESHES), default="dp2xtp2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--fetch", action="store_true",
                    help="snapshots fetched to the controller (before the workers' mirror files)")
    args = ap.parse_args()
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=args.vocab, max_position_embeddings=128)
    cfg._attn_implementation = "sdpa"
    t_start = time.perf_counter()
    graph = dtorch.Graph(backend="process")
    dtorch.Graph.set_default_graph(graph)
    if args.fetch:
        graph.runtime.mirror_many = lambda *a, **k: None  # (the runtime then says it keeps no mirror)
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

    def block(snap, n: int) -> float:
        """Seconds per step of ``n`` steps; a snapshot's last fetch is waited for within the block, so that the
        next block's first step does not carry it."""
        t0 = time.perf_counter()
        for _ in range(n):
            snap.run_step(step, ids)
        snap.wait()
        return (time.perf_counter() - t0) / n

    step(ids)  # warm: the optimizer's states exist, plans are cached
    first_s = time.perf_counter() - t_start
    plain = dtorch.recovery.snapshot(model, opt, every=10 ** 9)  # no snapshot after the first
    snap = dtorch.recovery.snapshot(model, opt, every=1)
    t0 = time.perf_counter()
    snap.take()
    take_s = time.perf_counter() - t0
    # blocks of steps without and with snapshots, alternately (the machine's load moves between rounds)
    rounds = [(block(plain, args.block), block(snap, args.block)) for _ in range(args.steps)]
    bare, with_snap = (statistics.median(r[i] for r in rounds) for i in (0, 1))
    zygote = os.environ.get("DTORCH_PROCESS_ZYGOTE", "1") not in ("0", "false")
    print(f"{n_params / 1e6:.1f} M parameters, {args.mesh} ({mesh.size()} workers), AdamW, batch {args.batch} x seq "
          f"{args.seq}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; workers "
          f"{'forked from the zygote' if zygote else 'spawned (DTORCH_PROCESS_ZYGOTE=0)'}, snapshot "
          f"{'fetched to the controller (--fetch)' if args.fetch else 'in the workers mirror files'}")
    print(f"first step      {first_s:.2f} s from the Graph's creation (workers started, model placed, one step)")
    print(f"step            {bare:.3f} s without snapshots, {with_snap:.3f} s with every=1 (medians of {args.steps} blocks of {args.block}): "
          f"overhead {with_snap / bare - 1:+.2f}")
    print(f"snapshot        {take_s:.3f} s alone (snap.take(), not overlapped), {snap.nbytes / 2 ** 20:.0f} MiB kept: "
          f"{take_s / bare:.2f} of a step")

    victim = graph.worker_pids()[1]
    killed: list = []

    def kill():
        killed.append(time.perf_counter())
        os.kill(victim, signal.SIGKILL)

    timer = threading.Timer(bare / 2, kill)
    starts.clear()
    timer.start()
    snap.run_step(step, ids)
    timer.join()
    (event,) = snap.events
    rerun = [s for s in starts if s > killed[0]]
    print(f"fault to next step {rerun[0] - killed[0]:.2f} s (worker 1 SIGKILLed {bare / 2:.2f} s into a step; "
          f"rebuilding {event.rebuilt} tensors on new workers: {event.seconds:.2f} s of it)")
    graph.runtime.shutdown()


if __name__ == "__main__":
    main()
