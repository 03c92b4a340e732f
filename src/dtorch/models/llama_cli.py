"""dtorch demo: a Llama under a parallel layout on simulated devices, checked against Hugging Face.

    dtorch demo                                   # dp2 x tp2 x pp2 x ulysses2 = 16 simulated CPU devices
    dtorch demo --tp 4 --ring-cp 2 --layers 6
    dtorch demo --model path/to/hf_checkpoint     # config.json + *.safetensors
    DTORCH_BACKEND=process dtorch demo            # one worker process per device instead of simulation
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import dtorch

from ..errors import CheckpointError, DTorchError
from ._checkpoint import load_config
from .llama import LlamaForCausalLM, LlamaLayoutError, check_layout, dim_size

# (argument, mesh dim) outer to inner. tp before ulysess_cp: both split the heads around attention and
# the outer mesh dim splits first, so Ulysses' all_to_all then leaves tp's head shards in place.
_DIM_ORDER = (("pp", "pp"), ("dp", "dp"), ("tp", "tp"), ("ulysses_cp", "ulysess_cp"), ("ring_cp", "ring_cp"))


_LAYOUT_HELP = {
    "dp": "data parallel: the batch is split",
    "tp": "tensor parallel: heads and MLP features are split",
    "pp": "pipeline parallel: layers are split into stages",
    "ulysses-cp": "Ulysses context parallel: the sequence is split",
    "ring-cp": "Ring context parallel: the sequence is split",
}


class HelpWithDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter that does not repeat a default the help text already states
    (``(default: ~2.75 x hidden)``): every option of a ``dtorch`` subcommand has a help text, so ``--help``
    shows every default."""

    def _get_help_string(self, action):
        if "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_layout_flags(p: argparse.ArgumentParser, defaults: dict, helps: dict | None = None, *, device: bool = True):
    """The layout group every subcommand shares (``defaults``: flag -> size; ``helps`` overrides texts)."""
    g = p.add_argument_group("layout (mesh dim sizes; their product is the number of devices)")
    texts = {**_LAYOUT_HELP, **(helps or {})}
    for flag, size in defaults.items():
        g.add_argument(f"--{flag}", type=int, default=size, help=texts[flag])
    if device:
        g.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="mesh device type (cpu devices are virtual; cuda needs GPUs or DTORCH_DTENSOR_IN_SAME_DEVICE=1)")
    return g


def add_model_size_flags(group, *, vocab: int | None, intermediate: bool = True) -> None:
    """The random model's sizes (``vocab`` None: no --vocab flag)."""
    group.add_argument("--layers", type=int, default=4, help="decoder layers")
    group.add_argument("--hidden", type=int, default=128, help="hidden size")
    group.add_argument("--heads", type=int, default=8, help="attention heads")
    group.add_argument("--kv-heads", type=int, default=4, help="key/value heads (fewer than --heads: grouped-query "
                       "attention)")
    if intermediate:
        group.add_argument("--intermediate", type=int, default=None, help="MLP width (default: ~2.75 x hidden)")
    if vocab is not None:
        group.add_argument("--vocab", type=int, default=vocab, help="vocabulary size")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtorch demo", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpWithDefaults)
    add_layout_flags(p, {"dp": 2, "tp": 2, "pp": 2, "ulysses-cp": 2, "ring-cp": 1})
    m = p.add_argument_group("model (a random Llama unless --model is given)")
    m.add_argument("--model", metavar="PATH", help="a Hugging Face Llama checkpoint directory (default: none, a "
                   "random Llama of the sizes below)")
    add_model_size_flags(m, vocab=512)
    i = p.add_argument_group("input and check")
    i.add_argument("--batch", type=int, default=4, help="prompts in the batch")
    i.add_argument("--seq", type=int, default=32, help="tokens per prompt")
    i.add_argument("--seed", type=int, default=0, help="seeds the random model and the token ids")
    i.add_argument("--tolerance", type=float, default=1e-4, help="rtol = atol for the comparison with Hugging Face")
    return p


def _flag(attr: str) -> str:
    return "--" + attr.replace("_", "-")


def _divisors(n: int) -> str:
    """12 -> "1, 2, 3, 4, 6 or 12"."""
    ds = [str(d) for d in range(1, n + 1) if n % d == 0]
    return ds[0] if len(ds) == 1 else ", ".join(ds[:-1]) + " or " + ds[-1]


