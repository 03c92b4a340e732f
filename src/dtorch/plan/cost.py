"""The cost model: a traced step (``trace.StepTrace``) -> time per pipeline stage and phase on a hardware profile.

- a kernel call: its FLOPs (torch's FlopCounterMode on the first device's blocks, as meta tensors) and the bytes
  it reads and writes, costed by a roofline with the profile's achievable efficiencies:
  ``max(flops / (peak * eff), bytes / (hbm * eff_memory)) + overhead``;
- a collective: alpha-beta on the link its mesh dim crosses (NVLink within a node, the per-GPU network across
  nodes; a group with several GPUs per node drives that many NICs), with NCCL's ring factors (all_gather and
  reduce_scatter move (m-1)/m of the full buffer, all_reduce twice that; tree latency for all_reduce across nodes);
- overlap: fsdp gathers and reductions, dp gradient reductions and ring-attention block sends run beside the
  compute (FSDP prefetch, async collectives) as far as the profile's ``overlap`` allows (1 on GPUs: their own
  streams; 0 for the process backend, whose worker runs a collective on the thread that runs its kernels); tp and
  Ulysses collectives and pipeline hand-offs are on the path;
- counts: the kernels and collectives each phase issues (the single controller issues them one at a time: the
  estimate's dispatch floor).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from ..commlog import CommRecord
from ..runtime.kernels import VJP_PREFIX, get_kernel

# collectives that can run beside the compute (their kernels on another stream): keyed by mesh dim name
OVERLAPPED_DIMS = ("fsdp", "dp", "ring_cp")
ATTENTION_KERNELS = ("sdpa", "kv_cache")  # fused attention kernels (torch's SDPA: flash on the GPU and the CPU)
RING_KERNELS = ("sdpa_ring_step",)  # ring attention's block steps (and their backward): dtorch's own torch ops
LINEAR_KERNELS = ("linear", "matmul")
# torch views: a new shape and strides over the same storage, no bytes moved (reshape may copy: it stays counted)
VIEW_KERNELS = ("view.permute", "view.index", "view.split", "view.expand")


@dataclass
class Costs:
    """One stage's time and traffic in one phase (seconds; bytes per device)."""
    compute: float = 0.0
    exposed_comm: float = 0.0  # collectives on the critical path
    overlapped_comm: float = 0.0  # collectives that run beside the compute
    flops: float = 0.0
    comm_bytes: dict = field(default_factory=dict)  # mesh dim -> bytes this device sends
    comm_time: dict = field(default_factory=dict)  # mesh dim -> seconds
    kernels: float = 0.0  # kernel calls on the busiest device
    collectives: float = 0.0  # collectives it takes part in

    def time(self, overlap: float = 1.0) -> float:
        """The phase's wall time: compute plus what cannot hide behind it."""
        hidden = min(self.overlapped_comm, overlap * self.compute)
        return self.compute + self.exposed_comm + self.overlapped_comm - hidden

    def add(self, other: "Costs", scale: float = 1.0) -> None:
        self.compute += scale * other.compute
        self.exposed_comm += scale * other.exposed_comm
        self.overlapped_comm += scale * other.overlapped_comm
        self.flops += scale * other.flops
        self.kernels += scale * other.kernels
        self.collectives += scale * other.collectives
        for k, v in other.comm_bytes.items():
            self.comm_bytes[k] = self.comm_bytes.get(k, 0.0) + scale * v
        for k, v in other.comm_time.items():
            self.comm_time[k] = self.comm_time.get(k, 0.0) + scale * v


@dataclass
class Options:
    float8: bool = False  # linear layers' matmuls in float8 (torchtitan's Float8Linear): twice the rate
    # True: cost a backward as torch's backward alone (GPU runs' eager autograd keeps each forward's graph); False:
    # the backend keeps no local graphs (the process backend's workers) and recomputes the forward in every VJP
    native_backward: bool = True

    @classmethod
    def of(cls, hw, float8: bool = False) -> "Options":
        """The options a profile implies (``vjp_recompute``: the backend recomputes each forward in its VJP)."""
        return cls(float8=float8, native_backward=not hw.efficiency["vjp_recompute"])


