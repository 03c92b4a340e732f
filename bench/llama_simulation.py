"""Simulated Llama forward: dtorch on 16 simulated CPU devices vs the single-device Hugging Face model.

Same process, same weights, same inputs. Layout dp2 x tp2 x pp2 x ulysses2 (16 devices) by default;
baselines: the Hugging Face forward on one device, and PyTorch DTensor's single-process simulation
(LocalTensorMode) of the TP=2 layout where it runs. Also per-device peak memory vs the ideal
(weights / (tp * pp)).

    .venv/bin/python bench/llama_simulation.py [--seq 16 256] [--repeat 3] [--small] [--device cuda]

``--device cuda`` builds a "cuda" mesh and runs the Hugging Face baseline on ``cuda:0`` (real GPUs, or
one GPU simulating several under DTORCH_DTENSOR_IN_SAME_DEVICE=1); bench/gpu_check.sh uses it.
"""
from __future__ import annotations

import argparse
import time

import torch

import dtorch


def make_config(small: bool):
    from transformers import LlamaConfig

    if small:
        return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)
    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2752, num_hidden_layers=2,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512)


def _sync() -> None:
    if torch.cuda.is_available():  # kernels are asynchronous: a time must include their completion
        torch.cuda.synchronize()


def best_time(fn, repeat: int) -> float:
    fn()  # warm up (plans, caches, allocator)
    best = float("inf")
    for _ in range(repeat):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def pytorch_dtensor_tp_time(hf, ids, tp: int, repeat: int):
    """HF Llama with PyTorch's tensor-parallel plan under LocalTensorMode (one process); None if it fails."""
    try:
        import copy

        import torch.distributed as dist
        from torch.distributed._local_tensor import LocalTensorMode
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:
        return None, f"unavailable ({exc})"
    dist.init_process_group("fake", world_size=tp, rank=0, store=FakeStore())
    try:
        with LocalTensorMode(tp):
            mesh = init_device_mesh("cpu", (tp,))
            model = copy.deepcopy(hf)
            plan = {}
            for i in range(len(model.model.layers)):
                p = f"model.layers.{i}."
                plan.update({p + "self_attn.q_proj": ColwiseParallel(), p + "self_attn.k_proj": ColwiseParallel(),
                             p + "self_attn.v_proj": ColwiseParallel(), p + "self_attn.o_proj": RowwiseParallel(),
                             p + "mlp.gate_proj": ColwiseParallel(), p + "mlp.up_proj": ColwiseParallel(),
                             p + "mlp.down_proj": RowwiseParallel()})
            parallelize_module(model, mesh, plan)
            with torch.no_grad():
                t = best_time(lambda: model(ids).logits, repeat)
            return t, "ok"
    except Exception as exc:  # report, don't hide: the table says why there is no number
        return None, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    finally:
        dist.destroy_process_group()


def main(argv=None):
    torch.set_grad_enabled(False)  # an inference benchmark: no autograd history (parameters require grad)
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    ap.add_argument("--layout", default="dp=2,tp=2,pp=2,ulysess_cp=2")
    ap.add_argument("--no-pytorch-dtensor", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="mesh device type; cuda also runs the Hugging Face baseline on cuda:0 when a GPU exists")
    args = ap.parse_args(argv)
    # the baseline's device: the GPU the mesh runs on (cpu when "cuda" is simulated on a machine without one)
    hf_device = torch.device("cuda", 0) if args.device == "cuda" and torch.cuda.is_available() else torch.device("cpu")

    from transformers import LlamaForCausalLM as HFLlama

    from dtorch.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    config = make_config(args.small)
    hf = HFLlama(config).eval()
    dims = dict(kv.split("=") for kv in args.layout.split(","))
    mesh = dtorch.init_device_mesh(args.device, tuple(int(v) for v in dims.values()), mesh_dim_names=list(dims))
    graph = dtorch.default_graph()
    model = LlamaForCausalLM(config, device_mesh=mesh)
    model.load_state_dict(hf.state_dict())
    hf.to(hf_device)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    print(f"model: {sum(p.numel() for p in hf.parameters()) / 1e6:.1f} M params, layout {mesh} ({mesh.size()} devices), "
          f"HF baseline on {hf_device}, torch threads {torch.get_num_threads()}\n")
    print(f"{'seq':>5} {'HF s':>8} {'dtorch s':>9} {'dtorch/HF':>9} {'max err':>9} {'PT DTensor tp2 s':>17} {'PT/HF':>6}")
    for seq in args.seq:
        ids = torch.randint(0, config.vocab_size, (args.batch, seq))
        hf_ids = ids.to(hf_device)
        with torch.no_grad():
            ref = hf(hf_ids).logits
            t_hf = best_time(lambda: hf(hf_ids).logits, args.repeat)
        out = model(ids)
        err = (out.to(ref.device) - ref).abs().max().item()
        t_dt = best_time(lambda: model(ids), args.repeat)
        if args.no_pytorch_dtensor:
            pt, why = None, "skipped"
        elif hf_device.type != "cpu":
            pt, why = None, "cpu only"  # LocalTensorMode simulates on the CPU
        else:
            pt, why = pytorch_dtensor_tp_time(hf, ids, 2, args.repeat)
        pt_s = f"{pt:17.3f} {pt / t_hf:6.2f}" if pt else f"{why[:40]:>17}"
        print(f"{seq:5d} {t_hf:8.3f} {t_dt:9.3f} {t_dt / t_hf:9.2f} {err:9.1e} {pt_s}")

    # memory: logical bytes each simulated device holds at peak during one forward
    graph.track_memory(True)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq[-1]))
    model(ids)
    stats = graph.get_memory_stats(mesh)
    peaks = [v["peak"] for v in stats.values()]
    allocated = [v["allocated"] for v in stats.values()]
    tp = dims.get("tp", "1")
    pp = dims.get("pp", "1")
    ideal = weights / (int(tp) * int(pp))
    print(f"\nper-device memory at seq {args.seq[-1]}: weights+live now {min(allocated) / 2**20:.1f}-{max(allocated) / 2**20:.1f} MiB, "
          f"peak {min(peaks) / 2**20:.1f}-{max(peaks) / 2**20:.1f} MiB; ideal weights/(tp*pp) = {ideal / 2**20:.1f} MiB "
          f"(peak/ideal {max(peaks) / ideal:.2f})")


if __name__ == "__main__":
    main()