def head_width_problems(hidden: int, heads: int) -> list[str]:
    """What is wrong with ``hidden`` over ``heads`` (empty: nothing): every head takes hidden / heads features,
    an even number (rotary embeddings rotate pairs)."""
    step = 2 * heads
    if hidden % step == 0:
        return []
    lo, hi = hidden // step * step, (hidden // step + 1) * step
    use = f"use --hidden {lo} or {hi}" if lo else f"use --hidden {hi}"
    if hidden % heads:
        return [f"--hidden {hidden} is not divisible by --heads {heads} (each head takes hidden / heads features); {use}"]
    return [f"--hidden {hidden} / --heads {heads} = {hidden // heads} features per head, which must be even (rotary "
            f"embeddings rotate pairs of features); {use}"]


def checkpoint_config(path, problems: list):
    """The config of the checkpoint at ``path``, or None with the reason appended to ``problems``."""
    try:
        return load_config(Path(path))
    except CheckpointError as exc:
        problems.append(str(exc))
        return None


def check_args(args) -> list[str]:
    """Every problem with the flags, all at once, each saying what to change (empty: they fit together).

    Runs before anything is built. The model counts come from the flags, or from the checkpoint's
    config.json with --model; whether the layout can serve them is ``llama.check_layout``'s call, the
    same check the model makes when it is built."""
    problems = []
    positive = [attr for attr, _ in _DIM_ORDER] + ["batch", "seq"]
    if not args.model:
        positive += ["layers", "hidden", "heads", "kv_heads", "vocab"]
        positive += ["intermediate"] if args.intermediate is not None else []
    problems += [f"{_flag(a)} {getattr(args, a)} must be at least 1" for a in positive if getattr(args, a) < 1]
    if not args.tolerance >= 0:
        problems.append(f"--tolerance {args.tolerance:g} must be a number >= 0")

    def fine(*attrs):  # only combine counts that are valid on their own
        return all(getattr(args, a) >= 1 for a in attrs)

    if not args.model and fine("hidden", "heads"):
        problems += head_width_problems(args.hidden, args.heads)
    if fine("seq", "ulysses_cp") and args.seq % args.ulysses_cp:
        s, u = args.seq, args.ulysses_cp
        problems.append(f"--seq {s} is not divisible by --ulysses-cp {u} (Ulysses splits the sequence evenly); use "
                        + (f"--seq {s // u * u} or {(s // u + 1) * u}" if s > u else f"--seq {u}")
                        + f", or --ulysses-cp {_divisors(s)}")

    config = checkpoint_config(args.model, problems) if args.model else None
    if not args.model and fine("layers", "heads", "kv_heads"):
        # the counts check_layout reads, straight from the flags (a LlamaConfig would refuse some
        # flag mistakes on its own before the layout could be judged)
        config = SimpleNamespace(num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                 num_hidden_layers=args.layers)
    if fine(*(attr for attr, _ in _DIM_ORDER)):
        mesh = _mesh(args)
        problems += _mesh_problems(mesh)
        if config is not None:
            try:
                check_layout(config, mesh)
            except LlamaLayoutError as exc:
                names = "--tp, --ulysses-cp and --pp set tp, ulysess_cp and pp"
                if not args.model:
                    names += "; --heads, --kv-heads and --layers set num_attention_heads, num_key_value_heads and " \
                             "num_hidden_layers"
                problems.append(f"{exc} ({names})")
    return problems


def _mesh_problems(mesh) -> list[str]:
    """Why this machine (or the backend) cannot run ``mesh``."""
    from ..runtime.devices import mesh_problems, read_device_config

    graph = dtorch.default_graph()
    out = [] if graph.satisfy(mesh) else [mesh_problems(mesh, getattr(graph.runtime, "config", None) or read_device_config())]
    limit = getattr(graph.runtime, "max_workers", None)  # the process and ray backends: a worker per device
    if limit is not None and mesh.size() > limit:
        out.append(f"the mesh has {mesh.size()} devices (--dp x --tp x --pp x --ulysses-cp x --ring-cp) but the "
                   f"{graph.backend} backend allows {limit} workers; use smaller sizes or raise "
                   "DTORCH_PROCESS_MAX_WORKERS")
    return out


