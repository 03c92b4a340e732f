"""Context parallelism for scaled_dot_product_attention: the sequence split over mesh dims, by Ulysses and Ring.

The caller chooses it (``context_parallel=ContextParallel(ulysses=..., ring=...)``, mesh dims by index or
name; the Llama reads its mesh dim names in models/layout.py); attention never guesses from the mesh. Q/K/V
arrive Shard(2) on those dims (or are laid out so) and leave the same way (docs/context-parallel.md):

- Ulysses (``UlyssesPlan``): a Shard(2) -> Shard(1) redistribution (all_to_all) on its dim, attention on
  whole sequences of a share of the heads, and the all_to_all back.
- Ring (``RingPlan``, ring.py): K/V blocks passed around the ring's dim, per-block results merged by their
  log-sum-exp. An uneven Ring split (torch.chunk blocks, some maybe empty) is padded to equal blocks for the
  ring and cut back afterwards.

With both, Ulysses outside Ring in mesh order reads each device's block of L as [U, L / U] first (same
data), so the all_to_all leaves Ring's shard of every chunk in place. GQA heads are repeated just enough
for the head shards of q and kv to line up (``expand``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from ...autograd.mode import is_grad_enabled
from ...autograd.node import requires_grad
from ...errors import DTorchError, OpError
from ...graph import check_one_graph
from ...placement import Replicate, Shard
from ...autograd.redistribute import redistribute_spec
from ...runtime.kernels import kernel
from ...spec import DTensorSpec, block_offsets, chunk_size
from ..dispatch import describe, local_map
from ..rules import spec_like
from .ring import RingPlan, RingStep, ring
from .sdpa import NAME, acc_dtype, check_inputs, mask_dim, plain, prod, shard_or_rep


@dataclass(frozen=True)
class ContextParallel:
    """Which mesh dims split the sequence of an attention call: ``ulysses`` (all_to_all between sequence and
    heads) and ``ring`` (K/V blocks passed around); each a mesh dim index or name, None: not used. A dim of
    size 1 counts as not used."""
    ulysses: int | str | None = None
    ring: int | str | None = None

    def dims(self, mesh) -> tuple:
        """(Ulysses mesh dim, Ring mesh dim) on ``mesh``, None for each not used."""
        out = []
        for d in (self.ulysses, self.ring):
            i = mesh.dim_name_index(d) if isinstance(d, str) else d
            if d is not None and (i is None or not 0 <= i < mesh.ndim):
                raise OpError(f"dtorch.{NAME}: context_parallel names mesh dim {d!r}, which the mesh {mesh} does "
                              "not have; name one of its dims (by name or index)")
            out.append(i if i is not None and mesh.shape[i] > 1 else None)
        if out[0] is not None and out[0] == out[1]:
            raise OpError(f"dtorch.{NAME}: context_parallel puts Ulysses and Ring on the same mesh dim "
                          f"({mesh.dim_label(out[0])}); give each its own dim")
        return tuple(out)


@dataclass(frozen=True)
class UlyssesPlan:
    moves: tuple  # per q, k, v: (view spec or None, all_to_all target spec)
    back: DTensorSpec  # the output after the all_to_all back
    merge: dict | None = None  # per-device real rows of the view when the view was padded


@dataclass(frozen=True)
class CPPlan:
    q_in: DTensorSpec  # q, k, v laid out Shard(2) on the cp dims (K/V before GQA expansion)
    k_in: DTensorSpec
    v_in: DTensorSpec
    o_final: DTensorSpec  # the output, laid out like q_in
    expand: int = 1  # repeat each kv head this often so kv head shards line up with q's
    k_exp: DTensorSpec | None = None
    v_exp: DTensorSpec | None = None
    ulysses: UlyssesPlan | None = None
    ring: RingPlan | None = None


# ------------------------------------------------------------------------------------------------
# kernels


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



# ------------------------------------------------------------------------------------------------
# planning (pure, cached)


def _skips_hidden_blocks(causal, needs_grad, U, mask, noise, ring_pad, l, s, e, ev, dtype) -> bool:
    """The causal fast path of the ring (ring.py): self-attention split evenly over the ring alone, no mask
    or dropout, no gradient wanted, what torch's fused kernel takes (one head size, its dtypes)."""
    return (causal and not needs_grad and U == 1 and mask is None and noise is None and l == s and e == ev
            and all(p is None for p in ring_pad) and dtype in (torch.float32, torch.bfloat16, torch.float16))


