"""dtorch train: train a small Llama on a text file (byte-level tokens) under any parallel layout.

    dtorch train                                        # dp2 x tp2 x pp2 x ulysses2 on 16 simulated CPU devices
    dtorch train --fsdp 2 --tp 2 --dp 1 --pp 1 --ulysses-cp 1 --steps 100
    dtorch train --text my.txt --save out/ --plot loss.png

The corpus (a few public-domain texts, shipped with dtorch) is read as bytes: vocabulary 256, no
tokenizer. Each step takes ``--batch`` random windows of ``--seq`` bytes, runs the forward with
``labels`` (Hugging Face's shifted loss), the backward and one AdamW step. After training: memory per
device (weights, gradients, optimizer states, gathered fsdp weights, activations, the step's peak) and the
collectives of one step per mesh dim. ``--save DIR`` writes a Hugging Face checkpoint (config.json + model.safetensors) that
``transformers.LlamaForCausalLM.from_pretrained`` loads to the same logits.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

import dtorch

from .llama import LlamaForCausalLM
from .llama_cli import (_DIM_ORDER, HelpWithDefaults, _ids, _mesh_problems, _mib, _random_config, _where,
                        add_layout_flags, add_model_size_flags, head_width_problems, run_command)

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
_TRAIN_DIMS = _DIM_ORDER + (("fsdp", "fsdp"),)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtorch train", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpWithDefaults)
    g = add_layout_flags(p, {"dp": 2, "tp": 2, "pp": 2, "ulysses-cp": 2, "ring-cp": 1},
                         {"dp": "data parallel: the batch is split, gradients all-reduced"}, device=False)
    g.add_argument("--fsdp", type=int, default=1, help="fully sharded data parallel: the batch and every "
                   "parameter, gradient and optimizer state are split")
    m = p.add_argument_group("model (a random Llama over byte tokens)")
    add_model_size_flags(m, vocab=None)
    t = p.add_argument_group("training")
    t.add_argument("--text", metavar="FILE", help="a text file to train on (default: the shipped corpus)")
    t.add_argument("--steps", type=int, default=20, help="optimizer steps")
    t.add_argument("--batch", type=int, default=8, help="windows of text per step")
    t.add_argument("--seq", type=int, default=64, help="bytes per window")
    t.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    t.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    t.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    t.add_argument("--grad-checkpointing", action="store_true", help="recompute each layer in the backward")
    t.add_argument("--selective-ac", type=int, metavar="N", default=None,
                   help="selective activation checkpointing: recompute only every N-th layer in the backward")
    t.add_argument("--seed", type=int, default=0, help="seeds the initial weights and the batches")
    t.add_argument("--eager", action="store_true", help="run every step eagerly (default: the step is traced once "
                   "with dtorch.compile and replayed, with the same numbers; eager with --recover)")
    t.add_argument("--recover", choices=("off", "replace", "shrink"), default="off",
                   help="replace: a worker lost mid-step (process and ray backends) is replaced, the step re-run "
                        "from a snapshot kept after every step (docs/recovery.md); shrink: training goes on without "
                        "it, on a mesh whose dp dim is one smaller (the batch re-split)")
    o = p.add_argument_group("output")
    o.add_argument("--save", metavar="DIR", help="write a Hugging Face checkpoint (safetensors, generation config and "
                   "a byte-level tokenizer.json) here, for dtorch generate --model DIR (default: none)")
    o.add_argument("--plot", metavar="PNG", help="draw the loss curve here (needs matplotlib: pip install "
                   "'dtorch[plot]') (default: none)")
    return p


def check_args(args) -> list[str]:
    """Every problem with the flags at once, each saying what to change."""
    problems = []
    positive = [a for a, _ in _TRAIN_DIMS] + ["layers", "hidden", "heads", "kv_heads", "steps", "batch", "seq"]
    problems += [f"--{a.replace('_', '-')} {getattr(args, a)} must be at least 1" for a in positive if getattr(args, a) < 1]
    if problems:
        return problems
    problems += head_width_problems(args.hidden, args.heads)
    if args.heads % args.kv_heads:
        problems.append(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.recover == "shrink" and args.dp < 2:
        problems.append(f"--recover shrink drops the lost device's slice of the dp dim, so it needs --dp 2 or more "
                        f"(got --dp {args.dp}); raise --dp or use --recover replace")
    if args.seq % args.ulysses_cp:
        problems.append(f"--seq {args.seq} must be divisible by --ulysses-cp {args.ulysses_cp}")
    text = Path(args.text) if args.text else CORPUS
    if not text.is_file():
        problems.append(f"--text {text}: no such file")
    elif text.stat().st_size < args.seq + 1:
        problems.append(f"--text {text} has {text.stat().st_size} bytes; it needs at least --seq + 1 = {args.seq + 1}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            problems.append("--plot needs matplotlib: pip install 'dtorch[plot]' (or pip install matplotlib)")
    if not problems:
        from types import SimpleNamespace

        from .llama import LlamaLayoutError, check_layout

        mesh = train_mesh(args)
        problems += _mesh_problems(mesh)
        try:
            check_layout(SimpleNamespace(num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                         num_hidden_layers=args.layers), mesh)
        except LlamaLayoutError as exc:
            problems.append(str(exc))
    return problems


def train_mesh(args):
    dims = [(name, getattr(args, attr)) for attr, name in _TRAIN_DIMS if getattr(args, attr) > 1]
    if not dims:
        return dtorch.DeviceMesh("cpu")
    names, sizes = zip(*dims)
    return dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))


def byte_batches(data: np.ndarray, batch: int, seq: int, generator: torch.Generator):
    """Endless random windows of ``seq`` bytes: (input ids, labels) with labels = input ids (the model shifts
    them, like Hugging Face: position i predicts byte i + 1)."""
    n = len(data) - seq
    tokens = torch.from_numpy(data.astype(np.int64))
    while True:
        starts = torch.randint(0, n, (batch,), generator=generator)
        ids = torch.stack([tokens[s: s + seq] for s in starts.tolist()])
        yield ids, ids


def bytes_per_device(tensors) -> dict:
    """Logical bytes each device holds of ``tensors``: {device id: bytes}."""
    from ..graph import _device_bytes

    out: dict = {}
    for t in tensors:
        spec = t._spec
        per = _device_bytes(spec)
        ids = spec.mesh.device_ids
        for k, dev in enumerate(ids):
            out[dev] = out.get(dev, 0) + int(per if isinstance(per, int) else per[k])
    return out


MEMORY_COLUMNS = (("params", "weights"), ("grads", "grads"), ("optimizer", "optimizer"), ("gathered", "gathered"),
                  ("activations", "activation peak"))


def memory_table(breakdown: dict, peaks: dict) -> str:
    """One row per group of devices holding the same bytes. ``breakdown``: ``Graph.get_memory_breakdown`` over
    the step, ``peaks``: each device's peak in the step. Each kind's column is the most it held during the
    step (the kinds peak at different moments; the step peak is what they held together at the worst one)."""
    rows = {}
    for (_, dev), kinds in breakdown.items():
        key = tuple(kinds[kind]["peak"] for kind, _ in MEMORY_COLUMNS) + (peaks.get(dev, 0),)
        rows.setdefault(key, []).append(dev)
    table = [("devices",) + tuple(title for _, title in MEMORY_COLUMNS) + ("step peak",)]
    for values, devs in sorted(rows.items(), key=lambda kv: kv[1][0]):
        table.append((_ids(devs),) + tuple(_mib(v) for v in values))
    n = len(table[0])
    widths = [max(len(r[c]) for r in table) for c in range(n)]
    lines = ["  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))) for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class TrainResult:
    def __init__(self, model, optimizer, config, losses, elapsed, tokens, log, breakdown, peaks):
        self.model, self.optimizer, self.config, self.losses = model, optimizer, config, losses
        self.elapsed, self.tokens, self.log, self.breakdown, self.peaks = elapsed, tokens, log, breakdown, peaks


def train(args, progress: bool = True) -> TrainResult:
    """Build the model on the flags' mesh and train it; the last step's memory and communication recorded."""
    import transformers
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    mesh = train_mesh(args)
    graph = dtorch.default_graph()
    text = Path(args.text) if args.text else CORPUS
    data = np.frombuffer(text.read_bytes(), dtype=np.uint8)
    cfg = _random_config(argparse.Namespace(intermediate=args.intermediate, hidden=args.hidden, layers=args.layers,
                                            heads=args.heads, kv_heads=args.kv_heads, vocab=256, seq=args.seq))
    cfg.initializer_range = 0.02
    cfg.bos_token_id = cfg.eos_token_id = None  # byte tokens: no byte ends a text (generation runs its length)
    hf = transformers.LlamaForCausalLM(cfg)  # torch's initialisation, then laid out on the mesh
    model = LlamaForCausalLM(cfg, mesh)
    model.load_state_dict(hf.state_dict())
    del hf
    if args.grad_checkpointing or args.selective_ac:
        model.gradient_checkpointing_enable(selective_ac_option=args.selective_ac)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"dtorch train: Llama over bytes, single controller, {_where(mesh)[0]}")
    print(f"model   {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
          f"({cfg.num_key_value_heads} kv), vocab 256; {n_params / 1e6:.2f} M parameters")
    print(f"mesh    {mesh}  ({_where(mesh)[1]})")
    print(f"data    {text.name}: {len(data)} bytes; batch {args.batch} x seq {args.seq}; AdamW lr {args.lr:g}\n")
    opt = dtorch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    batches = byte_batches(data, args.batch, args.seq, gen)
    losses = []
    measured = None
    # (a recovery re-runs steps on new workers: the steps stay eager there, a replay's record names the old ones)
    step_fn = train_step if args.eager or args.recover != "off" else dtorch.compile(train_step)
    bar = tqdm(range(args.steps), desc="training", unit="step", file=sys.stdout, dynamic_ncols=True,
               disable=not progress)
    t_start = time.perf_counter()
    tokens = 0
    snap = None
    if args.recover != "off":
        dtorch.recovery.configure(args.recover)
        snap = dtorch.recovery.snapshot(model, opt)

    def one_step(ids, labels):
        return step_fn(model, opt, ids, labels, args.clip)

    for step in bar:
        ids, labels = next(batches)
        last = step == args.steps - 1
        if last:  # the final step is the one measured: memory and communication
            graph.track_memory()
            log = dtorch.CommLog().__enter__()
        if snap is None:
            loss = one_step(ids, labels)  # (the measured step runs eagerly: memory is tracked)
        else:
            seen = len(snap.events)
            loss = snap.run_step(one_step, ids, labels)
            for event in snap.events[seen:]:
                bar.write(f"dtorch train: {event}")
        if last:
            log.__exit__(None, None, None)
            peaks = {dev: st["peak"] for (_, dev), st in graph.get_memory_stats(mesh).items()}
            measured = (log, graph.get_memory_breakdown(mesh), peaks)
            graph.track_memory(False)
        else:
            opt.zero_grad()
        losses.append(loss.item())
        tokens += ids.numel()
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens / (time.perf_counter() - t_start):.0f}")
    bar.close()
    elapsed = time.perf_counter() - t_start
    return TrainResult(model, opt, cfg, losses, elapsed, tokens, *measured)


def train_step(model, opt, ids, labels, clip: float):
    """Forward with labels, backward, gradient clipping, AdamW: what ``dtorch train`` compiles."""
    loss = model(ids, labels=labels).loss
    loss.backward()
    if clip > 0:
        dtorch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss


def run(args) -> int:
    r = train(args)
    print(f"\nloss {r.losses[0]:.3f} -> {r.losses[-1]:.3f} in {args.steps} steps, {r.elapsed:.1f} s "
          f"({r.tokens / r.elapsed:.0f} tokens/s)\n")
    print("memory per device in the last step (logical bytes; each kind's most, and the step's peak)")
    print(memory_table(r.breakdown, r.peaks) + "\n")
    print("communication in one step (forward, backward, clipping, AdamW)")
    print(r.log.table())
    losses = r.losses
    if args.save:
        save_hf_checkpoint(r.model, r.config, Path(args.save))
        print(f"\nsaved a Hugging Face checkpoint to {args.save} (transformers.LlamaForCausalLM.from_pretrained)")
    if args.plot:
        plot_losses(losses, Path(args.plot))
        print(f"loss curve: {args.plot}")
    return 0


def save_hf_checkpoint(model, cfg, path: Path) -> None:
    """config.json, generation_config.json, model.safetensors and the byte-level tokenizer (tokenizer.json,
    tokenizer_config.json): what ``dtorch generate --model`` and transformers' ``from_pretrained`` /
    ``AutoTokenizer.from_pretrained`` read."""
    import transformers

    hf = transformers.LlamaForCausalLM(cfg)
    hf.load_state_dict(model.state_dict())
    hf.save_pretrained(path, safe_serialization=True)
    transformers.PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer()).save_pretrained(path)


def byte_tokenizer():
    """A ``tokenizers.Tokenizer`` whose token ids are the text's UTF-8 bytes (the ids this command trains on):
    byte-level BPE with the 256 byte tokens and no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte -> character map

    vocab = {char: byte for byte, char in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def plot_losses(losses, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("dtorch train")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    return run_command(build_parser(), check_args, run, argv, inference=False)


if __name__ == "__main__":
    sys.exit(main())