def _where(mesh) -> tuple[str, str]:
    """(where the devices are, for the banner; what they are: "16 simulated cpu devices"), true to the
    backend: the process backend runs one worker process per device, the ray backend one Ray actor."""
    graph = dtorch.default_graph()
    n, kind = mesh.size(), mesh.device_type
    if graph.backend == "process":
        return "one worker process per device (process backend)", f"{n} {kind} devices, one worker process each"
    if graph.backend == "ray":
        return "one Ray actor per device (ray backend)", f"{n} {kind} devices, one Ray actor each"
    config = getattr(graph.runtime, "config", None)
    if kind == "cpu" or (config is not None and config.same_device):
        return "every device simulated in this process", f"{n} simulated {kind} devices"
    return "every device driven from this process", f"{n} {kind} devices"


class Progress:
    """One line that fills up on a terminal; a start and an end line otherwise."""

    def __init__(self, label: str, total: int = 0):
        self.label, self.total, self.tty = label, total, sys.stdout.isatty()
        self.t0 = time.perf_counter()
        if not self.tty:
            print(f"{label} ...", flush=True)
        self.update(0)

    def update(self, done: int, note: str = "", total: int | None = None) -> None:
        self.total = total or self.total
        if self.tty and self.total:
            filled = int(24 * done / self.total)
            bar = "#" * filled + "." * (24 - filled)
            print(f"\r{self.label:34s} [{bar}] {done}/{self.total} {note[:40]:40s}", end="", flush=True)

    def done(self, note: str = "") -> float:
        dt = time.perf_counter() - self.t0
        msg = f"{self.label:34s} done in {dt:.2f} s{(' ' + note) if note else ''}"
        print(("\r" + msg + " " * 60) if self.tty else "  " + msg.strip(), flush=True)
        return dt


def _random_config(args):
    from transformers import LlamaConfig

    inter = args.intermediate or int(round(args.hidden * 2.75 / 8)) * 8
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=inter, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=max(args.seq, 64), initializer_range=0.1)
    cfg._attn_implementation = "sdpa"
    return cfg


def _mesh(args):
    """The mesh the flags ask for (sizes checked by check_args): dims of size 1 left out."""
    dims = [(name, getattr(args, attr)) for attr, name in _DIM_ORDER if getattr(args, attr) > 1]
    if not dims:
        return dtorch.DeviceMesh(args.device)
    names, sizes = zip(*dims)
    return dtorch.init_device_mesh(args.device, sizes, mesh_dim_names=list(names))


def _describe_layout(model: LlamaForCausalLM, cfg, args) -> str:
    mesh = model.device_mesh
    lines = [f"mesh    {mesh}  ({_where(mesh)[1]})"]
    tp, ul, ring, dp = (dim_size(mesh, n) for n in ("tp", "ulysess_cp", "ring_cp", "dp"))
    kv = cfg.num_key_value_heads  # fewer kv heads than tp: each device holds one of them (replicated)
    if dp > 1:
        lines.append(f"  {'dp=' + str(dp):14s}batch {args.batch} split {dp} ways")
    if tp > 1:
        lines.append(f"  {'tp=' + str(tp):14s}{cfg.num_attention_heads} heads ({kv} kv) -> {cfg.num_attention_heads // tp} "
                     f"({max(kv // tp, 1)} kv) per device; MLP {cfg.intermediate_size} -> {cfg.intermediate_size // tp}; "
                     f"vocab {cfg.vocab_size} -> {cfg.vocab_size // tp} in lm_head")
    for name, size, how in (("ulysess_cp", ul, "all-to-all sequence <-> heads around attention"),
                            ("ring_cp", ring, "K/V blocks passed around a ring, log-sum-exp merge")):
        if size > 1:
            lines.append(f"  {name + '=' + str(size):14s}sequence {args.seq} split {size} ways: {how}")
    stages = model.model.stage_meshes
    if len(stages) > 1:
        lines.append(f"  {'pp=' + str(len(stages)):14s}{cfg.num_hidden_layers} layers in {len(stages)} stages, "
                     "activations handed on with send_recv")
    for s, smesh in enumerate(stages):
        layers = [i for i, st in enumerate(model.model.layer_stages) if st == s]
        parts = (["embed_tokens"] if s == 0 else []) + [f"layers {layers[0]}-{layers[-1]}" if len(layers) > 1
                                                         else f"layer {layers[0]}"]
        parts += ["norm", "lm_head"] if s == len(stages) - 1 else []
        lines.append(f"  stage {s}: devices {_ids(smesh.device_ids)}: {', '.join(parts)}")
    return "\n".join(lines)


