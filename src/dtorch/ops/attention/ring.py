"""Ring attention (Ring context parallelism): local Q against every K/V block in turn, the blocks passed on
along the ring's mesh dim, per-block results merged by their log-sum-exp.

At step s device j holds K/V block (j - s) mod R (``runtime.ring_shift`` moves every block one device on;
the executor records a send_recv). The general ring (``ring``) takes masks, dropout, a Ulysses view of
chunked blocks and uneven splits (padded to equal blocks, cut back after), and has a backward node that
runs the ring again (``RingAttentionNode``). A causal ring over an even split without masks, when no
gradient is wanted, skips the blocks causality hides (half the block pairs) and runs torch's fused
kernel on each block (``causal_ring``): the prefill of generation. The plans (specs, kwargs and
per-device offsets of every step) come from context_parallel.py, keyword-built ``RingPlan``s.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ...autograd.kernel_entry import run_blocks, wrap
from ...autograd.mode import is_grad_enabled as _grad_enabled
from ...autograd.node import Node, attach, requires_grad
from ...placement import Partial, Shard
from ...autograd.redistribute import redistribute_spec
from ...redistribute import relayout
from ...redistribute.executor import ring_shift
from ...runtime.kernels import broadcast_shape as _broadcast_shape
from ...runtime.kernels import kernel
from ...spec import DTensorSpec
from ..dispatch import local_map
from ..rules import spec_like
from .sdpa import NAME, acc_dtype, attend, merge, positions, rank4, take

_PSUM = Partial("sum")


@dataclass(frozen=True)
class RingStep:
    """One step of the ring: ``sdpa_ring_step``'s specs, kwargs and per-device offsets."""
    in_specs: tuple
    out_specs: tuple
    kwargs: dict
    device_args: dict


@dataclass(frozen=True)
class RingPlan:
    """The ring part of a context-parallel plan (context_parallel.py builds it, by keyword)."""
    mesh_dim: int  # the ring's mesh dim
    steps: tuple  # of RingStep, one per device on the ring
    k: DTensorSpec  # K/V as they travel the ring (padded if the split is uneven)
    v: DTensorSpec
    mask: DTensorSpec | None = None  # mask/noise: batch and head shards like q, whole along L and S
    noise: DTensorSpec | None = None
    pad: tuple = (None, None, None)  # (padded spec or None) for q, k, v: an uneven split runs on equal blocks
    o_unpad: tuple | None = None  # (the real output spec, per-device row counts) when q was padded
    # per q, k, v: (unpadded spec, per-device real rows) where the ring pads it: the backward cuts its gradient
    in_unpad: tuple = (None, None, None)
    # the causal fast path (causal_ring): an even split, no mask or dropout, no Ulysses view
    skips_hidden_blocks: bool = False
    bwd: dict = field(default_factory=dict, repr=False, compare=False)  # _backward_plan's cache


# ------------------------------------------------------------------------------------------------
# kernels


def _ring_block(q, k, v, mask, noise, *, lead, scale, causal, mask_rank, kv_rep, q_stride, k_stride, q_off, k_off,
                k_len=None):
    """Local Q against the K/V block held now (source block offset ``k_off``) -> (out, lse) of that block
    alone, in ``acc_dtype``, in q's layout (chunked blocks stay chunked). Mask and noise are whole along
    L and S; rows/cols are picked by position. ``k_len``: the blocks were padded to equal sizes and the key
    sequence (per chunk) really has this many rows; padded keys are masked out. Padded query rows are
    computed like real ones and cut off later."""
    qc = kc = 0
    q_shape = q.shape
    if q_stride:  # chunked blocks [.., U, C, E] -> [.., U * C, E]
        qc, kc = q.shape[-2], k.shape[-2]
        q, k, v = q.flatten(-3, -2), k.flatten(-3, -2), v.flatten(-3, -2)
    pos_q, _ = positions(q_off, q.shape[-2], qc, q_stride, q.device)
    pos_k, key_valid = positions(k_off, k.shape[-2], kc, k_stride, q.device, k_len)

    def pick(x, pos, dim):  # padded rows / cols (positions past the end) may read any row: masked or cut off
        return take(x, pos.clamp(max=x.shape[dim] - 1), dim, lead)

    if mask is not None:
        mask = rank4(mask, lead, mask_rank)
        mask = pick(mask, pos_q, -2) if mask.shape[-2] > 1 else mask
        mask = pick(mask, pos_k, -1) if mask.shape[-1] > 1 else mask
    if noise is not None:
        noise = pick(pick(noise, pos_q, -2), pos_k, -1)
    if kv_rep > 1:
        k, v = k.repeat_interleave(kv_rep, dim=-3), v.repeat_interleave(kv_rep, dim=-3)
    out, lse = attend(q, k, v, scale=scale, pos_q=pos_q, pos_k=pos_k, causal=causal, mask=mask, noise=noise,
                       key_valid=key_valid)
    if q_stride:
        out = out.unflatten(-2, (q_shape[-3], qc))
        lse = lse.unflatten(-1, (q_shape[-3], qc))
    return out, lse