# -- kernels -------------------------------------------------------------------------------------------------


_KERNEL_CACHE: dict = {}


def _freeze(v):
    if isinstance(v, dict):
        return tuple((k, _freeze(x)) for k, x in sorted(v.items()))
    if isinstance(v, (tuple, list)):
        return tuple(_freeze(x) for x in v)
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    if isinstance(v, np.ndarray):
        return ("array", v.shape, str(v.dtype), v.tobytes() if v.size <= 64 else None)
    try:
        hash(v)
    except TypeError:
        return repr(type(v))
    return v


def _local(specs, coord, grad: bool = False) -> list:
    out = []
    for s in specs:
        x = torch.empty(s.local_shape(coord), dtype=s.dtype, device="meta")
        if grad and (s.dtype.is_floating_point or s.dtype.is_complex):
            x.requires_grad_()
        out.append(x)
    return out


def _kwargs(kernel, kwargs, device_args, coord) -> dict:
    kw = {k: (v.to("meta") if isinstance(v, torch.Tensor) and v.ndim else v) for k, v in kwargs.items()}
    if device_args:
        kw.update({k: np.asarray(v)[coord].item() for k, v in device_args.items()})
    import inspect

    if "lead" in inspect.signature(kernel.fn).parameters:
        kw["lead"] = 0
    return kw


