"""scaled_dot_product_attention, layout [N, H, L, E], plain or context parallel.

Plain rule, per mesh dim (K/V are [N, Hk, S, E] / [N, Hk, S, Ev]):

    q/k/v S(0)          -> S(0)   batches are independent
    q/k/v S(1)          -> S(1)   heads are independent (GQA: kv heads sharded alike when both head
                                  counts divide evenly, else kv replicated and each device picks the
                                  kv heads its q heads use)
    q S(2), k/v whole   -> S(2)   query rows are independent; a causal mask uses global row offsets
    v S(3), q/k whole   -> S(3)   out[..., e] only reads v[..., e]
    v P, q/k whole      -> P      out = softmax(q k^T) v is linear in v
    otherwise           -> R

Context parallel (mesh dims "ulysess_cp"/"ulysses_cp" and "ring_cp", see docs/context-parallel.md):
Q/K/V arrive Shard(2) on those dims and leave the same way. Ulysses is a Shard(2) -> Shard(1)
redistribution (all_to_all) on its dim; Ring rotates K/V blocks with ``runtime.ring_shift`` and merges
per-block results by their log-sum-exp. An uneven Ring split (torch.chunk blocks, some maybe empty) is
padded to equal blocks for the ring and cut back afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..autograd.node import Node, attach, requires_grad
from ..errors import AttentionInputError, DTorchError, OpError
from ..graph import check_one_graph
from ..placement import Partial, Replicate, Shard
from ..redistribute import redistribute_spec
from ..redistribute.executor import ring_shift
from ..runtime.kernels import Kernel, kernel
from ..spec import DTensorSpec, block_offsets, chunk_size
from ..tensor import Tensor
from ..runtime.kernels import broadcast_shape as _broadcast_shape
from .dispatch import OpPlan, describe, dispatch, local_map
from .rules import spec_like, to_dtensors
from .table import register
from .matrix import whole

_NAME = "scaled_dot_product_attention"
_ULYSSES = ("ulysess_cp", "ulysses_cp")
_RING = ("ring_cp",)
_PSUM = Partial("sum")


# ------------------------------------------------------------------------------------------------
# math on local blocks (leading grid dims allowed everywhere)


def _positions(off, n: int, chunk: int, stride: int, device, real: int | None = None):
    """Global sequence positions of a local block of ``n`` rows: ``off + l`` for a contiguous block; a
    chunked block (Ulysses outside Ring) holds chunks of ``chunk`` rows that start ``stride`` apart.

    ``real``: the block was padded (ring attention on an uneven split, see ``_cp_plan``) and only
    offsets below ``real`` within a chunk are real rows. Returns ``(pos, valid)``, ``valid`` None when
    nothing is padded; padded rows get positions past their chunk's real rows."""
    l = torch.arange(n, device=device)
    first = 0
    if chunk:
        first = torch.div(l, chunk, rounding_mode="floor") * stride
        l = l % chunk
    if isinstance(off, torch.Tensor):
        l = off.reshape(off.shape + (1,)).to(device) + l  # [*grid, n]
    else:
        l = l + off
    return first + l, (l < real if real is not None else None)


def _take(x: torch.Tensor, idx: torch.Tensor, dim: int, lead: int) -> torch.Tensor:
    """``x.index_select(dim, idx)`` where ``idx`` may differ per device (leading grid dims ``[*g, n]``)."""
    if idx.ndim == 1:
        return x.index_select(dim, idx.to(x.device))
    g = _broadcast_shape([tuple(x.shape[:lead]), tuple(idx.shape[:lead])])  # (not torch's: it imports sympy)
    x = x.expand(g + tuple(x.shape[lead:]))
    d = dim % x.ndim
    shape = [1] * x.ndim
    shape[:lead] = idx.shape[:lead]
    shape[d] = idx.shape[-1]
    target = list(x.shape)
    target[d] = idx.shape[-1]
    return torch.gather(x, d, idx.reshape(shape).to(x.device).expand(target))


def _rank4(t: torch.Tensor, lead: int, rank: int) -> torch.Tensor:
    """A mask of ``rank`` local dims, right-aligned to [N, H, L, S] behind the grid dims."""
    return t.reshape(tuple(t.shape[:lead]) + (1,) * (4 - rank) + tuple(t.shape[lead:]))


def _match_heads(q, k, v, lead, heads, q_head_off):
    """K/V with one head per q head (GQA): a local repeat when shards align, else a per-device pick."""
    mode, group = heads
    if mode == "local":
        if group > 1:
            k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
        return k, v
    hq = q.shape[-3]
    idx = torch.arange(hq, device=q.device)
    if isinstance(q_head_off, torch.Tensor):
        idx = q_head_off.reshape(q_head_off.shape + (1,)).to(q.device) + idx
    else:
        idx = idx + q_head_off
    idx = torch.div(idx, group, rounding_mode="floor")
    return _take(k, idx, -3, lead), _take(v, idx, -3, lead)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Attention accumulates in float32, or in the input's dtype when that is wider (float64, like torch)."""
    return torch.promote_types(dtype, torch.float32)