@kernel("sdpa_ring_step")
def _ring_step_kernel(q, k, v, *extra, lead, scale, causal, mask_rank, has_noise, has_acc, kv_rep, q_stride,
                      k_stride, out_dtype, q_off, k_off, k_len=None):
    """One ring step: ``_ring_block`` merged into the running (out, lse) (the last two inputs, from step 1)."""
    extra = list(extra)
    mask = extra.pop(0) if mask_rank is not None else None
    noise = extra.pop(0) if has_noise else None
    out, lse = _ring_block(q, k, v, mask, noise, lead=lead, scale=scale, causal=causal, mask_rank=mask_rank,
                           kv_rep=kv_rep, q_stride=q_stride, k_stride=k_stride, q_off=q_off, k_off=k_off, k_len=k_len)
    if has_acc:
        out, lse = merge(extra[0], extra[1], out, lse)
    return out.to(out_dtype), lse


@kernel("sdpa_ring_step_backward")
def _ring_step_backward_kernel(q, k, v, *extra, lead, need, has_acc, out_dtypes, mask_rank, has_noise, **block):
    """One step of the ring backward: the gradients of the K/V block held now, and of local Q (and the
    mask), added to the accumulators (the last inputs, from step 1) -> one per ``need`` (q, k, v, mask).

    Inputs after mask/noise: the forward's merged output O and log-sum-exp L, and dO. The output is
    O = sum_b w_b o_b with w_b = exp(lse_b - L) over the key blocks b, so block b's share of the
    gradient is the VJP of its own (o_b, lse_b) with cotangents w_b dO and w_b dO . (o_b - O)
    (d w_b / d lse_b = w_b (1 - w_b), d w_c / d lse_b = -w_c w_b). The VJP itself is torch's autograd
    through ``_ring_block``, so the local math is torch's own derivative code."""
    extra = list(extra)
    mask = extra.pop(0) if mask_rank is not None else None
    noise = extra.pop(0) if has_noise else None
    o, big_lse, do = extra[:3]
    acc_in = extra[3:]
    a = acc_dtype(q.dtype)
    xs = (q, k, v, mask)
    # stacked grids keep a replicated block once (grid dim 1), and the per-device offsets span the whole
    # mesh: expand to the full grid so that each device's gradient stays its own (a broadcast would sum
    # the devices' terms; the executable keeps one of the equal replicas)
    grid = ()
    if lead:
        offs = [tuple(x.shape) for x in (block["q_off"], block["k_off"]) if isinstance(x, torch.Tensor)]
        grid = tuple(_broadcast_shape([tuple(x.shape[:lead]) for x in xs + (o,) if x is not None] + offs))
    with torch.enable_grad():
        leaves, call = [], []
        for x, n in zip(xs, need):
            if n:
                x = x.detach().to(a).expand(grid + tuple(x.shape[lead:])).requires_grad_()
                leaves.append(x)
            call.append(x)
        ob, lb = _ring_block(*call, noise, lead=lead, mask_rank=mask_rank, **block)
        zero = torch.zeros((), device=lb.device, dtype=a)
        w = torch.exp(lb.detach() - torch.where(torch.isfinite(big_lse), big_lse, zero))  # 0 where lb = -inf
        dof = do.to(a)
        g_out = w.unsqueeze(-1) * dof
        g_lse = w * (dof * (ob.detach() - o.to(a))).sum(-1)
        pairs = [(y, c) for y, c in ((ob, g_out), (lb, g_lse)) if y.requires_grad]  # lse does not depend on v
        grads = torch.autograd.grad([y for y, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
    res = []
    for i, (g, leaf) in enumerate(zip(grads, leaves)):
        g = torch.zeros_like(leaf) if g is None else g
        if has_acc:
            g = acc_in[i] + g
        res.append(g.to(out_dtypes[i]))
    return tuple(res)


@kernel("sdpa_pad_seq")
def _pad_seq_kernel(*xs, sizes: tuple):
    """Each input with zero rows appended to its sequence dim (-2) up to its size in ``sizes`` (ring
    blocks of one size); one call for q, k and v."""
    return tuple(F.pad(x, (0, 0, 0, size - x.shape[-2])) if size != x.shape[-2] else x for x, size in zip(xs, sizes))


@kernel("sdpa_unpad_seq")
def _unpad_seq_kernel(x, *, length):
    """The first ``length`` (per device) rows of the sequence dim (-2): the padding dropped again."""
    return x.narrow(-2, 0, int(length))


# the causal fast path: torch's fused kernel on each block, hidden blocks skipped


def _flash(q, k, v, causal: bool, scale: float):
    """(out, lse) of attention on [N, H, L, E] blocks (kv heads repeated for grouped-query attention): torch's
    fused CPU kernel where it runs (the kernel torch's own SDPA uses), else the same math written out."""
    g = q.shape[-3] // k.shape[-3]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)[:2]
        return out.to(torch.promote_types(q.dtype, torch.float32)), lse.float()
    acc = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc)), lse


