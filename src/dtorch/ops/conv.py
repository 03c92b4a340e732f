"""Convolutions: conv1d/2d/3d and conv_transpose1d/2d/3d, layout [N, C, *spatial] (or unbatched [C, *spatial]).

Rule, per mesh dim (weight [Cout, Cin/groups, *k]; transposed: [Cin, Cout/groups, *k]):

    weight S(out channels)          -> out S(1)    x R (groups == 1), or x S(1) when each device's input
                                                   channels are whole groups matching its output channels
    weight S(in channels), g == 1   -> out P(sum)  x S(1); the bias joins the partial sum once
    x S(0)                          -> out S(0)    batch: a local conv
    x S(1)                          -> P(sum)      (groups == 1: weight S(in)) or S(1) (aligned groups:
                                                   weight S(out), depthwise convs)
    x S(d), d spatial (conv only)   -> out S(d)    halo exchange: each device receives the kernel's
                                                   overlap rows from its neighbours (send_recv of only
                                                   those rows), then convolves its window
    x P(sum|avg), weight R          -> P           conv is linear in x (a sum's bias joins once)
    weight P(sum|avg), x R          -> P
    otherwise                       -> R

Halo exchange (``plan_halos`` / ``run_halos``, shared with pooling): for a spatial dim sharded on one mesh
dim, output row o reads input rows [o*s - pad, o*s - pad + dilation*(k-1)]; device j owns the output rows
torch.chunk gives it, so it needs at most ``lh`` rows before its block and ``rh`` rows after it. Every
device cuts its last ``lh`` / first ``rh`` rows, the two slices move one step along the mesh dim
(``executor.ring_shift``: one send_recv each), the wrapped slice at either end is replaced by the padding
value, and the device convolves the window of [left halo | block | right halo] its output rows read, with
no padding on that dim. Corners (two sharded spatial dims) come with the second exchange, which cuts the
already extended blocks. Uneven shards are exact when every device holds at least as many rows as a halo
(torch.chunk leaves only the last blocks short); otherwise (a device with fewer rows than the halo, an
empty one) that dim falls back to being gathered (Replicate on its mesh dim, output Replicate there).
Transposed convolutions gather a sharded spatial dim (their windows overlap on the output side).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from ..autograd.kernel_entry import wrap
from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..autograd.node import Node, attach, requires_grad
from ..autograd.redistribute import redistribute_spec
from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..redistribute import relayout
from ..redistribute.executor import ring_shift
from ..runtime.kernels import kernel, per_device
from ..spec import DTensorSpec, chunk_size, shard_range
from ..tensor import Tensor
from ..runtime.kernels import broadcast_shape as _broadcast_shape
from .dispatch import OpPlan, dispatch
from .rules import meta_call, spec_like, to_dtensors
from .table import register

_R = Replicate()
_PSUM = Partial("sum")
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


# ------------------------------------------------------------------------------------------------
# halo exchange (shared with pooling)


@dataclass(frozen=True)
class HaloStep:
    """One exchange along tensor dim ``dim`` (negative) over mesh dim ``mesh_dim``."""
    dim: int
    mesh_dim: int
    lh: int  # rows every device receives from its left neighbour
    rh: int  # ... from its right neighbour
    core: int  # the block size every device's block is padded to (torch.chunk's chunk)
    src: DTensorSpec  # the tensor cut
    left: DTensorSpec | None  # the slices that travel ([n * lh] along dim)
    right: DTensorSpec | None
    ext: DTensorSpec  # [left | block | right | padding to core] per device, even along dim


@dataclass(frozen=True)
class HaloPlan:
    steps: tuple  # HaloStep per exchanged dim, in order
    windows: tuple  # per exchanged dim: (dim, offset, length): ints when every device agrees, else None
    device_args: dict | None  # "off{k}" / "wl{k}": per-device window offset / length (numpy, mesh shape)
    kwargs: dict  # "off{k}" / "wl{k}" that every device shares
    fallback: tuple  # tensor dims that could not be exchanged (gathered instead)


def halo_geometry(size: int, n: int, out_size: int, k_eff: int, stride: int, pad_left: int):
    """Per device of ``n`` along a dim of ``size`` rows (torch.chunk blocks) whose output has ``out_size``
    rows: (lh, rh, offsets, lengths) of the windows in [lh rows | block | ...], or None when a device holds
    fewer rows than a halo (the exchange with the neighbours alone cannot give it its window)."""
    ins = [shard_range(size, n, j) for j in range(n)]
    outs = [shard_range(out_size, n, j) for j in range(n)]
    need = []
    for (i0, m), (o0, ln) in zip(ins, outs):
        if ln == 0:
            need.append(None)
            continue
        start = o0 * stride - pad_left
        length = (ln - 1) * stride + k_eff
        need.append((i0 - start, start + length - (i0 + m), length))
    lh = max([0] + [nd[0] for nd in need if nd is not None])
    rh = max([0] + [nd[1] for nd in need if nd is not None])
    if (lh or rh) and min(m for _, m in ins) < max(lh, rh):
        return None
    offs = [0 if nd is None else lh - nd[0] for nd in need]
    lens = [0 if nd is None else nd[2] for nd in need]
    return lh, rh, offs, lens


def plan_halos(x: DTensorSpec, geoms: dict) -> tuple[DTensorSpec, HaloPlan]:
    """``geoms``: tensor dim (negative) -> (out_size, k_eff, stride, pad_left) of every spatial dim.

    Returns x's layout for the exchange (a spatial dim sharded on several mesh dims keeps only the outer
    one; a dim the exchange cannot serve is gathered) and the plan."""
    mesh = x.mesh
    nd = x.ndim
    pl = list(x.placements)
    seen = set()
    for i, p in enumerate(pl):
        if isinstance(p, Shard):
            d = p.dim - nd
            if d in geoms:
                if d in seen:
                    pl[i] = _R
                seen.add(d)
    fallback = []
    geo = {}
    for i, p in enumerate(pl):
        if isinstance(p, Shard) and p.dim - nd in geoms:
            d = p.dim - nd
            out_size, k_eff, stride, pad_left = geoms[d]
            g = halo_geometry(x.shape[d], mesh.shape[i], out_size, k_eff, stride, pad_left)
            if g is None:
                pl[i] = _R
                fallback.append(d)
            else:
                geo[d] = (i, g)
    x_in = spec_like(x, placements=pl)
    steps, windows, kwargs, dargs = [], [], {}, {}
    cur = x_in
    for k, (d, (i, (lh, rh, offs, lens))) in enumerate(sorted(geo.items())):
        n = mesh.shape[i]
        core = chunk_size(x.shape[d], n)
        shape = list(cur.shape)
        left = right = None
        if lh:
            shape[d] = n * lh
            left = spec_like(cur, shape=shape)
        if rh:
            shape[d] = n * rh
            right = spec_like(cur, shape=shape)
        if lh or rh or not cur.is_even():
            shape[d] = n * (lh + core + rh)
            ext = spec_like(cur, shape=shape)
            steps.append(HaloStep(d, i, lh, rh, core, cur, left, right, ext))
            cur = ext
        for key, vals in ((f"off{k}", offs), (f"wl{k}", lens)):
            if len(set(vals)) == 1:
                kwargs[key] = vals[0]
            else:
                arr = np.zeros(mesh.shape, dtype=np.int64)
                for j, v in enumerate(vals):
                    idx = [slice(None)] * mesh.ndim
                    idx[i] = j
                    arr[tuple(idx)] = v
                dargs[key] = arr
        windows.append(d)
    return x_in, HaloPlan(tuple(steps), tuple(windows), dargs or None, kwargs, tuple(fallback))


def halo_input_spec(plan: HaloPlan, x_in: DTensorSpec) -> DTensorSpec:
    return plan.steps[-1].ext if plan.steps else x_in


@kernel("conv.halo_edges")
def _halo_edges_kernel(x, *, dim: int, lh: int, rh: int):
    outs = []
    if lh:
        outs.append(x.narrow(dim, x.shape[dim] - lh, lh))
    if rh:
        outs.append(x.narrow(dim, 0, rh))
    return tuple(outs) if len(outs) > 1 else outs[0]


def on_grid(v, x, lead: int):
    """A per-device value (a tensor of the mesh's shape) cut to ``x``'s grid: it only varies on mesh dims where x
    is sharded, and broadcasting x over a replicated dim would make the backward add the replicas' gradients."""
    if not isinstance(v, torch.Tensor):
        return v
    return v[tuple(slice(0, 1) if x.shape[i] == 1 else slice(None) for i in range(lead))]


def _fill_where(a, flag, fill: float, lead: int):
    """``a``, or ``fill`` everywhere on the devices whose ``flag`` is set (the slice that wrapped around)."""
    if not isinstance(flag, torch.Tensor):
        return torch.full_like(a, fill) if flag else a
    flag = on_grid(flag, a, lead)
    return torch.where(per_device(flag, a, lead) != 0, torch.full((), fill, dtype=a.dtype, device=a.device), a)


@kernel("conv.halo_extend")
def _halo_extend_kernel(x, *lr, lead=0, dim: int, lh: int, rh: int, core: int, fill: float, first=0, last=0):
    parts = []
    it = iter(lr)
    if lh:
        parts.append(_fill_where(next(it), first, fill, lead))
    parts.append(x)
    if rh:
        parts.append(_fill_where(next(it), last, fill, lead))
    short = core - x.shape[dim]
    if short:  # a short (uneven) block: padding after the right halo keeps every block the same size
        shape = list(x.shape)
        shape[dim] = short
        parts.append(x.new_zeros(shape))
    if lead:  # a masked slice may have grown grid dims that x's replicas share (size 1): broadcast them all
        g = tuple(_broadcast_shape([tuple(p.shape[:lead]) for p in parts]))
        parts = [p.expand(g + tuple(p.shape[lead:])) for p in parts]
    return torch.cat(parts, dim)


def _edge_flags(spec: DTensorSpec, mesh_dim: int, at: int):
    arr = np.zeros(spec.mesh.shape, dtype=np.int64)
    idx = [slice(None)] * spec.mesh.ndim
    idx[mesh_dim] = at
    arr[tuple(idx)] = 1
    return arr


def _halo_edges_rule(specs, step: HaloStep, fill: float):
    outs = tuple(s for s in (step.left, step.right) if s is not None)
    return OpPlan((step.src,), outs, _halo_edges_kernel, {"dim": step.dim, "lh": step.lh, "rh": step.rh},
                  multi_output=len(outs) > 1)


def _halo_extend_rule(specs, step: HaloStep, fill: float):
    n = step.src.mesh.shape[step.mesh_dim]
    ins = (step.src,) + tuple(s for s in (step.left, step.right) if s is not None)
    return OpPlan(ins, (step.ext,), _halo_extend_kernel,
                  {"dim": step.dim, "lh": step.lh, "rh": step.rh, "core": step.core, "fill": fill},
                  {"first": _edge_flags(step.src, step.mesh_dim, 0), "last": _edge_flags(step.src, step.mesh_dim, n - 1)})


class RingShiftNode(Node):
    """The backward of a ring shift: the gradient travels back the other way (one send_recv)."""

    __slots__ = ("spec", "mesh_dim", "shift", "graph")
    name = "halo_exchange"

    def __init__(self, x: Tensor, mesh_dim: int, shift: int):
        super().__init__([x], 1)
        # the cotangent's layout: x's, a Partial term's cotangent being the whole (replicated) cotangent
        spec = x._spec.with_placements([_R if isinstance(p, Partial) else p for p in x._spec.placements])
        self.spec, self.mesh_dim, self.shift, self.graph = spec, mesh_dim, shift, x._graph

    def apply(self, grads):
        g = grads[0]
        if g is None:
            return [None]
        g = relayout(g.to(self.spec.dtype) if g.dtype != self.spec.dtype else g, self.spec)
        h = ring_shift(self.graph.runtime, g._h, self.spec, self.mesh_dim, -self.shift)
        return [wrap(self.spec, h, self.graph)]


def shift_blocks(x: Tensor, mesh_dim: int, shift: int) -> Tensor:
    """Device j gets the block of device j - shift along ``mesh_dim`` (cyclic; ``x`` must be even)."""
    h = ring_shift(x._graph.runtime, x._h, x._spec, mesh_dim, shift)
    out = wrap(x._spec, h, x._graph)
    if _grad_enabled() and requires_grad(x) and x.dtype.is_floating_point:
        attach(RingShiftNode(x, mesh_dim, shift), [out])
    return out


def run_halos(x: Tensor, plan: HaloPlan, fill: float) -> Tensor:
    """``x`` (laid out as the plan's first step's source) extended by the exchanged halos."""
    for step in plan.steps:
        static = (step, float(fill))
        parts = []
        if step.lh or step.rh:
            edges = dispatch("halo_exchange.edges", _halo_edges_rule, [x], static)
            edges = edges if isinstance(edges, tuple) else (edges,)
            it = iter(edges)
            if step.lh:
                parts.append(shift_blocks(next(it), step.mesh_dim, 1))  # my left halo: my left neighbour's last rows
            if step.rh:
                parts.append(shift_blocks(next(it), step.mesh_dim, -1))
        x = dispatch("halo_exchange.extend", _halo_extend_rule, [x] + parts, static)
    return x


def window(x, dim: int, off, length, lead: int):
    """Rows [off, off + length) of ``x`` along ``dim``; ``off`` may differ per device (a grid tensor)."""
    if not isinstance(off, torch.Tensor):
        return x.narrow(dim, int(off), int(length))
    length = int(length)
    off = on_grid(off, x, lead)
    d = dim % x.ndim
    shape = [1] * x.ndim
    shape[d] = length
    idx = per_device(off, x, lead) + torch.arange(length, device=x.device).reshape(shape)
    target = list(x.shape)
    target[d] = length
    g = _broadcast_shape([tuple(x.shape[:lead]), tuple(idx.shape[:lead])])
    target[:lead] = g
    return torch.gather(x.expand(tuple(g) + tuple(x.shape[lead:])), d, idx.expand(target))


def apply_windows(x, windows: tuple, lead: int, kw: dict):
    for k, d in enumerate(windows):
        x = window(x, d, kw[f"off{k}"], kw[f"wl{k}"], lead)
    return x


# ------------------------------------------------------------------------------------------------
# the convolution kernel


def _per_grid(fn, lead: int, x, others):
    """``fn(x, *others)`` for every device: the grid folded into the batch where ``others`` (weight, bias) are
    the same on every device, else one call per device."""
    if not lead:
        return fn(x, *others)
    gx = tuple(x.shape[:lead])
    if all(s == 1 for o in others for s in o.shape[:lead]):
        xf = x.reshape((-1,) + tuple(x.shape[lead + 1:]))
        out = fn(xf, *[o.reshape(tuple(o.shape[lead:])) for o in others])
        return out.reshape(gx + (x.shape[lead],) + tuple(out.shape[1:]))
    g = _broadcast_shape([gx] + [tuple(o.shape[:lead]) for o in others])
    flat = [t.expand(tuple(g) + tuple(t.shape[lead:])).reshape((-1,) + tuple(t.shape[lead:])) for t in (x,) + tuple(others)]
    outs = [fn(*[t[i] for t in flat]) for i in range(flat[0].shape[0])]
    return torch.stack(outs).reshape(tuple(g) + tuple(outs[0].shape))


@kernel("conv.conv")
def _conv_kernel(x, w, *b, lead=0, nd: int, transposed: bool, stride, padding, dilation, groups: int,
                 output_padding=0, pre_pad=None, windows=(), k_eff=(), **win):
    x = apply_windows(x, windows, lead, win)
    empty = [k for k, d in enumerate(windows) if x.shape[d] == 0]
    for k in empty:  # a device with no output rows: a window of zeros gives one row, cut to none below
        d = windows[k]
        shape = list(x.shape)
        shape[d] = k_eff[k]
        x = torch.cat([x, x.new_zeros(shape)], d)
    if pre_pad is not None:
        x = F.pad(x, pre_pad)

    def one(xi, wi, *bi):
        bias = bi[0] if bi else None
        if xi.shape[1] == 0:  # an empty channel shard (uneven split): torch gives no channels, the sum needs zeros
            xi = torch.cat([xi, xi.new_zeros((xi.shape[0], 1) + tuple(xi.shape[2:]))], 1)
            wd = 0 if transposed else 1
            wi = torch.cat([wi, wi.new_zeros(tuple(wi.shape[:wd]) + (1,) + tuple(wi.shape[wd + 1:]))], wd)
        od = 1 if transposed else 0
        if wi.shape[od] == 0:  # an empty output-channel shard: one zero channel computed, then cut away
            wi = torch.cat([wi, wi.new_zeros(tuple(wi.shape[:od]) + (1,) + tuple(wi.shape[od + 1:]))], od)
            bias = None if bias is None else torch.cat([bias, bias.new_zeros(1)])
            return one(xi, wi, *(() if bias is None else (bias,))).narrow(1, 0, 0)
        if transposed:
            return _CONV_T[nd](xi, wi, bias, stride, padding, output_padding, groups, dilation)
        g = xi.shape[1] // wi.shape[1] if wi.shape[1] else groups
        return _CONV[nd](xi, wi, bias, stride, padding, dilation, g)

    out = _per_grid(one, lead, x, (w,) + b)
    for k in empty:
        out = out.narrow(windows[k], 0, 0)
    return out


# ------------------------------------------------------------------------------------------------
# the rule


@dataclass(frozen=True)
class ConvPlan:
    x_in: DTensorSpec
    halo: HaloPlan | None
    final: OpPlan


def _tuple(v, nd: int) -> tuple:
    if isinstance(v, (list, tuple)):
        if len(v) != nd:
            raise OpError(f"expected {nd} values, got {list(v)}")
        return tuple(int(a) for a in v)
    return (int(v),) * nd


def _groups_aligned(x: DTensorSpec, w: DTensorSpec, groups: int, transposed: bool) -> bool:
    """Every device's input channels are whole groups and its weight rows the output channels of exactly
    those groups (so a local conv with groups = local channels / channels per group is the global one)."""
    if transposed or groups == 1:
        return False
    cin_g, cout_g = w.shape[1], w.shape[0] // groups
    for c in x.mesh.coordinates():
        (xa, xn) = x.local_box(c)[1]
        (wa, wn) = w.local_box(c)[0]
        if xa % cin_g or xn % cin_g or wa != xa // cin_g * cout_g or wn != xn // cin_g * cout_g:
            return False
    return True


@lru_cache(maxsize=1024)
def conv_plan(specs: tuple, nd: int, transposed: bool, stride, padding, dilation, groups: int, output_padding) -> ConvPlan:
    x, w = specs[0], specs[1]
    b = specs[2] if len(specs) > 2 else None
    if x.ndim != nd + 2:
        raise OpError(f"expected a {nd + 2}-D input [N, C, *spatial] (or {nd + 1}-D unbatched), got shape {list(x.shape)}")
    if w.ndim != nd + 2:
        raise OpError(f"expected a {nd + 2}-D weight, got shape {list(w.shape)}")

    def meta(xi, wi, *bi):
        bias = bi[0] if bi else None
        if transposed:
            return _CONV_T[nd](xi, wi, bias, stride, padding, output_padding, groups, dilation)
        return _CONV[nd](xi, wi, bias, stride, padding, dilation, groups)

    out_meta = meta_call(meta, specs)
    out_shape = tuple(out_meta.shape)
    mesh = x.mesh
    out_ch_dim, in_ch_dim = (1, 0) if transposed else (0, 1)
    xp, wp, bp, op = [], [], [], []
    for i in range(mesh.ndim):
        px, pw = x.placements[i], w.placements[i]
        pb = b.placements[i] if b is not None else _R
        choice = None
        if pw == Shard(out_ch_dim) and groups == 1:
            choice = (_R, pw, Shard(0), Shard(1))
        elif pw == Shard(out_ch_dim) and not transposed:
            choice = (Shard(1), pw, Shard(0), Shard(1))  # checked below: whole groups per device
        elif pw == Shard(in_ch_dim) and groups == 1:
            choice = (Shard(1), pw, _PSUM, _PSUM)
        elif px == Shard(0):
            choice = (px, _R, _R, px)
        elif px == Shard(1) and groups == 1:
            choice = (px, Shard(in_ch_dim), _PSUM, _PSUM)
        elif px == Shard(1) and not transposed:
            choice = (px, Shard(0), Shard(0), Shard(1))
        elif isinstance(px, Shard) and px.dim >= 2 and not transposed:
            choice = (px, _R, _R, px)
        elif isinstance(px, Partial) and px.reduce_op in ("sum", "avg") and not isinstance(pw, Partial):
            choice = (px, _R, px, px)  # a sum's bias joins once (R -> P(sum) puts it on one device)
        elif isinstance(pw, Partial) and pw.reduce_op in ("sum", "avg") and not isinstance(pb, Partial):
            choice = (_R, pw, pw, pw)
        if choice is None:
            choice = (_R, _R, _R, _R)
        for lst, p in zip((xp, wp, bp, op), choice):
            lst.append(p)
    x_in = spec_like(x, placements=xp)
    w_in = spec_like(w, placements=wp)
    if not _groups_aligned(x_in, w_in, groups, transposed) and groups != 1:
        # group-sharded channels that do not line up: gather the channels on those mesh dims
        for i in range(mesh.ndim):
            if xp[i] == Shard(1) or wp[i] == Shard(out_ch_dim):
                xp[i] = wp[i] = bp[i] = op[i] = _R
        x_in, w_in = spec_like(x, placements=xp), spec_like(w, placements=wp)
    kwargs = {"nd": nd, "transposed": transposed, "stride": stride, "padding": padding, "dilation": dilation,
              "groups": groups, "output_padding": output_padding}
    halo = None
    device_args = None
    spatial = [p.dim - x.ndim for p in xp if isinstance(p, Shard) and p.dim >= 2]
    if spatial:
        kshape = w.shape[2:]
        pads = _explicit_padding(padding, kshape, dilation, nd)
        geoms = {}
        for k in range(nd):
            d = k - nd
            k_eff = dilation[k] * (kshape[k] - 1) + 1
            geoms[d] = (out_shape[d], k_eff, stride[k], pads[k][0])
        x_in, halo = plan_halos(x_in, geoms)
        for i, p in enumerate(x_in.placements):  # dims that fell back to a gather: output Replicate there
            if isinstance(p, Replicate) and isinstance(xp[i], Shard) and xp[i].dim >= 2:
                op[i] = _R
        conv_pad, pre = [], []
        for k in range(nd):
            lo, hi = pads[k]
            if k - nd in halo.windows:
                lo = hi = 0
            m = min(lo, hi)
            conv_pad.append(m)
            pre = [lo - m, hi - m] + pre  # F.pad lists the last dim first
        kwargs.update(padding=tuple(conv_pad), pre_pad=tuple(pre) if any(pre) else None, windows=halo.windows,
                      k_eff=tuple(dilation[k] * (kshape[k] - 1) + 1 for k in range(nd) if k - nd in halo.windows),
                      **halo.kwargs)
        device_args = halo.device_args
    ins = (halo_input_spec(halo, x_in) if halo else x_in, w_in)
    if b is not None:
        ins += (spec_like(b, placements=bp),)
    out = DTensorSpec(mesh, tuple(op), out_shape, out_meta.dtype)
    return ConvPlan(x_in, halo, OpPlan(ins, (out,), _conv_kernel, kwargs, device_args))


def _explicit_padding(padding, kshape, dilation, nd: int) -> list:
    """(left, right) per spatial dim; "same" puts the odd row on the right, like torch."""
    if padding == "valid":
        return [(0, 0)] * nd
    if padding == "same":
        out = []
        for k in range(nd):
            total = dilation[k] * (kshape[k] - 1)
            out.append((total // 2, total - total // 2))
        return out
    return [(p, p) for p in padding]


def _final_rule(specs, plan_key):
    return conv_plan(*plan_key).final


def _conv_rule(specs, *static):
    return conv_plan(tuple(specs), *static).final


def _conv(name: str, nd: int, transposed: bool, input, weight, bias, stride, padding, dilation, groups,
          output_padding=0):
    x, w, b = to_dtensors(name, [input, weight, bias])
    if not isinstance(x, Tensor) or not isinstance(w, Tensor):
        raise OpError(f"dtorch.{name}: input and weight must be tensors")
    if x.ndim == nd + 1:  # unbatched [C, *spatial], as torch takes it
        return _conv(name, nd, transposed, x.unsqueeze(0), w, b, stride, padding, dilation, groups,
                     output_padding).squeeze(0)
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise OpError(f"dtorch.{name}: padding must be an int, a tuple, 'same' or 'valid', got {padding!r}")
        if transposed:
            raise OpError(f"dtorch.{name}: padding={padding!r} is not supported for transposed convolutions (torch "
                          "neither); give the padding as numbers")
    else:
        padding = _tuple(padding, nd)
    static = (nd, transposed, _tuple(stride, nd), padding, _tuple(dilation, nd), int(groups),
              _tuple(output_padding, nd) if transposed else 0)
    tensors = [x, w] + ([b] if isinstance(b, Tensor) else [])
    try:
        cp = conv_plan(tuple(t._spec for t in tensors), *static)
    except OpError as exc:
        raise OpError(f"dtorch.{name}: {exc}") from exc
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        from .dispatch import describe
        raise OpError(f"dtorch.{name} cannot run on inputs {describe([t._spec for t in tensors])}: {exc}") from exc
    if cp.halo is None:
        return dispatch(name, _conv_rule, tensors, static)
    x = run_halos(redistribute_spec(x, cp.x_in), cp.halo, 0.0)
    return dispatch(name + ".window", _final_rule, [x] + tensors[1:], ((tuple(t._spec for t in tensors),) + static,))


@register(rule=_conv_rule, kernel=_conv_kernel, torch_fns=(F.conv1d,), functional=True)
def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``F.conv1d`` on [N, C, L]: batch, channel (tp) and length (halo exchange) sharding."""
    return _conv("conv1d", 1, False, input, weight, bias, stride, padding, dilation, groups)


@register(rule=_conv_rule, kernel=_conv_kernel, torch_fns=(F.conv2d,), functional=True)
def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``F.conv2d`` on [N, C, H, W]: batch, channel (tp) and spatial (halo exchange) sharding."""
    return _conv("conv2d", 2, False, input, weight, bias, stride, padding, dilation, groups)


@register(rule=_conv_rule, kernel=_conv_kernel, torch_fns=(F.conv3d,), functional=True)
def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """``F.conv3d`` on [N, C, D, H, W]: batch, channel (tp) and spatial (halo exchange) sharding."""
    return _conv("conv3d", 3, False, input, weight, bias, stride, padding, dilation, groups)


@register(rule=_conv_rule, kernel=_conv_kernel, torch_fns=(F.conv_transpose1d,), functional=True)
def conv_transpose1d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """``F.conv_transpose1d``: batch and channel sharding; a sharded length is gathered."""
    return _conv("conv_transpose1d", 1, True, input, weight, bias, stride, padding, dilation, groups, output_padding)


@register(rule=_conv_rule, kernel=_conv_kernel, torch_fns=(F.conv_transpose2d,), functional=True)
def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """``F.conv_transpose2d``: batch and channel sharding (weight [Cin, Cout/groups, kh, kw]); sharded
    spatial dims are gathered."""
    return _conv("conv_transpose2d", 2, True, input, weight, bias, stride, padding, dilation, groups, output_padding)
