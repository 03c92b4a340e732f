"""Pooling, interpolate and pad on [N, C, *spatial] (or unbatched [C, *spatial]) tensors.

Rule, per mesh dim:

    x S(batch or channel)                 -> the same shard: every (n, c) plane is pooled on its own
    max/avg pool, x S(d) spatial          -> S(d): halo exchange with the neighbours (ops/conv.py's), the
                                             wrapped edge filled with -inf (max) or 0 (avg); an avg pool
                                             whose divisor would see the edge (count_include_pad=False with
                                             padding on that dim, ceil_mode) gathers that dim instead, as
                                             does max pooling with return_indices (global indices)
    adaptive_avg_pool, x S(d) spatial     -> P(sum) where that dim pools to one value (each device's sum
                                             over its rows / the global size); other sizes gather the dim
    interpolate / pad, x S(d) on a dim    -> gathered (Replicate) on that mesh dim
    they resize / pad
    avg pool, adaptive_avg_pool,          -> P(sum|avg): linear in x (pad: a sum with a nonzero constant
    interpolate, pad: x P(sum|avg)           value is reduced first)
    max pool, pad: x P(max|min)           -> kept where the op commutes with it (max pool with P(max))
    otherwise                             -> R
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from ..autograd.redistribute import redistribute_spec
from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .conv import apply_windows, halo_input_spec, plan_halos, run_halos
from .dispatch import OpPlan, dispatch
from .rules import meta_call, spec_like, to_dtensors
from .table import register

_R = Replicate()
_MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_ADAPTIVE = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def _fold(fn, x, lead: int, nd: int = 2):
    """``fn`` on the blocks of every device at once: the grid dims folded into the first dim (``nd``: the
    spatial dims at the end; the batch/channel dims before them may hold empty shards)."""
    empty = [d for d in range(lead, x.ndim - nd) if x.shape[d] == 0]
    if empty:  # an empty batch/channel shard: torch refuses empty planes; one zero plane computed, then cut
        d = empty[0]
        shape = list(x.shape)
        shape[d] = 1
        out = _fold(fn, torch.cat([x, x.new_zeros(shape)], d), lead, nd)
        return tuple(o.narrow(d, 0, 0) for o in out) if isinstance(out, tuple) else out.narrow(d, 0, 0)
    if not lead:
        return fn(x)
    g = tuple(x.shape[:lead])
    out = fn(x.reshape((-1,) + tuple(x.shape[lead + 1:])))
    outs = out if isinstance(out, tuple) else (out,)
    res = tuple(o.reshape(g + (x.shape[lead],) + tuple(o.shape[1:])) for o in outs)
    return res if isinstance(out, tuple) else res[0]


def _tuple(v, nd: int, what: str) -> tuple:
    if isinstance(v, (list, tuple)):
        if len(v) == 1:
            v = v[0]
        elif len(v) != nd:
            raise OpError(f"{what} must be an int or {nd} ints, got {list(v)}")
        else:
            return tuple(int(a) for a in v)
    return (int(v),) * nd


# ------------------------------------------------------------------------------------------------
# max / avg pooling


@kernel("pool.pool")
def _pool_kernel(x, *, lead=0, kind: str, nd: int, kernel_size, stride, padding, dilation=1, ceil_mode=False,
                 count_include_pad=True, divisor_override=None, return_indices=False, windows=(), **win):
    x = apply_windows(x, windows, lead, win)
    empty = [d for d in windows if x.shape[d] == 0]
    if empty:  # no output rows here (fewer outputs than devices on that dim): torch refuses an empty input,
        # so pool one window of rows (no padding on a windowed dim: exactly one output row) and cut it away
        shape = list(x.shape)
        for d in empty:
            shape[d] = (dilation[d] if isinstance(dilation, tuple) else dilation) * (kernel_size[d] - 1) + 1
        out = _pool_kernel.fn(x.new_zeros(shape), lead=lead, kind=kind, nd=nd, kernel_size=kernel_size,
                              stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil_mode,
                              count_include_pad=count_include_pad, divisor_override=divisor_override,
                              return_indices=return_indices)
        for d in empty:
            out = tuple(o.narrow(d, 0, 0) for o in out) if isinstance(out, tuple) else out.narrow(d, 0, 0)
        return out
    if kind == "max":
        def fn(t):
            return _MAX[nd](t, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    else:
        def fn(t):
            if nd == 1:
                return F.avg_pool1d(t, kernel_size, stride, padding, ceil_mode, count_include_pad)
            return _AVG[nd](t, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return _fold(fn, x, lead, nd)


@lru_cache(maxsize=1024)
def _pool_plan(x: DTensorSpec, kind: str, nd: int, kernel_size, stride, padding, dilation, ceil_mode: bool,
               count_include_pad: bool, divisor_override, return_indices: bool):
    if x.ndim not in (nd + 1, nd + 2):
        raise OpError(f"expected a {nd + 2}-D input [N, C, *spatial] or {nd + 1}-D [C, *spatial], got shape "
                      f"{list(x.shape)}")
    kw = {"kind": kind, "nd": nd, "kernel_size": kernel_size, "stride": stride, "padding": padding,
          "ceil_mode": ceil_mode, "return_indices": return_indices}
    if kind == "max":
        kw["dilation"] = dilation
    else:
        kw.update(count_include_pad=count_include_pad, divisor_override=divisor_override)
    meta = meta_call(lambda t: _pool_kernel.fn(t, **kw), (x,))
    metas = meta if isinstance(meta, tuple) else (meta,)
    out_shape = tuple(metas[0].shape)
    first = x.ndim - nd
    pl, out_pl = [], []
    for p in x.placements:
        if isinstance(p, Shard) and p.dim < first:
            pl.append(p)
            out_pl.append(p)
        elif isinstance(p, Shard):
            k = p.dim - first
            ok = not return_indices and (kind == "max" or (not ceil_mode and (count_include_pad or not padding[k])))
            pl.append(p if ok else _R)
            out_pl.append(p if ok else _R)
        elif isinstance(p, Partial) and (p.reduce_op in ("sum", "avg") if kind == "avg" else
                                         p.reduce_op == "max" and not return_indices):
            pl.append(p)
            out_pl.append(p)
        else:
            pl.append(_R)
            out_pl.append(_R)
    x_in = spec_like(x, placements=pl)
    halo, device_args = None, None
    if any(isinstance(p, Shard) and p.dim >= first for p in pl):
        geoms = {}
        for k in range(nd):
            d = k - nd
            k_eff = (dilation[k] if kind == "max" else 1) * (kernel_size[k] - 1) + 1
            geoms[d] = (out_shape[d], k_eff, stride[k], padding[k])
        x_in, halo = plan_halos(x_in, geoms)
        out_pl = [_R if isinstance(q, Replicate) and isinstance(p, Shard) else p for p, q in zip(out_pl, x_in.placements)]
        kw.update(padding=tuple(0 if k - nd in halo.windows else padding[k] for k in range(nd)),
                  windows=halo.windows, **halo.kwargs)
        if kind == "avg" and divisor_override is None and any(padding[k] for k in range(nd) if k - nd in halo.windows):
            # the zero rows of a window stand in for the padding the divisor counts (count_include_pad)
            kw["divisor_override"] = int(np.prod(kernel_size))
        device_args = halo.device_args
    outs = tuple(DTensorSpec(x.mesh, tuple(out_pl), tuple(m.shape), m.dtype) for m in metas)
    final = OpPlan((halo_input_spec(halo, x_in) if halo else x_in,), outs, _pool_kernel, kw, device_args,
                   multi_output=len(outs) > 1)
    _check_local_shapes(final)
    return x_in, halo, final


def _check_local_shapes(plan: OpPlan) -> None:
    """Every device's blocks through the kernel on meta tensors (once per distinct local shape and per-device
    arguments; the plan is cached): a window torch would refuse, or an output block other than the plan's, fails
    here, on the controller, before a worker runs anything (a kernel failing on the workers stops them all)."""
    seen = set()
    for coord in np.ndindex(*plan.in_specs[0].mesh.shape):
        ins = tuple(s.local_shape(coord) for s in plan.in_specs)
        args = {k: int(v[coord]) for k, v in (plan.device_args or {}).items()}
        if (ins, tuple(args.items())) in seen:
            continue
        seen.add((ins, tuple(args.items())))
        metas = [torch.empty(shape, dtype=s.dtype, device="meta") for shape, s in zip(ins, plan.in_specs)]
        out = plan.kernel.fn(*metas, **plan.kwargs, **args)
        got = tuple(tuple(o.shape) for o in (out if isinstance(out, tuple) else (out,)))
        want = tuple(s.local_shape(coord) for s in plan.out_specs)
        if got != want:
            raise OpError(f"device {coord} would compute blocks of shapes {list(got)}, its output blocks are "
                          f"{list(want)} (a bug in the pooling plan: please report it)")


def _pool_rule(specs, *static):
    return _pool_plan(specs[0], *static)[2]


def _pool_window_rule(specs, key):
    return _pool_plan(*key)[2]


def _pool(name: str, kind: str, nd: int, input, kernel_size, stride, padding, dilation=1, ceil_mode=False,
          count_include_pad=True, divisor_override=None, return_indices=False):
    (x,) = to_dtensors(name, [input])
    if not isinstance(x, Tensor):
        raise OpError(f"dtorch.{name} expects a tensor, got {type(input).__name__}")
    k = _tuple(kernel_size, nd, "kernel_size")
    s = k if stride is None or (isinstance(stride, (list, tuple)) and not stride) else _tuple(stride, nd, "stride")
    static = (kind, nd, k, s, _tuple(padding, nd, "padding"), _tuple(dilation, nd, "dilation"), bool(ceil_mode),
              bool(count_include_pad), None if divisor_override is None else int(divisor_override), bool(return_indices))
    try:
        x_in, halo, _ = _pool_plan(x._spec, *static)
    except OpError as exc:
        raise OpError(f"dtorch.{name}: {exc}") from exc
    except (RuntimeError, ValueError, TypeError, IndexError) as exc:
        raise OpError(f"dtorch.{name} cannot run on input {x._spec}: {exc}") from exc
    if halo is None:
        return dispatch(name, _pool_rule, [x], static)
    ext = run_halos(redistribute_spec(x, x_in), halo, float("-inf") if kind == "max" else 0.0)
    return dispatch(name + ".window", _pool_window_rule, [ext], ((x._spec,) + static,))


def _max_pool(nd):
    name = f"max_pool{nd}d"

    def max_pool(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
        return _pool(name, "max", nd, input, kernel_size, stride, padding, dilation, ceil_mode,
                     return_indices=return_indices)

    max_pool.__name__ = max_pool.__qualname__ = name
    max_pool.__doc__ = (f"``F.{name}``: batch/channel shards pool locally, spatial shards exchange halos "
                        "(-inf at the edges); return_indices gathers sharded spatial dims (indices are global).")
    return max_pool


def _avg_pool(nd):
    name = f"avg_pool{nd}d"

    def avg_pool(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        return _pool(name, "avg", nd, input, kernel_size, stride, padding, 1, ceil_mode, count_include_pad,
                     divisor_override if nd > 1 else None)

    if nd == 1:
        def avg_pool1d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True):
            return avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad)
        fn = avg_pool1d
    else:
        fn = avg_pool
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"``F.{name}``: batch/channel shards pool locally, spatial shards exchange halos (zeros at the "
                  "edges); linear, so Partial(sum|avg) inputs stay partial.")
    return fn


max_pool1d = register("max_pool1d", rule=_pool_rule, kernel=_pool_kernel,
                      torch_fns=(F.max_pool1d, torch.max_pool1d), functional=True)(_max_pool(1))
max_pool2d = register("max_pool2d", rule=_pool_rule, kernel=_pool_kernel,
                      torch_fns=(F.max_pool2d, torch.max_pool2d), functional=True)(_max_pool(2))
avg_pool1d = register("avg_pool1d", rule=_pool_rule, kernel=_pool_kernel,
                      torch_fns=(F.avg_pool1d, torch.avg_pool1d), functional=True)(_avg_pool(1))
avg_pool2d = register("avg_pool2d", rule=_pool_rule, kernel=_pool_kernel,
                      torch_fns=(F.avg_pool2d,), functional=True)(_avg_pool(2))


# ------------------------------------------------------------------------------------------------
# adaptive average pooling


@kernel("pool.adaptive_avg")
def _adaptive_kernel(x, *, lead=0, nd: int, output_size, summed=(), sizes=()):
    for d, n in zip(summed, sizes):  # a sharded dim pooled to one value: this device's share of the mean
        x = x.sum(d, keepdim=True) / n
    return _fold(lambda t: _ADAPTIVE[nd](t, output_size), x, lead, nd)


def _adaptive_rule(specs, nd, output_size):
    x = specs[0]
    if x.ndim not in (nd + 1, nd + 2):
        raise OpError(f"expected a {nd + 2}-D input [N, C, *spatial] or {nd + 1}-D [C, *spatial], got shape "
                      f"{list(x.shape)}")
    first = x.ndim - nd
    size = tuple(x.shape[first + k] if o is None else o for k, o in enumerate(output_size))
    meta = meta_call(lambda t: _ADAPTIVE[nd](t, size), (x,))
    pl, out_pl, summed = [], [], set()
    for p in x.placements:
        if isinstance(p, Shard) and p.dim < first:
            pl.append(p)
            out_pl.append(p)
        elif isinstance(p, Shard) and size[p.dim - first] == 1 and p.dim - x.ndim not in summed:
            summed.add(p.dim - x.ndim)
            pl.append(p)
            out_pl.append(Partial("sum"))
        elif isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            pl.append(p)
            out_pl.append(p)
        else:
            pl.append(_R)
            out_pl.append(_R)
    summed = tuple(sorted(summed))
    out = DTensorSpec(x.mesh, tuple(out_pl), tuple(meta.shape), meta.dtype)
    return OpPlan((spec_like(x, placements=pl),), (out,), _adaptive_kernel,
                  {"nd": nd, "output_size": size, "summed": summed, "sizes": tuple(x.shape[d] for d in summed)})


def _adaptive(nd):
    name = f"adaptive_avg_pool{nd}d"

    def adaptive_avg_pool(input, output_size):
        (x,) = to_dtensors(name, [input])
        if not isinstance(x, Tensor):
            raise OpError(f"dtorch.{name} expects a tensor, got {type(input).__name__}")
        if isinstance(output_size, (list, tuple)):
            if len(output_size) != nd:
                raise OpError(f"dtorch.{name}: output_size must be an int or {nd} values, got {list(output_size)}")
            size = tuple(None if o is None else int(o) for o in output_size)
        else:
            size = (int(output_size),) * nd
        return dispatch(name, _adaptive_rule, [x], (nd, size))

    adaptive_avg_pool.__name__ = adaptive_avg_pool.__qualname__ = name
    adaptive_avg_pool.__doc__ = (f"``F.{name}``: batch/channel shards local; a sharded spatial dim pooled to one "
                                 "value gives Partial(sum) (no gather), other sizes gather it.")
    return adaptive_avg_pool


adaptive_avg_pool1d = register("adaptive_avg_pool1d", rule=_adaptive_rule, kernel=_adaptive_kernel,
                               torch_fns=(F.adaptive_avg_pool1d, torch.adaptive_avg_pool1d), functional=True)(_adaptive(1))
adaptive_avg_pool2d = register("adaptive_avg_pool2d", rule=_adaptive_rule, kernel=_adaptive_kernel,
                               torch_fns=(F.adaptive_avg_pool2d,), functional=True)(_adaptive(2))


# ------------------------------------------------------------------------------------------------
# interpolate and pad: the resized / padded dims are whole on every device


def _whole_dims_rule(x: DTensorSpec, dims: set, partial_ok, kern, kwargs, meta) -> OpPlan:
    pl = []
    for p in x.placements:
        if isinstance(p, Shard) and p.dim not in dims:
            pl.append(p)
        elif isinstance(p, Partial) and partial_ok(p):
            pl.append(p)
        else:
            pl.append(_R)
    out = DTensorSpec(x.mesh, tuple(pl), tuple(meta.shape), meta.dtype)
    return OpPlan((spec_like(x, placements=pl),), (out,), kern, kwargs)


@kernel("pool.interpolate")
def _interpolate_kernel(x, *, lead=0, **kw):
    return _fold(lambda t: F.interpolate(t, **kw), x, lead)


def _interpolate_rule(specs, kw):
    x = specs[0]
    kwargs = dict(kw)
    meta = meta_call(lambda t: F.interpolate(t, **kwargs), (x,))
    return _whole_dims_rule(x, set(range(2, x.ndim)), lambda p: p.reduce_op in ("sum", "avg"),
                            _interpolate_kernel, kwargs, meta)


@register(rule=_interpolate_rule, kernel=_interpolate_kernel, torch_fns=(F.interpolate,), functional=True)
def interpolate(input, size=None, scale_factor=None, mode="nearest", align_corners=None, recompute_scale_factor=None,
                antialias=False):
    """``F.interpolate`` on [N, C, *spatial]: batch and channel shards resize locally, sharded spatial dims are
    gathered; every mode is linear in the input, so Partial(sum|avg) stays partial."""
    (x,) = to_dtensors("interpolate", [input])
    if not isinstance(x, Tensor):
        raise OpError(f"dtorch.interpolate expects a tensor, got {type(input).__name__}")

    def hashable(v):
        return tuple(v) if isinstance(v, list) else v

    kw = (("size", hashable(size)), ("scale_factor", hashable(scale_factor)), ("mode", mode),
          ("align_corners", align_corners), ("recompute_scale_factor", recompute_scale_factor), ("antialias", antialias))
    return dispatch("interpolate", _interpolate_rule, [x], (kw,))


@kernel("pool.pad")
def _pad_kernel(x, *, lead=0, pad, mode: str, value):
    if mode == "constant":
        return F.pad(x, pad, mode, value)
    return _fold(lambda t: F.pad(t, pad, mode), x, lead)


def _pad_rule(specs, pad, mode, value):
    x = specs[0]
    meta = meta_call(lambda t: F.pad(t, pad, mode, value), (x,))
    dims = {x.ndim - 1 - k // 2 for k in range(len(pad)) if pad[k]}

    def partial_ok(p):
        if p.reduce_op == "sum":
            return mode != "constant" or not value
        return True

    return _whole_dims_rule(x, dims, partial_ok, _pad_kernel, {"pad": pad, "mode": mode, "value": value}, meta)


@register(rule=_pad_rule, kernel=_pad_kernel, torch_fns=(F.pad,), functional=True)
def pad(input, pad, mode: str = "constant", value=None):
    """``F.pad`` (constant, reflect, replicate, circular): dims that get padding are gathered, the others keep
    their shards."""
    (x,) = to_dtensors("pad", [input])
    if not isinstance(x, Tensor):
        raise OpError(f"dtorch.pad expects a tensor, got {type(input).__name__}")
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise OpError(f"dtorch.pad: mode must be 'constant', 'reflect', 'replicate' or 'circular', got {mode!r}")
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise OpError(f"dtorch.pad: pad must have an even length of at most 2 * {x.ndim} values, got {list(pad)}")
    if mode != "constant" and value:
        raise OpError(f"dtorch.pad: value is only used by mode='constant', got value={value} with mode={mode!r}")
    return dispatch("pad", _pad_rule, [x], (tuple(int(p) for p in pad), mode, None if value is None else float(value)))