def _attend(q, k, v, *, scale, pos_q=None, pos_k=None, causal=False, mask=None, noise=None, key_valid=None):
    """Attention of q against one K/V block -> (out, lse), both in ``_acc_dtype``.

    ``out`` is normalized over this block only and ``lse`` is log sum_j exp(score_j); rows with no
    visible key (also an empty key block) give out = 0 and lse = -inf (never NaN), like torch's fully
    masked rows. ``key_valid`` ([.., S] bool) drops padded keys.
    """
    acc = _acc_dtype(q.dtype)
    qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [.., N, H, L, E] @ [.., N, H, E, S] -> [.., N, H, L, S]
    neg_inf = torch.tensor(float("-inf"), device=s.device, dtype=acc)
    if mask is not None:
        s = torch.where(mask, s, neg_inf) if mask.dtype == torch.bool else s + mask.to(acc)
    allowed = None
    if causal:
        allowed = pos_k.unsqueeze(-2) <= pos_q.unsqueeze(-1)  # [.., L, S]
    if key_valid is not None:
        allowed = key_valid.unsqueeze(-2) if allowed is None else allowed & key_valid.unsqueeze(-2)
    if allowed is not None:
        if allowed.ndim > 2:  # per-device positions: [*grid, L, S] -> [*grid, 1, 1, L, S]
            allowed = allowed.unsqueeze(-3).unsqueeze(-3)
        s = torch.where(allowed, s, neg_inf)
    if s.shape[-1]:
        # the result does not depend on m (it only keeps exp in range): a constant for autograd
        m = s.detach().amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros((), device=s.device, dtype=acc))
    else:  # no keys at all (amax cannot reduce an empty dim): sum of nothing, out 0 and lse -inf below
        m = s.new_zeros(s.shape[:-1] + (1,))
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    if s.requires_grad:  # log(0) would send 0 * inf = NaN back through rows that see no key
        seen = denom > 0
        lse = torch.where(seen, m + torch.log(torch.where(seen, denom, torch.ones((), device=s.device, dtype=acc))),
                          neg_inf).squeeze(-1)
    else:
        lse = (m + torch.log(denom)).squeeze(-1)
    if noise is not None:
        p = p * noise.to(acc)
    out = torch.matmul(p, vf) / torch.where(denom > 0, denom, torch.ones((), device=s.device))
    return out, lse


