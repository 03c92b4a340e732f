"""TP=2 and TP=4 Llama forward: dtorch's process backend (TP worker processes, one controller) against
PyTorch DTensor tensor parallel (``torch.distributed.tensor.parallel`` on TP gloo processes), same
model, same weights, same thread count per process, one command.

    .venv/bin/python bench/process_backend.py                    # TP=2 and TP=4, defaults below
    .venv/bin/python bench/process_backend.py --tp 2 --hidden 256 --layers 2 --seq 64 --iters 5
    .venv/bin/python bench/process_backend.py --floor            # and what no TP system can go below
    .venv/bin/python bench/process_backend.py --ray              # and dtorch's ray backend (TP Ray actors)

Beside the eager forward, the same forward under ``dtorch.compile`` (its own pool of workers: the replay runs as
one worker program per worker, a ``RunProgram`` record each, docs/compile.md), in the same rounds.

The two systems run in alternating rounds (DTensor's ranks wait on a store key while dtorch runs, and
dtorch's workers wait on their queues while DTensor runs), so both see the same load on a shared
machine; the medians are over every round's forwards.

Reports per forward: wall time of each system, their ratio, and for dtorch the controller's own time
(issuing every op without waiting) against the wall time, per op and as a ratio. dtorch's forward
ends when every worker is done (``sync``); fetching the logits to the controller is reported apart
(DTensor's logits stay on its ranks). Logits are checked against Hugging Face's single-process forward.

``--floor`` adds, after the rounds: each rank's local forward alone (a plain Llama of one rank's share:
heads, MLP width and logits / TP; TP such processes at once, no communication; the slowest rank), and
the forward's collectives alone on gloo (2 all_reduces of the hidden states per layer, the logits'
all_gather), as DTensor runs them.
"""
from __future__ import annotations

