"""TP=2 Llama forward: dtorch's process backend (2 worker processes, one controller) against PyTorch
DTensor tensor parallel (``torch.distributed.tensor.parallel`` on 2 gloo processes), same model, same
weights, same thread count per process, one command.

    .venv/bin/python bench/process_backend.py                    # defaults below
    .venv/bin/python bench/process_backend.py --hidden 256 --layers 2 --seq 64 --iters 5

Reports per forward: wall time of each system, their ratio, and for dtorch the controller's own time
(issuing every op without waiting) against the wall time, per op and as a ratio. dtorch's forward
ends when every worker is done (``sync``); fetching the logits to the controller is reported apart
(DTensor's logits stay on its ranks). Logits are checked against Hugging Face's single-process forward.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import transformers


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per worker")
    ap.add_argument("--dtensor-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def hf_model(args) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.6875) // 8 * 8,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.heads, vocab_size=args.vocab,
                                   max_position_embeddings=max(args.seq, 64), rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def token_ids(args) -> torch.Tensor:
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))


def timed(fn, args) -> list[float]:
    for _ in range(args.warmup):
        fn()
    out = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- dtorch, process backend ---------------------------------------------------------------------------


def bench_dtorch(args, hf):
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # read by the workers when they start
    import dtorch
    from dtorch.models.llama import LlamaForCausalLM

    graph = dtorch.Graph(backend="process")
    dtorch.Graph.set_default_graph(graph)
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids = dtorch.Tensor(token_ids(args), device_mesh=mesh)
    rt = graph.runtime
    issue, wall, fetch, ops = [], [], [], []
    logits = None
    for n in range(args.warmup + args.iters):
        graph.sync()
        before = rt.stats["ops"]
        t0 = time.perf_counter()
        out = model(ids)  # returns as soon as every op is queued
        t1 = time.perf_counter()
        graph.sync()
        t2 = time.perf_counter()
        logits = out.to_torch()  # 4 bytes x batch x seq x vocab through the controller's store
        t3 = time.perf_counter()
        if n >= args.warmup:
            issue.append(t1 - t0)
            wall.append(t2 - t0)
            fetch.append(t3 - t2)
            ops.append(rt.stats["ops"] - before)
    rt.shutdown()
    return {"wall": statistics.median(wall), "controller": statistics.median(issue), "fetch": statistics.median(fetch),
            "ops": int(statistics.median(ops)), "logits": logits}


# -- PyTorch DTensor tensor parallel -----------------------------------------------------------------------


def dtensor_worker(args) -> None:
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(args.threads)
    rank = args.dtensor_rank
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = hf_model(args)
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}  # vocab over tp, gathered, like dtorch's
    for i in range(args.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    ids = token_ids(args)
    with torch.no_grad():
        times = timed(lambda: model(ids).logits, args)
        logits = model(ids).logits
    if rank == 0:
        torch.save(logits, args.out)
        print(json.dumps({"wall": statistics.median(times)}), flush=True)
    dist.barrier()
    os._exit(0)  # gloo processes can abort at interpreter exit; nothing is left to tear down


def bench_dtensor(args):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.pt")
        base = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + ["--port", str(store.port), "--out", out]
        procs = [subprocess.Popen(base + ["--dtensor-rank", str(r)], stdout=subprocess.PIPE, text=True)
                 for r in range(2)]
        try:
            res = json.loads(procs[0].communicate(timeout=1800)[0])
            procs[1].wait(timeout=60)
        finally:
            for p in procs:
                p.kill()
        res["logits"] = torch.load(out)
    return res


def main(argv=None) -> int:
    torch.set_grad_enabled(False)  # inference: no autograd history (parameters require grad)
    args = parse(argv)
    if args.dtensor_rank is not None:
        dtensor_worker(args)
        return 0
    hf = hf_model(args)
    ids = token_ids(args)
    torch.set_num_threads(args.threads)
    with torch.no_grad():
        single = statistics.median(timed(lambda: hf(ids), args))
        expected = hf(ids).logits
    dt = bench_dtensor(args)
    ours = bench_dtorch(args, hf)
    for name, res in (("dtorch", ours), ("DTensor", dt)):
        err = (res["logits"] - expected).abs().max().item()
        assert err < 1e-3, f"{name} logits differ from Hugging Face's by {err}"
    ms = lambda s: f"{s * 1e3:8.1f} ms"  # noqa: E731
    print(f"Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x seq {args.seq}; "
          f"{args.threads} torch thread(s) per process, {os.cpu_count()} cores; median of {args.iters}")
    print(f"  Hugging Face, 1 process            {ms(single)}")
    print(f"  PyTorch DTensor TP=2, 2 processes   {ms(dt['wall'])}")
    print(f"  dtorch process backend TP=2         {ms(ours['wall'])}   ({ours['ops']} ops per forward; "
          f"fetching the logits to the controller takes {ms(ours['fetch']).strip()} more)")
    print(f"  dtorch / DTensor wall time          {ours['wall'] / dt['wall']:8.2f}x")
    print(f"  dtorch controller time              {ms(ours['controller'])}   "
          f"({ours['controller'] / ours['ops'] * 1e6:.0f} us per op)")
    print(f"  controller time / wall time         {ours['controller'] / ours['wall']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