def _flash_lead(q, k, v, causal: bool, scale: float, lead: int):
    """``_flash`` with ``lead`` leading grid dims (folded into the batch)."""
    grid = q.shape[:lead]
    k, v = k.expand(grid + k.shape[lead:]), v.expand(grid + v.shape[lead:])
    out, lse = _flash(q.reshape((-1,) + q.shape[lead + 1:]) if lead else q,
                      k.reshape((-1,) + k.shape[lead + 1:]) if lead else k,
                      v.reshape((-1,) + v.shape[lead + 1:]) if lead else v, causal, scale)
    if lead:
        out = out.reshape(grid + q.shape[lead:-1] + (out.shape[-1],))
        lse = lse.reshape(grid + q.shape[lead:-1])
    return out, lse


@kernel("sdpa_causal_ring_step")
def _causal_ring_kernel(q, k, v, *acc, lead=0, scale: float, step: int, axis: int, ring: int, rank=0,
                        out_dtype=None):
    """One step of causal ring attention over an even split: this device holds K/V block ``rank - step``
    (mod ring). Step 0 is the diagonal block (causal); after that the devices past ``step`` attend a whole
    earlier block and the others hold a later one, which causality hides (skipped, not computed). Stacked
    devices (``lead``): the devices that attend are the slice ``step:`` of grid dim ``axis``."""
    if step == 0:
        out, lse = _flash_lead(q, k, v, True, scale, lead)
    elif not lead:
        out, lse = acc
        if int(rank) >= step:
            out, lse = merge(out, lse, *_flash(q, k, v, False, scale))
    else:
        out, lse = (t.clone() for t in acc)
        n = ring - step
        part = [t.narrow(axis, step, n) for t in (q, k, v)]
        o2, l2 = _flash_lead(*part, False, scale, lead)
        mo, ml = merge(out.narrow(axis, step, n), lse.narrow(axis, step, n), o2, l2)
        out.narrow(axis, step, n).copy_(mo)
        lse.narrow(axis, step, n).copy_(ml)
    return (out.to(out_dtype), lse) if out_dtype is not None else (out, lse)


# ------------------------------------------------------------------------------------------------
# execution