import argparse
import datetime
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
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tensor-parallel sizes to run (default: 2 4)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--iters", type=int, default=4, help="forwards per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (DTensor, then dtorch)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per process (default: cores / TP, at least 1)")
    ap.add_argument("--ray", action="store_true",
                    help="also dtorch's ray backend (one Ray actor per device, a local Ray), in the same rounds")
    ap.add_argument("--floor", action="store_true",
                    help="also measure the floor: each rank's local compute alone (TP processes at once, no "
                         "communication) and the forward's collectives alone on gloo")
    ap.add_argument("--dtensor-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--floor-rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtensor-world", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for tp in args.tp:
        if tp < 1 or args.heads % tp:
            ap.error(f"--tp {tp}: the tensor-parallel size must divide --heads {args.heads}")
    return args


def threads_for(args, tp: int) -> int:
    return args.threads or max(1, (os.cpu_count() or 2) // tp)


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


def cpu_seconds(pids) -> float:
    """User + system CPU time of these processes (every thread) so far; 0 where /proc is missing."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            return 0.0
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


# -- PyTorch DTensor tensor parallel (TP processes, started by the bench) ---------------------------------


def dtensor_worker(args) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = args.dtensor_world
    torch.set_num_threads(threads_for(args, tp))
    rank = args.dtensor_rank
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=1800))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=tp)
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = hf_model(args)
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}  # vocab over tp, gathered, like dtorch's
    for i in range(args.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    ids = token_ids(args)
    fwd = lambda: model(ids).logits  # noqa: E731
    with torch.no_grad():
        timed(fwd, args.warmup)
        store.add("ready", 1)
        for k in range(args.rounds):
            store.wait([f"go/{k}"])  # idle (no CPU) while dtorch runs its round
            times = timed(fwd, args.iters)
            dist.barrier()  # the round ends when every rank is done
            if rank == 0:
                store.set(f"done/{k}", json.dumps(times))
        logits = fwd()
    if rank == 0:
        torch.save(logits, args.out)
    dist.barrier()
    os._exit(0)  # gloo processes can abort at interpreter exit; nothing is left to tear down


def local_model(args, tp: int) -> transformers.LlamaForCausalLM:
    """One tensor-parallel rank's share of the model as a plain Llama: heads / TP, MLP width / TP, vocab / TP
    output columns (embedding and norms whole, as both systems keep them on every rank)."""
    cfg = transformers.LlamaConfig(hidden_size=args.hidden,
                                   intermediate_size=int(args.hidden * 2.6875) // 8 * 8 // tp,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads // tp,
                                   num_key_value_heads=args.heads // tp, head_dim=args.hidden // args.heads,
                                   vocab_size=args.vocab, max_position_embeddings=max(args.seq, 64),
                                   rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.lm_head = torch.nn.Linear(args.hidden, args.vocab // tp, bias=False)
    return model


def floor_worker(args) -> None:
    """The floor's rank: its local forward (no communication) while the other ranks run theirs, then the
    forward's collectives alone (2 all_reduces of the hidden states per layer and the logits' all_gather)."""
    import torch.distributed as dist

    tp, rank = args.dtensor_world, args.floor_rank
    torch.set_num_threads(threads_for(args, tp))
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=datetime.timedelta(seconds=1800))
    model, ids = local_model(args, tp), token_ids(args)
    with torch.no_grad():
        timed(lambda: model(ids), args.warmup)
        store.add("ready", 1)
        store.wait(["go"])
        compute = statistics.median(timed(lambda: model(ids), args.rounds * args.iters))
    dist.init_process_group("gloo", store=dist.PrefixStore("pg/", store), rank=rank, world_size=tp)
    hidden = torch.randn(args.batch, args.seq, args.hidden)
    logits = torch.randn(args.batch, args.seq, args.vocab // tp)

    def collectives():
        for _ in range(2 * args.layers):
            dist.all_reduce(hidden)
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits)
        torch.cat(parts, dim=-1)

    timed(collectives, args.warmup)
    comm = statistics.median(timed(collectives, args.rounds * args.iters))
    store.set(f"floor/{rank}", json.dumps([compute, comm]))
    dist.barrier()
    os._exit(0)


def measure_floor(args, tp: int) -> tuple[float, float]:
    """(slowest rank's local compute, the collectives alone) per forward, in seconds."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=1800))
    base = [sys.executable, os.path.abspath(__file__)] + sys.argv[1:] + [
        "--port", str(store.port), "--dtensor-world", str(tp)]
    procs = [subprocess.Popen(base + ["--floor-rank", str(r)]) for r in range(tp)]
    try:
        while int(store.add("ready", 0)) < tp:
            time.sleep(0.05)
        store.set("go", "1")
        res = [json.loads(store.get(f"floor/{r}")) for r in range(tp)]  # (get waits for the key)
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
    return max(r[0] for r in res), statistics.median(r[1] for r in res)


class DTensorRanks:
    """TP DTensor processes that run one round of forwards per ``round(k)`` and wait in between."""

    def __init__(self, args, tp: int, tmp: str):
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=1800))
        self.out = os.path.join(tmp, f"logits-{tp}.pt")
        argv = [a for a in sys.argv[1:]]
        base = [sys.executable, os.path.abspath(__file__)] + argv + [
            "--port", str(self.store.port), "--out", self.out, "--dtensor-world", str(tp)]
        self.procs = [subprocess.Popen(base + ["--dtensor-rank", str(r)]) for r in range(tp)]
        self.tp = tp

    def wait_ready(self) -> None:
        while int(self.store.add("ready", 0)) < self.tp:
            self._alive()
            time.sleep(0.05)

    def round(self, k: int) -> list[float]:
        self.store.set(f"go/{k}", "1")
        while not self.store.check([f"done/{k}"]):
            self._alive()
            time.sleep(0.002)
        return json.loads(self.store.get(f"done/{k}"))

    def finish(self) -> torch.Tensor:
        try:
            for p in self.procs:
                p.wait(timeout=300)
            return torch.load(self.out)
        finally:
            for p in self.procs:
                p.kill()

    def _alive(self) -> None:
        bad = [p.returncode for p in self.procs if p.poll() not in (None, 0)]
        if bad:
            raise RuntimeError(f"a DTensor rank exited with code {bad[0]}")


# -- dtorch, process backend ---------------------------------------------------------------------------


def _forward(model, ids):
    return model(ids)


