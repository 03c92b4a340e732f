"""The Llama's KV cache: preallocated dtorch tensors written in place, laid out like the attention.

Per decoder layer, keys and values ``[batch, kv_heads, slots, head_dim]`` on the layer's pipeline stage:

    dp          Shard(0)  each dp device keeps the rows of its part of the batch
    tp          Shard(1)  each tp device keeps the kv heads its query heads use
    ulysess_cp,
    ring_cp     Shard(2)  each cp device keeps a block of slots (nested, mesh-dim order, outer to inner)

Slots are not positions. Attention is a sum over keys, so a key may sit in any slot as long as the mask
knows which token it holds: the controller keeps the slot table (the order index of the token in each
slot, and for each batch row whether it is a real token or padding) and sends the mask each step. So
every cp block fills its own slots from the front:

- prefill (nothing cached yet): the prompt is laid out by sequence over cp (the model's usual layout,
  ring or Ulysses attention over the prompt itself); device ``r`` writes its chunk of keys and values
  into the first slots of its own block. Nothing moves.
- decode (anything cached): the new tokens are replicated over cp; each goes to the block with the most
  free slots, so the blocks stay within one slot of each other. Each cp device attends the query to its
  block alone (``kv_cache.attend``: a partial output and its log-sum-exp) and the partials are merged by
  their log-sum-exp (``kv_cache.combine``, flash-decoding): what crosses devices is the partial outputs
  of the new tokens, never the cache.

The shapes are static (the slot count is fixed; the mask has the slot count as its last dim), so every
decode step runs the plans of the step before. The cache grows (a new slot count, copied locally) only
when a forward with ``use_cache`` outgrows it; ``generate`` sizes it once for prompt + new tokens.
"""
from __future__ import annotations

import numpy as np
import torch

import dtorch

from ..errors import DTorchError
from ..mesh import DeviceMesh
from ..ops.attention import _plain as plain_attention
from ..ops.dispatch import OpPlan, dispatch
from ..ops.rules import spec_like
from ..placement import Partial, Replicate, Shard
from ..redistribute.executor import ring_shift
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .llama import activation_placements

CP_DIMS = ("ulysess_cp", "ulysses_cp", "ring_cp")
BATCH_DIMS = ("dp", "fsdp")  # mesh dims that split the batch


class KVCacheError(DTorchError, ValueError):
    """The cache cannot take this forward (another batch size, full, another model)."""


# ------------------------------------------------------------------------------------------------
# layouts, by mesh dim name


def cache_placements(mesh: DeviceMesh) -> tuple:
    """[B, kv_heads, slots, d]: batch over dp, kv heads over tp, slots over the cp dims."""
    out = []
    for name in mesh.dim_names or [None] * mesh.ndim:
        out.append(Shard(0) if name in BATCH_DIMS else Shard(1) if name == "tp" else Shard(2) if name in CP_DIMS
                   else Replicate())
    return tuple(out)


def decode_placements(mesh: DeviceMesh, ndim: int = 2) -> list:
    """Activations of a decode step: batch over dp, replicated everywhere else (the cp devices each hold
    their block of the cache, not of the new tokens)."""
    names = mesh.dim_names or [None] * mesh.ndim
    return [Shard(0) if name in BATCH_DIMS and ndim else Replicate() for name in names]


def cp_size(mesh: DeviceMesh) -> int:
    n = 1
    for name, size in zip(mesh.dim_names or (), mesh.shape):
        n *= size if name in CP_DIMS else 1
    return n


# ------------------------------------------------------------------------------------------------
# kernels (leading grid dims allowed: ``lead``)


def _heads_first(x, heads: int):
    """A projection's output [.., B, L, heads * d] as [.., B, heads, L, d] (a view where it can be)."""
    return x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads)).transpose(-3, -2)


