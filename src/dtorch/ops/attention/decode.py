"""What decoding with a KV cache runs (models/kv_cache.py keeps the cache and its slot table).

Kernels: the cache written in place (``kv_cache.write``: a prefill's keys/values, or a decode step's
projections rotated on the way in), grown (``kv_cache.grow``), the new tokens' queries attended against
each device's block of slots (``kv_cache.attend``: a partial output and its log-sum-exp when the slots are
split over devices) and the partials merged (``kv_cache.combine``, flash-decoding), q/k rotated by each
row's own positions (``kv_cache.rotary``), the last position of a sequence-sharded tensor
(``kv_cache.last_row``).

The rules read no mesh dim names: the cache's own placements say which mesh dims split the batch
(Shard(0)), the kv heads (Shard(1)) and the slots (Shard(2)); the model lays the cache out (models/).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from ... import capture
from ...autograd.kernel_entry import write_local
from ...placement import Partial, Replicate, Shard
from ...runtime.kernels import kernel
from ...spec import DTensorSpec
from ..dispatch import OpPlan, dispatch, local_map
from ..rules import spec_like


# ------------------------------------------------------------------------------------------------
# kernels (leading grid dims allowed: ``lead``)


def _heads_first(x, heads: int):
    """A projection's output [.., B, L, heads * d] as [.., B, heads, L, d] (a view where it can be)."""
    return x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads)).transpose(-3, -2)