class DtorchTP:
    def __init__(self, args, tp: int, hf, backend: str = "process", compiled: bool = False):
        # read by the workers / device actors when they start
        os.environ["OMP_NUM_THREADS"] = os.environ["DTORCH_RAY_THREADS"] = str(threads_for(args, tp))
        import dtorch
        from dtorch.models.llama import LlamaForCausalLM

        self.graph = dtorch.Graph(backend=backend)
        dtorch.Graph.set_default_graph(self.graph)
        mesh = dtorch.init_device_mesh("cpu", (tp,), mesh_dim_names=["tp"])
        self.model = LlamaForCausalLM(hf.config, mesh)
        self.model.load_state_dict(hf.state_dict())
        self.ids = dtorch.Tensor(token_ids(args), device_mesh=mesh)
        self.step = dtorch.compile(_forward) if compiled else _forward
        self.rt = self.graph.runtime
        self.wall, self.issue, self.fetch, self.ops = [], [], [], []
        self.logits = None
        for _ in range(args.warmup):
            self.forward(record=False)

    def forward(self, record=True) -> None:
        rt, graph = self.rt, self.graph
        graph.sync()
        before = rt.stats["ops"]
        t0 = time.perf_counter()
        with graph:  # tensors the forward makes (positions) live with the model's (the default is per Graph)
            out = self.step(self.model, self.ids)  # returns as soon as every op is queued
        t1 = time.perf_counter()
        graph.sync()
        t2 = time.perf_counter()
        if record:
            self.issue.append(t1 - t0)
            self.wall.append(t2 - t0)
            self.ops.append(rt.stats["ops"] - before)
            if not self.fetch:  # 4 bytes x batch x seq x vocab to the controller, once
                self.logits = out.to_torch()
                self.fetch.append(time.perf_counter() - t2)

    def pids(self) -> list[int]:
        """This process and the workers (the process backend's children, or the ray backend's actors)."""
        pool = self.rt._pool
        workers = [p.pid for p in pool.procs.values()] if hasattr(pool, "procs") else [
            i["pid"] for i in pool.info.values()]
        return [os.getpid()] + workers

    def close(self) -> None:
        self.rt.shutdown()


# -- driver -------------------------------------------------------------------------------------------


def run_tp(args, tp: int, hf, expected, tmp: str) -> dict:
    threads = threads_for(args, tp)
    ids = token_ids(args)
    torch.set_num_threads(threads)
    with torch.no_grad():
        timed(lambda: hf(ids), args.warmup)
        single = statistics.median(timed(lambda: hf(ids), args.iters * 2))
    ranks = DTensorRanks(args, tp, tmp)
    ray_tp = None
    try:
        ours = DtorchTP(args, tp, hf)
        compiled = DtorchTP(args, tp, hf, compiled=True)
        ray_tp = DtorchTP(args, tp, hf, backend="ray") if args.ray else None
        ranks.wait_ready()
        dt = []
        dt_pids = [p.pid for p in ranks.procs]
        # CPU time of every process of each system, in its rounds (the ray backend's: controller and actors,
        # not Ray's own daemons)
        cpu = {"dtensor": 0.0, "dtorch": 0.0, "compiled": 0.0, "ray": 0.0}
        for k in range(args.rounds):
            c0 = cpu_seconds(dt_pids)
            dt += ranks.round(k)
            cpu["dtensor"] += cpu_seconds(dt_pids) - c0
            for key, system in (("dtorch", ours), ("compiled", compiled), ("ray", ray_tp)):
                if system is None:
                    continue
                c0 = cpu_seconds(system.pids())
                for _ in range(args.iters):
                    system.forward()
                cpu[key] += cpu_seconds(system.pids()) - c0
        dt_logits = ranks.finish()
    finally:
        for p in ranks.procs:
            p.kill()
    ours.close()
    compiled.close()
    assert compiled.step.stats["replays"] > 0, compiled.step.last_reason
    if ray_tp is not None:
        ray_tp.close()
    floor = measure_floor(args, tp) if args.floor else None
    checked = [("dtorch", ours.logits), ("dtorch compiled", compiled.logits), ("DTensor", dt_logits)] + ([("ray", ray_tp.logits)] if ray_tp else [])
    for name, logits in checked:
        err = (logits - expected).abs().max().item()
        assert err < 1e-3, f"{name} TP={tp} logits differ from Hugging Face's by {err}"
    med = statistics.median
    return {"tp": tp, "threads": threads, "hf": single, "dtensor": med(dt), "dtorch": med(ours.wall),
            "controller": med(ours.issue), "fetch": ours.fetch[0],
            "compiled": (med(compiled.wall), med(compiled.issue), compiled.rt.stats["program_runs"]), "ops": int(med(ours.ops)), "floor": floor,
            "cpu": {k: v / (args.rounds * args.iters) for k, v in cpu.items()},
            "ray": (med(ray_tp.wall), med(ray_tp.issue), ray_tp.fetch[0]) if ray_tp else None}


