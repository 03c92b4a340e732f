"""dtorch generate: text from a Llama under a parallel layout, tokens streamed as they come.

    dtorch generate --prompt "Once upon a time"                  # a random Llama on tp2 x pp2 (4 simulated devices)
    dtorch generate --model path/to/hf_checkpoint --prompt "..." --tp 2 --ring-cp 2
    dtorch generate --prompt "a" --prompt "b c" --dp 2 --do-sample --top-p 0.9 --seed 3
    DTORCH_BACKEND=process dtorch generate ...                   # one worker process per device
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from .llama import LlamaForCausalLM, LlamaLayoutError, check_layout
from .llama_cli import (_DIM_ORDER, HelpWithDefaults, _flag, _ids, _mesh, _mesh_problems, _where, add_layout_flags,
                        add_model_size_flags, checkpoint_config, head_width_problems, run_command)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dtorch generate", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpWithDefaults)
    add_layout_flags(p, {"dp": 1, "tp": 2, "pp": 2, "ulysses-cp": 1, "ring-cp": 1}, {
        "dp": "data parallel: the prompts are split",
        "tp": "tensor parallel: heads (and the KV cache's kv heads) are split",
        "pp": "pipeline parallel: layers (and their KV cache) are split",
        "ulysses-cp": "Ulysses context parallel: the prompt and the cache's slots are split",
        "ring-cp": "Ring context parallel: the prompt and the cache's slots are split"})
    m = p.add_argument_group("model (a random Llama unless --model is given; its tokens are the prompt's bytes)")
    m.add_argument("--model", metavar="DIR", help="a Hugging Face Llama checkpoint directory with tokenizer.json "
                   "(dtorch train --save writes one) (default: none, a random Llama of the sizes below)")
    add_model_size_flags(m, vocab=512, intermediate=False)
    i = p.add_argument_group("generation (unset: the model's generation_config.json, then transformers' defaults)")
    i.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt (repeat for a batch, left-padded) (default: 'Once upon a time')")
    i.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    i.add_argument("--do-sample", action="store_true", default=None,
                   help="sample (default: the generation config's do_sample, else greedy)")
    i.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the generation config's, else 1.0)")
    i.add_argument("--top-k", type=int, default=None,
                   help="sample among the k likeliest tokens; 0: all (default: the generation config's, else 50)")
    i.add_argument("--top-p", type=float, default=None,
                   help="sample within the top-p probability mass (default: the generation config's, else 1.0)")
    i.add_argument("--seed", type=int, default=0, help="seeds the random model and the sampling generator")
    i.add_argument("--check", action="store_true", help="also run Hugging Face's generate on one device and compare "
                   "the tokens (greedy only)")
    return p


def check_args(args) -> list[str]:
    """Every problem with the flags, each saying what to change (empty: they fit together)."""
    positive = [attr for attr, _ in _DIM_ORDER] + ["max_new_tokens"]
    if not args.model:
        positive += ["layers", "hidden", "heads", "kv_heads", "vocab"]
    problems = [f"{_flag(a)} {getattr(args, a)} must be at least 1" for a in positive if getattr(args, a) < 1]
    if args.temperature is not None and not args.temperature > 0:
        problems.append(f"--temperature {args.temperature:g} must be > 0")
    if args.top_k is not None and args.top_k < 0:
        problems.append(f"--top-k {args.top_k} must be at least 0")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        problems.append(f"--top-p {args.top_p:g} must be in (0, 1]")
    if args.check and args.do_sample:
        problems.append("--check compares greedy tokens; drop --do-sample or --check")
    if any(not p for p in args.prompt or ["x"]):
        problems.append("--prompt must not be empty")
    if not args.model and args.hidden >= 1 and args.heads >= 1:
        problems += head_width_problems(args.hidden, args.heads)
    config = None
    if args.model:
        config = checkpoint_config(args.model, problems)
        if not (Path(args.model) / "tokenizer.json").is_file():
            problems.append(f"{args.model} has no tokenizer.json (the tokenizers package reads it); save the "
                            "checkpoint's tokenizer there (tokenizer.save_pretrained(DIR))")
    elif all(getattr(args, a) >= 1 for a in ("layers", "heads", "kv_heads")):
        from types import SimpleNamespace

        config = SimpleNamespace(num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                 num_hidden_layers=args.layers)
    if all(getattr(args, a) >= 1 for a, _ in _DIM_ORDER):
        mesh = _mesh(args)
        problems += _mesh_problems(mesh)
        if config is not None:
            try:
                check_layout(config, mesh)
            except LlamaLayoutError as exc:
                problems.append(f"{exc} (--tp, --ulysses-cp and --pp set tp, ulysess_cp and pp)")
    return problems


class _Bytes:
    """The random model's tokenizer: a token per UTF-8 byte (ids modulo the vocabulary)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab for b in text.encode()]

    def decode(self, ids) -> str:
        return " ".join(str(i) for i in ids)