def _causal_ring_plan(r, nr, q_run, k_run, v_run, o_acc, lse, o_out, scale) -> RingPlan:
    ranks = np.zeros(q_run.mesh.shape, dtype=np.int64)  # each device's place on the ring
    for c in q_run.mesh.coordinates():
        ranks[c] = c[r]
    lse = spec_like(lse, dtype=torch.float32)  # (torch's fused kernel gives it in float32)
    steps = []
    for st in range(nr):
        last = st == nr - 1
        steps.append(RingStep(in_specs=(q_run, k_run, v_run) + ((o_acc, lse) if st else ()),
                              out_specs=(o_out if last else o_acc, lse),
                              kwargs={"scale": scale, "step": st, "axis": r, "ring": nr,
                                      "out_dtype": o_out.dtype if last else None},
                              device_args={"rank": ranks}))
    return RingPlan(mesh_dim=r, steps=tuple(steps), k=k_run, v=v_run, skips_hidden_blocks=True)


@lru_cache(maxsize=1024)
def plan_context_parallel(q, k, v, mask, noise, causal, scale, gqa, u, r, needs_grad) -> CPPlan:
    """The plan of one context-parallel call (pure: specs in; cached): ``u``/``r`` the Ulysses and Ring mesh
    dims (None: not used); ``needs_grad``: the call records autograd history (no causal fast path then)."""
    specs = (q, k, v) + ((mask,) if mask is not None else ())
    check_inputs(specs, mask is not None, causal, gqa)
    mesh = q.mesh
    n, hq, l, e = q.shape
    hk, s, ev = k.shape[1], k.shape[2], v.shape[3]
    U = mesh.shape[u] if u is not None else 1
    nr = mesh.shape[r] if r is not None else 1

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
    t = prod(mesh.shape[i] for i in head_dims)
    split = " * ".join(f"{mesh.dim_label(i)}({mesh.shape[i]})" for i in head_dims + ([u] if U > 1 else []))
    if U > 1 and hq % (t * U):
        raise OpError(f"dtorch.{NAME}: Ulysses context parallel splits the {hq} query heads over {split} = {t * U} "
                      f"devices; use a head count divisible by that, or a smaller {mesh.dim_label(u)} dim")
    if U > 1 and (l % U or s % U):
        raise OpError(f"dtorch.{NAME}: Ulysses context parallel needs sequence lengths (query {l}, key {s}) "
                      f"divisible by {mesh.dim_label(u)} ({U})")
    g = hq // hk
    expand = 1
    if g > 1 and t * U > 1:
        if hq % (t * U):
            raise OpError(f"dtorch.{NAME}: GQA with context parallel needs the {hq} query heads divisible by the "
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
    common = dict(q_in=q_in, k_in=k_in, v_in=v_in, expand=expand, k_exp=k_exp, v_exp=v_exp, o_final=o_final,
                  ulysses=UlyssesPlan(moves=ulysses, back=o_back, merge=o_merge) if U > 1 else None)
    if nr == 1:
        return CPPlan(**common)

    # Ring: local Q against each K/V block in turn; device j holds block (j - step) mod nr
    heads_now = head_dims + ([u] if U > 1 else [])
    full = (n, hq, l, s)

    def whole_seq(x):  # mask/noise: batch and head shards like q, whole along L and S
        if x is None:
            return None
        pl = []
        for i in range(mesh.ndim):
            od = 0 if base[i] == Shard(0) else 1 if i in heads_now else None
            md = mask_dim(x, od, full) if od is not None else None
            pl.append(shard_or_rep(md))
        return x.with_placements(pl)

    mask_r, noise_r = whole_seq(mask), whole_seq(noise)
    extra = tuple(x for x in (mask_r, noise_r) if x is not None)
    ring_pad = (padded(q_cur), padded(k_cur), padded(v_cur))  # the view was padded already
    q_run, k_run, v_run = (p if p is not None else x for p, x in zip(ring_pad, (q_cur, k_cur, v_cur)))
    acc = acc_dtype(q.dtype)
    o_acc = DTensorSpec(mesh, q_run.placements, q_run.shape[:-1] + (ev,), acc)
    lse = DTensorSpec(mesh, q_run.placements, q_run.shape[:-1], acc)
    o_out = spec_like(o_acc, dtype=q.dtype)
    o_unpad = None
    if ring_pad[0] is not None:
        o_real = spec_like(o_out, shape=q_cur.shape[:-1] + (ev,))
        o_unpad = (o_real, {"length": real_rows(o_real)})
    if _skips_hidden_blocks(causal, needs_grad, U, mask, noise, ring_pad, l, s, e, ev, q.dtype):
        return CPPlan(**common, ring=_causal_ring_plan(r, nr, q_run, k_run, v_run, o_acc, lse, o_out, scale))
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
        steps.append(RingStep(in_specs=(q_run, k_run, v_run) + extra + ((o_acc, lse) if st else ()),
                              out_specs=(o_out if last else o_acc, lse), kwargs=kwargs,
                              device_args={"q_off": q_off, "k_off": block_offsets(k_run, sd, src)}))
    in_unpad = tuple((x, {"length": real_rows(x)}) if p is not None else None
                     for x, p in zip((q_cur, k_cur, v_cur), ring_pad))
    return CPPlan(**common, ring=RingPlan(mesh_dim=r, steps=tuple(steps), k=k_run, v=v_run, mask=mask_r,
                                          noise=noise_r, pad=ring_pad, o_unpad=o_unpad, in_unpad=in_unpad))



# ------------------------------------------------------------------------------------------------
# execution


def _run(kern, x, out_spec: DTensorSpec, device_args=None, **kwargs):
    return local_map(f"{NAME}.{kern.name}", kern, [x], [out_spec], kwargs, device_args)[0]


def context_parallel(q, k, v, mask, noise, causal: bool, scale: float, gqa: bool, u, r):
    """Attention with the sequence split over mesh dims ``u`` (Ulysses) and/or ``r`` (Ring)."""
    tensors = [x for x in (q, k, v, mask, noise) if x is not None]
    if any(x._graph is not q._graph for x in tensors):  # the ring runs q's runtime on k's and v's blocks
        check_one_graph(NAME, tensors)
    specs = (q._spec, k._spec, v._spec, mask._spec if mask is not None else None,
             noise._spec if noise is not None else None)
    needs_grad = is_grad_enabled() and any(requires_grad(x) for x in tensors)
    try:
        cp = plan_context_parallel(*specs, causal, scale, gqa, u, r, needs_grad)
    except DTorchError:
        raise
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise OpError(f"dtorch.{NAME} cannot run on inputs {describe([s for s in specs if s])}: {exc}") from exc
    mesh = q.device_mesh
    q, k, v = redistribute_spec(q, cp.q_in), redistribute_spec(k, cp.k_in), redistribute_spec(v, cp.v_in)
    if cp.expand > 1:
        # each kv head repeated in place, then cut like q's heads (a local slice when heads were whole)
        base = cp.q_in.placements
        k = redistribute_spec(_run(_repeat_kv_kernel, k, cp.k_exp, repeats=cp.expand), cp.k_exp.with_placements(base))
        v = redistribute_spec(_run(_repeat_kv_kernel, v, cp.v_exp, repeats=cp.expand), cp.v_exp.with_placements(base))
    if cp.ulysses is not None:
        moved = []
        for x, (view, a2a) in zip((q, k, v), cp.ulysses.moves):
            if view is not None:
                x = _run(_split_seq_kernel, x, view, size=view.even_local_shape()[3])
            moved.append(x.redistribute(mesh, a2a.placements))  # all_to_all on the Ulysses dim
        q, k, v = moved
    out = plain(q, k, v, mask, noise, causal, scale, gqa) if cp.ring is None else ring(cp.ring, q, k, v, mask, noise)
    if cp.ulysses is not None:
        back = cp.ulysses.back
        out = out.redistribute(mesh, back.placements)  # all_to_all back on the Ulysses dim
        if back.shape != cp.o_final.shape:
            out = _run(_merge_seq_kernel, out, cp.o_final, cp.ulysses.merge)
    return out
