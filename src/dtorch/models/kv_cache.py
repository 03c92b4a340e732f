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

from .. import capture
from ..errors import DTorchError
from ..mesh import DeviceMesh
from ..nn import functional as F
from ..ops.attention.decode import attend_cached, grow_cache, rotate, signed_sin, write_cache
from ..ops.rules import spec_like
from ..spec import DTensorSpec
from ..tensor import Tensor
from .layout import (activation_placements, cache_placements, context_parallel, cp_size, decode_placements,
                     heads_last_placements, mask_placements)


class KVCacheError(DTorchError, ValueError):
    """The cache cannot take this forward (another batch size, full, another model)."""


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

    def reset(self) -> None:
        """Forget every cached token, for a new batch of prompts of the same size (``generate`` keeps its cache
        between calls): the keys and values are zeroed in place (the tensors stay, so a replayed decode step bound
        to them still holds), the slot table emptied: the cache is then a new one's bit for bit."""
        with torch.no_grad():
            for t in self.key_cache + self.value_cache:
                t.zero_()
        self.order.fill_(-1)
        self.valid.zero_()
        self.fill = [0] * self.cp
        self._seen = self._next = 0
        self._recorded = False
        self._growable = False

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
                caches[i] = grow_cache(t, spec, block)
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

    def _mask(self, q_order: torch.Tensor, attended: int | None = None) -> torch.Tensor:
        """[B, 1, L, slots]: the slots each new token (order ``q_order`` [L]) attends; [B, 1, L, attended]: the
        first ``attended`` slots only (``attended_slots``)."""
        order = self.order if attended is None else self.order[:attended]
        seen = (order[None, :] <= q_order[:, None]) & (order[None, :] >= 0)  # [L, slots]
        valid = self.valid if attended is None else self.valid[:, :attended]
        return (valid[:, None, :] & seen[None]).unsqueeze(1)

    def attended_slots(self, n: int) -> int | None:
        """How many slots, from the first, a decode step of ``n`` new tokens attends (its mask's last dim), or None
        for all of them. Without cp the tokens fill the slots from the front, so the used ones (this step's
        included) rounded up suffice: a masked slot adds exact zeros, so the values are the same as over every
        slot, without the attention's work on the free ones (Hugging Face attends its cached tokens only). Each
        size is a decode trace of its own (the mask's shape): multiples of 16 up to 128, then 4 sizes per doubling
        (at most 25% of the attended slots free), so a cache of S slots makes ~8 + 4 log2(S / 128) of them."""
        if self.cp > 1:  # (every cp block fills from its own front: a prefix of the slots is not the used ones)
            return None
        used = self.fill[0] + n
        step = max(16, 1 << max(0, used.bit_length() - 3))
        return min(-(-used // step) * step, self.slots)

    # -- per layer ---------------------------------------------------------------------------------
    def _write(self, layer_idx: int, k: Tensor, v: Tensor, args) -> None:
        kwargs, device_args = args
        for caches, new in ((self.key_cache, k), (self.value_cache, v)):
            write_cache(caches[layer_idx], new, kwargs=kwargs, device_args=device_args)

    def _write_projected(self, layer_idx: int, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, args) -> None:
        kwargs, device_args = args
        for caches, new, rope in ((self.key_cache, k, (cos, sin)), (self.value_cache, v, ())):
            write_cache(caches[layer_idx], new, rope, projected=True, kwargs=kwargs, device_args=device_args)

    def _attend_projected(self, layer_idx: int, q: Tensor, mask: Tensor, cos: Tensor, sin: Tensor, scale: float,
                          heads: int) -> Tensor:
        return attend_cached(q, self.key_cache[layer_idx], self.value_cache[layer_idx], mask, cos, sin, scale, heads)

    def __repr__(self):
        return (f"KVCache({len(self)} layers, batch {self.batch_size}, {self.slots} slots over cp {self.cp}, "
                f"{self.kv_heads} kv heads x {self.head_dim}, {self._seen} tokens cached)")


def _take(cache: KVCache, n: int, valid: torch.Tensor, sharded: bool, grow: bool, seen: int) -> None:
    """Slots for ``n`` new tokens (``KVCache._take``), kept on the cache for ``_taken`` to read; ``seen`` more
    tokens given."""
    (kwargs, device_args), order = cache._take(n, valid, sharded=sharded, grow=grow)
    cache._taken = (kwargs, {} if device_args is None else device_args, order)
    cache._seen += seen


def _taken(cache: KVCache, i: int):
    """Part ``i`` of the last ``_take``: the write's kwargs, its per-device arguments ({} when none), the order."""
    return cache._taken[i]


class CachedForward:
    """One forward with padding, given positions and/or a KV cache: what the model's layers ask of it.

    ``ids`` [B, S] (torch), ``valid`` [B, S] bool (False: padding), ``positions`` [B, S] (rope),
    ``cache`` a KVCache or None, ``grow`` whether the cache may grow. ``segments`` [B, S] (or None): the
    sequence each token belongs to when several are packed in a row (Hugging Face's packed position ids): a
    token attends only earlier tokens of its own sequence. Under cp a prefill's sequence is left-padded to
    a multiple of the cp size (masked keys: nothing changes for the real tokens); ``self.pad`` columns were
    added in front. ``recording``: the forward records autograd history, so a decode step attends with
    differentiable ops (``attention``) rather than the fused decode kernels. ``attended``: a decode step's
    attention covers the first ``attended`` slots only (``KVCache.attended_slots``; None: all).
    """

    def __init__(self, model, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache | None, grow: bool = False, segments: torch.Tensor | None = None,
                 recording: bool = False, attended: int | None = None):
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
        self._per_mesh: dict = {}
        self._table = None
        self.write_args = None
        if cache is not None:
            if cache.batch_size != b:
                raise KVCacheError(f"the KV cache holds {cache.batch_size} rows; this forward has {b}")
            # the slot table is Python state: a step capture (dtorch.compile) runs the take again at each replay
            # and recomputes what the step reads of it (the write arguments, the mask) as live values
            capture.effect(_take, cache, ids.shape[1], valid, not self.decode, grow, s)
            # (without cp every device writes the same slots: no per-device arguments, none live, so that a replay
            # runs each write as one bare call)
            self.write_args = (capture.live(_taken, cache, 0), capture.live(_taken, cache, 1) if cache.cp > 1 else None)
            order = capture.live(_taken, cache, 2)
            if self.decode:
                self.mask_full = capture.live(cache._mask, order, None if recording else attended)
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

    def input_ids(self, mesh: DeviceMesh, input_ids=None) -> Tensor:
        """This forward's ids (padded for an even cp split: ``self.ids``) on ``mesh``."""
        return Tensor(self.ids, device_mesh=mesh, placements=self.placements(mesh))

    def _on(self, mesh: DeviceMesh, name: str, make):
        key = (mesh, name)
        if key not in self._per_mesh:
            self._per_mesh[key] = make()
        return self._per_mesh[key]

    def rope(self, rotary, mesh: DeviceMesh, dtype: torch.dtype, seq_len: int | None = None):
        """cos, sin [B, S, d] at each token's own position, on ``mesh``; sin with its first half negated
        (``signed_sin``: the kernels that take it, ops/attention/decode.py, fold rotate_half's sign into it).

        Computed here on the controller (a few KB for a decode step) with the rotary module's float32
        frequencies and the float operations of its forward, and sent: no device runs a dozen tiny ops
        per stage and step for a table every device of a row needs whole."""
        def make():
            cos, sin = self._rope_table(rotary)
            pl = self.placements(mesh)
            return (Tensor(cos.to(dtype), device_mesh=mesh, placements=pl),
                    Tensor(signed_sin(sin).to(dtype), device_mesh=mesh, placements=pl))

        return self._on(mesh, ("rope", dtype), make)

    def _rope_table(self, rotary):
        if self._table is None:
            if "dynamic" in rotary.rope_type or rotary.rope_type == "longrope":
                capture.refuse(f"the {rotary.rope_type} rope rescales with the sequence length (Python state)")
                seq_len = int(self.positions.max()) + 1 if self.positions.numel() else 1
                rotary._update(seq_len)  # (Hugging Face's dynamic_rope_update for these positions)
            freqs = self.positions.float().unsqueeze(-1) * rotary._in_use  # the torch copy of inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if rotary.attention_scaling != 1.0:
                cos, sin = cos * rotary.attention_scaling, sin * rotary.attention_scaling
            self._table = (cos, sin)
        return self._table

    def rotate(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor):
        """q, k rotated by each row's positions (cos/sin [B, S, d] from ``rope``): one op."""
        return rotate(q, k, cos, sin)

    def _mask(self, mesh: DeviceMesh) -> Tensor:
        def make():  # decode: [B, 1, L, slots], slots over cp like the cache's; else [B, 1, S, S], the prompt's own
            return Tensor(self.mask_full, device_mesh=mesh, placements=mask_placements(mesh, self.decode))

        return self._on(mesh, "mask", make)

    def decode_attention(self, attn, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """A decode step's attention from the projections' outputs q/k/v [B, L, heads * d] (laid out as
        they come: heads over tp in the last dim): k rotated and written into the cache and v written (one
        in-place kernel each), q rotated and attended (one op, plus the cp merge), the output [B, L, nh * d]
        ready for o_proj. The same arithmetic as ``attention`` without its dozen view and element-wise ops."""
        mesh = q.device_mesh
        want = heads_last_placements(mesh)
        q, k, v = (t if t.placements == want else t.redistribute(mesh, want) for t in (q, k, v))
        self.cache._write_projected(attn.layer_idx, k, v, cos, sin, self.write_args)
        return self.cache._attend_projected(attn.layer_idx, q, self._mask(q.device_mesh), cos, sin, attn.scaling,
                                            attn.num_heads)

    def attention(self, attn, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """The attention of layer ``attn`` over the tokens of this forward (a prefill, a forward without a
        cache, or a decode step that records gradients): q/k/v [B, heads, S, d], rotated, with the padding
        mask; the keys and values go into the cache."""
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
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=self._recording_mask(q.device_mesh),
                                               scale=attn.scaling, enable_gqa=gqa)
        elif self.all_valid:  # (with no gradient, a ring skips the blocks causality hides: ops/attention/ring.py)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling, enable_gqa=gqa,
                                               context_parallel=context_parallel(q.device_mesh))
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(q.device_mesh), scale=attn.scaling,
                                               enable_gqa=gqa, context_parallel=context_parallel(q.device_mesh))
        if self.cache is not None:
            self.cache._write(attn.layer_idx, k, v, self.write_args)
        return o

    def _recording_mask(self, mesh: DeviceMesh) -> Tensor:
        def make():  # [B, 1, L, slots + L], batch over dp
            return Tensor(self.mask_full, device_mesh=mesh, placements=mask_placements(mesh, False))

        return self._on(mesh, "recording mask", make)


__all__ = ["KVCache", "KVCacheError", "CachedForward"]