def _rotate(x, cos, sin):
    """Hugging Face's apply_rotary_pos_emb on [.., B, H, L, d] with cos/sin [.., B, L, d], ``sin`` as
    ``signed_sin`` gives it: ``x * cos + rotate_half(x) * sin`` with rotate_half's negation in the table, so
    rotate_half is a roll (one op for its four; (-a) * b and a * (-b) are the same float, so are the bits)."""
    return x * cos.unsqueeze(-3) + x.roll(x.shape[-1] // 2, -1) * sin.unsqueeze(-3)


def signed_sin(sin):
    """Hugging Face's sin table [.., d] as the kernels here take it: its first half negated (``_rotate``)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


@kernel("kv_cache.write")
def _write_kernel(cache, new, *rope, lead=0, src=0, dst=0, count=0, projected: bool = False):
    """``new[..., src:src + count, :]`` into ``cache[..., dst:dst + count, :]`` on each device (count 0:
    nothing). Per-device values come as python ints (one device, or the same on every device) or as
    tensors of the mesh's shape (stacked devices). ``projected``: ``new`` is the projection's output
    [.., B, L, heads * d] (a decode step), rotated by ``rope`` (cos, sin) when given."""
    if projected:
        new = _heads_first(new, cache.shape[-3])
        if rope:
            new = _rotate(new, *rope)
    if not isinstance(count, torch.Tensor):
        if count:  # (narrow and copy_: a decode step's 8 writes skip Python's indexing)
            new = new if src == 0 and count == new.shape[-2] else new.narrow(-2, src, count)
            cache.narrow(-2, dst, count).copy_(new)
        return
    count, src, dst = (torch.as_tensor(x).cpu() for x in (count, src, dst))
    grid_c, grid_n = cache.shape[:lead], new.shape[:lead]
    for idx in np.ndindex(tuple(count.shape)):
        c = int(count[idx])
        if c:
            s, d = int(src[idx]), int(dst[idx])
            ci = tuple(min(i, g - 1) for i, g in zip(idx, grid_c))  # (a grid dim of 1: replicas share a block)
            ni = tuple(min(i, g - 1) for i, g in zip(idx, grid_n))
            cache[ci][..., d:d + c, :] = new[ni][..., s:s + c, :]


@kernel("kv_cache.grow")
def _grow_kernel(x, *, slots: int):
    """Each device's block of slots with free slots appended (a larger cache, same tokens in the same slots)."""
    out = x.new_zeros(x.shape[:-2] + (slots, x.shape[-1]))
    out[..., : x.shape[-2], :] = x
    return out


@kernel("kv_cache.attend")
def _attend_kernel(q, k, v, mask, cos, sin, *, lead=0, scale: float, parts: bool, out_dtype: torch.dtype):
    """The new tokens' queries (the projection's output ``[B, L, nh * d]``, rotated here by cos/sin
    ``[B, L, d]``) against this device's keys/values ``[B, hk, M, d]`` where ``mask`` ``[B, 1, L, M]``
    allows. Returns the output ``[B, L, nh * d]`` (ready for o_proj) or, with ``parts``, the output
    ``[1, B, nh, L, d]`` normalised over these keys and its log-sum-exp ``[1, B, nh, L]`` (this device's
    part, merged over the cp devices by ``kv_cache.combine``). Query head ``i`` uses kv head
    ``i // (nh / hk)`` (grouped-query attention without copying the cache). A mask over fewer slots than the
    cache's (``M`` its last dim) covers the first ``M`` only: the others are not attended."""
    if mask.shape[-1] != k.shape[-2]:
        k, v = k.narrow(-2, 0, mask.shape[-1]), v.narrow(-2, 0, mask.shape[-1])
    q = _rotate(_heads_first(q, q.shape[-1] // k.shape[-1]), cos, sin)  # (this device's heads) [.., B, nh, L, d]
    if not parts:  # torch's fused attention (grouped-query, masked), on the stacked devices' rows as one batch
        return _fused_attend(q, k, v, mask, scale).transpose(-3, -2).flatten(-2).to(out_dtype)
    acc = torch.promote_types(q.dtype, torch.float32)
    hk, length = k.shape[-3], q.shape[-2]
    g = q.shape[-3] // hk
    # the g query heads of a kv head as rows of one matrix: [.., B, hk, g * L, d] (no copy of the cache per head)
    qf = q.to(acc).reshape(q.shape[:-3] + (hk, g * length, q.shape[-1]))
    s = torch.matmul(qf, k.to(acc).transpose(-1, -2))  # [.., B, hk, g * L, M]
    s = s.view(s.shape[:-2] + (g, length, s.shape[-1]))
    s = torch.where(mask.unsqueeze(-3), s * scale, float("-inf"))  # mask [.., B, 1, 1, L, M]
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)  # rows that see no key: weights 0, not NaN
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, 1.0)
    out = torch.matmul(p.view(p.shape[:-3] + (g * length, p.shape[-1])), v.to(acc))  # [.., B, hk, g * L, d]
    # (the grid dims are the broadcast of q's and the cache's: a cp dim is 1 in q's, the cache's size in k's)
    out = out.reshape(out.shape[:-2] + (g, length, out.shape[-1])).flatten(-4, -3)  # [.., B, nh, L, d]
    if not parts:
        return out.transpose(-3, -2).flatten(-2).to(out_dtype)
    lse = (m + torch.log(denom)).squeeze(-1).flatten(-3, -2)  # [.., B, nh, L]; -inf: no key here
    return out.unsqueeze(-5), lse.unsqueeze(-4)


def _fused_attend(q, k, v, mask, scale: float):
    """``q`` [.., B, nh, L, d] against ``k``/``v`` [.., B, hk, M, d] where ``mask`` [.., B, 1, L, M] allows, by
    ``torch.nn.functional.scaled_dot_product_attention`` (a row that sees no key gives zeros, as in the parts
    path). The leading dims (grid dims, batch) are flattened into one: torch's kernel takes 4-d inputs fast."""
    # (the four have the same leading dims, each 1 or the size; torch.broadcast_shapes costs ~15 us a call)
    lead = tuple(map(max, q.shape[:-3], k.shape[:-3], v.shape[:-3], mask.shape[:-3]))
    # flattened in the order of the cache's strides: a grid in the full tensor's layout (runtime/grids.py) has its
    # tp dim inside the batch's, and flattening in the dims' own order would copy the keys and values every step
    perm, back = _stride_order(k.stride()[:len(lead)])

    def flat(x):
        x = x if x.shape[:-3] == lead else x.expand(lead + x.shape[-3:])
        x = x if perm is None else x.permute(perm)
        return x.reshape((-1,) + x.shape[-3:])

    out = torch.nn.functional.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=flat(mask),
                                                           scale=scale, enable_gqa=True)
    if perm is None:
        return out.reshape(lead + tuple(out.shape[-3:]))
    # (each row of the batch is attended on its own: their order changes no value)
    return out.reshape(tuple(lead[i] for i in perm[:len(lead)]) + tuple(out.shape[-3:])).permute(back)


@functools.lru_cache(maxsize=256)
def _stride_order(strides: tuple) -> tuple:
    """(the permutation of an attention input that puts its leading dims of these strides outermost first
    (ties in their own order) and leaves the last three, its inverse), or (None, None) when they are in order."""
    n = len(strides)
    order = sorted(range(n), key=lambda i: -strides[i])
    if order == list(range(n)):
        return None, None
    perm = tuple(order) + tuple(range(n, n + 3))
    return perm, tuple(perm.index(i) for i in range(n + 3))


