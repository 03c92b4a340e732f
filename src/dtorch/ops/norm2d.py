"""batch_norm, group_norm, instance_norm on [N, C, *spatial].

batch_norm in training (or without running statistics): the per-channel mean and variance over the
batch and spatial dims are dtorch reductions, so each device sums its own rows and one all-reduce of
the per-channel sums per sharding mesh dim makes them whole (never a gather of the activations); the
output is element-wise from there and keeps x's layout. Channel shards keep theirs (each device
normalises its own channels; weight, bias and running statistics follow them). The running statistics
(dtorch tensors) are updated in place as torch does: ``r = (1 - momentum) * r + momentum * stat``, the
variance unbiased. In eval mode it is one kernel (``F.batch_norm`` with the running statistics) per
device, x in any layout but Partial (a Partial(avg) stays: the op is affine).

group_norm / instance_norm: one kernel per device. Batch shards are local; channel shards are local
when every device holds whole groups (instance_norm: always) with weight and bias sharded alike; sharded
spatial dims and other channel shards are gathered (Replicate on that mesh dim).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..autograd.mode import no_grad
from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .dispatch import OpPlan, dispatch
from .rules import meta_call, spec_like, to_dtensors
from .table import register

_R = Replicate()


def _channel_view(t: Tensor, ndim: int) -> Tensor:
    return t.reshape((1, t.shape[0]) + (1,) * (ndim - 2))


def _replicate_partials(t: Tensor) -> Tensor:
    """Statistics are used by every device: Partial sums are all-reduced (one per mesh dim), shards stay."""
    pl = [_R if isinstance(p, Partial) else p for p in t.placements]
    return t if list(pl) == list(t.placements) else t.redistribute(t.device_mesh, pl)


# -- batch_norm --------------------------------------------------------------------------------------

@kernel("norm2d.batch_norm_eval")
def _bn_eval_kernel(x, rm, rv, *wb, lead=0, eps: float, has_weight: bool, has_bias: bool):
    c = x.shape[lead + 1]
    # every device's blocks at once: the channel statistics broadcast against [*grid, N, C, *spatial]
    shape = tuple(rm.shape[:lead]) + (1, c) + (1,) * (x.ndim - lead - 2)
    if x.numel() and all(d == 1 for t in (x, rm, rv, *wb) for d in t.shape[:lead]):  # one block: torch's call
        grid = x.shape[:lead]
        x, rm, rv, *wb = [t.reshape(t.shape[lead:]) for t in (x, rm, rv, *wb)]
        w = wb[0] if has_weight else None
        b = wb[-1] if has_bias else None
        y = F.batch_norm(x, rm.detach(), rv.detach(), w, b, False, 0.0, eps)  # (torch: no gradient to them)
        return y.reshape(tuple(grid) + tuple(y.shape))
    y = (x - rm.reshape(shape)) * torch.rsqrt(rv.reshape(shape) + eps)
    if has_weight:
        y = y * wb[0].reshape(tuple(wb[0].shape[:lead]) + shape[lead:])
    if has_bias:
        y = y + wb[-1].reshape(tuple(wb[-1].shape[:lead]) + shape[lead:])
    return y


def _bn_eval_rule(specs, eps, has_weight, has_bias):
    x = specs[0]
    meta = meta_call(lambda xi, rm, rv, *wb: F.batch_norm(xi, rm, rv, wb[0] if has_weight else None,
                                                         wb[-1] if has_bias else None, False, 0.0, eps), specs)
    pl, cpl = [], []
    for p in x.placements:
        if isinstance(p, Shard):
            pl.append(p)
            cpl.append(Shard(0) if p.dim == 1 else _R)
        elif p == Partial("avg"):
            pl.append(p)
            cpl.append(_R)
        else:
            pl.append(_R)
            cpl.append(_R)
    out = DTensorSpec(x.mesh, tuple(pl), tuple(meta.shape), meta.dtype)
    ins = (spec_like(x, placements=pl),) + tuple(spec_like(s, placements=cpl) for s in specs[1:])
    return OpPlan(ins, (out,), _bn_eval_kernel, {"eps": eps, "has_weight": has_weight, "has_bias": has_bias})


def _bn_train(x: Tensor, running_mean, running_var, weight, bias, momentum, eps) -> Tensor:
    dims = (0,) + tuple(range(2, x.ndim))
    n = x.numel() // x.shape[1]
    if n <= 1:
        raise OpError(f"dtorch.batch_norm: expected more than 1 value per channel when training, got input size "
                      f"{list(x.shape)}")
    x = _replicate_partials(x)  # (once: the statistics and the output all read it)
    stats_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    xf = x.to(stats_dtype) if x.dtype != stats_dtype else x
    params = [t for t in (weight, bias) if t is not None]
    whole = all(all(isinstance(p, Replicate) for p in t.placements) for t in [x] + params)
    if whole and running_mean is None and running_var is None:
        # nothing sharded, no statistics to keep: torch's fused kernel on every device (its bits)
        return dispatch("batch_norm", _whole_bn_rule, [x] + params, (eps, weight is not None, bias is not None))
    mean = _replicate_partials(xf.mean(dims))  # per-channel sums: one all-reduce per batch/spatial mesh dim
    centered = xf - _channel_view(mean, x.ndim)
    var = _replicate_partials((centered * centered).mean(dims))
    if whole:  # the output from torch's fused kernel; the running statistics from the stats above
        y = dispatch("batch_norm", _whole_bn_rule, [x] + params, (eps, weight is not None, bias is not None))
    else:
        y = centered * _channel_view((var + eps).rsqrt(), x.ndim)
        if weight is not None:
            y = y * _channel_view(weight, x.ndim)
        if bias is not None:
            y = y + _channel_view(bias, x.ndim)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
    if running_mean is not None or running_var is not None:
        with no_grad():
            if running_mean is not None:
                _update(running_mean, mean, momentum)
            if running_var is not None:
                _update(running_var, var * (n / (n - 1)), momentum)
    return y


@kernel("norm2d.batch_norm_whole")
def _whole_bn_kernel(x, *wb, lead=0, eps: float, has_weight: bool, has_bias: bool):
    grid = x.shape[:lead]
    x, *wb = [t.reshape(t.shape[lead:]) for t in (x, *wb)]  # (every grid dim is 1: nothing is sharded)
    y = F.batch_norm(x, None, None, wb[0] if has_weight else None, wb[-1] if has_bias else None, True, 0.0, eps)
    return y.reshape(tuple(grid) + tuple(y.shape))


def _whole_bn_rule(specs, eps, has_weight, has_bias):
    return OpPlan(tuple(specs), (specs[0],), _whole_bn_kernel,
                  {"eps": eps, "has_weight": has_weight, "has_bias": has_bias})


def _update(running: Tensor, stat: Tensor, momentum: float) -> None:
    if not isinstance(running, Tensor):
        raise OpError("dtorch.batch_norm: running_mean / running_var must be dtorch tensors to be updated in place "
                      "(wrap them with dtorch.Tensor(..., device_mesh=...) or use dtorch.nn.BatchNorm2d)")
    stat = stat.detach().to(running.dtype)
    running.mul_(1.0 - momentum).add_(stat * momentum)


@register(rule=_bn_eval_rule, kernel=_bn_eval_kernel, torch_fns=(F.batch_norm,), functional=True)
def batch_norm(input, running_mean, running_var, weight=None, bias=None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5):
    """``F.batch_norm``. Training statistics are reduced across batch and spatial shards with all-reduces of
    per-channel sums; ``running_mean`` / ``running_var`` (dtorch tensors) are updated in place like torch."""
    x, rm, rv, w, b = to_dtensors("batch_norm", [input, running_mean, running_var, weight, bias])
    if not isinstance(x, Tensor):
        raise OpError(f"dtorch.batch_norm expects a tensor, got {type(input).__name__}")
    if x.ndim < 2:
        raise OpError(f"dtorch.batch_norm: expected an input [N, C, ...] of at least 2 dims, got shape {list(x.shape)}")
    c = x.shape[1]
    for name, t in (("running_mean", rm), ("running_var", rv), ("weight", w), ("bias", b)):
        if t is not None and tuple(t.shape) != (c,):
            raise OpError(f"dtorch.batch_norm: {name} must have shape [{c}] (the channels), got {list(t.shape)}")
    if training or rm is None or rv is None:
        if training and isinstance(running_mean, torch.Tensor) and not isinstance(running_mean, Tensor):
            raise OpError("dtorch.batch_norm: running_mean is a torch tensor; dtorch cannot update it in place. Pass "
                          "dtorch tensors (or None) as running statistics")
        return _bn_train(x, rm if training else None, rv if training else None, w, b, float(momentum), float(eps))
    tensors = [x, rm.detach(), rv.detach()] + [t for t in (w, b) if t is not None]  # (torch: no gradient to them)
    return dispatch("batch_norm", _bn_eval_rule, tensors, (float(eps), w is not None, b is not None))


# -- group_norm / instance_norm ----------------------------------------------------------------------

@kernel("norm2d.group_norm")
def _group_norm_kernel(x, *wb, lead=0, groups_per_channel: int, eps: float, has_weight: bool, has_bias: bool,
                       instance: bool = False):
    def one(xi, *p):
        w = p[0] if has_weight else None
        b = p[-1] if has_bias else None
        if xi.numel() == 0:  # an empty shard (uneven split): torch refuses it; nothing to normalise
            return xi + sum(t.sum() * 0 for t in p) if p else xi.clone()
        if instance:
            return F.instance_norm(xi, None, None, w, b, True, 0.0, eps)
        return F.group_norm(xi, xi.shape[1] // groups_per_channel, w, b, eps)

    if not lead:
        return one(x, *wb)
    from .conv import _per_grid
    return _per_grid(one, lead, x, wb)


def _channel_groups_ok(x: DTensorSpec, mesh_dim: int, cpg: int) -> bool:
    """Every device along ``mesh_dim`` holds whole groups of ``cpg`` channels."""
    for coord in x.mesh.coordinates():
        lo, n = x.local_box(coord)[1]
        if lo % cpg or n % cpg:
            return False
    return True


def _group_rule(specs, num_groups, eps, has_weight, has_bias, instance):
    x = specs[0]
    c = x.shape[1]
    cpg = 1 if instance else c // num_groups
    if instance:
        meta = meta_call(lambda xi, *p: F.instance_norm(xi, None, None, p[0] if has_weight else None,
                                                        p[-1] if has_bias else None, True, 0.0, eps), specs)
    else:
        meta = meta_call(lambda xi, *p: F.group_norm(xi, num_groups, p[0] if has_weight else None,
                                                     p[-1] if has_bias else None, eps), specs)
    pl, cpl = [], []
    for i, p in enumerate(x.placements):
        if p == Shard(0):
            pl.append(p)
            cpl.append(_R)
        elif p == Shard(1) and (instance or _channel_groups_ok(spec_like(x, placements=[
                q if k == i else _R for k, q in enumerate(x.placements)]), i, cpg)):
            pl.append(p)
            cpl.append(Shard(0))
        else:
            pl.append(_R)
            cpl.append(_R)
    x_in = spec_like(x, placements=pl)
    if not instance and not _channel_groups_ok(x_in, 0, cpg):  # nested channel shards that split a group
        pl = [_R if p == Shard(1) else p for p in pl]
        cpl = [_R] * len(cpl)
        x_in = spec_like(x, placements=pl)
    out = DTensorSpec(x.mesh, tuple(pl), tuple(meta.shape), meta.dtype)
    ins = (x_in,) + tuple(spec_like(s, placements=cpl) for s in specs[1:])
    return OpPlan(ins, (out,), _group_norm_kernel, {"groups_per_channel": cpg, "eps": eps, "has_weight": has_weight,
                                                    "has_bias": has_bias, "instance": instance})


@register(rule=_group_rule, kernel=_group_norm_kernel, torch_fns=(F.group_norm,), functional=True)
def group_norm(input, num_groups: int, weight=None, bias=None, eps: float = 1e-5):
    """``F.group_norm``: batch shards local, channel shards local when each device holds whole groups; sharded
    spatial dims are gathered."""
    x, w, b = to_dtensors("group_norm", [input, weight, bias])
    if not isinstance(x, Tensor):
        raise OpError(f"dtorch.group_norm expects a tensor, got {type(input).__name__}")
    if x.ndim < 2 or num_groups <= 0 or x.shape[1] % num_groups:
        raise OpError(f"dtorch.group_norm: the channels ({x.shape[1] if x.ndim > 1 else None}) must be divisible by "
                      f"num_groups ({num_groups}); input shape {list(x.shape)}")
    tensors = [x] + [t for t in (w, b) if t is not None]
    return dispatch("group_norm", _group_rule, tensors, (int(num_groups), float(eps), w is not None, b is not None, False))


@register(rule=_group_rule, kernel=_group_norm_kernel, torch_fns=(F.instance_norm,), functional=True)
def instance_norm(input, running_mean=None, running_var=None, weight=None, bias=None, use_input_stats: bool = True,
                  momentum: float = 0.1, eps: float = 1e-5):
    """``F.instance_norm``: per (sample, channel) statistics; batch and channel shards local, sharded spatial dims
    gathered. With ``use_input_stats=False`` it is batch_norm in eval mode."""
    if not use_input_stats:
        return batch_norm(input, running_mean, running_var, weight, bias, False, momentum, eps)
    if running_mean is not None or running_var is not None:
        raise OpError("dtorch.instance_norm: updating running statistics from instance statistics is not supported; "
                      "pass running_mean=None and running_var=None (InstanceNorm's default track_running_stats=False)")
    x, w, b = to_dtensors("instance_norm", [input, weight, bias])
    if not isinstance(x, Tensor):
        raise OpError(f"dtorch.instance_norm expects a tensor, got {type(input).__name__}")
    tensors = [x] + [t for t in (w, b) if t is not None]
    return dispatch("instance_norm", _group_rule, tensors, (0, float(eps), w is not None, b is not None, True))