def ring(plan: RingPlan, q, k, v, mask, noise):
    """Attention of q against every K/V block of the ring (q/k/v laid out as the plan's first step takes
    them, before padding), with its backward node; returns the output laid out like q."""
    graph = q._graph
    extra = [redistribute_spec(x, s) for x, s in ((mask, plan.mask), (noise, plan.noise)) if x is not None]
    inputs = [q, k, v] + extra
    pad = [(x, p) for x, p in zip((q, k, v), plan.pad) if p is not None]
    if pad:  # (the ring's node covers the padding and the cut: its backward pads dO and cuts dQ/dK/dV)
        padded = iter(local_map(f"{NAME}.pad", _pad_seq_kernel, [x for x, _ in pad], [p for _, p in pad],
                                {"sizes": tuple(p.even_local_shape()[-2] for _, p in pad)}, record=False))
        q, k, v = (x if p is None else next(padded) for x, p in zip((q, k, v), plan.pad))
    step_kernel = _causal_ring_kernel if plan.skips_hidden_blocks else _ring_step_kernel
    kh, vh = k._h, v._h
    acc: list = []
    for st, step in enumerate(plan.steps):
        acc = run_blocks(f"{NAME} (ring step {st})", step_kernel, graph, [q._h, kh, vh] + [x._h for x in extra] + acc,
                         step.in_specs, step.out_specs, step.kwargs, step.device_args)
        if st + 1 < len(plan.steps):  # pass K/V on: device j now holds block j - st - 1
            kh = ring_shift(graph.runtime, kh, plan.k, plan.mesh_dim, 1)  # the executor records the send_recv
            vh = ring_shift(graph.runtime, vh, plan.v, plan.mesh_dim, 1)
    out = merged = wrap(plan.steps[-1].out_specs[0], acc[0], graph)
    if plan.o_unpad is not None:  # drop the padded query rows
        out = local_map(f"{NAME}.unpad", _unpad_seq_kernel, [out], [plan.o_unpad[0]], {}, plan.o_unpad[1],
                        record=False)[0]
    if _grad_enabled() and any(_differentiable(x) for x in inputs):
        if plan.skips_hidden_blocks:  # (planned for a call without gradients: context_parallel.py asks)
            raise AssertionError("the causal fast path of the ring has no backward")
        attach(RingAttentionNode(plan, inputs, [q, k, v] + extra, merged, acc[1]), [out])
    return out


def _differentiable(x) -> bool:
    return requires_grad(x) and x.dtype.is_floating_point


@dataclass(frozen=True)
class _RingBackwardStep:
    in_specs: tuple
    out_specs: tuple
    kwargs: dict


def _backward_plan(cp: RingPlan, need: tuple) -> tuple:
    """Per ring step of the backward: the specs and kwargs of ``sdpa_ring_step_backward`` (cached on the plan).

    Accumulators: dQ (q's layout) and the mask's (its layout, Partial(sum) on every mesh dim that splits
    the work, Replicate where every device computes the same) stay on their device; dK/dV have K/V's
    layout and travel with their blocks. All in ``acc_dtype``; the last step casts to the input dtypes."""
    plan = cp.bwd.get(need)
    if plan is not None:
        return plan
    first = cp.steps[0]
    q_run, k_run, v_run = first.in_specs[:3]
    extra = first.in_specs[3:]
    o_out, lse = cp.steps[-1].out_specs
    mask = cp.mask
    targets = [q_run, k_run, v_run]
    if mask is not None:
        targets.append(spec_like(mask, placements=[
            p if isinstance(p, Shard) else _PSUM if isinstance(pq, Shard) else p
            for p, pq in zip(mask.placements, q_run.placements)]))
    targets = [t for t, n in zip(targets, need) if n]
    acc = acc_dtype(q_run.dtype)
    acc_specs = tuple(spec_like(t, dtype=acc) for t in targets)
    final_specs = tuple(targets)
    steps = []
    last = len(cp.steps) - 1
    for st, step in enumerate(cp.steps):
        kw = {key: step.kwargs[key] for key in ("scale", "causal", "mask_rank", "has_noise", "kv_rep", "q_stride",
                                                 "k_stride", "k_len")}
        outs = final_specs if st == last else acc_specs
        kw.update(need=need, has_acc=st > 0, out_dtypes=tuple(t.dtype for t in outs))
        steps.append(_RingBackwardStep((q_run, k_run, v_run) + extra + (o_out, lse, o_out) + (acc_specs if st else ()),
                                       outs, kw))
    plan = cp.bwd[need] = (tuple(steps), final_specs)
    return plan