def _merge(o1, lse1, o2, lse2):
    """Combine two partial attentions over disjoint key sets by their log-sum-exp."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros((), device=lse.device))  # both empty: weights 0
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


# ------------------------------------------------------------------------------------------------
# kernels


def _math_sdpa(q, k, v, mask, noise, causal, scale, group):
    """torch's math SDPA (``_scaled_dot_product_attention_math``, the path it takes with dropout on the CPU)
    with the dropout mask given: the same operations in the same order, so the same bits (float32/64)."""
    sf = math.sqrt(scale)
    q = q * sf
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(mask.logical_not(), float("-inf"))
    if group > 1:
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    attn = torch.matmul(q, k.transpose(-2, -1) * sf)
    if mask is not None:
        attn = attn + mask
    attn = torch._safe_softmax(attn, -1) * noise
    return torch.matmul(attn, v)


def _with_causal(mask, l: int, s: int):
    """``mask`` and the top-left causal mask (query i sees keys j <= i), as torch's fused kernels combine
    ``attn_mask`` with ``is_causal=True``: a bool mask and-ed, a float mask -inf above the diagonal."""
    below = torch.ones(l, s, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return mask & below
    return torch.where(below, mask, torch.tensor(float("-inf"), dtype=mask.dtype, device=mask.device))


@kernel("sdpa")
def _sdpa_kernel(q, k, v, *extra, lead, scale, causal, mask_rank, has_noise, heads, q_off=0, q_head_off=0):
    if (not has_noise or q.dtype in (torch.float32, torch.float64)) and heads[0] == "local" \
            and not isinstance(q_off, torch.Tensor) and q_off == 0:
        xs = whole((q, k, v) + extra, lead)
        if xs is not None:
            # whole heads and keys on every device, queries from the first: torch's own SDPA on the blocks
            # (its fused kernel, float16 included), so one device or replicated inputs give torch's bits
            m = xs[3] if mask_rank is not None else None
            if m is not None and causal:  # (dropout never comes with both: torch refuses the three)
                m, causal = _with_causal(m, xs[0].shape[-2], xs[1].shape[-2]), False
            if has_noise:
                out = _math_sdpa(xs[0], xs[1], xs[2], m, xs[-1], causal, scale, heads[1])
            else:
                out = F.scaled_dot_product_attention(xs[0], xs[1], xs[2], m, is_causal=causal, scale=scale,
                                                     enable_gqa=heads[1] > 1)
            return out.reshape((1,) * lead + tuple(out.shape)) if lead else out
    mask = _rank4(extra[0], lead, mask_rank) if mask_rank is not None else None
    noise = extra[-1] if has_noise else None
    k, v = _match_heads(q, k, v, lead, heads, q_head_off)
    pos_q = pos_k = None
    if causal:
        pos_q, _ = _positions(q_off, q.shape[-2], 0, 0, q.device)
        pos_k = torch.arange(k.shape[-2], device=q.device)
    out, _ = _attend(q, k, v, scale=scale, pos_q=pos_q, pos_k=pos_k, causal=causal, mask=mask, noise=noise)
    return out.to(q.dtype)


def _ring_block(q, k, v, mask, noise, *, lead, scale, causal, mask_rank, kv_rep, q_stride, k_stride, q_off, k_off,
                k_len=None):
    """Local Q against the K/V block held now (source block offset ``k_off``) -> (out, lse) of that block
    alone, in ``_acc_dtype``, in q's layout (chunked blocks stay chunked). Mask and noise are whole along
    L and S; rows/cols are picked by position. ``k_len``: the blocks were padded to equal sizes and the key
    sequence (per chunk) really has this many rows; padded keys are masked out. Padded query rows are
    computed like real ones and cut off later."""
    qc = kc = 0
    q_shape = q.shape
    if q_stride:  # chunked blocks [.., U, C, E] -> [.., U * C, E]
        qc, kc = q.shape[-2], k.shape[-2]
        q, k, v = q.flatten(-3, -2), k.flatten(-3, -2), v.flatten(-3, -2)
    pos_q, _ = _positions(q_off, q.shape[-2], qc, q_stride, q.device)
    pos_k, key_valid = _positions(k_off, k.shape[-2], kc, k_stride, q.device, k_len)

    def pick(x, pos, dim):  # padded rows / cols (positions past the end) may read any row: masked or cut off
        return _take(x, pos.clamp(max=x.shape[dim] - 1), dim, lead)

    if mask is not None:
        mask = _rank4(mask, lead, mask_rank)
        mask = pick(mask, pos_q, -2) if mask.shape[-2] > 1 else mask
        mask = pick(mask, pos_k, -1) if mask.shape[-1] > 1 else mask
    if noise is not None:
        noise = pick(pick(noise, pos_q, -2), pos_k, -1)
    if kv_rep > 1:
        k, v = k.repeat_interleave(kv_rep, dim=-3), v.repeat_interleave(kv_rep, dim=-3)
    out, lse = _attend(q, k, v, scale=scale, pos_q=pos_q, pos_k=pos_k, causal=causal, mask=mask, noise=noise,
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
        out, lse = _merge(extra[0], extra[1], out, lse)
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
    a = _acc_dtype(q.dtype)
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


@kernel("sdpa_repeat_kv")
def _repeat_kv_kernel(x, *, repeats: int):
    return x.repeat_interleave(repeats, dim=-3)


@kernel("sdpa_split_seq")
def _split_seq_kernel(x, *, size: int):
    # [.., C, D] -> [.., 1, C, D]: the same block read as [N, H, U, L / U, D] with U sharded; zero rows
    # appended up to ``size`` when Ring splits L / U unevenly (ring blocks of one size, see _cp_plan)
    return F.pad(x.unsqueeze(-3), (0, 0, 0, size - x.shape[-2]))


@kernel("sdpa_merge_seq")
def _merge_seq_kernel(x, *, length=None):
    # the inverse of sdpa_split_seq: ``length`` (per device) real rows when it padded
    x = x.squeeze(-3)
    return x if length is None else x.narrow(-2, 0, int(length))


@kernel("sdpa_pad_seq")
def _pad_seq_kernel(*xs, sizes: tuple):
    """Each input with zero rows appended to its sequence dim (-2) up to its size in ``sizes`` (ring
    blocks of one size); one call for q, k and v."""
    return tuple(F.pad(x, (0, 0, 0, size - x.shape[-2])) if size != x.shape[-2] else x for x, size in zip(xs, sizes))


@kernel("sdpa_unpad_seq")
def _unpad_seq_kernel(x, *, length):
    """The first ``length`` (per device) rows of the sequence dim (-2): the padding dropped again."""
    return x.narrow(-2, 0, int(length))


# ------------------------------------------------------------------------------------------------
# checks and the plain rule


def _check(specs, has_mask: bool, causal: bool, gqa: bool):
    q, k, v = specs[:3]
    shapes = f"query {list(q.shape)}, key {list(k.shape)}, value {list(v.shape)}"
    if not q.ndim == k.ndim == v.ndim == 4:
        raise OpError(f"dtorch.{_NAME} takes query/key/value of layout [N, H, L, E]; got {shapes}")
    (n, hq, _, e), (nk, hk, s, ek), (nv, hv, sv, _) = q.shape, k.shape, v.shape
    problems = []
    if not n == nk == nv:
        problems.append("batch sizes (dim 0) differ")
    if hk != hv or s != sv:
        problems.append("key and value must agree on heads (dim 1) and sequence length (dim 2)")
    if ek != e:
        problems.append("query and key must have the same embedding size (dim 3)")
    if hq != hk and not gqa:
        problems.append(f"{hq} query heads vs {hk} key/value heads: pass enable_gqa=True for grouped-query attention")
    elif hq != hk and (hk == 0 or hq % hk):
        problems.append(f"query heads ({hq}) must be a multiple of key/value heads ({hk})")
    if not q.dtype == k.dtype == v.dtype:
        problems.append(f"dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    if has_mask:  # (with is_causal too: whether torch takes the pair is _check_mask_with_causal's call)
        m = specs[3]
        if m.dtype not in (torch.bool, torch.float32, q.dtype):  # torch's rule
            problems.append(f"attn_mask dtype must be bool, float32 or the query dtype ({q.dtype}), got {m.dtype}")
        full = (n, hq, q.shape[2], s)
        if m.ndim > 4 or any(a not in (1, b) for a, b in zip(m.shape[::-1], full[::-1])):
            problems.append(f"attn_mask of shape {list(m.shape)} does not broadcast to [N, H, L, S] = {list(full)}")
    if problems:  # all of these are RuntimeErrors in torch too
        raise AttentionInputError(f"dtorch.{_NAME}: {'; '.join(problems)} ({shapes})")


def _mask_dim(spec, od: int, full: tuple):
    """The mask dim that lines up with output dim ``od`` of [N, H, L, S], if it is not broadcast."""
    md = od - (4 - spec.ndim)
    return md if md >= 0 and spec.shape[md] == full[od] > 1 else None


def _shard_or_rep(dim):
    return Replicate() if dim is None else Shard(dim)


def _prod(xs) -> int:
    return int(np.prod(list(xs), dtype=np.int64))


def _plain_rule(specs, has_mask, has_noise, causal, scale, gqa):
    _check(specs, has_mask, causal, gqa)
    q, k, v = specs[:3]
    mask = specs[3] if has_mask else None
    n, hq, l, _ = q.shape
    hk, s, ev = k.shape[1], k.shape[2], v.shape[3]
    full = (n, hq, l, s)
    mesh = q.mesh
    R = Replicate()
    qp, kp, vp, mp, zp, op = [], [], [], [], [], []
    head_dims, seq_dims = [], []
    for i in range(mesh.ndim):
        pq, pv = q.placements[i], v.placements[i]
        dims = {p.dim for p in (pq, k.placements[i], pv) if isinstance(p, Shard)}
        mode = 0 if 0 in dims else 1 if 1 in dims else 2 if pq == Shard(2) else None
        if mode is not None:
            kv = Shard(mode) if mode < 2 else R
            md = _mask_dim(mask, mode, full) if has_mask else None
            row = (Shard(mode), kv, kv, _shard_or_rep(md), Shard(mode), Shard(mode))
            (head_dims if mode == 1 else seq_dims if mode == 2 else []).append(i)
        elif pv == Shard(3):
            row = (R, R, pv, R, R, pv)
        elif isinstance(pv, Partial) and pv.reduce_op in ("sum", "avg"):
            row = (R, R, pv, R, R, pv)
        else:
            row = (R,) * 6
        for lst, p in zip((qp, kp, vp, mp, zp, op), row):
            lst.append(p)
    heads = ("local", hq // hk)
    if hq != hk and head_dims:
        t = _prod(mesh.shape[i] for i in head_dims)
        if hq % t or hk % t:  # q and kv head chunks would not line up: every device keeps all kv heads
            for i in head_dims:
                kp[i] = vp[i] = R
            heads = ("offset", hq // hk)
    q_in = spec_like(q, placements=qp)
    in_specs = [q_in, spec_like(k, placements=kp), spec_like(v, placements=vp)]
    if has_mask:
        in_specs.append(spec_like(mask, placements=mp))
    if has_noise:
        in_specs.append(spec_like(specs[-1], placements=zp))
    out = DTensorSpec(mesh, tuple(op), (n, hq, l, ev), q.dtype)
    device_args = {}
    if causal and seq_dims:
        device_args["q_off"] = block_offsets(q_in, 2)
    if heads[0] == "offset":
        device_args["q_head_off"] = block_offsets(q_in, 1)
    kwargs = {"scale": scale, "causal": causal, "mask_rank": mask.ndim if has_mask else None,
              "has_noise": has_noise, "heads": heads}
    return OpPlan(tuple(in_specs), (out,), _sdpa_kernel, kwargs, device_args or None)


# ------------------------------------------------------------------------------------------------
# context parallel planning (pure, cached)


@dataclass(frozen=True)
class _RingStep:
    in_specs: tuple
    out_specs: tuple
    kwargs: dict
    device_args: dict


@dataclass(frozen=True)
class _CPPlan:
    q_in: DTensorSpec
    k_in: DTensorSpec  # K/V before GQA expansion
    v_in: DTensorSpec
    expand: int  # repeat each kv head this often so kv head shards line up with q's
    k_exp: DTensorSpec | None
    v_exp: DTensorSpec | None
    ulysses: tuple  # (view spec or None, all_to_all target spec) for q, k, v; () without Ulysses
    o_merge: dict | None  # per-device real rows of the view when the view was padded
    ring_dim: int | None
    ring_steps: tuple  # of _RingStep
    mask_r: DTensorSpec | None
    noise_r: DTensorSpec | None
    k_r: DTensorSpec | None  # K/V as they travel the ring (padded if the split is uneven)
    v_r: DTensorSpec | None
    ring_pad: tuple  # (padded spec or None) for q, k, v: an uneven ring split runs on equal blocks
    o_unpad: tuple | None  # (the real output spec, per-device row counts) when q was padded
    o_back: DTensorSpec | None  # output after the all_to_all back (Ulysses)
    o_final: DTensorSpec
    # per q, k, v: (unpadded spec, per-device real rows) where the ring pads it: the backward cuts its gradient
    in_unpad: tuple = (None, None, None)
    bwd: dict = field(default_factory=dict, repr=False, compare=False)  # _ring_backward_plan's cache


def _cp_dims(mesh):
    names = mesh.dim_names or []

    def find(candidates):
        for nm in candidates:
            if nm in names and mesh.shape[names.index(nm)] > 1:
                return names.index(nm)
        return None

    return find(_ULYSSES), find(_RING)


@lru_cache(maxsize=1024)
def _cp_plan(q, k, v, mask, noise, causal, scale, gqa, u, r) -> _CPPlan:
    specs = (q, k, v) + ((mask,) if mask is not None else ())
    _check(specs, mask is not None, causal, gqa)
    mesh = q.mesh
    n, hq, l, e = q.shape
    hk, s, ev = k.shape[1], k.shape[2], v.shape[3]
    U = mesh.shape[u] if u is not None else 1
    nr = mesh.shape[r] if r is not None else 1
    names = mesh.dim_names

    # canonical layout: Shard(2) on the cp dims; batch or head shards pass through on the others
    base, head_dims = [], []
    for i in range(mesh.ndim):
        dims = {p.dim for p in (q.placements[i], k.placements[i], v.placements[i]) if isinstance(p, Shard)}
        if i in (u, r):
            base.append(Shard(2))
        elif 0 in dims:
            base.append(Shard(0))
        elif 1 in dims:
            base.append(Shard(1))
            head_dims.append(i)
        else:
            base.append(Replicate())
    t = _prod(mesh.shape[i] for i in head_dims)
    split = " * ".join(f"{names[i]}({mesh.shape[i]})" for i in head_dims + ([u] if U > 1 else []))
    if U > 1 and hq % (t * U):
        raise OpError(f"dtorch.{_NAME}: Ulysses context parallel splits the {hq} query heads over {split} = {t * U} "
                      "devices; use a head count divisible by that, or a smaller ulysess_cp dim")
    if U > 1 and (l % U or s % U):
        raise OpError(f"dtorch.{_NAME}: Ulysses context parallel needs sequence lengths (query {l}, key {s}) "
                      f"divisible by ulysess_cp ({U})")
    g = hq // hk
    expand = 1
    if g > 1 and t * U > 1:
        if hq % (t * U):
            raise OpError(f"dtorch.{_NAME}: GQA with context parallel needs the {hq} query heads divisible by the "
                          f"head split {split} = {t * U}")
        # the smallest repeat of each kv head that makes kv head shards line up with q's (g always does)
        expand = next(d for d in range(1, g + 1) if g % d == 0 and (hk * d) % (t * U) == 0)
    kv_pre = list(base)
    if expand > 1 and hk % t:  # uneven kv head shards: expand whole heads, then cut (a local slice)
        for i in head_dims:
            kv_pre[i] = Replicate()
    q_in = spec_like(q, placements=base)
    k_in, v_in = spec_like(k, placements=kv_pre), spec_like(v, placements=kv_pre)
    k_exp = v_exp = None
    k_cur, v_cur = spec_like(k, placements=base), spec_like(v, placements=base)
    if expand > 1:
        k_exp = spec_like(k_in, shape=(n, hk * expand, s, e))
        v_exp = spec_like(v_in, shape=(n, hk * expand, s, ev))
        k_cur, v_cur = spec_like(k_exp, placements=base), spec_like(v_exp, placements=base)

    # Ulysses: sequence <-> heads. With Ulysses outside Ring in mesh order, each device's block of L is
    # read as [U, L / U] first (same data), so the all_to_all leaves Ring's shard of every chunk in place.
    view = U > 1 and nr > 1 and u < r
    sd = 3 if view else 2  # the dim Ring splits

    # An uneven Ring split (torch.chunk blocks: c, .., c, rest, 0, ..) is padded with zero rows at the
    # end of every block up to c rows: device j's real rows keep their place (its block starts at j * c
    # either way), every device and ring step works on blocks of one shape (one stacked kernel per step
    # instead of a loop over devices, and no empty blocks), and the kernels mask padded keys (``k_len``)
    # and compute padded query rows like real ones; they are cut off at the end. With the [U, L / U] view
    # the padding goes on the view (sdpa_split_seq), so the all_to_all runs on equal blocks too.
    def padded(x):
        size = x.shape[sd]
        if nr == 1 or size % nr == 0:
            return None
        return spec_like(x, shape=x.shape[:sd] + (nr * chunk_size(size, nr),) + x.shape[sd + 1:])

    def real_rows(x):  # x unpadded: per device, how many rows of its padded block are real
        return np.minimum(chunk_size(x.shape[sd], nr), x.shape[sd] - block_offsets(x, sd))

    ulysses = ()
    q_cur = q_in
    o_merge = None
    if U > 1:
        def to_heads(x):
            pl = list(x.placements)
            vw = None
            if view:
                pl[r] = Shard(3)
                vw = DTensorSpec(mesh, tuple(pl), x.shape[:2] + (U, x.shape[2] // U) + x.shape[3:], x.dtype)
                vp = padded(vw)
                x = vw = vw if vp is None else vp
            pl[u] = Shard(1)
            return vw, x.with_placements(pl)

        ulysses = (to_heads(q_in), to_heads(k_cur), to_heads(v_cur))
        q_cur, k_cur, v_cur = (a2a for _, a2a in ulysses)

    o_final = DTensorSpec(mesh, tuple(base), (n, hq, l, ev), q.dtype)
    o_back = None
    if U > 1:
        o_back = o_final
        if view:
            o_back = spec_like(ulysses[0][0], shape=ulysses[0][0].shape[:-1] + (ev,))
            if (l // U) % nr:
                o_merge = {"length": real_rows(spec_like(o_back, shape=o_back.shape[:sd] + (l // U, ev)))}
    if nr == 1:
        return _CPPlan(q_in, k_in, v_in, expand, k_exp, v_exp, ulysses, o_merge, None, (), None, None, None, None,
                       (), None, o_back, o_final)

    # Ring: local Q against each K/V block in turn; device j holds block (j - step) mod nr
    heads_now = head_dims + ([u] if U > 1 else [])
    full = (n, hq, l, s)

    def whole_seq(x):  # mask/noise: batch and head shards like q, whole along L and S
        if x is None:
            return None
        pl = []
        for i in range(mesh.ndim):
            od = 0 if base[i] == Shard(0) else 1 if i in heads_now else None
            md = _mask_dim(x, od, full) if od is not None else None
            pl.append(_shard_or_rep(md))
        return x.with_placements(pl)

    mask_r, noise_r = whole_seq(mask), whole_seq(noise)
    extra = tuple(x for x in (mask_r, noise_r) if x is not None)
    ring_pad = (padded(q_cur), padded(k_cur), padded(v_cur))  # the view was padded already
    q_run, k_run, v_run = (p if p is not None else x for p, x in zip(ring_pad, (q_cur, k_cur, v_cur)))
    acc = _acc_dtype(q.dtype)
    o_acc = DTensorSpec(mesh, q_run.placements, q_run.shape[:-1] + (ev,), acc)
    lse = DTensorSpec(mesh, q_run.placements, q_run.shape[:-1], acc)
    o_out = spec_like(o_acc, dtype=q.dtype)
    o_unpad = None
    if ring_pad[0] is not None:
        o_real = spec_like(o_out, shape=q_cur.shape[:-1] + (ev,))
        o_unpad = (o_real, {"length": real_rows(o_real)})
    k_len = s // U if view else s  # real key rows along the ring dim (per view chunk)
    q_off = block_offsets(q_run, sd)
    steps = []
    for st in range(nr):
        def src(c, st=st):
            c = list(c)
            c[r] = (c[r] - st) % nr
            return tuple(c)

        last = st == nr - 1
        kwargs = {"scale": scale, "causal": causal, "mask_rank": mask.ndim if mask is not None else None,
                  "has_noise": noise is not None, "has_acc": st > 0, "kv_rep": hq // k_cur.shape[1],
                  "q_stride": l // U if view else 0, "k_stride": s // U if view else 0,
                  "out_dtype": q.dtype if last else acc,
                  "k_len": k_len if k_len % nr else None}
        steps.append(_RingStep((q_run, k_run, v_run) + extra + ((o_acc, lse) if st else ()),
                               (o_out if last else o_acc, lse), kwargs,
                               {"q_off": q_off, "k_off": block_offsets(k_run, sd, src)}))
    in_unpad = tuple((x, {"length": real_rows(x)}) if p is not None else None
                     for x, p in zip((q_cur, k_cur, v_cur), ring_pad))
    return _CPPlan(q_in, k_in, v_in, expand, k_exp, v_exp, ulysses, o_merge, r, tuple(steps), mask_r, noise_r, k_run,
                   v_run, ring_pad, o_unpad, o_back, o_final, in_unpad)


# ------------------------------------------------------------------------------------------------
# execution


def _local(kern: Kernel, xs: list, out_specs, kwargs: dict, device_args=None, record: bool = True) -> list:
    """Run a local kernel on every device's blocks of ``xs`` -> one Tensor per output spec (``local_map``).
    Recorded for autograd unless ``record`` is False (a node that covers the kernel records instead)."""
    return local_map(f"{_NAME}.{kern.name}", kern, xs, out_specs, kwargs, device_args, record)


def _run(kern: Kernel, x: Tensor, out_spec: DTensorSpec, device_args=None, **kwargs) -> Tensor:
    return _local(kern, [x], [out_spec], kwargs, device_args)[0]


def _plain(q, k, v, mask, noise, causal, scale, gqa) -> Tensor:
    tensors = [q, k, v] + [t for t in (mask, noise) if t is not None]
    return dispatch(_NAME, _plain_rule, tensors, (mask is not None, noise is not None, causal, scale, gqa))


def _context_parallel(q, k, v, mask, noise, causal, scale, gqa, u, r) -> Tensor:
    tensors = [x for x in (q, k, v, mask, noise) if x is not None]
    if any(x._graph is not q._graph for x in tensors):  # the ring runs q's runtime on k's and v's blocks
        check_one_graph(_NAME, tensors)
    specs = (q._spec, k._spec, v._spec, mask._spec if mask is not None else None,
             noise._spec if noise is not None else None)
    try:
        cp = _cp_plan(*specs, causal, scale, gqa, u, r)
    except DTorchError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise OpError(f"dtorch.{_NAME} cannot run on inputs {describe([s for s in specs if s])}: {exc}") from exc
    mesh = q.device_mesh
    q, k, v = redistribute_spec(q, cp.q_in), redistribute_spec(k, cp.k_in), redistribute_spec(v, cp.v_in)
    if cp.expand > 1:
        # each kv head repeated in place, then cut like q's heads (a local slice when heads were whole)
        k = redistribute_spec(_run(_repeat_kv_kernel, k, cp.k_exp, repeats=cp.expand), _base_like(cp, cp.k_exp))
        v = redistribute_spec(_run(_repeat_kv_kernel, v, cp.v_exp, repeats=cp.expand), _base_like(cp, cp.v_exp))
    if cp.ulysses:
        moved = []
        for x, (view, a2a) in zip((q, k, v), cp.ulysses):
            if view is not None:
                x = _run(_split_seq_kernel, x, view, size=view.even_local_shape()[3])
            moved.append(x.redistribute(mesh, a2a.placements))  # all_to_all on the Ulysses dim
        q, k, v = moved
    if cp.ring_dim is None:
        out = _plain(q, k, v, mask, noise, causal, scale, gqa)
    else:
        out = _ring(cp, q, k, v, mask, noise)
    if cp.o_back is not None:
        out = out.redistribute(mesh, cp.o_back.placements)  # all_to_all back on the Ulysses dim
        if cp.o_back.shape != cp.o_final.shape:
            out = _run(_merge_seq_kernel, out, cp.o_final, cp.o_merge)
    return out


def _base_like(cp: _CPPlan, spec: DTensorSpec) -> DTensorSpec:
    return spec.with_placements(cp.q_in.placements)


def _ring(cp: _CPPlan, q, k, v, mask, noise) -> Tensor:
    graph = q._graph
    rt = graph.runtime
    extra = [redistribute_spec(x, s) for x, s in ((mask, cp.mask_r), (noise, cp.noise_r)) if x is not None]
    inputs = [q, k, v] + extra
    pad = [(x, p) for x, p in zip((q, k, v), cp.ring_pad) if p is not None]
    if pad:  # (the ring's node covers the padding and the cut: its backward pads dO and cuts dQ/dK/dV)
        padded = iter(_local(_pad_seq_kernel, [x for x, _ in pad], [p for _, p in pad],
                             {"sizes": tuple(p.even_local_shape()[-2] for _, p in pad)}, record=False))
        q, k, v = (x if p is None else next(padded) for x, p in zip((q, k, v), cp.ring_pad))
    kh, vh = k._h, v._h
    acc: list = []
    for st, step in enumerate(cp.ring_steps):
        try:
            acc = rt.run_local(_ring_step_kernel, [q._h, kh, vh] + [x._h for x in extra] + acc, step.in_specs,
                               step.out_specs, step.kwargs, step.device_args)
        except DTorchError:
            raise
        except Exception as exc:
            raise OpError(f"dtorch.{_NAME} (ring step {st}) failed on inputs {describe(step.in_specs[:3])}: "
                          f"{type(exc).__name__}: {exc}") from exc
        if st + 1 < len(cp.ring_steps):  # pass K/V on: device j now holds block j - st - 1
            kh = ring_shift(rt, kh, cp.k_r, cp.ring_dim, 1)  # the executor records the send_recv
            vh = ring_shift(rt, vh, cp.v_r, cp.ring_dim, 1)
    out = merged = Tensor._make(cp.ring_steps[-1].out_specs[0], acc[0], graph)
    if cp.o_unpad is not None:  # drop the padded query rows
        out = _local(_unpad_seq_kernel, [out], [cp.o_unpad[0]], {}, cp.o_unpad[1], record=False)[0]
    if _grad_enabled() and any(_differentiable(x) for x in inputs):
        attach(RingAttentionNode(cp, inputs, [q, k, v] + extra, merged, acc[1]), [out])
    return out


def _differentiable(x: Tensor) -> bool:
    return requires_grad(x) and x.dtype.is_floating_point


@dataclass(frozen=True)
class _RingBackwardStep:
    in_specs: tuple
    out_specs: tuple
    kwargs: dict


def _ring_backward_plan(cp: _CPPlan, need: tuple) -> tuple:
    """Per ring step of the backward: the specs and kwargs of ``sdpa_ring_step_backward`` (cached on the plan).

    Accumulators: dQ (q's layout) and the mask's (its layout, Partial(sum) on every mesh dim that splits
    the work, Replicate where every device computes the same) stay on their device; dK/dV have K/V's
    layout and travel with their blocks. All in ``_acc_dtype``; the last step casts to the input dtypes."""
    plan = cp.bwd.get(need)
    if plan is not None:
        return plan
    first = cp.ring_steps[0]
    q_run, k_run, v_run = first.in_specs[:3]
    extra = first.in_specs[3:]
    o_out, lse = cp.ring_steps[-1].out_specs
    mask = cp.mask_r
    targets = [q_run, k_run, v_run]
    if mask is not None:
        targets.append(spec_like(mask, placements=[
            p if isinstance(p, Shard) else _PSUM if isinstance(pq, Shard) else p
            for p, pq in zip(mask.placements, q_run.placements)]))
    targets = [t for t, n in zip(targets, need) if n]
    acc = _acc_dtype(q_run.dtype)
    acc_specs = tuple(spec_like(t, dtype=acc) for t in targets)
    final_specs = tuple(targets)
    steps = []
    last = len(cp.ring_steps) - 1
    for st, step in enumerate(cp.ring_steps):
        kw = {key: step.kwargs[key] for key in ("scale", "causal", "mask_rank", "has_noise", "kv_rep", "q_stride",
                                                 "k_stride", "k_len")}
        outs = final_specs if st == last else acc_specs
        kw.update(need=need, has_acc=st > 0, out_dtypes=tuple(t.dtype for t in outs))
        steps.append(_RingBackwardStep((q_run, k_run, v_run) + extra + (o_out, lse, o_out) + (acc_specs if st else ()),
                                       outs, kw))
    plan = cp.bwd[need] = (tuple(steps), final_specs)
    return plan


class RingAttentionNode(Node):
    """The backward of ``_ring`` (from the unpadded Q/K/V to the unpadded output).

    It runs the ring again: at step s device j holds K/V block (j - s) mod R together with that block's
    dK/dV accumulators, adds the local contribution (``sdpa_ring_step_backward``), and passes all four
    on; dQ (and a float mask's gradient) accumulate where they are. One more shift after the last step
    brings every dK/dV home. Communication: send_recv on the ring dim only (K/V R - 1 times each,
    dK/dV R times each); the sequence is never gathered."""

    __slots__ = ("cp", "versions", "run", "need", "out_h", "lse_h", "graph")
    name = _NAME

    def __init__(self, cp: _CPPlan, inputs: list, run: list, out: Tensor, lse_h):
        need = tuple(_differentiable(x) for x in inputs[:3]) + (
            cp.mask_r is not None and _differentiable(inputs[3]),)
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
        from ..redistribute import relayout

        g = grads[0]
        if g is None:
            return [None] * len(self.edges)
        for n, x, version in self.versions:
            if x._version != version:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace "
                    f"operation: input {n} of dtorch.{_NAME} ({x._spec}) is at version {x._version}; expected "
                    f"version {version} instead. Write a copy (x.clone()) instead, or run the in-place op after "
                    "the backward.")
        cp, rt = self.cp, self.graph.runtime
        steps, final = _ring_backward_plan(cp, self.need)
        o_out = cp.ring_steps[-1].out_specs[0]
        if g.dtype != o_out.dtype:
            g = g.to(o_out.dtype)
        if cp.o_unpad is not None:  # padded query rows got no gradient
            g = relayout(g, cp.o_unpad[0])
            g = _local(_pad_seq_kernel, [g], [o_out], {"sizes": (o_out.even_local_shape()[-2],)}, record=False)[0]
        g = relayout(g, o_out)
        q, k, v, extra = self.run[0], self.run[1], self.run[2], self.run[3:]
        kh, vh = k._h, v._h
        order = [i for i, n in enumerate(self.need) if n]  # which of q, k, v, mask each accumulator is
        travel = [j for j, i in enumerate(order) if i in (1, 2)]
        acc: list = []
        for st, (step, fwd) in enumerate(zip(steps, cp.ring_steps)):
            acc = rt.run_local(_ring_step_backward_kernel,
                               [q._h, kh, vh] + [x._h for x in extra] + [self.out_h, self.lse_h, g._h] + acc,
                               step.in_specs, step.out_specs, step.kwargs, fwd.device_args)
            if st + 1 < len(steps):
                kh = ring_shift(rt, kh, cp.k_r, cp.ring_dim, 1)
                vh = ring_shift(rt, vh, cp.v_r, cp.ring_dim, 1)
            # dK/dV go with their blocks; after the last step the shift brings each home
            for j in travel:
                acc[j] = ring_shift(rt, acc[j], step.out_specs[j], cp.ring_dim, 1)
        grads = [Tensor._make(spec, h, self.graph) for spec, h in zip(final, acc)]
        cuts = [c for c, n in zip(cp.in_unpad + (None,), self.need) if n]
        return [x if c is None else _local(_unpad_seq_kernel, [x], [c[0]], {}, c[1], record=False)[0]
                for x, c in zip(grads, cuts)]


# ------------------------------------------------------------------------------------------------
# the op


def _check_mask_with_causal(q, k, v, mask, dropout_p: float, scale, gqa: bool) -> None:
    """``attn_mask`` with ``is_causal=True``: torch's fused kernels combine the two (``_with_causal``), its math
    kernel refuses the pair. Which one torch would run depends on the shapes (4-D, one head size for q, k and
    v, ...), on dropout and on the backends ``torch.nn.attention.sdpa_kernel`` enables: torch's own choice,
    asked with stand-ins of these shapes and dtypes (one row of memory each, expanded), decides."""
    device = "cuda" if q.device_mesh.device_type == "cuda" and torch.cuda.is_available() else "cpu"

    def stand_in(x: Tensor) -> torch.Tensor:
        row = torch.empty(x.shape[-1:], dtype=x.dtype, device=device, requires_grad=x.requires_grad)
        return row.expand(tuple(x.shape))

    try:
        choice = torch._fused_sdp_choice(*(stand_in(x) for x in (q, k, v, mask)), dropout_p, True, scale=scale,
                                         enable_gqa=gqa)
    except RuntimeError as exc:  # no backend enabled can run it
        raise AttentionInputError(f"dtorch.{_NAME}: {exc}") from exc
    if choice == int(SDPBackend.MATH):
        raise AttentionInputError(
            f"dtorch.{_NAME}: Explicit attn_mask should not be set when is_causal=True: for these inputs torch runs "
            "its math kernel, which refuses the pair (dropout, 3-D inputs, a value head size other than the query's, "
            "a 3-D mask, or sdpa_kernel(SDPBackend.MATH)); fold the causal mask into attn_mask "
            "(& torch.ones(L, S, dtype=torch.bool).tril()) or drop one of them")


@register(rule=_plain_rule, kernel=_sdpa_kernel, torch_fns=(F.scaled_dot_product_attention,), functional=True)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False):
    """``F.scaled_dot_product_attention`` on [N, H, L, E] tensors; context parallel on a mesh with a
    ``ulysess_cp`` / ``ring_cp`` dim of size > 1.

    With ``dropout_p > 0`` the dropout mask is drawn for the global [N, H, L, S] attention weights by
    torch on the controller (on CPU the same values as torch's SDPA for the same seed)."""
    q, k, v, mask = to_dtensors(_NAME, [query, key, value, attn_mask])
    if not all(isinstance(x, Tensor) for x in (q, k, v)):
        raise OpError(f"dtorch.{_NAME}: query, key and value must be tensors")
    if is_causal and isinstance(mask, Tensor):  # (before the 3-D form becomes 4-D: torch refuses it there)
        _check_mask_with_causal(q, k, v, mask, dropout_p, scale, bool(enable_gqa))
    if q.ndim == 3 and k.ndim == 3 and v.ndim == 3:  # torch also takes [N, L, E]: one head
        mask = mask.unsqueeze(-3) if isinstance(mask, Tensor) and mask.ndim == 3 else mask
        out = scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), mask, dropout_p,
                                           is_causal, scale, enable_gqa)
        return out.squeeze(1)
    if not 0.0 <= dropout_p <= 1.0:
        raise OpError(f"dtorch.{_NAME}: dropout_p must be in [0, 1], got {dropout_p}")
    e = q.shape[-1] if q.ndim else 1
    scale = float(1.0 / math.sqrt(e) if scale is None else scale)
    noise = None
    if dropout_p > 0.0 and q.ndim == 4 and k.ndim == 4:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        # torch's recipe: empty_like(attn).bernoulli_(1 - p).div_(1 - p); p == 1 drops everything
        full = (torch.zeros(shape, dtype=q.dtype) if dropout_p == 1.0
                else torch.empty(shape, dtype=q.dtype).bernoulli_(1 - dropout_p).div_(1 - dropout_p))
        noise = Tensor(full, device_mesh=q.device_mesh)
    u, r = _cp_dims(q.device_mesh)
    if u is None and r is None:
        return _plain(q, k, v, mask, noise, bool(is_causal), scale, bool(enable_gqa))
    return _context_parallel(q, k, v, mask, noise, bool(is_causal), scale, bool(enable_gqa), u, r)