class _HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(path / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


class _Stream:
    """Prints row 0's text as its tokens come (the decoded text's new part each step)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out or sys.stdout, [], ""
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())
        if value.ndim == 2:  # the prompt
            return
        self.ids.append(int(value[0]))
        text = self.tokenizer.decode(self.ids)
        if isinstance(self.tokenizer, _Bytes):
            text += " "
        if text.startswith(self.shown):
            print(text[len(self.shown):], end="", file=self.out, flush=True)
            self.shown = text

    def end(self):
        print(file=self.out, flush=True)


def _random_model(args, mesh, max_positions: int):
    import transformers

    torch.manual_seed(args.seed)
    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=int(round(args.hidden * 2.75 / 8)) * 8,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                                   max_position_embeddings=max(max_positions, 64), initializer_range=0.1,
                                   eos_token_id=None, bos_token_id=None)
    cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(cfg).eval()
    model = LlamaForCausalLM(cfg, mesh)
    model.load_state_dict(hf.state_dict())
    return model, hf


def _batch(tokenizer, prompts, pad_id: int):
    rows = [tokenizer.encode(p) for p in prompts]
    s = max(len(r) for r in rows)
    ids = torch.full((len(rows), s), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), s, dtype=torch.long)
    for n, r in enumerate(rows):
        ids[n, s - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[n, s - len(r):] = 1
    return ids, mask


def _kv_table(cache) -> str:
    groups: dict = {}
    for (_, dev), b in cache.memory_per_device().items():
        groups.setdefault(b, []).append(dev)
    ideal = cache.ideal_bytes()
    lines = [f"KV cache {cache.slots} slots x {len(cache)} layers, {ideal / 2**20:.3f} MiB on one device; per device:"]
    for b, devs in sorted(groups.items()):
        lines.append(f"  devices {_ids(devs):12s} {b / 2**20:.3f} MiB  (1/{ideal / b:.1f} of it)")
    return "\n".join(lines)


def run(args) -> int:
    mesh = _mesh(args)
    prompts = args.prompt or ["Once upon a time"]
    print(f"dtorch generate: Llama, single controller, {_where(mesh)[0]}")
    hf = None
    if args.model:
        model = LlamaForCausalLM.from_pretrained(args.model, device_mesh=mesh, dtype=torch.float32)
        tokenizer = _HFTokenizer(Path(args.model))
        source = f"checkpoint {args.model}"
    else:
        tokenizer = _Bytes(args.vocab)
        longest = max(len(tokenizer.encode(p)) for p in prompts)
        model, hf = _random_model(args, mesh, longest + args.max_new_tokens)
        source = "random weights, byte tokens"
    cfg = model.config
    pad = next((p for p in (model.generation_config.pad_token_id, cfg.pad_token_id) if p is not None), 0)
    ids, mask = _batch(tokenizer, prompts, pad)
    # the flags given; the rest comes from the model's generation config (as in transformers)
    settings = {"max_new_tokens": args.max_new_tokens, "pad_token_id": pad}
    settings.update({k: getattr(args, k) for k in ("do_sample", "temperature", "top_k", "top_p")
                     if getattr(args, k) is not None})
    if args.check:
        settings["do_sample"] = False
    sampling = model.generation_config.do_sample if args.do_sample is None and not args.check else args.do_sample
    print(f"model   Llama ({source}): {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv), vocab {cfg.vocab_size}")
    print(f"mesh    {mesh}  ({_where(mesh)[1]})")
    print(f"prompts {len(prompts)} (longest {ids.shape[1]} tokens, left-padded); "
          f"{'sampling' if sampling else 'greedy'}, up to {args.max_new_tokens} new tokens\n")
    for p in prompts[:1]:
        print(p, end="" if args.model else "\n", flush=True)
    stream = _Stream(tokenizer)
    gen = torch.Generator().manual_seed(args.seed)
    out = model.generate(ids, attention_mask=mask, generator=gen, streamer=stream, return_dict_in_generate=True,
                         **settings)
    new = out.sequences[:, ids.shape[1]:]
    for n, p in enumerate(prompts[1:], start=1):
        print(f"\n[{n}] {p}{'' if args.model else chr(10)}{tokenizer.decode(new[n].tolist())}")
    t = out.timings
    b = ids.shape[0]
    print(f"\nprefill {b} x {ids.shape[1]} tokens in {t['prefill_s'] * 1e3:.1f} ms "
          f"({b * ids.shape[1] / max(t['prefill_s'], 1e-9):.0f} tokens/s)")
    if t["decode_steps"]:
        print(f"decode  {t['decode_steps']} steps x {b} rows in {t['decode_s'] * 1e3:.1f} ms "
              f"({b * t['decode_steps'] / t['decode_s']:.1f} tokens/s)")
    print(_kv_table(out.past_key_values))
    if args.check:
        import transformers

        if hf is None:
            hf = transformers.LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        want = hf.generate(ids, attention_mask=mask, **settings)
        ok = torch.equal(want, out.sequences)
        print(f"check   Hugging Face generate (1 device): {'PASS, the same tokens' if ok else 'FAIL, other tokens'}")
        return 0 if ok else 1
    return 0


def main(argv=None) -> int:
    return run_command(build_parser(), check_args, run, argv, inference=True)


if __name__ == "__main__":
    sys.exit(main())
