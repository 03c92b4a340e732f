"""Run one training step of a Llama on the meta backend and keep what it did: every kernel call and collective
in program order (tagged with the phase, forward / backward / step, and the decoder layer it belongs to), and
the memory accounting per pipeline stage (what the step held at its peak, and what the forward holds for the
backward). Nothing is allocated: the model, the step and the optimizer are shapes only."""
from __future__ import annotations

import copy
import gc
from dataclasses import dataclass, field

import torch

import dtorch

from .. import commlog
from ..graph import Graph
from ..models.llama import LlamaForCausalLM
from ..optim.optimizer import scalar_dtype, zeros_state

# mesh dims outer to inner: tensor parallelism innermost (within a node), then context, data, pipeline
MESH_ORDER = (("pp", "pp"), ("dp", "dp"), ("fsdp", "fsdp"), ("ring_cp", "ring_cp"), ("ulysses_cp", "ulysess_cp"),
              ("tp", "tp"))


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    ulysses_cp: int = 1
    ring_cp: int = 1

    @property
    def devices(self) -> int:
        return self.dp * self.fsdp * self.tp * self.pp * self.ulysses_cp * self.ring_cp

    @property
    def batch_ways(self) -> int:  # mesh dims that split the batch
        return self.dp * self.fsdp

    def sizes(self) -> list[tuple[str, int]]:
        """(mesh dim name, size) of the dims above 1, outer to inner."""
        return [(name, getattr(self, attr)) for attr, name in MESH_ORDER if getattr(self, attr) > 1]

    def __str__(self):
        parts = [f"{attr}{getattr(self, attr)}" for attr, _ in MESH_ORDER if getattr(self, attr) > 1]
        return " x ".join(parts) or "1 device"

    def mesh(self) -> dtorch.DeviceMesh:
        dims = self.sizes()
        if not dims:
            return dtorch.DeviceMesh("cpu")
        names, sizes = zip(*dims)
        return dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))


@dataclass
class StageMemory:
    """Bytes on the first device of one pipeline stage."""
    peak: int = 0
    at_peak: dict = field(default_factory=dict)  # kind -> bytes when the device peaked
    kind_peak: dict = field(default_factory=dict)  # kind -> the most that kind held
    held: int = 0  # what the forward keeps for the backward (allocated after the forward - before it)
    layer_held: list = field(default_factory=list)  # the same, per decoder layer of the stage


@dataclass
class StepTrace:
    layout: Layout
    config: object
    rows: int  # sequences in the traced micro-batch (the whole batch dim, every dp/fsdp rank together)
    seq: int
    events: list  # (phase, layer or None, stage, KernelCall | CommRecord)
    memory: list  # StageMemory per stage
    stage_layers: list  # decoder layer indices on each stage
    ac: str
    grad_bytes: list = field(default_factory=list)  # per stage: bytes of each parameter's gradient on its first device