@kernel("kv_cache.combine")
def _combine_kernel(out, lse, *, out_dtype: torch.dtype):
    """Merge the cp devices' partial outputs ``[C, B, nh, L, d]`` by their log-sum-exps ``[C, B, nh, L]``
    into ``[B, L, nh * d]``."""
    total = torch.logsumexp(lse, dim=-4, keepdim=True)
    total = torch.where(torch.isfinite(total), total, torch.zeros((), dtype=total.dtype, device=total.device))
    w = torch.exp(lse - total).unsqueeze(-1)  # a part with no visible key weighs 0
    merged = (out * w).sum(-5)
    return merged.transpose(-3, -2).flatten(-2).to(out_dtype)


@kernel("kv_cache.last_row")
def _last_row_kernel(x, *, lead=0, holds=1):
    """The last row of this device's block of the sequence (dim -2), where this device holds the sequence's
    last position (``holds``), else zeros: summed over the sequence's devices, the global last row."""
    if x.shape[-2] == 0:
        return x.new_zeros(x.shape[:-2] + (1, x.shape[-1]))
    row = x[..., -1:, :]
    if isinstance(holds, torch.Tensor):
        holds = holds.to(torch.bool).reshape(tuple(holds.shape) + (1,) * (row.ndim - holds.ndim)).to(row.device)
        return torch.where(holds, row, torch.zeros((), dtype=row.dtype, device=row.device))
    return row if holds else torch.zeros_like(row)


@kernel("kv_cache.rotary")
def _rotary_kernel(q, k, cos, sin):
    """Hugging Face's ``apply_rotary_pos_emb`` on q/k [B, H, S, d] with each row's cos/sin [B, S, d] (sin
    signed: ``signed_sin``), the same float results, as one kernel (instead of a dozen element-wise ops)."""
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotary_rule(specs):
    q, k, cos, sin = specs
    qp, cp = [], []
    for p in q.placements:  # batch, heads and sequence shards stay; the head dim must be whole
        keep = isinstance(p, Shard) and p.dim in (0, 1, 2)
        qp.append(p if keep else Replicate())
        cp.append(Shard(0) if keep and p.dim == 0 else Shard(1) if keep and p.dim == 2 else Replicate())
    in_specs = (q.with_placements(qp), k.with_placements(qp), cos.with_placements(cp), sin.with_placements(cp))
    dtype = torch.promote_types(q.dtype, cos.dtype)
    return OpPlan(in_specs, (spec_like(in_specs[0], dtype=dtype), spec_like(in_specs[1], dtype=dtype)),
                  _rotary_kernel, {}, multi_output=True)


# ------------------------------------------------------------------------------------------------
# rules: placements follow the cache's (k's): Shard(0) batch, Shard(1) kv heads, Shard(2) slots


def _roles(k: DTensorSpec) -> list:
    """Per mesh dim, what the cache splits there: "batch", "heads", "slots" or None."""
    return [{0: "batch", 1: "heads", 2: "slots"}.get(p.dim) if isinstance(p, Shard) else None for p in k.placements]


def _slot_devices(k: DTensorSpec) -> int:
    """How many blocks of slots the cache is cut into (the product of the slot-splitting mesh dims)."""
    n = 1
    for role, size in zip(_roles(k), k.mesh.shape):
        n *= size if role == "slots" else 1
    return n


def _attend_rule(specs, scale: float, parts: bool, heads: int):
    """q [B, L, nh * d] (a projection's output: heads over the cache's head dims in its last dim), cos/sin
    [B, L, d], the cache's keys/values [B, hk, slots, d] and the mask [B, 1, L, slots] (slots like the cache)."""
    q, k, v, mask, cos, sin = specs
    mesh = q.mesh
    roles = _roles(k)
    qp = [Shard(0) if r == "batch" else Shard(2) if r == "heads" else Replicate() for r in roles]
    rp = [Shard(0) if r == "batch" else Replicate() for r in roles]
    mp = [Shard(0) if r == "batch" else Shard(3) if r == "slots" else Replicate() for r in roles]
    in_specs = (q.with_placements(qp), k, v.with_placements(k.placements), mask.with_placements(mp),
                cos.with_placements(rp), sin.with_placements(rp))
    n, length, width = q.shape
    dv = v.shape[-1]
    kw = {"scale": scale, "parts": parts, "out_dtype": q.dtype}
    if not parts:
        return OpPlan(in_specs, (DTensorSpec(mesh, tuple(qp), (n, length, heads * dv), q.dtype),), _attend_kernel, kw)
    pp = tuple(Shard(1) if r == "batch" else Shard(2) if r == "heads" else Shard(0) if r == "slots" else Replicate()
               for r in roles)
    acc = torch.promote_types(q.dtype, torch.float32)
    blocks = _slot_devices(k)
    outs = (DTensorSpec(mesh, pp, (blocks, n, heads, length, dv), acc), DTensorSpec(mesh, pp, (blocks, n, heads, length), acc))
    return OpPlan(in_specs, outs, _attend_kernel, kw, multi_output=True)


