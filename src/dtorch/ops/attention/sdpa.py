"""Attention on local blocks, and the plain (not context parallel) rule of scaled_dot_product_attention.

The rule, per mesh dim (layout [N, H, L, E]; K/V are [N, Hk, S, E] / [N, Hk, S, Ev]):

    q/k/v S(0)          -> S(0)   batches are independent
    q/k/v S(1)          -> S(1)   heads are independent (GQA: kv heads sharded alike when both head
                                  counts divide evenly, else kv replicated and each device picks the
                                  kv heads its q heads use)
    q S(2), k/v whole   -> S(2)   query rows are independent; a causal mask uses global row offsets
    v S(3), q/k whole   -> S(3)   out[..., e] only reads v[..., e]
    v P, q/k whole      -> P      out = softmax(q k^T) v is linear in v
    otherwise           -> R

The block math (``attend``: one K/V block -> output and log-sum-exp; ``merge``: two blocks' results by
their log-sum-exp) is what the ring (ring.py) and the KV cache's decode (decode.py) are built from.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import AttentionInputError, OpError
from ...placement import Partial, Replicate, Shard
from ...runtime.kernels import broadcast_shape as _broadcast_shape
from ...runtime.kernels import kernel
from ...spec import DTensorSpec, block_offsets
from ..dispatch import OpPlan, dispatch
from ..matrix import whole
from ..rules import spec_like

NAME = "scaled_dot_product_attention"


# ------------------------------------------------------------------------------------------------
# math on local blocks (leading grid dims allowed everywhere)


def positions(off, n: int, chunk: int, stride: int, device, real: int | None = None):
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


def take(x: torch.Tensor, idx: torch.Tensor, dim: int, lead: int) -> torch.Tensor:
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


def rank4(t: torch.Tensor, lead: int, rank: int) -> torch.Tensor:
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
    return take(k, idx, -3, lead), take(v, idx, -3, lead)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Attention accumulates in float32, or in the input's dtype when that is wider (float64, like torch)."""
    return torch.promote_types(dtype, torch.float32)


def attend(q, k, v, *, scale, pos_q=None, pos_k=None, causal=False, mask=None, noise=None, key_valid=None):
    """Attention of q against one K/V block -> (out, lse), both in ``acc_dtype``.

    ``out`` is normalized over this block only and ``lse`` is log sum_j exp(score_j); rows with no
    visible key (also an empty key block) give out = 0 and lse = -inf (never NaN), like torch's fully
    masked rows. ``key_valid`` ([.., S] bool) drops padded keys.
    """
    acc = acc_dtype(q.dtype)
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


def merge(o1, lse1, o2, lse2):
    """Combine two partial attentions over disjoint key sets by their log-sum-exp."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros((), device=lse.device))  # both empty: weights 0
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


# ------------------------------------------------------------------------------------------------
# the kernel


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
        if not has_noise and mask_rank is None and q.shape[:lead] == k.shape[:lead] == v.shape[:lead]:
            # every device holds whole heads and keys and its queries start at 0: its blocks are batch rows of
            # one fused call over the stacked devices (each (row, head) is computed alone: the per-device bits)
            rows = tuple(q.shape[:lead + 1])
            q, k, v = (x.reshape((prod(rows),) + tuple(x.shape[lead + 1:])) for x in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=heads[1] > 1)
            return out.reshape(rows + tuple(out.shape[1:]))
    mask = rank4(extra[0], lead, mask_rank) if mask_rank is not None else None
    noise = extra[-1] if has_noise else None
    k, v = _match_heads(q, k, v, lead, heads, q_head_off)
    pos_q = pos_k = None
    if causal:
        pos_q, _ = positions(q_off, q.shape[-2], 0, 0, q.device)
        pos_k = torch.arange(k.shape[-2], device=q.device)
    out, _ = attend(q, k, v, scale=scale, pos_q=pos_q, pos_k=pos_k, causal=causal, mask=mask, noise=noise)
    return out.to(q.dtype)



# ------------------------------------------------------------------------------------------------
# checks and the plain rule


def check_inputs(specs, has_mask: bool, causal: bool, gqa: bool):
    q, k, v = specs[:3]
    shapes = f"query {list(q.shape)}, key {list(k.shape)}, value {list(v.shape)}"
    if not q.ndim == k.ndim == v.ndim == 4:
        raise OpError(f"dtorch.{NAME} takes query/key/value of layout [N, H, L, E]; got {shapes}")
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
        raise AttentionInputError(f"dtorch.{NAME}: {'; '.join(problems)} ({shapes})")


def mask_dim(spec, od: int, full: tuple):
    """The mask dim that lines up with output dim ``od`` of [N, H, L, S], if it is not broadcast."""
    md = od - (4 - spec.ndim)
    return md if md >= 0 and spec.shape[md] == full[od] > 1 else None


def shard_or_rep(dim):
    return Replicate() if dim is None else Shard(dim)


def prod(xs) -> int:
    return int(np.prod(list(xs), dtype=np.int64))


def _plain_rule(specs, has_mask, has_noise, causal, scale, gqa):
    check_inputs(specs, has_mask, causal, gqa)
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
            md = mask_dim(mask, mode, full) if has_mask else None
            row = (Shard(mode), kv, kv, shard_or_rep(md), Shard(mode), Shard(mode))
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
        t = prod(mesh.shape[i] for i in head_dims)
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



def plain(q, k, v, mask, noise, causal: bool, scale: float, gqa: bool):
    """Attention by the plain rule (module docstring): one kernel per device, laid out by ``dispatch``."""
    tensors = [q, k, v] + [t for t in (mask, noise) if t is not None]
    return dispatch(NAME, _plain_rule, tensors, (mask is not None, noise is not None, causal, scale, gqa))