class _Tee(list):
    """CommLog records that also land in the trace's event list (tagged)."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink

    def append(self, rec):
        super().append(rec)
        self.sink(rec)


def trace_step(config, layout: Layout, *, seq: int, rows: int, ac: str = "none", param_dtype=torch.bfloat16,
               clip: bool = True) -> StepTrace:
    """One forward, backward, gradient clipping and AdamW step of ``config``'s Llama on ``layout`` for a micro-batch
    of ``rows`` sequences of ``seq`` tokens; ``ac``: "none", "full" (every layer recomputed, as dtorch runs it) or
    "selective" (traced as "none": the cost model applies torchtitan's per-op policy)."""
    # the memory accounting starts with a walk over the garbage collector's objects for the graph's live tensors
    # (Graph.track_memory); everything alive before the graph is made cannot be one of them, so it is frozen out
    # of that walk (a search traces hundreds of steps: the walk was a seventh of its time)
    gc.freeze()
    try:
        return _trace_step(config, layout, seq=seq, rows=rows, ac=ac, param_dtype=param_dtype, clip=clip)
    finally:
        gc.unfreeze()


def _trace_step(config, layout, *, seq, rows, ac, param_dtype, clip) -> StepTrace:
    cfg = copy.deepcopy(config)
    graph = Graph(backend="meta")
    rt = graph.runtime
    events: list = []
    state = {"phase": "setup", "layer": None}
    with graph:
        mesh = layout.mesh()
        policy = None if param_dtype is None or param_dtype == torch.float32 else \
            dtorch.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        model = LlamaForCausalLM(cfg, mesh, mp_policy=policy)
        if ac == "full":
            model.gradient_checkpointing_enable()
        stage_meshes = model.model.stage_meshes
        stage_of = {d: s for s, m in enumerate(stage_meshes) for d in m.device_ids}
        stage_layers = [[i for i, s in enumerate(model.model.layer_stages) if s == k] for k in range(len(stage_meshes))]
        params = [p for p in model.parameters() if p.requires_grad]
        opt = dtorch.optim.AdamW(params, lr=1e-4)
        for p in params:  # AdamW's states as its first step makes them (the traced step is a steady one)
            opt.state[p] = {"step": torch.tensor(0.0, dtype=scalar_dtype()), "exp_avg": zeros_state(p),
                            "exp_avg_sq": zeros_state(p)}
        layer_marks: dict = {}

        def enter(idx):
            def hook(module, args):
                state["layer"] = idx
                if state["phase"] == "forward":
                    s = model.model.layer_stages[idx]
                    layer_marks[idx] = _live(graph, stage_meshes[s])
            return hook

        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(enter(i))

        def leave(module, args):
            state["layer"] = None
        model.model.norm.register_forward_pre_hook(leave)

        def on_kernel(call):
            events.append((state["phase"], state["layer"], stage_of[call.in_specs[0].mesh.device_ids[0]]
                           if call.in_specs else stage_of[call.out_specs[0].mesh.device_ids[0]], call))

        def on_comm(rec):
            stage = stage_of.get(rec.devices[0], 0) if rec.devices else 0
            events.append((state["phase"], state["layer"], stage, rec))

        log = commlog.CommLog()
        log.records = _Tee(on_comm)
        rt.on_kernel = on_kernel
        ids = torch.zeros(rows, seq, dtype=torch.long)
        graph.track_memory()
        before = [_live(graph, m) for m in stage_meshes]
        with log:
            state["phase"] = "forward"
            loss = model(ids, labels=ids).loss
            after = [_live(graph, m) for m in stage_meshes]
            state["phase"], state["layer"] = "backward", None
            loss.backward()
            del loss
            state["phase"], state["layer"] = "step", None
            if clip:
                dtorch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad()
        rt.on_kernel = None
        memory = []
        breakdown = graph.get_memory_breakdown()
        stats = graph.get_memory_stats()
        for s, m in enumerate(stage_meshes):
            dev = (m.device_type, m.device_ids[0])
            kinds = breakdown.get(dev, {})
            marks = [layer_marks.get(i) for i in stage_layers[s]] + [after[s]]
            per_layer = [b - a for a, b in zip(marks, marks[1:]) if a is not None and b is not None]
            memory.append(StageMemory(peak=stats[dev]["peak"], at_peak={k: v["at_peak"] for k, v in kinds.items()},
                                      kind_peak={k: v["peak"] for k, v in kinds.items()}, held=after[s] - before[s],
                                      layer_held=per_layer))
        graph.track_memory(False)
        grad_bytes = [[] for _ in stage_meshes]
        for p in params:
            spec = p._spec
            first = spec.mesh.device_ids[0]
            grad_bytes[stage_of[first]].append(_prod(spec.local_shape((0,) * spec.mesh.ndim)) * spec.dtype.itemsize)
    return StepTrace(layout, cfg, rows, seq, events, memory, stage_layers, ac, grad_bytes)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _live(graph: Graph, mesh) -> int:
    """Bytes the first device of ``mesh`` holds now (tracked), read without a scan."""
    v = graph._live.get(mesh, 0)
    return int(v if isinstance(v, int) else v[0])