def _combine_rule(specs, out_dtype: torch.dtype):
    out, lse = specs
    # the parts of every cp device on each device (an all_gather of the new tokens' outputs, not the cache)
    pl = tuple(Replicate() if isinstance(p, Shard) and p.dim == 0 else p for p in out.placements)
    res = tuple(Replicate() if isinstance(p, Replicate) else Shard(p.dim - 1) for p in pl)
    _, n, nh, length, dv = out.shape
    res = tuple(Shard(2) if p == Shard(1) else p for p in res)  # [B, nh, L, d] -> [B, L, nh * d]: heads last
    return OpPlan((out.with_placements(pl), lse.with_placements(pl)),
                  (DTensorSpec(out.mesh, res, (n, length, nh * dv), out_dtype),), _combine_kernel,
                  {"out_dtype": out_dtype})


def _last_row_rule(specs):
    (x,) = specs
    seq = x.ndim - 2
    holds = np.zeros(x.mesh.shape, dtype=np.int64)
    for c in x.mesh.coordinates():
        off, n = x.local_box(c)[seq]
        holds[c] = int(n > 0 and off + n == x.shape[seq])
    pl = tuple(Partial() if isinstance(p, Shard) and p.dim == seq else p for p in x.placements)
    shape = x.shape[:seq] + (1,) + x.shape[seq + 1:]
    if holds.min() == holds.max():
        return OpPlan((x,), (DTensorSpec(x.mesh, pl, shape, x.dtype),), _last_row_kernel, {"holds": int(holds.flat[0])})
    return OpPlan((x,), (DTensorSpec(x.mesh, pl, shape, x.dtype),), _last_row_kernel, {}, {"holds": holds})


def last_position(h):
    """``h[:, -1:]`` of ``[B, S, H]`` without gathering the sequence: the device holding the last position
    gives it, the others zeros, summed over the sequence's mesh dims (an all_reduce of ``[B, 1, H]``)."""
    if not any(isinstance(p, Shard) and p.dim == 1 for p in h.placements):
        return h.narrow(1, h.shape[1] - 1, 1)
    out = dispatch("kv_cache.last_row", _last_row_rule, (h,))
    return out.redistribute(h.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in out.placements])


# ------------------------------------------------------------------------------------------------
# entry points (models/kv_cache.py)


def write_cache(target, new, rope=(), *, projected: bool = False, kwargs: dict, device_args=None) -> None:
    """``new`` (keys or values; a decode step's projection when ``projected``, rotated by ``rope`` = (cos, sin)
    when given) written into the cache tensor ``target``'s slots in place (``kv_cache.write``)."""
    write_local("kv_cache.write", _write_kernel, target, [new, *rope],
                capture.live(_projected, kwargs) if projected else kwargs, device_args)


def _projected(kwargs: dict) -> dict:
    """The write's kwargs for a projection's keys or values (recomputed by a replay: the slots are live)."""
    return dict(kwargs, projected=True)


def grow_cache(t, spec: DTensorSpec, slots: int):
    """The cache tensor ``t`` with each device's block of slots extended to ``slots`` (``spec``: the result's)."""
    return local_map("kv_cache.grow", _grow_kernel, [t], [spec], {"slots": slots})[0]


def attend_cached(q, k, v, mask, cos, sin, scale: float, heads: int):
    """The new tokens' attention over the cache (q: the projection's output [B, L, nh * d], rotated here) ->
    [B, L, nh * d] ready for o_proj; the devices' partials merged when the slots are split over devices."""
    ins = (q, k, v, mask, cos, sin)
    if _slot_devices(k._spec) == 1:
        return dispatch("kv_cache.attend", _attend_rule, ins, (scale, False, heads))
    out, lse = dispatch("kv_cache.attend", _attend_rule, ins, (scale, True, heads))
    return dispatch("kv_cache.combine", _combine_rule, (out, lse), (q.dtype,))


def rotate(q, k, cos, sin):
    """q, k [B, H, S, d] rotated by each row's positions (cos/sin [B, S, d]): one op."""
    return dispatch("kv_cache.rotary", _rotary_rule, (q, k, cos, sin))