class _EagerTally(TorchDispatchMode):
    """The bytes read and written by the eager torch ops a kernel runs that do no matmul (their time is their memory
    traffic; views: new strides over the same storage, none)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and func.overloadpacket not in _MATMUL_OPS:
            self.bytes += sum(t.numel() * t.element_size() for t in tree_flatten((args, kwargs, out))[0]
                                  if isinstance(t, torch.Tensor))
        return out


_MATMUL_OPS = frozenset(FlopCounterMode(display=False).flop_registry)


@dataclass(frozen=True)
class Work:
    """What one kernel call does on one device, before a profile's rates: its FLOPs, and the bytes its eager torch
    ops that do no matmul read and write (``Work.add``: a recomputing VJP adds its forward's)."""
    flops: float = 0.0
    eager_bytes: float = 0.0

    def add(self, other: "Work", sign: float = 1.0) -> "Work":
        return Work(max(0.0, self.flops + sign * other.flops), max(0.0, self.eager_bytes + sign * other.eager_bytes))


def _count(fn) -> Work:
    with FlopCounterMode(display=False) as counter, _EagerTally() as tally:
        fn()
    return Work(float(counter.get_total_flops()), float(tally.bytes))


def _forward_work(kernel, in_specs, kwargs, device_args, coord) -> Work:
    xs = _local(in_specs, coord)
    kw = _kwargs(kernel, kwargs, device_args, coord)
    return _count(lambda: kernel.fn(*xs, **kw))


def _backward_work(kernel, in_specs, kwargs, device_args, coord, recompute: bool = False) -> Work:
    """A kept graph's backward (``recompute``: as a backend without kept graphs runs it, the forward again first)."""
    xs = _local(in_specs, coord, grad=True)
    kw = _kwargs(kernel, kwargs, device_args, coord)
    with torch.enable_grad():
        out = kernel.fn(*xs, **kw)
        fwd = _forward_work(kernel, in_specs, kwargs, device_args, coord) if recompute else Work()
    outs = [y for y in (out if isinstance(out, tuple) else (out,)) if y.requires_grad]
    leaves = [x for x in xs if x.requires_grad]
    if not outs or not leaves:
        return fwd
    return fwd.add(_count(lambda: torch.autograd.grad(outs, leaves, [torch.ones_like(y) for y in outs],
                                                      allow_unused=True)))


def kernel_work(call, options: Options) -> tuple[float, float, str, Work]:
    """(FLOPs, bytes moved, class, eager work) on the busiest device for one ``KernelCall``. Class: "linear",
    "attention" (a fused attention kernel: FLOPs at the attention rate, its inputs' and outputs' bytes), "ring" (a
    ring-attention block step: fused on GPUs as torchtitan runs it, else its torch ops) or "other". Bytes moved:
    the blocks the kernel reads and writes (twice that for a backward, three times with the forward recomputed);
    the eager work: FLOPs and the bytes of the torch ops that do no matmul, as the kernel runs them eagerly."""
    name = call.kernel.name
    base = name[len(VJP_PREFIX):] if name.startswith(VJP_PREFIX) else name
    recompute = not options.native_backward
    mesh = (call.in_specs or call.out_specs)[0].mesh
    coords = [(0,) * mesh.ndim]
    if call.device_args or not all(sp.is_even() for sp in call.in_specs + call.out_specs):
        coords.append(tuple(n - 1 for n in mesh.shape))
    # keyed by what one device computes (its blocks' shapes, the arguments it gets), not by the mesh: layouts
    # of a search that give a device the same blocks share the count
    key = (call.kind, name, tuple((s.local_shape(c), s.dtype) for c in coords for s in call.in_specs + call.out_specs),
           _freeze(call.kwargs), tuple(_freeze({k: np.asarray(v)[c].item() for k, v in (call.device_args or {}).items()})
                                       for c in coords), options.native_backward)
    hit = _KERNEL_CACHE.get(key)
    if hit is not None:
        return hit
    work, ran = Work(), True
    for coord in coords:  # the slowest of the first and last device (uneven shards, causal ring steps)
        try:
            if call.kind == "backward":
                w = _backward_work(call.kernel, call.in_specs, call.kwargs, call.device_args, coord, recompute)
            elif call.kind == "write":
                w = Work()
            else:
                w = _forward_work(call.kernel, call.in_specs, call.kwargs, call.device_args, coord)
                if name.startswith(VJP_PREFIX) and options.native_backward:
                    n_in = len(call.kwargs.get("vjp", ((),))[0])
                    kw = {k: v for k, v in call.kwargs.items() if k != "vjp"}
                    w = w.add(_forward_work(get_kernel(base), call.in_specs[:n_in], kw, call.device_args, coord), -1.0)
        except Exception:  # noqa: BLE001  (a kernel meta tensors cannot run: count its blocks' bytes only)
            w, ran = Work(), False
        if w.flops >= work.flops:
            work = w
    if base == "sdpa" and call.kwargs.get("causal"):
        work = replace(work, flops=0.5 * work.flops)  # a causal flash kernel skips the masked half
    coord = coords[0]
    moved = sum(_prod(s.local_shape(coord)) * s.dtype.itemsize for s in call.in_specs + call.out_specs)
    if call.kind == "forward" and name in VIEW_KERNELS:
        moved = 0
        work = replace(work, eager_bytes=0.0)
    if call.kind == "backward" or name.startswith(VJP_PREFIX):
        moved *= 3 if recompute else 2
    if (call.kind == "write" or not ran) and not work.eager_bytes:
        work = replace(work, eager_bytes=float(moved))
    cls = "ring" if base.startswith(RING_KERNELS) else "attention" if base.startswith(ATTENTION_KERNELS) else \
        "linear" if base in LINEAR_KERNELS else "other"
    out = _KERNEL_CACHE[key] = (work.flops, float(moved), cls, work)
    return out


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def kernel_time(call, hw, options: Options) -> tuple[float, float]:
    """(seconds, FLOPs) of one kernel call on ``hw``. Where the profile's kernels are fused (``eager_kernels`` 0,
    the GPU profiles: the published runs' stacks fuse norms and element-wise ops, and run each ring-attention
    block as one flash-attention kernel, as torchtitan's context parallelism does), a kernel is a roofline on the
    blocks it reads and writes: ``max(FLOPs / rate, bytes / memory rate)``, at the attention rate for attention.
    Where they run eagerly (``eager_kernels`` 1: the process backend's workers), a kernel runs its torch ops one
    after the other: its FLOPs at the matmul rate plus the bytes of its other ops at the memory rate (a fused
    attention kernel stays a roofline). Then the cost per kernel (``kernel_overhead_us``) and per recomputing VJP
    (``vjp_overhead_us``: the forward's graph built again and autograd run on it)."""
    flops, moved, cls, work = kernel_work(call, options)
    eff = hw.efficiency
    dtype = _matmul_dtype(call)
    peak = hw.peak(dtype)
    if cls == "linear" and options.float8 and dtype == "bfloat16":
        peak = hw.peak("float8")
    bandwidth = hw.hbm_gbps * 1e9 * eff["memory"]
    if cls == "attention" or (cls == "ring" and not eff["eager_kernels"]):
        t = max(flops / (peak * eff["attention"]) if flops else 0.0, moved / bandwidth)
    elif eff["eager_kernels"]:
        t = (flops / (peak * eff["matmul"]) if flops else 0.0) + work.eager_bytes / bandwidth
    else:
        t = max(flops / (peak * eff["matmul"]) if flops else 0.0, moved / bandwidth)
    t += eff["kernel_overhead_us"] * 1e-6
    if is_recomputing_vjp(call, options):
        t += eff["vjp_overhead_us"] * 1e-6
    return t, flops


def is_recomputing_vjp(call, options: Options) -> bool:
    """Does this call run a forward again and autograd on it (a ``vjp:`` kernel, or any backward on a backend
    that keeps no local graphs)?"""
    return call.kernel.name.startswith(VJP_PREFIX) or (call.kind == "backward" and not options.native_backward)


def _matmul_dtype(call) -> str:
    dtypes = {s.dtype for s in call.in_specs if s.dtype.is_floating_point}
    if torch.float32 in dtypes and len(dtypes) == 1:
        return "float32"
    if torch.float16 in dtypes:
        return "float16"
    return "bfloat16"


# -- collectives ---------------------------------------------------------------------------------------------


def group_span(layout, dim: str, gpus_per_node: int) -> tuple[int, int]:
    """(group size, group members per node) of mesh dim ``dim`` (devices numbered row-major in ``trace.MESH_ORDER``)."""
    sizes = layout.sizes()
    names = [n for n, _ in sizes]
    if dim not in names:
        return 1, 1
    i = names.index(dim)
    m = sizes[i][1]
    stride = int(np.prod([s for _, s in sizes[i + 1:]], dtype=np.int64)) if i + 1 < len(sizes) else 1
    nodes = {(k * stride) // gpus_per_node for k in range(m)}
    return m, max(1, m // len(nodes))


def collective_terms(kind: str, m: int, size: float) -> tuple[float, float]:
    """(latency steps, bytes each device moves) of one collective among ``m`` devices on ``size``-byte input blocks,
    NCCL's ring algorithms: all_gather and reduce_scatter take m-1 steps (the gather moves every other block, the
    scatter (m-1)/m of its buffer), all_reduce twice a reduce_scatter's, all_to_all (m-1)/m, a broadcast log2(m)
    steps of the whole block, a send_recv one hop. ``calibrate`` inverts the same terms."""
    if kind == "send_recv":
        return 1.0, size
    if kind == "all_gather":
        return m - 1.0, (m - 1) * size
    if kind in ("reduce_scatter", "all_to_all"):
        return m - 1.0, (m - 1) / m * size
    if kind == "all_reduce":
        return 2.0 * (m - 1), 2 * (m - 1) / m * size
    return float(math.ceil(math.log2(m))), size  # broadcast


def collective_time(rec: CommRecord, layout, hw) -> tuple[float, float]:
    """(seconds, bytes one device sends) of one CommLog record: alpha-beta on the mesh dim's link (or on the
    profile's link for that kind of collective: a calibrated process backend moves each kind its own way)."""
    dim = rec.mesh_dim if isinstance(rec.mesh_dim, str) else "pp"
    m, per_node = group_span(layout, dim, hw.gpus_per_node)
    n_dev = max(1, len(rec.devices))
    eff = hw.efficiency["collective"]
    own = hw.collectives.get(rec.kind)
    if rec.kind == "send_recv":
        senders = n_dev // 2 if dim == "pp" else n_dev
        size = rec.nbytes / max(1, senders)
        link = hw.intra if per_node == m and dim != "pp" else hw.inter
        if dim == "pp" and hw.gpus_per_node >= layout.devices:
            link = hw.intra
        link = own or link
        return link.latency_us * 1e-6 + size / (link.gbps * 1e9 * eff), size
    size = rec.nbytes / n_dev  # each device's input block
    if m <= 1:
        return 0.0, 0.0
    within = per_node == m
    if own is not None:
        bw, alpha = own.gbps * 1e9, own.latency_us * 1e-6
    elif within:
        bw, alpha = hw.intra.gbps * 1e9, hw.intra.latency_us * 1e-6
    else:  # across nodes: each of the group's GPUs in a node drives its own NIC; NVLink inside stays faster
        bw = min(hw.intra.gbps, per_node * hw.inter.gbps) * 1e9
        alpha = hw.inter.latency_us * 1e-6
    bw *= eff
    steps, moved = collective_terms(rec.kind, m, size)
    t = steps * alpha + moved / bw
    if rec.kind == "all_reduce" and not within:  # NCCL's tree across nodes when its latency is lower
        t = min(t, 2 * math.ceil(math.log2(m)) * alpha + moved / bw)
    return t, moved


def accumulation_time(grad_bytes, hw) -> float:
    """Seconds to add one more micro-batch's gradients into the accumulated ones (``grad_bytes``: each gradient's
    bytes on a device): one in-place add per gradient, reading both and writing one (dtorch's ``_accumulate``, as
    torch's AccumulateGrad). Costed where kernels run eagerly (``eager_kernels``); a fused stack accumulates in the
    weight-gradient GEMM itself (Megatron-LM's gradient_accumulation_fusion), at no extra pass."""
    bandwidth = hw.hbm_gbps * 1e9 * hw.efficiency["memory"]
    return sum(hw.efficiency["kernel_overhead_us"] * 1e-6 + 3 * b / bandwidth for b in grad_bytes)


# -- a traced step -------------------------------------------------------------------------------------------


def stage_costs(trace, hw, options: Options) -> list[dict]:
    """Per stage: {phase: Costs} for "forward", "backward" (one micro-batch) and "step"; plus, per decoder layer
    of the forward, the selective-AC split ("sac": recompute seconds and the bytes the policy keeps)."""
    n = len(trace.stage_layers)
    out = [{"forward": Costs(), "backward": Costs(), "step": Costs(), "sac_recompute": 0.0, "sac_keep": 0.0}
           for _ in range(n)]
    mm_count: dict = {}
    for phase, layer, stage, item in trace.events:
        if phase not in ("forward", "backward", "step"):
            continue
        c = out[stage][phase]
        if isinstance(item, CommRecord):
            t, moved = collective_time(item, trace.layout, hw)
            dim = item.mesh_dim if isinstance(item.mesh_dim, str) else "pp"
            c.comm_bytes[dim] = c.comm_bytes.get(dim, 0.0) + moved
            c.comm_time[dim] = c.comm_time.get(dim, 0.0) + t
            c.collectives += 1
            if dim in OVERLAPPED_DIMS and phase != "step":
                c.overlapped_comm += t
            else:
                c.exposed_comm += t
            continue
        t, flops = kernel_time(item, hw, options)
        c.compute += t
        c.flops += flops
        c.kernels += 1
        if phase == "forward" and layer is not None:
            # torchtitan's per-op selective AC keeps each layer's input, the outputs of attention and of every
            # other matmul, and recomputes the rest in the backward
            coord = (0,) * item.out_specs[0].mesh.ndim if item.out_specs else None
            if layer not in mm_count and item.in_specs:
                mm_count[layer] = 0
                s0 = item.in_specs[0]
                out[stage]["sac_keep"] += _prod(s0.local_shape((0,) * s0.mesh.ndim)) * s0.dtype.itemsize
            cls = kernel_work(item, options)[2]
            keep = cls in ("attention", "ring")
            if cls == "linear":
                k = mm_count[layer] = mm_count.get(layer, 0) + 1
                keep = k % 2 == 1
            if keep and coord is not None:
                out[stage]["sac_keep"] += sum(_prod(s.local_shape(coord)) * s.dtype.itemsize for s in item.out_specs)
            else:
                out[stage]["sac_recompute"] += t
    return out