class RingAttentionNode(Node):
    """The backward of ``ring`` (from the unpadded Q/K/V to the unpadded output).

    It runs the ring again: at step s device j holds K/V block (j - s) mod R together with that block's
    dK/dV accumulators, adds the local contribution (``sdpa_ring_step_backward``), and passes all four
    on; dQ (and a float mask's gradient) accumulate where they are. One more shift after the last step
    brings every dK/dV home. Communication: send_recv on the ring dim only (K/V R - 1 times each,
    dK/dV R times each); the sequence is never gathered."""

    __slots__ = ("cp", "versions", "run", "need", "out_h", "lse_h", "graph")
    name = NAME

    def __init__(self, cp: RingPlan, inputs: list, run: list, out, lse_h):
        need = tuple(_differentiable(x) for x in inputs[:3]) + (
            cp.mask is not None and _differentiable(inputs[3]),)
        super().__init__([x for x, n in zip(inputs, need) if n], 1)
        self.cp = cp
        self.need = need
        # inputs the backward reads as they are must not change before it (a padded copy cannot: keeping
        # the unpadded input alive only for the check would cost its memory)
        self.versions = [(n, x, x._version) for n, (x, r) in enumerate(zip(inputs, run)) if x is r]
        self.run = run  # q, k, v as the ring ran them (padded), mask/noise
        self.out_h = out._h  # the merged output and log-sum-exp: the backward recomputes no global softmax
        self.lse_h = lse_h
        self.graph = out._graph

    def release(self):
        super().release()
        self.versions = self.run = self.out_h = self.lse_h = None

    def apply(self, grads):
        g = grads[0]
        if g is None:
            return [None] * len(self.edges)
        for n, x, version in self.versions:
            if x._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: input {n} of dtorch.{NAME} ({x._spec}) is at version {x._version}; expected "
                    f"version {version} instead. Write a copy (x.clone()) instead, or run the in-place op after "
                    "the backward.")
        cp, rt = self.cp, self.graph.runtime
        steps, final = _backward_plan(cp, self.need)
        o_out = cp.steps[-1].out_specs[0]
        if g.dtype != o_out.dtype:
            g = g.to(o_out.dtype)
        if cp.o_unpad is not None:  # padded query rows got no gradient
            g = relayout(g, cp.o_unpad[0])
            g = local_map(f"{NAME}.pad", _pad_seq_kernel, [g], [o_out], {"sizes": (o_out.even_local_shape()[-2],)},
                          record=False)[0]
        g = relayout(g, o_out)
        q, k, v, extra = self.run[0], self.run[1], self.run[2], self.run[3:]
        kh, vh = k._h, v._h
        order = [i for i, n in enumerate(self.need) if n]  # which of q, k, v, mask each accumulator is
        travel = [j for j, i in enumerate(order) if i in (1, 2)]
        acc: list = []
        for st, (step, fwd) in enumerate(zip(steps, cp.steps)):
            acc = run_blocks(f"{NAME} (ring backward step {st})", _ring_step_backward_kernel, self.graph,
                             [q._h, kh, vh] + [x._h for x in extra] + [self.out_h, self.lse_h, g._h] + acc,
                             step.in_specs, step.out_specs, step.kwargs, fwd.device_args)
            if st + 1 < len(steps):
                kh = ring_shift(rt, kh, cp.k, cp.mesh_dim, 1)
                vh = ring_shift(rt, vh, cp.v, cp.mesh_dim, 1)
            # dK/dV go with their blocks; after the last step the shift brings each home
            for j in travel:
                acc[j] = ring_shift(rt, acc[j], step.out_specs[j], cp.mesh_dim, 1)
        grads = [wrap(spec, h, self.graph) for spec, h in zip(final, acc)]
        cuts = [c for c, n in zip(cp.in_unpad + (None,), self.need) if n]
        return [x if c is None else local_map(f"{NAME}.unpad", _unpad_seq_kernel, [x], [c[0]], {}, c[1], record=False)[0]
                for x, c in zip(grads, cuts)]
