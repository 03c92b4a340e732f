"""``dtorch.plan.estimate``: memory per device, communication per mesh dim, step time, tokens/s per device and MFU
of one training layout, from a meta-backend trace of the step and the cost model (docs/plan.md)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..models.llama import LlamaLayoutError, check_layout
from ..mesh import assign_layers_to_stages
from . import hardware as hw_mod
from .cost import Costs, Options, accumulation_time, stage_costs
from .trace import Layout, trace_step

CONFIGS = Path(__file__).parent / "configs"
AC_MODES = ("none", "full", "selective")
SCHEDULES = ("1f1b", "gpipe", "interleaved")
GIB = 1 << 30


class PlanError(ValueError):
    """Inputs that describe no valid run: the message says what to change."""


def load_config(config):
    """A Llama config: a shipped name (llama3-8b, llama3-70b, llama3-405b), a config.json or a checkpoint
    directory holding one, or a config object."""
    import transformers

    if not isinstance(config, (str, Path)):
        return config
    text = str(config)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        shipped = CONFIGS / f"{text.lower()}.json"
        if not shipped.is_file():
            names = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
            raise PlanError(f"--config {text}: neither a shipped config ({names}) nor a config.json file")
        path = shipped
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"--config {text}: cannot read {path}: {exc}") from exc
    return transformers.LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})


@dataclass
class Estimate:
    """What one layout costs per device (the busiest pipeline stage's device) and per step."""
    layout: Layout
    hardware: str
    devices: int
    seq: int
    global_batch: int
    micro_batches: int
    activation_checkpointing: str
    float8: bool
    memory: dict  # bytes per device: params, grads, optimizer, activations, overhead, peak; capacity
    fits: bool
    comm_bytes: dict  # mesh dim -> bytes each device sends per step
    comm_time: dict  # mesh dim -> seconds of collectives per step (overlapped or not)
    step_time: float
    compute_time: float
    exposed_comm_time: float
    bubble_time: float
    controller_time: float  # the controller's issue of the step's ops (a floor on step_time)
    tokens_per_second_per_device: float
    mfu: float
    notes: list = field(default_factory=list)

    @property
    def peak_memory_gib(self) -> float:
        return self.memory["peak"] / GIB

    def to_dict(self) -> dict:
        return {"layout": {k: getattr(self.layout, k) for k in ("dp", "fsdp", "tp", "pp", "ulysses_cp", "ring_cp")},
                "layout_name": str(self.layout), "hardware": self.hardware, "devices": self.devices, "seq": self.seq,
                "global_batch": self.global_batch, "micro_batches": self.micro_batches,
                "activation_checkpointing": self.activation_checkpointing, "float8": self.float8,
                "memory_bytes": dict(self.memory), "memory_gib": {k: v / GIB for k, v in self.memory.items()},
                "fits": self.fits, "comm_bytes_per_step": dict(self.comm_bytes),
                "comm_seconds_per_step": dict(self.comm_time), "step_time_s": self.step_time,
                "compute_s": self.compute_time, "exposed_comm_s": self.exposed_comm_time, "bubble_s": self.bubble_time,
                "controller_s": self.controller_time,
                "tokens_per_second_per_device": self.tokens_per_second_per_device, "mfu": self.mfu,
                "notes": list(self.notes)}


def model_flops_per_token(cfg, seq: int) -> float:
    """torchtitan's count (its MFU): 6 x (parameters less the token embedding) + 12 x layers x hidden x seq
    (the attention scores and values, causal or not)."""
    h, i, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    nh = cfg.num_attention_heads
    nkv = getattr(cfg, "num_key_value_heads", None) or nh
    d = getattr(cfg, "head_dim", None) or h // nh
    per_layer = h * nh * d * 2 + h * nkv * d * 2 + 3 * h * i + 2 * h
    params = L * per_layer + h + (0 if getattr(cfg, "tie_word_embeddings", False) else v * h)
    return 6 * params + 12 * L * nh * d * seq


def _layout(devices, dp, fsdp, tp, pp, ulysses_cp, ring_cp) -> Layout:
    fixed = dp * tp * pp * ulysses_cp * ring_cp
    if fsdp is None:
        if devices is None:
            fsdp = 1
        elif devices % fixed:
            raise PlanError(f"--devices {devices} is not a multiple of dp({dp}) * tp({tp}) * pp({pp}) * "
                            f"ulysses_cp({ulysses_cp}) * ring_cp({ring_cp}) = {fixed}; fsdp takes the rest")
        else:
            fsdp = devices // fixed
    lay = Layout(dp=dp, fsdp=fsdp, tp=tp, pp=pp, ulysses_cp=ulysses_cp, ring_cp=ring_cp)
    bad = [f"{k} {getattr(lay, k)}" for k in ("dp", "fsdp", "tp", "pp", "ulysses_cp", "ring_cp") if getattr(lay, k) < 1]
    if bad:
        raise PlanError(f"layout sizes must be at least 1: {', '.join(bad)}")
    if devices is not None and lay.devices != devices:
        raise PlanError(f"dp({dp}) * fsdp({fsdp}) * tp({tp}) * pp({pp}) * ulysses_cp({ulysses_cp}) * ring_cp({ring_cp}) "
                        f"= {lay.devices} != devices({devices})")
    return lay


def estimate(config="llama3-8b", devices: int | None = None, hardware="h100-sxm-80gb", *, dp: int = 1,
             fsdp: int | None = None, tp: int = 1, pp: int = 1, ulysses_cp: int = 1, ring_cp: int = 1, seq: int = 8192,
             global_batch: int | None = None, micro_batches: int | None = None,
             activation_checkpointing: str = "selective", mixed_precision: str = "bf16", float8: bool = False,
             pp_schedule: str = "1f1b", pp_virtual_stages: int | None = None, exact: bool = False) -> Estimate:
    """Predict one training step of a Llama (``config``: llama3-8b/70b/405b or a config.json) on ``devices`` GPUs of
    ``hardware`` (a shipped profile name or a profile file) in the layout ``dp x fsdp x tp x pp x ulysses_cp x
    ring_cp`` (fsdp takes the devices the others leave). ``global_batch`` sequences of ``seq`` tokens per step, in
    ``micro_batches`` (default: the pipeline stage count); ``activation_checkpointing`` none/full/selective
    (torchtitan's per-op policy); ``mixed_precision`` "bf16" (FSDP2's: bf16 compute, float32 master weights,
    gradient reductions and AdamW states) or "fp32"; ``float8``: linear layers' matmuls in float8.
    ``pp_virtual_stages``: the interleaved schedule's model chunks per device (default 2).
    ``exact``: trace every layer of every stage (default: trace 1 and 2 layers per stage, and at most 3 stages,
    and extrapolate: exact for identical layers and identical middle stages, ``tests/plan``)."""
    cfg = load_config(config)
    hw = hw_mod.load(hardware)
    lay = _layout(devices, dp, fsdp, tp, pp, ulysses_cp, ring_cp)
    if activation_checkpointing not in AC_MODES:
        raise PlanError(f"--activation-checkpointing {activation_checkpointing!r}: choose one of {', '.join(AC_MODES)}")
    if pp_schedule not in SCHEDULES:
        raise PlanError(f"--pp-schedule {pp_schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if pp_virtual_stages is not None and pp_schedule != "interleaved":
        raise PlanError(f"--pp-virtual-stages {pp_virtual_stages} is for --pp-schedule interleaved (got {pp_schedule})")
    virtual = pp_virtual_stages or 2
    if mixed_precision not in ("bf16", "fp32"):
        raise PlanError(f"--mixed-precision {mixed_precision!r}: choose bf16 or fp32")
    m = micro_batches or max(1, lay.pp)
    if global_batch is None:
        global_batch = lay.batch_ways * m
    problems = []
    if seq < 1 or global_batch < 1 or m < 1:
        problems.append(f"seq ({seq}), global batch ({global_batch}) and micro-batches ({m}) must be at least 1")
    elif global_batch % m or (global_batch // m) % lay.batch_ways:
        problems.append(f"the global batch ({global_batch}) must split into {m} micro-batches of a multiple of "
                        f"dp * fsdp = {lay.batch_ways} sequences")
    cp = lay.ulysses_cp * lay.ring_cp
    if seq % cp:
        problems.append(f"--seq {seq} must be divisible by ulysses_cp * ring_cp = {cp}")
    try:
        check_layout(cfg, lay.mesh())
    except LlamaLayoutError as exc:
        problems.append(str(exc))
    if problems:
        raise PlanError("; ".join(problems))
    rows = global_batch // m
    param_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    options = Options.of(hw, float8)
    ac_traced = "full" if activation_checkpointing == "full" else "none"
    L = cfg.num_hidden_layers
    stage_counts = [assign_layers_to_stages(L, lay.pp).count(s) for s in range(lay.pp)]
    if pp_schedule == "interleaved" and not 1 <= virtual <= min(stage_counts):
        raise PlanError(f"--pp-virtual-stages {virtual}: each of the {lay.pp} stages splits into at most "
                        f"{min(stage_counts)} chunks (its layers); choose 1 to {min(stage_counts)}")
    if exact:
        tr = trace_step(cfg, lay, seq=seq, rows=rows, ac=ac_traced, param_dtype=param_dtype)
        per_stage = _stage_summaries(tr, hw, options)
    else:
        per_stage = _extrapolated_stages(cfg, lay, hw, options, stage_counts, seq=seq, rows=rows, ac=ac_traced,
                                         param_dtype=param_dtype)
    return _compose(cfg, lay, hw, per_stage, seq=seq, global_batch=global_batch, m=m, ac=activation_checkpointing,
                    float8=float8, schedule=pp_schedule, virtual=virtual)


def _extrapolated_stages(cfg, lay: Layout, hw, options, stage_counts, **trace_kw) -> list[dict]:
    """Per stage summaries of ``lay`` from two short traces. Every stage's numbers are affine in its layer count
    (identical decoder layers), so the step is traced with 1 and 2 layers per stage; and a pipeline's middle stages
    (a stage that holds neither the embedding nor the head) are all alike, so at most 3 stages are traced (first,
    one middle, last) and the middle one stands for the others. The collectives are costed on ``lay`` itself
    (the pipeline's size decides which links its hand-offs cross)."""
    import copy

    traced = replace(lay, pp=min(lay.pp, 3))
    summaries = []
    for n in (1, 2):
        c = copy.deepcopy(cfg)
        c.num_hidden_layers = n * traced.pp
        tr = trace_step(c, traced, **trace_kw)
        tr.layout = lay
        per = _stage_summaries(tr, hw, options)
        summaries.append(per[:1] + per[1:2] * (lay.pp - 2) + per[-1:] if lay.pp > 3 else per)
    return [_affine(a, b, k - 1) for a, b, k in zip(summaries[0], summaries[1], stage_counts)]


def _stage_summaries(tr, hw, options) -> list[dict]:
    """Per stage: the cost model's numbers for one micro-batch, and the traced memory, as flat floats."""
    out = []
    for s, (costs, mem) in enumerate(zip(stage_costs(tr, hw, options), tr.memory)):
        d = {"fwd": costs["forward"], "bwd": costs["backward"], "step": costs["step"],
             "sac_recompute": costs["sac_recompute"], "sac_keep": costs["sac_keep"],
             "accumulate": accumulation_time(tr.grad_bytes[s], hw) if hw.efficiency["eager_kernels"] else 0.0,
             "peak": float(mem.peak), "held": float(mem.held), "layer_held": float(sum(mem.layer_held))}
        for kind in ("params", "grads", "optimizer", "gathered", "activations"):
            d["at_peak_" + kind] = float(mem.at_peak.get(kind, 0))
            d["max_" + kind] = float(mem.kind_peak.get(kind, 0))
        out.append(d)
    return out


def _affine(a: dict, b: dict, k: int) -> dict:
    """``a + k (b - a)``, field by field (Costs too): a stage's numbers for 1 + k layers from those for 1 and 2."""
    out = {}
    for key, va in a.items():
        vb = b[key]
        if isinstance(va, Costs):
            c = Costs()
            c.add(va, 1.0 - k)
            c.add(vb, float(k))
            out[key] = c
        else:
            out[key] = va + k * (vb - va)
    return out


def _split_dp(c: Costs) -> tuple[Costs, float]:
    """A backward's costs without its dp gradient reduction (reduced once per step), and that reduction's seconds."""
    dp = c.comm_time.get("dp", 0.0)
    rest = replace(c, overlapped_comm=c.overlapped_comm - dp, comm_bytes=dict(c.comm_bytes), comm_time=dict(c.comm_time))
    return rest, dp


def _compose(cfg, lay, hw, stages, *, seq, global_batch, m, ac, float8, schedule, virtual=2) -> Estimate:
    p = lay.pp
    notes = []
    overlap = hw.efficiency["overlap"]
    fb, dp_times = [], []
    for st in stages:
        bwd, dp_t = _split_dp(st["bwd"])
        t = st["fwd"].time(overlap) + bwd.time(overlap)
        if ac == "selective":
            t += st["sac_recompute"]
        t += (m - 1) / m * st["accumulate"]  # every micro-batch's gradients after the first are added to the sum
        fb.append(t)
        dp_times.append((dp_t, bwd.time()))
    if p == 1:
        pipe = m * fb[0]
        bubble = 0.0
    else:
        slowest = max(fb)
        ideal = m * slowest
        if schedule == "interleaved":  # Megatron's interleaved 1F1B: v chunks per device, a 1/v bubble
            fill = (sum(fb) - slowest) / virtual
        else:
            fill = sum(fb) - slowest
        pipe = ideal + fill
        bubble = pipe - m * sum(fb) / p
    step_tail = max(st["step"].time(overlap) + max(0.0, dp_t - overlap * b) for st, (dp_t, b) in zip(stages, dp_times))
    step_time = pipe + step_tail
    compute = max(m * (st["fwd"].compute + st["bwd"].compute) + (m - 1) * st["accumulate"] for st in stages) + \
        max(st["step"].compute for st in stages)
    exposed = step_time - compute - max(0.0, bubble)
    # the single controller issues every stage's kernels and collectives one at a time, each micro-batch's
    # forward and backward and then the optimizer's: that many times its cost per op is a floor on the step
    issued = sum(m * (st["fwd"].kernels + st["fwd"].collectives + st["bwd"].kernels + st["bwd"].collectives)
                 + st["step"].kernels + st["step"].collectives for st in stages)
    controller = issued * hw.efficiency["controller_op_us"] * 1e-6
    if controller > step_time:
        notes.append(f"the controller's dispatch bounds the step: {issued:.0f} ops at "
                     f"{hw.efficiency['controller_op_us']:.0f} us each, {controller / step_time - 1:.0%} above the devices' time")
        step_time = controller
    # communication of one device of the first stage (every stage's devices run the same collectives but
    # the pipeline hand-offs): fsdp, tp and cp per micro-batch, dp's gradient reduction once
    comm_bytes, comm_time = {}, {}
    for phase, scale in (("fwd", m), ("bwd", m), ("step", 1)):
        c = stages[0][phase]
        for k in c.comm_bytes:
            n = 1 if (k == "dp" and phase == "bwd") else scale
            comm_bytes[k] = comm_bytes.get(k, 0.0) + n * c.comm_bytes[k]
            comm_time[k] = comm_time.get(k, 0.0) + n * c.comm_time.get(k, 0.0)
    # memory: the busiest stage (1F1B: stage s holds min(p - s, m) micro-batches' activations at its peak)
    best = None
    for s, st in enumerate(stages):
        inflight = 1 if p == 1 else (m if schedule == "gpipe" else min(p - s, m))
        held = st["held"]
        peak = st["peak"]
        if ac == "selective":
            held_sac = max(0.0, held - st["layer_held"]) + st["sac_keep"]
            peak -= held - held_sac
            held = held_sac
        peak += (inflight - 1) * held
        if best is None or peak > best[0]:
            best = (peak, s, held, inflight, st)
    peak, s_peak, held, inflight, st = best
    static = st["at_peak_params"] + st["at_peak_grads"] + st["at_peak_optimizer"]
    overhead = hw.memory_overhead_gib * GIB
    memory = {"params": st["max_params"], "grads": st["max_grads"], "optimizer": st["max_optimizer"],
              "gathered": st["max_gathered"], "activations": max(0.0, peak - static), "overhead": overhead,
              "peak": peak + overhead, "capacity": hw.usable_memory_gib * GIB}
    fits = memory["peak"] <= memory["capacity"]
    tokens = global_batch * seq
    tps = tokens / step_time / lay.devices
    mfu = tps * model_flops_per_token(cfg, seq) / hw.peak("bfloat16")
    if p > 1:
        notes.append(f"pipeline: {schedule}{f' ({virtual} virtual stages)' if schedule == 'interleaved' else ''}, {m} micro-batches, bubble {bubble / step_time:.0%} of the step")
    return Estimate(layout=lay, hardware=hw.name, devices=lay.devices, seq=seq, global_batch=global_batch,
                    micro_batches=m, activation_checkpointing=ac, float8=float8, memory=memory, fits=fits,
                    comm_bytes=comm_bytes, comm_time=comm_time, step_time=step_time, compute_time=compute,
                    exposed_comm_time=max(0.0, exposed), bubble_time=max(0.0, bubble), controller_time=controller,
                    tokens_per_second_per_device=tps, mfu=mfu, notes=notes)