def report(args, r: dict) -> None:
    ms = lambda s: f"{s * 1e3:8.1f} ms"  # noqa: E731
    tp = r["tp"]
    n = args.rounds * args.iters
    print(f"TP={tp}: Llama {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, batch {args.batch} x seq "
          f"{args.seq}; {r['threads']} torch thread(s) per process, {os.cpu_count()} cores; median of {n} "
          f"({args.rounds} alternating rounds)")
    print(f"  Hugging Face, 1 process             {ms(r['hf'])}")
    print(f"  PyTorch DTensor TP={tp}, {tp} processes  {ms(r['dtensor'])}")
    print(f"  dtorch process backend TP={tp}        {ms(r['dtorch'])}   ({r['ops']} ops per forward; "
          f"fetching the logits to the controller takes {ms(r['fetch']).strip()} more)")
    print(f"  dtorch / DTensor wall time          {r['dtorch'] / r['dtensor']:8.2f}x")
    if r["cpu"]["dtensor"]:
        print(f"  CPU time per forward, all processes {ms(r['cpu']['dtorch'])} dtorch (controller and workers), "
              f"{ms(r['cpu']['dtensor']).strip()} DTensor: {r['cpu']['dtorch'] / r['cpu']['dtensor']:.2f}x")
    wall, issue, runs = r["compiled"]
    print(f"  dtorch.compile'd forward TP={tp}       {ms(wall)}   (controller {ms(issue).strip()}; {runs} worker "
          "program runs)")
    print(f"  dtorch.compile'd / DTensor wall     {wall / r['dtensor']:8.2f}x;  "
          f"/ eager dtorch {wall / r['dtorch']:.2f}x")
    if r["cpu"]["dtensor"]:
        print(f"  CPU time per forward, compiled      {ms(r['cpu']['compiled'])}: "
              f"{r['cpu']['compiled'] / r['cpu']['dtensor']:.2f}x DTensor's", flush=True)
    print(f"  dtorch controller time              {ms(r['controller'])}   "
          f"({r['controller'] / r['ops'] * 1e6:.0f} us per op)")
    print(f"  controller time / wall time         {r['controller'] / r['dtorch']:8.2f}", flush=True)
    if r["ray"]:
        wall, issue, fetch = r["ray"]
        print(f"  dtorch ray backend TP={tp}            {ms(wall)}   (fetching the logits takes {ms(fetch).strip()} "
              f"more; controller {ms(issue).strip()})")
        print(f"  ray / process backend wall time     {wall / r['dtorch']:8.2f}x;  ray / DTensor {wall / r['dtensor']:.2f}x")
        print(f"  CPU time per forward, ray backend   {ms(r['cpu']['ray'])} (controller and actors): "
              f"{r['cpu']['ray'] / r['cpu']['dtorch']:.2f}x the process backend's", flush=True)
    if r["floor"]:
        compute, comm = r["floor"]
        print(f"  floor: each rank's local forward    {ms(compute)}   (the slowest of {tp} ranks run at once, no "
              "communication)")
        print(f"  floor: the collectives alone, gloo  {ms(comm)}   ({2 * args.layers} all_reduces of the hidden "
              "states, 1 all_gather of the logits)", flush=True)


def main(argv=None) -> int:
    torch.set_grad_enabled(False)  # inference: no autograd history (parameters require grad)
    args = parse(argv)
    if args.dtensor_rank is not None:
        dtensor_worker(args)
        return 0
    if args.floor_rank is not None:
        floor_worker(args)
        return 0
    hf = hf_model(args)
    with torch.no_grad():
        expected = hf(token_ids(args)).logits
    with tempfile.TemporaryDirectory() as tmp:
        for tp in args.tp:
            report(args, run_tp(args, tp, hf, expected, tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
