"""The ``dtorch`` command."""
from __future__ import annotations

import argparse
import sys


def _walkthrough(args) -> int:
    import torch

    import dtorch
    from dtorch import Partial, Replicate, Shard

    torch.manual_seed(0)
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    print(f"mesh: {mesh!r}\n")
    x = dtorch.randn(8, 6, device_mesh=mesh, placements=[Shard(0), Shard(1)])
    print("x = randn(8, 6) sharded rows over dp and columns over tp:")
    dtorch.visualize_sharding(x)
    with dtorch.CommLog() as log:
        y = x.redistribute(mesh, [Replicate(), Shard(0)])
    print("\nredistribute to [R, S(0)]:")
    dtorch.visualize_sharding(y)
    print(log.table())
    p = dtorch.Tensor(torch.ones(4), device_mesh=mesh, placements=[Partial(), Replicate()])
    print(f"\na Partial(sum) tensor over dp reduces to {p.to_torch().tolist()}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="dtorch", description="dtorch: single-controller distributed tensors")
    sub = parser.add_subparsers(dest="command")
    # add_help=False: `dtorch demo --help` reaches the demo's own parser
    for name in ("demo", "llama"):
        demo = sub.add_parser(name, add_help=False, help="the main demo (Llama under a parallel layout on simulated "
                              "CPU devices)" if name == "demo" else "the same as demo")
        demo.set_defaults(func=_demo)
    train = sub.add_parser("train", add_help=False, help="train a small Llama on a text file (byte tokens) under "
                           "any layout; memory and communication of a step; --save a Hugging Face checkpoint")
    train.set_defaults(func=_train)
    gen = sub.add_parser("generate", add_help=False, help="generate text with a KV cache under a parallel layout "
                         "(a Hugging Face checkpoint or a random Llama)")
    gen.set_defaults(func=_generate)
    rl = sub.add_parser("rl", add_help=False, help="GRPO on a small Llama: the trainer in one layout, the rollout in "
                        "another, weights synced device to device (reverse-the-digits task, shipped)")
    rl.set_defaults(func=_rl)
    plan = sub.add_parser("plan", add_help=False, help="predict memory per device, communication, step time and MFU "
                          "of a training layout at any scale without the hardware (meta backend + cost model); --search")
    plan.set_defaults(func=_plan)
    walk = sub.add_parser("walkthrough", help="a DTensor walk-through with visualize_sharding")
    walk.set_defaults(func=_walkthrough)
    worker = sub.add_parser("worker", add_help=False, help="start process-backend workers that join a controller "
                            "(--controller HOST:PORT --ranks 0-3)")
    worker.set_defaults(func=_worker)
    args, rest = parser.parse_known_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    args.rest = rest
    return args.func(args)


def _worker(args) -> int:
    from .runtime.registry import run_command  # the worker is the process backend's own business

    return run_command("worker", args.rest)


def _train(args) -> int:
    from .models import train_cli

    return train_cli.main(args.rest)


def _generate(args) -> int:
    from .models import generate_cli

    return generate_cli.main(args.rest)


def _rl(args) -> int:
    from .rl import cli

    return cli.main(args.rest)


def _plan(args) -> int:
    from .plan import cli

    return cli.main(args.rest)


def _demo(args) -> int:
    try:
        from .models import llama_cli
    except ImportError:
        return _walkthrough(args)
    return llama_cli.main(args.rest)


if __name__ == "__main__":
    sys.exit(main())
