"""Generation speed: dtorch's KV-cache generate on simulated devices vs Hugging Face on one device.

decode: a random Llama (hidden 512, 8 heads / 4 kv heads, 4 layers, MLP 1408, vocab 8192, float32) on
tp2 x pp2 x dp2 = 8 simulated CPU devices, greedy, ``--batch`` prompts of ``--prompt`` tokens, ``--new``
new tokens; decode tokens/s = batch x decode steps / the time from the first new token to the last (both
sides timed by a streamer's put calls). Hugging Face: ``generate`` of the same model (its DynamicCache).

prefill: the same model on ring_cp=4, one prompt of ``--seq`` tokens: ``generate(max_new_tokens=1)`` (the
prompt's forward into the cache plus the first token) vs Hugging Face's ``generate(max_new_tokens=1)``.

Each measurement is the median of ``--runs`` runs after a warm-up run, dtorch and Hugging Face interleaved.
The simulated devices share this process's cores: dtorch does the same arithmetic as one device (the
blocks of all devices are stacked into one kernel call where they are even) plus its dispatch overhead.

    .venv/bin/python bench/generate.py [--runs 5] [--batch 8] [--new 64] [--seq 1024] [--threads N] [--clock cpu] [--stub-gemms]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import dtorch
import dtorch.models.generation as generation
from dtorch.models.llama import LlamaForCausalLM


TIMER = time.perf_counter  # --clock cpu: time.thread_time


class Clock:
    def __init__(self):
        self.t = []

    def put(self, value):
        self.t.append(TIMER())

    def end(self):
        pass

    def decode_s(self) -> float:  # put: the prompt, then each new token
        return self.t[-1] - self.t[1]


def model_pair(mesh, max_positions: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=8192,
                                   max_position_embeddings=max_positions, initializer_range=0.02,
                                   eos_token_id=None, bos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(cfg).eval()
    model = LlamaForCausalLM(cfg, mesh)
    model.load_state_dict(hf.state_dict())
    return hf, model


def stub_gemms() -> None:
    """--stub-gemms: torch.mm, torch.bmm and F.linear return zeros (the GEMMs are the same on both sides), so the
    times are what each side does besides them (the tokens are then not checked)."""
    import dtorch.ops.matrix as matrix

    torch.mm = lambda a, b: torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
    torch.bmm = lambda a, b: torch.zeros(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype)
    torch.nn.functional.linear = lambda x, w, b=None: torch.zeros(x.shape[:-1] + (w.shape[0],), dtype=x.dtype)
    if hasattr(matrix, "_local_plan"):  # (plans hold the GEMM they call)
        matrix._local_plan.cache_clear()
    if hasattr(matrix, "_strided_plan"):
        matrix._strided_plan.cache_clear()


def decode(args) -> None:
    if args.stub_gemms:
        stub_gemms()
    mesh = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["pp", "dp", "tp"])
    hf, model = model_pair(mesh, args.prompt + args.new + 8)
    ids = torch.randint(1, 8192, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=args.new, do_sample=False, pad_token_id=0)
    ours, eager, theirs = [], [], []
    for run in range(args.runs + 1):
        c = Clock()
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), streamer=c, **kw)
        h = c.decode_s()
        times = {}
        for compiled in (True, False):  # the decode steps replayed (dtorch.compile, the default), then eager
            generation.COMPILE_DECODE = compiled
            c = Clock()
            got = model.generate(ids, streamer=c, **kw)
            times[compiled] = c.decode_s()
            assert args.stub_gemms or torch.equal(got, want), "dtorch and Hugging Face generated other tokens"
        generation.COMPILE_DECODE = True
        if run:  # the first run plans every op (and warms Hugging Face up)
            ours.append(times[True])
            eager.append(times[False])
            theirs.append(h)
    toks = args.batch * (args.new - 1)
    d, e, h = statistics.median(ours), statistics.median(eager), statistics.median(theirs)
    print(f"decode  tp2 x pp2 x dp2 (8 simulated cpu devices), batch {args.batch}, prompt {args.prompt}, "
          f"{args.new} new tokens (identical to HF's), {args.clock} clock")
    print(f"  dtorch        {toks / d:9.1f} tokens/s  ({d / (args.new - 1) * 1e3:.2f} ms per step; decode replayed)")
    print(f"  dtorch eager  {toks / e:9.1f} tokens/s  ({e / (args.new - 1) * 1e3:.2f} ms per step; "
          f"{h / e:.2f}x HF's tokens/s)")
    print(f"  Hugging Face  {toks / h:9.1f} tokens/s  ({h / (args.new - 1) * 1e3:.2f} ms per step, 1 device)")
    print(f"  ratio         {h / d:9.2f}x HF's tokens/s, replayed (target >= 1.0x: issue 24); per run: "
          + " ".join(f"{b / a:.2f}" for a, b in zip(ours, theirs)))


def prefill(args) -> None:
    mesh = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["ring_cp"])
    hf, model = model_pair(mesh, args.seq + 8)
    ids = torch.randint(1, 8192, (1, args.seq), generator=torch.Generator().manual_seed(2))
    ours, theirs = [], []
    for run in range(args.runs + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                               pad_token_id=0)
        t1 = time.perf_counter()
        got = model.generate(ids, max_new_tokens=1)
        t2 = time.perf_counter()
        assert torch.equal(got, want), "dtorch and Hugging Face chose another first token"
        if run:
            theirs.append(t1 - t0)
            ours.append(t2 - t1)
    d, h = statistics.median(ours), statistics.median(theirs)
    print(f"prefill ring_cp=4 (4 simulated cpu devices), 1 x {args.seq} tokens into the KV cache + the first token")
    print(f"  dtorch        {d * 1e3:9.1f} ms")
    print(f"  Hugging Face  {h * 1e3:9.1f} ms (1 device)")
    print(f"  ratio         {d / h:9.2f}x HF's time (target <= 1.2x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--only", choices=("decode", "prefill"))
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="decode: wall time, or this thread's CPU time (with --threads 1 all the work is this "
                        "thread's: on a machine other sessions load, the CPU time leaves out the waits for a core)")
    p.add_argument("--stub-gemms", action="store_true", help="decode: time everything but the GEMMs (stubbed)")
    args = p.parse_args()
    global TIMER
    TIMER = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads")
    if args.only != "prefill":
        decode(args)
    if args.only != "decode":
        prefill(args)


if __name__ == "__main__":
    main()