def _rotate(x, cos, sin):
    """Hugging Face's apply_rotary_pos_emb on [.., B, H, L, d] with cos/sin [.., B, L, d]."""
    cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


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
        if count:
            cache[..., dst:dst + count, :] = new[..., src:src + count, :]
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
    ``i // (nh / hk)`` (grouped-query attention without copying the cache)."""
    q = _rotate(_heads_first(q, q.shape[-1] // k.shape[-1]), cos, sin)  # (this device's heads) [.., B, nh, L, d]
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


def _merge_into(out, lse, o2, l2):
    total = torch.logaddexp(lse, l2)
    safe = torch.where(torch.isfinite(total), total, 0.0)
    return out * torch.exp(lse - safe).unsqueeze(-1) + o2 * torch.exp(l2 - safe).unsqueeze(-1), total


@kernel("kv_cache.causal_ring_step")
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
            out, lse = _merge_into(out, lse, *_flash(q, k, v, False, scale))
    else:
        out, lse = (t.clone() for t in acc)
        n = ring - step
        part = [t.narrow(axis, step, n) for t in (q, k, v)]
        o2, l2 = _flash_lead(*part, False, scale, lead)
        mo, ml = _merge_into(out.narrow(axis, step, n), lse.narrow(axis, step, n), o2, l2)
        out.narrow(axis, step, n).copy_(mo)
        lse.narrow(axis, step, n).copy_(ml)
    return (out.to(out_dtype), lse) if out_dtype is not None else (out, lse)


def causal_ring_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor | None:
    """Causal attention of q/k/v [B, H, S, d] split evenly over ``ring_cp`` (the only cp dim), as ring
    attention that skips the blocks causality hides (half the work of computing every block pair) and runs
    torch's fused kernel on each block. None when the layout is another (the caller uses the general
    op): Ulysses too, an uneven split, another placement."""
    mesh = q.device_mesh
    names = mesh.dim_names or ()
    cps = [i for i, n in enumerate(names) if n in CP_DIMS and mesh.shape[i] > 1]
    if len(cps) != 1 or names[cps[0]] != "ring_cp" or q.shape[2] % mesh.shape[cps[0]]:
        return None
    axis, ring = cps[0], mesh.shape[cps[0]]
    want = tuple(Shard(0) if n in BATCH_DIMS else Shard(1) if n == "tp" else Shard(2) if i == axis else Replicate()
                 for i, n in enumerate(names))
    if any(tuple(t.placements) != want for t in (q, k, v)):
        return None
    rt, graph = q._graph.runtime, q._graph
    acc = torch.promote_types(q.dtype, torch.float32)
    o_spec = DTensorSpec(mesh, want, q.shape[:-1] + (v.shape[-1],), acc)
    l_spec = DTensorSpec(mesh, want, q.shape[:-1], acc)
    ranks = np.zeros(mesh.shape, dtype=np.int64)
    for c in mesh.coordinates():
        ranks[c] = c[axis]
    kh, vh, state = k._h, v._h, []
    for st in range(ring):
        last = st == ring - 1
        outs = [spec_like(o_spec, dtype=q.dtype) if last else o_spec, l_spec]
        kw = {"scale": scale, "step": st, "axis": axis, "ring": ring, "out_dtype": q.dtype if last else None}
        state = rt.run_local(_causal_ring_kernel, [q._h, kh, vh] + state,
                             [q._spec, k._spec, v._spec] + ([o_spec, l_spec] if st else []), outs, kw,
                             {"rank": ranks})
        if not last:  # pass K/V on: device r now holds block r - st - 1
            kh = ring_shift(rt, kh, k._spec, axis, 1)
            vh = ring_shift(rt, vh, v._spec, axis, 1)
    return Tensor._make(spec_like(o_spec, dtype=q.dtype), state[0], graph)


@kernel("kv_cache.rotary")
def _rotary_kernel(q, k, cos, sin):
    """Hugging Face's ``apply_rotary_pos_emb`` on q/k [B, H, S, d] with each row's cos/sin [B, S, d], the
    same float operations in the same order, as one kernel (instead of a dozen element-wise ops)."""
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
# rules


def _attend_rule(specs, scale: float, parts: bool, heads: int):
    """q [B, L, nh * d] (a projection's output: heads over tp in its last dim), cos/sin [B, L, d]."""
    q, k, v, mask, cos, sin = specs
    mesh = q.mesh
    names = mesh.dim_names or [None] * mesh.ndim
    qp = [Shard(0) if n in BATCH_DIMS else Shard(2) if n == "tp" else Replicate() for n in names]
    rp = [Shard(0) if n in BATCH_DIMS else Replicate() for n in names]
    kp = cache_placements(mesh)
    mp = [Shard(0) if n in BATCH_DIMS else Shard(3) if n in CP_DIMS else Replicate() for n in names]
    in_specs = (q.with_placements(qp), k.with_placements(kp), v.with_placements(kp), mask.with_placements(mp),
                cos.with_placements(rp), sin.with_placements(rp))
    n, length, width = q.shape
    dv = v.shape[-1]
    kw = {"scale": scale, "parts": parts, "out_dtype": q.dtype}
    if not parts:
        return OpPlan(in_specs, (DTensorSpec(mesh, tuple(qp), (n, length, heads * dv), q.dtype),), _attend_kernel, kw)
    pp = tuple(Shard(1) if n_ in BATCH_DIMS else Shard(2) if n_ == "tp" else Shard(0) if n_ in CP_DIMS
               else Replicate() for n_ in names)
    acc = torch.promote_types(q.dtype, torch.float32)
    outs = (DTensorSpec(mesh, pp, (cp_size(mesh), n, heads, length, dv), acc),
            DTensorSpec(mesh, pp, (cp_size(mesh), n, heads, length), acc))
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


def last_position(h: Tensor) -> Tensor:
    """``h[:, -1:]`` of ``[B, S, H]`` without gathering the sequence: the device holding the last position
    gives it, the others zeros, summed over the sequence's mesh dims (an all_reduce of ``[B, 1, H]``)."""
    if not any(isinstance(p, Shard) and p.dim == 1 for p in h.placements):
        return h.narrow(1, h.shape[1] - 1, 1)
    out = dispatch("kv_cache.last_row", _last_row_rule, (h,))
    return out.redistribute(h.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in out.placements])


# ------------------------------------------------------------------------------------------------
# the cache


def _llama_model(model):
    inner = getattr(model, "model", model)
    if not hasattr(inner, "stage_meshes") or not hasattr(inner, "layers"):
        raise KVCacheError(f"KVCache needs a dtorch Llama (LlamaForCausalLM or LlamaModel), got {type(model).__name__}")
    return inner


class KVCache:
    """Keys and values of every decoder layer, preallocated for ``batch_size`` rows and ``max_length`` tokens.

    ``KVCache(model, batch_size, max_length)`` holds ``key_cache[i]`` / ``value_cache[i]`` (dtorch tensors
    ``[batch, kv_heads, slots, head_dim]``, see the module doc for their layout) on layer ``i``'s pipeline
    stage. Pass it as ``past_key_values=`` to the model's forward (which fills it) or let ``generate`` make
    one. ``get_seq_length()`` is the number of tokens cached (Hugging Face's); ``memory_per_device()`` the
    bytes each device holds for it.
    """

    def __init__(self, model, batch_size: int, max_length: int, *, dtype: torch.dtype | None = None):
        llama = _llama_model(model)
        if not (isinstance(batch_size, int) and batch_size >= 1 and isinstance(max_length, int) and max_length >= 1):
            raise KVCacheError(f"KVCache needs batch_size >= 1 and max_length >= 1 (ints), got {batch_size!r} and "
                               f"{max_length!r}")
        self._model = llama
        self.batch_size = batch_size
        self.layer_meshes = [llama.stage_meshes[s] for s in llama.layer_stages]
        self.cp = cp_size(llama.stage_meshes[0])
        attn = llama.layers[0].self_attn
        self.kv_heads, self.head_dim = attn.kv_heads_held, attn.head_dim
        self.dtype = dtype or attn.k_proj.weight.dtype
        self.block = -(-max_length // self.cp)  # slots per cp block
        self.key_cache = [self._empty(mesh) for mesh in self.layer_meshes]
        self.value_cache = [self._empty(mesh) for mesh in self.layer_meshes]
        # the slot table (controller side): the order index of the token in each slot (-1: free) and,
        # per batch row, whether that token is a real one (padding and free slots are never attended)
        self.order = torch.full((self.slots,), -1, dtype=torch.int64)
        self.valid = torch.zeros(batch_size, self.slots, dtype=torch.bool)
        self.fill = [0] * self.cp  # used slots per cp block
        self._seen = 0  # tokens the caller gave (Hugging Face's sequence length)
        self._next = 0  # order index of the next token (with the padding added for an even cp split)
        self._recorded = False  # a forward that recorded gradients wrote into it (models/forward.py)

    @property
    def slots(self) -> int:
        return self.block * self.cp

    @property
    def max_length(self) -> int:
        """Tokens the cache can hold without growing (a prompt under cp may use up to cp - 1 more for padding)."""
        return self.slots

    def _empty(self, mesh: DeviceMesh) -> Tensor:
        shape = (self.batch_size, self.kv_heads, self.slots, self.head_dim)
        return Tensor(torch.zeros(shape, dtype=self.dtype), device_mesh=mesh, placements=cache_placements(mesh))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def __len__(self) -> int:
        return len(self.key_cache)

    def memory_per_device(self) -> dict:
        """``{(device_type, device id): bytes}`` the keys and values take on each device."""
        out: dict = {}
        for t in self.key_cache + self.value_cache:
            mesh = t.device_mesh
            for dev, b in zip(mesh.device_ids, t._spec.device_bytes()):
                key = (mesh.device_type, dev)
                out[key] = out.get(key, 0) + int(b)
        return dict(sorted(out.items()))

    def ideal_bytes(self) -> int:
        """Bytes of every layer's keys and values for the tokens the cache was sized for, on one device."""
        return 2 * len(self.key_cache) * self.batch_size * self.kv_heads * self.slots * self.head_dim \
            * self.dtype.itemsize

    # -- the slot table ---------------------------------------------------------------------------
    def _device_blocks(self, mesh: DeviceMesh) -> np.ndarray:
        """Per device (mesh shape): the index of its cp block of slots."""
        spec = self.key_cache[0]._spec
        out = np.zeros(mesh.shape, dtype=np.int64)
        for c in mesh.coordinates():
            out[c] = spec.local_box(c)[2][0] // self.block
        return out

    def _take_one_block(self, n: int, valid: torch.Tensor) -> tuple:
        """``_take`` without cp: the tokens go to the next slots, the same on every device."""
        slots = torch.arange(self.fill[0], self.fill[0] + n)
        order = torch.arange(self._next, self._next + n)
        self.order[slots] = order
        self.valid[:, slots] = valid
        args = {"src": 0, "dst": self.fill[0], "count": n}
        self.fill[0] += n
        self._next += n
        return (args, None), order

    def _grow(self, block: int) -> None:
        """More slots per cp block (a new shape: plans are made again once); tokens keep their blocks."""
        old = self.block
        for caches in (self.key_cache, self.value_cache):
            for i, t in enumerate(caches):
                spec = spec_like(t._spec, shape=t.shape[:2] + (block * self.cp,) + t.shape[3:])
                h = t._graph.runtime.run_local(_grow_kernel, [t._h], [t._spec], [spec], {"slots": block}, None)
                caches[i] = Tensor._make(spec, h[0], t._graph)
        idx = torch.arange(self.cp * old)
        new = (idx // old) * block + idx % old
        order = torch.full((self.cp * block,), -1, dtype=torch.int64)
        valid = torch.zeros(self.batch_size, self.cp * block, dtype=torch.bool)
        order[new], valid[:, new] = self.order, self.valid
        self.order, self.valid, self.block = order, valid, block

    def _take(self, n: int, valid: torch.Tensor, sharded: bool, grow: bool) -> tuple:
        """Slots for ``n`` new tokens (``valid`` [B, n]: real or padding): returns (write arguments, their
        order indices). ``sharded``: the tokens arrive split over cp like the prompt (each device's chunk goes
        to its own block), else replicated (each goes to the block with the most free slots)."""
        if self.cp == 1 and self.fill[0] + n <= self.block:
            return self._take_one_block(n, valid)
        mesh = self.layer_meshes[0]
        blocks = self._device_blocks(mesh)
        if sharded:
            probe = DTensorSpec(mesh, cache_placements(mesh), (self.batch_size, self.kv_heads, n, self.head_dim),
                                self.dtype)
            runs = [None] * self.cp  # block -> (first token, count)
            for c in mesh.coordinates():
                runs[int(blocks[c])] = probe.local_box(c)[2]
        else:
            counts = [0] * self.cp
            for _ in range(n):  # water filling: the least used block first (ties: the first)
                b = min(range(self.cp), key=lambda j: (self.fill[j] + counts[j], j))
                counts[b] += 1
            starts = np.cumsum([0] + counts[:-1])
            runs = [(int(s), c) for s, c in zip(starts, counts)]
        need = max(self.fill[b] + runs[b][1] for b in range(self.cp))
        if need > self.block:
            if not grow:
                raise KVCacheError(f"the KV cache is full: {self._seen} tokens cached, {self.slots} slots "
                                   f"({self.block} per cp block), {n} more do not fit; make it with a larger "
                                   "max_length")
            self._grow(max(need, 2 * self.block))
        order = torch.arange(self._next, self._next + n)
        for b, (first, count) in enumerate(runs):
            slots = b * self.block + self.fill[b] + torch.arange(count)
            self.order[slots] = order[first:first + count]
            self.valid[:, slots] = valid[:, first:first + count]
        src = np.zeros(mesh.shape, dtype=np.int64)
        dst, cnt = np.zeros_like(src), np.zeros_like(src)
        for c in mesh.coordinates():
            b = int(blocks[c])
            first, count = runs[b]
            src[c] = 0 if sharded else first
            dst[c], cnt[c] = self.fill[b], count
        for b in range(self.cp):
            self.fill[b] += runs[b][1]
        self._next += n
        args = {"src": src, "dst": dst, "count": cnt}
        if all(a.min() == a.max() for a in args.values()):  # the same on every device: plain arguments
            return ({k: int(a.flat[0]) for k, a in args.items()}, None), order
        return ({}, args), order

    def _mask(self, q_order: torch.Tensor) -> torch.Tensor:
        """[B, 1, L, slots]: the slots each new token (order ``q_order`` [L]) attends."""
        seen = (self.order[None, :] <= q_order[:, None]) & (self.order[None, :] >= 0)  # [L, slots]
        return (self.valid[:, None, :] & seen[None]).unsqueeze(1)

    # -- per layer ---------------------------------------------------------------------------------
    def _write(self, layer_idx: int, k: Tensor, v: Tensor, args) -> None:
        kwargs, device_args = args
        for caches, new in ((self.key_cache, k), (self.value_cache, v)):
            target = caches[layer_idx]
            rt = target._graph.runtime
            h = rt.write(_write_kernel, target._h, target._spec, [new._h], [new._spec], kwargs, device_args)
            target._written(h)

    def _write_projected(self, layer_idx: int, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, args) -> None:
        kwargs, device_args = args
        kwargs = dict(kwargs, projected=True)
        for caches, new, rope in ((self.key_cache, k, (cos, sin)), (self.value_cache, v, ())):
            target = caches[layer_idx]
            ins = [new, *rope]
            h = target._graph.runtime.write(_write_kernel, target._h, target._spec, [t._h for t in ins],
                                            [t._spec for t in ins], kwargs, device_args)
            target._written(h)

    def _attend_projected(self, layer_idx: int, q: Tensor, mask: Tensor, cos: Tensor, sin: Tensor, scale: float,
                          heads: int) -> Tensor:
        k, v = self.key_cache[layer_idx], self.value_cache[layer_idx]
        ins = (q, k, v, mask, cos, sin)
        if self.cp == 1:
            return dispatch("kv_cache.attend", _attend_rule, ins, (scale, False, heads))
        out, lse = dispatch("kv_cache.attend", _attend_rule, ins, (scale, True, heads))
        return dispatch("kv_cache.combine", _combine_rule, (out, lse), (q.dtype,))

    def __repr__(self):
        return (f"KVCache({len(self)} layers, batch {self.batch_size}, {self.slots} slots over cp {self.cp}, "
                f"{self.kv_heads} kv heads x {self.head_dim}, {self._seen} tokens cached)")


class CachedForward:
    """One forward with padding, given positions and/or a KV cache: what the model's layers ask of it.

    ``ids`` [B, S] (torch), ``valid`` [B, S] bool (False: padding), ``positions`` [B, S] (rope),
    ``cache`` a KVCache or None, ``grow`` whether the cache may grow. ``segments`` [B, S] (or None): the
    sequence each token belongs to when several are packed in a row (Hugging Face's packed position ids): a
    token attends only earlier tokens of its own sequence. Under cp a prefill's sequence is left-padded to
    a multiple of the cp size (masked keys: nothing changes for the real tokens); ``self.pad`` columns were
    added in front. ``recording``: the forward records autograd history, so a decode step attends with
    differentiable ops (``attention``) rather than the fused decode kernels.
    """

    def __init__(self, model, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache | None, grow: bool = False, segments: torch.Tensor | None = None,
                 recording: bool = False):
        llama = _llama_model(model)
        self.model = llama
        self.cache = cache
        self.recording = recording
        self.decode = cache is not None and cache._next > 0
        self.fused = self.decode and not recording  # a decode step on the fused kernels (decode_attention)
        b, s = ids.shape
        cp = cp_size(llama.stage_meshes[0])
        self.pad = 0 if self.decode else -s % cp
        if self.pad:
            ids = torch.cat([ids.new_zeros(b, self.pad), ids], dim=1)
            valid = torch.cat([valid.new_zeros(b, self.pad), valid], dim=1)
            positions = torch.cat([positions.new_zeros(b, self.pad), positions], dim=1)
            if segments is not None:
                segments = torch.cat([segments.new_full((b, self.pad), -1), segments], dim=1)
        self.ids, self.valid, self.positions = ids, valid, positions
        self.seq_len = int(positions.max()) + 1 if positions.numel() else 1  # for the length-dependent rope types
        self._per_mesh: dict = {}
        self._table = None
        self.write_args = None
        if cache is not None:
            if cache.batch_size != b:
                raise KVCacheError(f"the KV cache holds {cache.batch_size} rows; this forward has {b}")
            self.write_args, order = cache._take(ids.shape[1], valid, sharded=not self.decode, grow=grow)
            cache._seen += s
            if self.decode:
                self.mask_full = cache._mask(order)
                if recording:  # [B, 1, L, slots + L]: the cached tokens, then the new ones (causal)
                    cached = self.mask_full & ~torch.isin(cache.order, order)
                    own = valid[:, None, None, :] & torch.ones(s, s, dtype=torch.bool).tril()
                    self.mask_full = torch.cat([cached, own], dim=-1)
        self.all_valid = bool(valid.all()) and segments is None  # the plain causal mask serves
        if not self.decode and not self.all_valid:
            causal = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()
            self.mask_full = valid[:, None, None, :] & causal[None, None]
            if segments is not None:
                self.mask_full = self.mask_full & (segments[:, None, :, None] == segments[:, None, None, :])

    def placements(self, mesh: DeviceMesh, ndim: int = 2) -> list:
        if self.decode:
            return decode_placements(mesh, ndim)
        return activation_placements(mesh, 0 if ndim else None, 1)

    def input_ids(self, mesh: DeviceMesh) -> Tensor:
        return Tensor(self.ids, device_mesh=mesh, placements=self.placements(mesh))

    def _on(self, mesh: DeviceMesh, name: str, make):
        key = (mesh, name)
        if key not in self._per_mesh:
            self._per_mesh[key] = make()
        return self._per_mesh[key]

    def rope(self, rotary, mesh: DeviceMesh, dtype: torch.dtype):
        """cos, sin [B, S, d] at each token's own position, on ``mesh``.

        Computed here on the controller (a few KB for a decode step) with the rotary module's float32
        frequencies and the float operations of its forward, and sent: no device runs a dozen tiny ops
        per stage and step for a table every device of a row needs whole."""
        def make():
            cos, sin = self._rope_table(rotary)
            pl = self.placements(mesh)
            return (Tensor(cos.to(dtype), device_mesh=mesh, placements=pl),
                    Tensor(sin.to(dtype), device_mesh=mesh, placements=pl))

        return self._on(mesh, ("rope", dtype), make)

    def _rope_table(self, rotary):
        if self._table is None:
            if "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
                rotary._update(self.seq_len)  # (Hugging Face's dynamic_rope_update for these positions)
            freqs = self.positions.float().unsqueeze(-1) * rotary._in_use  # the torch copy of inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if rotary.attention_scaling != 1.0:
                cos, sin = cos * rotary.attention_scaling, sin * rotary.attention_scaling
            self._table = (cos, sin)
        return self._table

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
        """q, k rotated by each row's positions (cos/sin [B, S, d] from ``rope``): one op."""
        return dispatch("kv_cache.rotary", _rotary_rule, (q, k, cos, sin))

    def _mask(self, mesh: DeviceMesh) -> Tensor:
        def make():
            if self.decode:  # [B, 1, L, slots]: slots over cp like the cache's
                pl = [Shard(0) if n in BATCH_DIMS else Shard(3) if n in CP_DIMS else Replicate()
                      for n in mesh.dim_names or [None] * mesh.ndim]
            else:  # [B, 1, S, S] for the prompt's own attention
                pl = [Shard(0) if n in BATCH_DIMS else Replicate() for n in mesh.dim_names or [None] * mesh.ndim]
            return Tensor(self.mask_full, device_mesh=mesh, placements=pl)

        return self._on(mesh, "mask", make)

    def decode_attention(self, attn, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """A decode step's attention from the projections' outputs q/k/v [B, L, heads * d] (laid out as
        they come: heads over tp in the last dim): k rotated and written into the cache and v written (one
        in-place kernel each), q rotated and attended (one op, plus the cp merge), the output [B, L, nh * d]
        ready for o_proj. The same arithmetic as ``attention`` without its dozen view and element-wise ops."""
        mesh = q.device_mesh
        want = [Shard(0) if n in BATCH_DIMS else Shard(2) if n == "tp" else Replicate()
                for n in mesh.dim_names or [None] * mesh.ndim]
        q, k, v = (t if t.placements == want else t.redistribute(mesh, want) for t in (q, k, v))
        self.cache._write_projected(attn.layer_idx, k, v, cos, sin, self.write_args)
        return self.cache._attend_projected(attn.layer_idx, q, self._mask(q.device_mesh), cos, sin, attn.scaling,
                                            attn.num_heads)

    def attention(self, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The attention of layer ``attn`` over the tokens of this forward (a prefill, a forward without a
        cache, or a decode step that records gradients): q/k/v [B, heads, S, d], rotated, with the padding
        mask; the keys and values go into the cache."""
        from ..nn import functional as F

        if self.fused:
            raise AssertionError("a decode step's attention is decode_attention (the model calls it)")
        gqa = attn.kv_heads_held != attn.num_heads
        if self.decode:
            # the cached keys and values are constants (a copy: the cache is written in place), the new
            # tokens' own ones take part in the gradient
            with torch.no_grad():
                cached_k = self.cache.key_cache[attn.layer_idx].clone()
                cached_v = self.cache.value_cache[attn.layer_idx].clone()
            keys, values = dtorch.cat([cached_k, k], dim=2), dtorch.cat([cached_v, v], dim=2)
            # not context parallel: the new tokens are whole on every cp device (the attention op's plain rule)
            o = plain_attention(q, keys, values, self._recording_mask(q.device_mesh), None, False, attn.scaling, gqa)
        elif self.all_valid:
            o = causal_ring_attention(q, k, v, attn.scaling) if self.cache is not None and not self.recording else None
            if o is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(q.device_mesh), scale=attn.scaling,
                                               enable_gqa=gqa)
        if self.cache is not None:
            self.cache._write(attn.layer_idx, k, v, self.write_args)
        return o

    def _recording_mask(self, mesh: DeviceMesh) -> Tensor:
        def make():  # [B, 1, L, slots + L], batch over dp
            pl = [Shard(0) if n in BATCH_DIMS else Replicate() for n in mesh.dim_names or [None] * mesh.ndim]
            return Tensor(self.mask_full, device_mesh=mesh, placements=pl)

        return self._on(mesh, "recording mask", make)


__all__ = ["BATCH_DIMS", "KVCache", "KVCacheError", "CachedForward", "cache_placements", "decode_placements", "last_position"]
