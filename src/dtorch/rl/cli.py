"""dtorch rl: GRPO on a small Llama, the trainer in one layout and the rollout in another, on one controller.

    dtorch rl                                           # trainer fsdp2 x tp2, rollout dp2 x tp2 on 4 other devices
    dtorch rl --train-dp 2 --train-tp 2 --gen-tp 4      # dp x tp trainer, tp4 rollout
    dtorch rl --train-fsdp 4 --gen-dp 2 --gen-tp 2 --colocate     # the rollout on the trainer's devices
    dtorch rl --backend process --plot reward.png       # one worker process per device, the reward curve

The task ships with dtorch (dtorch/rl/task.py): the prompt is some random digits, the right completion is
those digits reversed, the reward the fraction of positions right. Each step samples ``--group``
completions for each of ``--prompts`` prompts with the rollout model (KV cache, its own layout), scores
them, takes the reference model's log-probs (the initial policy, in the rollout's layout) for the KL term,
updates the policy (the trainer's layout) with the GRPO loss and AdamW, and writes the new weights into the
rollout model (``dtorch.nn.utils.copy_parameters_``: device to device, each device receiving only the
blocks it lacks). At the end: the time each role took, the bytes each weight sync moved, a few greedy
answers, and ``--plot`` draws the reward curve.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import dtorch

from ..models.llama import LlamaForCausalLM, LlamaLayoutError, check_layout
from ..models.llama_cli import HelpWithDefaults, _mesh_problems, _mib, _where, add_model_size_flags, \
    head_width_problems, run_command
from ..nn import skip_init
from ..nn.utils import copy_parameters_
from ..runtime.registry import backend_names
from .grpo import grpo_loss, group_advantages, token_logprobs
from .task import ReverseDigits

# (flag suffix, mesh dim name) in mesh order, outer to inner
TRAIN_DIMS = (("pp", "pp"), ("dp", "dp"), ("fsdp", "fsdp"), ("tp", "tp"))
GEN_DIMS = (("pp", "pp"), ("dp", "dp"), ("tp", "tp"))
ROLES = ("rollout", "reference", "policy update", "weight sync")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtorch rl", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpWithDefaults)
    t = p.add_argument_group("trainer layout (the policy: forward, backward, AdamW)")
    t.add_argument("--train-pp", type=int, default=1, help="pipeline stages")
    t.add_argument("--train-dp", type=int, default=1, help="data parallel: the batch split, gradients all-reduced")
    t.add_argument("--train-fsdp", type=int, default=2, help="fully sharded data parallel: the batch and every "
                   "parameter, gradient and AdamW state split")
    t.add_argument("--train-tp", type=int, default=2, help="tensor parallel: heads, MLP features and vocab split")
    g = p.add_argument_group("rollout layout (generation with a KV cache, and the reference model)")
    g.add_argument("--gen-pp", type=int, default=1, help="pipeline stages")
    g.add_argument("--gen-dp", type=int, default=2, help="data parallel: the prompts split")
    g.add_argument("--gen-tp", type=int, default=2, help="tensor parallel")
    g.add_argument("--colocate", action="store_true", help="put the rollout on the trainer's first devices instead of "
                   "the devices after them")
    r = p.add_argument_group("where it runs")
    r.add_argument("--backend", choices=backend_names(), default=None, help="dtorch backend (default: DTORCH_BACKEND, "
                   "else inprocess: every device simulated in this process)")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="mesh device type")
    r.add_argument("--threads", type=int, default=1, help="torch threads of this process (0: torch's default); the "
                   "simulated devices' kernels are tiny, and a thread pool spinning on a busy machine slows them down")
    m = p.add_argument_group("model (a random Llama over the task's 12 tokens)")
    add_model_size_flags(m, vocab=None)
    m.set_defaults(layers=2, hidden=64, heads=4, kv_heads=2)
    o = p.add_argument_group("GRPO")
    o.add_argument("--digits", type=int, default=3, help="digits per prompt (the answer has as many)")
    o.add_argument("--steps", type=int, default=100, help="GRPO steps (rollout, reference, update, sync)")
    o.add_argument("--prompts", type=int, default=16, help="prompts per step")
    o.add_argument("--group", type=int, default=8, help="completions sampled per prompt (the group of its advantages)")
    o.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    o.add_argument("--clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    o.add_argument("--kl", type=float, default=0.02, help="kl_coef: weight of the KL term to the reference model")
    o.add_argument("--clip-eps", type=float, default=0.2, help="PPO clipping of the probability ratio")
    o.add_argument("--updates", type=int, default=1, help="policy updates per batch of rollouts (above 1 the ratio "
                   "moves off 1 and the clipping matters)")
    o.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollout")
    o.add_argument("--seed", type=int, default=0, help="seeds the initial weights, the prompts and the sampling")
    out = p.add_argument_group("output")
    out.add_argument("--plot", metavar="PNG", help="draw the mean reward per step here (default: none)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _sizes(args, dims, prefix: str) -> list[tuple[str, int]]:
    return [(name, getattr(args, f"{prefix}_{flag}")) for flag, name in dims]


def check_args(args) -> list[str]:
    """Every problem with the flags at once, each saying what to change."""
    problems = []
    sizes = [f"{prefix}_{flag}" for prefix, dims in (("train", TRAIN_DIMS), ("gen", GEN_DIMS)) for flag, _ in dims]
    positive = sizes + ["layers", "hidden", "heads", "kv_heads", "digits", "steps", "prompts", "updates"]
    problems += [f"--{a.replace('_', '-')} {getattr(args, a)} must be at least 1"
                 for a in positive if getattr(args, a) < 1]
    if args.group < 2:
        problems.append(f"--group {args.group} must be at least 2 (advantages compare the completions of a prompt)")
    if not args.temperature > 0:
        problems.append(f"--temperature {args.temperature} must be > 0")
    if args.threads < 0:
        problems.append(f"--threads {args.threads} must be >= 0")
    if args.lr <= 0 or args.kl < 0 or args.clip_eps < 0 or args.clip < 0:
        problems.append("--lr must be > 0, --kl, --clip-eps and --clip >= 0")
    if problems:
        return problems
    problems += head_width_problems(args.hidden, args.heads)
    if args.heads % args.kv_heads:
        problems.append(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    batch = args.prompts * args.group
    for prefix, dims in (("train", ("dp", "fsdp")), ("gen", ("dp",))):
        split = 1
        for d in dims:
            split *= getattr(args, f"{prefix}_{d}")
        if batch % split:
            problems.append(f"--prompts {args.prompts} x --group {args.group} = {batch} sequences do not split over "
                            f"{' x '.join(f'--{prefix}-{d}' for d in dims)} = {split}")
    n_train, n_gen = _count(args, TRAIN_DIMS, "train"), _count(args, GEN_DIMS, "gen")
    if args.colocate and n_gen > n_train:
        problems.append(f"--colocate puts the rollout's {n_gen} devices on the trainer's {n_train}; use a rollout "
                        "layout with at most as many devices, or drop --colocate")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            problems.append("--plot needs matplotlib: pip install 'dtorch[plot]' (or pip install matplotlib)")
    if problems:
        return problems
    from types import SimpleNamespace

    # the Graph the run uses (a new one for --backend: its workers start with the first tensor)
    args.graph = dtorch.Graph(backend=args.backend) if args.backend else dtorch.default_graph()
    counts = SimpleNamespace(num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                             num_hidden_layers=args.layers)
    with args.graph:
        for role, mesh in (("trainer", train_mesh(args)), ("rollout", gen_mesh(args))):
            problems += [f"{role}: {p}" for p in _mesh_problems(mesh)]
            try:
                check_layout(counts, mesh)
            except LlamaLayoutError as exc:
                problems.append(f"{role}: {exc}")
    if problems and args.backend:
        args.graph.runtime.shutdown()
    return problems


def _count(args, dims, prefix: str) -> int:
    n = 1
    for _, size in _sizes(args, dims, prefix):
        n *= size
    return n


def _mesh(device: str, sizes: list, first: int) -> dtorch.DeviceMesh:
    """A mesh of the dims of size > 1 (a 1-D one of one device when none is), on ids ``first`` and on."""
    dims = [(name, n) for name, n in sizes if n > 1] or [("dp", 1)]
    names, shape = zip(*dims)
    count = 1
    for n in shape:
        count *= n
    return dtorch.DeviceMesh(device, torch.arange(first, first + count).reshape(shape), mesh_dim_names=list(names))


def train_mesh(args) -> dtorch.DeviceMesh:
    return _mesh(args.device, _sizes(args, TRAIN_DIMS, "train"), 0)


def gen_mesh(args) -> dtorch.DeviceMesh:
    first = 0 if args.colocate else _count(args, TRAIN_DIMS, "train")
    return _mesh(args.device, _sizes(args, GEN_DIMS, "gen"), first)


def model_config(args, task: ReverseDigits):
    from transformers import LlamaConfig

    intermediate = args.intermediate or int(round(args.hidden * 2.75 / 8)) * 8
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      vocab_size=task.vocab_size, max_position_embeddings=64, initializer_range=0.02,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)  # (no token ends a completion early)
    cfg._attn_implementation = "sdpa"
    return cfg


class RLResult:
    def __init__(self, rewards, times, comm, sync_bytes, param_bytes, elapsed, samples, greedy_reward):
        self.rewards, self.times, self.comm, self.sync_bytes = rewards, times, comm, sync_bytes
        self.param_bytes, self.elapsed, self.samples, self.greedy_reward = param_bytes, elapsed, samples, greedy_reward


def train(args, progress: bool = True) -> RLResult:
    """The GRPO loop the module doc describes (on the default Graph, with ``--threads`` torch threads); returns
    the rewards per step and the time of each role."""
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _train(args, progress)
    finally:
        torch.set_num_threads(threads)


def _train(args, progress: bool) -> RLResult:
    from tqdm import tqdm

    graph = dtorch.default_graph()
    task = ReverseDigits(args.digits)
    cfg = model_config(args, task)
    torch.manual_seed(args.seed)
    tmesh, gmesh = train_mesh(args), gen_mesh(args)
    policy = LlamaForCausalLM(cfg, tmesh)  # Hugging Face's initialisation for this seed
    with skip_init():  # (their weights come from the policy)
        rollout, reference = LlamaForCausalLM(cfg, gmesh), LlamaForCausalLM(cfg, gmesh)
    with torch.no_grad():
        copy_parameters_(rollout, policy)
        copy_parameters_(reference, policy)
    for p in reference.parameters():
        p.requires_grad_(False)
    opt = dtorch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    n_params = sum(p.numel() for p in policy.parameters())
    print(f"dtorch rl: GRPO on one controller, {_where(tmesh)[0]}")
    print(f"task      reverse {args.digits} digits (reward: the fraction of positions right)")
    print(f"model     Llama, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
          f"({cfg.num_key_value_heads} kv), vocab {cfg.vocab_size}; {n_params / 1e3:.0f} K parameters")
    print(f"trainer   {tmesh}")
    print(f"rollout   {gmesh}{'  (colocated)' if args.colocate else ''}, the reference model too")
    print(f"GRPO      {args.prompts} prompts x {args.group} completions per step, lr {args.lr:g}, kl {args.kl:g}, "
          f"clip {args.clip_eps:g}, {args.updates} update(s) per batch\n")

    gen = torch.Generator().manual_seed(args.seed)
    n_prompt, n_new = task.prompt_length, task.completion_length
    mask = torch.zeros(args.prompts * args.group, n_prompt + n_new - 1)
    mask[:, n_prompt - 1:] = 1  # log-prob t is of token t + 1: the completion's tokens
    times = dict.fromkeys(ROLES, 0.0)
    comm = dict.fromkeys(ROLES, 0)  # CommLog bytes
    rewards, sync_bytes = [], 0
    bar = tqdm(range(args.steps), desc="GRPO", unit="step", file=sys.stdout, dynamic_ncols=True, disable=not progress)
    t_start = time.perf_counter()

    def timed(role, fn):
        t0 = time.perf_counter()
        with dtorch.CommLog() as log:
            out = fn()
        graph.sync()  # (the process backend runs asynchronously: each role's work is counted to it)
        times[role] += time.perf_counter() - t0
        comm[role] += sum(r.nbytes for r in log.records)
        return out

    for _ in bar:
        prompts = task.prompts(args.prompts, gen).repeat_interleave(args.group, 0)  # [B, L]: groups in a row
        seqs = timed("rollout", lambda: rollout.generate(prompts, max_new_tokens=n_new, do_sample=True, top_k=0,
                                                        temperature=args.temperature, generator=gen))
        reward = task.reward(prompts, seqs[:, n_prompt:])
        advantages = group_advantages(reward, args.group)
        with torch.no_grad():
            ref_lp = timed("reference", lambda: token_logprobs(reference, seqs) if args.kl else None)

        def update():
            old_lp = None  # one update: on-policy (ratio 1); more: the ratio to the policy that sampled
            if args.updates > 1:
                with torch.no_grad():
                    old_lp = token_logprobs(policy, seqs)
            for _ in range(args.updates):
                lp = token_logprobs(policy, seqs)
                loss = grpo_loss(lp, old_lp, ref_lp, advantages, mask, clip_eps=args.clip_eps, kl_coef=args.kl)
                loss.backward()
                if args.clip > 0:
                    dtorch.nn.utils.clip_grad_norm_(policy.parameters(), args.clip)
                opt.step()
                opt.zero_grad()

        timed("policy update", update)
        sync_bytes = timed("weight sync", lambda: copy_parameters_(rollout, policy))
        rewards.append(float(reward.mean()))
        bar.set_postfix(reward=f"{rewards[-1]:.3f}", avg10=f"{sum(rewards[-10:]) / len(rewards[-10:]):.3f}")
    bar.close()
    elapsed = time.perf_counter() - t_start
    test = task.prompts(64, gen)
    with torch.no_grad():
        answers = rollout.generate(test, max_new_tokens=n_new)[:, n_prompt:]  # greedy
    greedy = float(task.reward(test, answers).mean())
    samples = [(task.render(p), task.render(a), task.render(task.answers(p[None])[0])) for p, a in zip(test[:4], answers[:4])]
    param_bytes = sum(p.numel() * p.dtype.itemsize for p in policy.parameters())
    return RLResult(rewards, times, comm, sync_bytes, param_bytes, elapsed, samples, greedy)


def role_table(times: dict, comm: dict, steps: int) -> str:
    """Time per role (total, per step, share) and the bytes its collectives and moves carry per step."""
    total = sum(times.values()) or 1.0
    rows = [("role", "total", "per step", "share", "communication per step")]
    for role in ROLES:
        rows.append((role, f"{times[role]:.2f} s", f"{1e3 * times[role] / steps:.1f} ms",
                     f"{100 * times[role] / total:.0f} %", _mib(comm[role] / steps)))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    lines = ["  ".join(c.ljust(w) if k == 0 else c.rjust(w) for k, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args) -> int:
    try:
        with args.graph:
            r = train(args, progress=not args.no_progress)
    finally:
        if args.backend:
            args.graph.runtime.shutdown()
    first, last = r.rewards[:10], r.rewards[-10:]
    f, l_ = sum(first) / len(first), sum(last) / len(last)
    print(f"\nmean reward {f:.3f} (first {len(first)} steps) -> {l_:.3f} (last {len(last)} steps), "
          f"{l_ / f if f else float('inf'):.1f}x, in {args.steps} steps, {r.elapsed:.1f} s; greedy reward now "
          f"{r.greedy_reward:.3f}\n")
    print("time per role")
    print(role_table(r.times, r.comm, args.steps) + "\n")
    print(f"weight sync: {_mib(r.sync_bytes)} moved between devices per sync (trainer -> rollout layout, device to "
          f"device, only the blocks each device lacks); the parameters are {_mib(r.param_bytes)}\n")
    print("greedy answers now (prompt -> answer, right answer)")
    for prompt, answer, right in r.samples:
        print(f"  {prompt} -> {answer}   ({right})")
    if args.plot:
        plot_rewards(r.rewards, Path(args.plot))
        print(f"\nreward curve: {args.plot}")
    return 0


def plot_rewards(rewards, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = range(1, len(rewards) + 1)
    ax.plot(steps, rewards, alpha=0.4, label="mean reward")
    k = min(10, len(rewards))
    smooth = [sum(rewards[max(0, i - k + 1):i + 1]) / len(rewards[max(0, i - k + 1):i + 1]) for i in range(len(rewards))]
    ax.plot(steps, smooth, label=f"average of the last {k}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_title("dtorch rl: reverse the digits")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    return run_command(build_parser(), check_args, run, argv, inference=False)


if __name__ == "__main__":
    sys.exit(main())