def _ids(ids) -> str:
    """[0, 1, 2, 3, 8, 9] -> "0-3,8-9"."""
    runs, ids = [], sorted(ids)
    for i in ids:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _memory_table(graph, mesh, single_bytes: int) -> str:
    """One row per group of devices holding the same bytes (a 16-device mesh is usually 1-2 rows)."""
    groups: dict = {}
    for (_, dev), st in graph.get_memory_stats(mesh).items():
        groups.setdefault((st["allocated"], st["peak"]), []).append(dev)
    rows = [("devices", "allocated", "peak")]
    for (alloc, peak), devs in sorted(groups.items(), key=lambda kv: kv[1][0]):
        rows.append((_ids(devs), _mib(alloc), _mib(peak)))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    out = ["  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))) for r in rows]
    out.insert(1, "  ".join("-" * w for w in widths))
    out.append(f"(one device holding the whole model: {_mib(single_bytes)} of parameters)")
    return "\n".join(out)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _hf_forward(hf, ids, label: str):
    """The reference forward with a per-layer progress line (forward hooks on the decoder layers)."""
    layers = hf.model.layers
    bar = Progress(label, len(layers))
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: bar.update(i + 1, f"layer {i}"))
             for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            logits = hf(ids).logits
            dt = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
    bar.done()
    return logits, dt


def run(args) -> int:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # this demo draws its own

    torch.manual_seed(args.seed)
    graph = dtorch.default_graph()
    graph.track_memory()
    mesh = _mesh(args)
    print(f"dtorch demo: Llama, single controller, {_where(mesh)[0]}\n")

    if args.model:
        bar = Progress("loading dtorch model (sharded reads)")
        model = LlamaForCausalLM.from_pretrained(args.model, device_mesh=mesh, dtype=torch.float32,
                                                 progress=lambda i, n, key: bar.update(i, key, n))
        bar.done()
        cfg = model.config
        bar = Progress("loading Hugging Face reference")
        hf = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        bar.done()
        source = f"checkpoint {args.model}"
    else:
        cfg = _random_config(args)
        hf = transformers.LlamaForCausalLM(cfg).eval()
        model = LlamaForCausalLM(cfg, mesh)
        model.load_state_dict(hf.state_dict())
        source = "random weights"
    n_params = sum(p.numel() for p in hf.parameters())
    print(f"model   Llama ({source}): {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv), MLP {cfg.intermediate_size}, "
          f"vocab {cfg.vocab_size}; {n_params / 1e6:.2f} M parameters")
    print(f"input   token ids [batch {args.batch}, seq {args.seq}]")
    print(_describe_layout(model, cfg, args) + "\n")

    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
    expected, hf_time = _hf_forward(hf, ids, "Hugging Face forward (1 device)")
    t0 = time.perf_counter()
    model(ids)  # first call: plans every op and redistribution once (cached afterwards)
    cold = time.perf_counter() - t0
    graph.reset_peak_memory_stats()
    with dtorch.CommLog() as log:
        t0 = time.perf_counter()
        logits = model(ids)
        warm = time.perf_counter() - t0

    err = (logits - expected).abs().max().item()
    ok = torch.allclose(logits, expected, rtol=args.tolerance, atol=args.tolerance)
    verdict = "PASS" if ok else "FAIL"
    print(f"\nmax |dtorch - Hugging Face| = {err:.3e}   {verdict} (rtol = atol = {args.tolerance:g}, logits "
          f"{list(logits.shape)})")
    print(f"time    dtorch forward {warm * 1e3:.1f} ms on {_where(mesh)[1]} "
          f"(first call {cold * 1e3:.1f} ms, planning included); Hugging Face forward {hf_time * 1e3:.1f} ms\n")
    print("memory per device (logical bytes; peak during the forward)")
    print(_memory_table(graph, mesh, n_params * 4) + "\n")
    print("communication in one forward")
    print(log.table())
    return 0 if ok else 1


def run_command(parser, check, run_fn, argv, *, inference: bool) -> int:
    """The shared life of a ``dtorch`` subcommand: parse, report every bad flag at once (one line, exit
    code 2, like argparse's own errors), run (``inference``: without autograd history; parameters
    require grad), turn dtorch's errors into that one line too."""
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    problems = check(args)
    if problems:
        print(f"{parser.prog}: error: " + "; ".join(problems), file=sys.stderr)
        return 2
    try:
        with torch.set_grad_enabled(not inference):
            return run_fn(args)
    except (DTorchError, ValueError, FileNotFoundError) as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        dtorch.default_graph().track_memory(False)


def main(argv=None) -> int:
    return run_command(build_parser(), check_args, run, argv, inference=True)


if __name__ == "__main__":
    sys.exit(main())
