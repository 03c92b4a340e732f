"""Losses: cross_entropy (Megatron's vocab-parallel form) and mse_loss, built from dtorch ops.

Cross entropy on logits [N, C, d...] (class dim 1; [C] for one sample) never gathers the class dim:

    m     = amax(x, C)               P(max) over class shards   -> all_reduce of [N, 1, d...]
    z     = x - m                    keeps x's layout
    se    = sum(exp(z), C)           P(sum) over class shards   -> all_reduce of [N, 1, d...]
    logp  = z - log(se)              keeps x's layout (torch's log_softmax, in its order)
    pick  = logp[i, t_i]             each class shard picks the targets in its range (its offset is a
                                     per-device value), zero elsewhere: P(sum), [N, d...]
    smooth = sum(logp * w, C)        label smoothing only: P(sum), [N, d...]

Batch (and other non-class) shards pass through every step, so the loss stays sharded until the final
sum, which leaves a Partial scalar. Every step is a dispatched op: autograd records it, and the
gradient of the logits comes out with the logits' own layout (dlogp -> dz is local; the reductions'
transposes are broadcasts of [N, 1, d...] tensors).

Class-index targets without label smoothing (a language model's loss) take shorter paths in float32/64:
with the classes split, ``lse - x[i, t_i]`` with ``lse = m + log(sum(exp(x - m), C))`` (one kernel for the sum
and the pick, so no logits-sized log-probabilities are made or differentiated, and the gradient of x is one
tensor, not two summed); with whole classes on every device, torch's own fused loss on each device's rows (a
sum per device, then the mean over the counted targets).

The target weights ``weight[t_i]`` are an embedding lookup (vocab-parallel when the weight is
sharded); ignored targets get weight 0 and pick 0. The formulas follow torch's
``cross_entropy_loss_label_smoothing`` / ``cross_entropy_loss_prob_target`` (ATen LossNLL.cpp).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import broadcast_shape as _broadcast_shape, kernel, per_device
from ..spec import DTensorSpec, block_offsets
from ..tensor import Tensor
from .args import IndexOutOfRangeError
from .dispatch import OpPlan, dispatch
from .rules import spec_like, to_dtensors
from .table import register

_REDUCTIONS = ("none", "mean", "sum")


def _reduction(reduction: str, size_average, reduce) -> str:
    if size_average is not None or reduce is not None:  # the legacy arguments, as torch reads them
        from torch.nn import _reduction

        return _reduction.legacy_get_string(size_average, reduce)
    if reduction not in _REDUCTIONS:
        raise OpError(f"dtorch loss: reduction={reduction!r} is not valid; use 'none', 'mean' or 'sum'")
    return reduction


def _reduced(t: Tensor) -> Tensor:
    """``t`` with its Partial mesh dims reduced (a recorded redistribution: gradients pass through)."""
    pl = [Replicate() if isinstance(p, Partial) else p for p in t.placements]
    return t.redistribute(t.device_mesh, pl) if pl != list(t.placements) else t


# -- the target pick: logp[i, t_i] with the class dim possibly sharded ------------------------------

def check_targets(t: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Class indices must lie in [0, C) or equal ignore_index, as torch requires (a class-sharded pick
    would silently give 0 for them)."""
    if t.numel() == 0:
        return
    bad = (t != ignore_index) & ((t < 0) | (t >= n_classes))
    if t.device.type != "cpu":
        torch._assert_async(~bad.any(), f"dtorch.cross_entropy: a target is out of bounds for {n_classes} classes")
        return
    if bad.any():
        first = int(t[bad].flatten()[0])
        raise IndexOutOfRangeError(
            f"dtorch.cross_entropy: target {first} is out of bounds for {n_classes} classes; targets must lie in "
            f"[0, {n_classes}) or equal ignore_index ({ignore_index})")


def _target_index(x, target, lead: int, cd: int, n_classes: int, ignore_index: int, masked: bool, class_off):
    """(each target's class index in this device's block of ``x``, unsqueezed at ``cd``; whether it counts).
    x: lead + [n, c_local, d...] (class dim cd, negative); target: lead + [n, d...]. Masked: this device holds
    classes [off, off + c_local); a target outside them counts nowhere here (another class shard picks it)."""
    t = target.long()
    check_targets(t, n_classes, ignore_index)
    keep = t != ignore_index
    if masked:
        t = t - per_device(class_off, t, lead)
        keep = keep & (t >= 0) & (t < x.shape[cd])
    return torch.where(keep, t, 0).unsqueeze(cd), keep


def _take(x, idx, keep, cd: int):
    """x[i, t_i] (0 where ``keep`` is False), broadcasting a replicated block's grid dims."""
    if x.shape[cd] == 0:  # an empty class shard (uneven split) picks nothing
        row = list(x.shape)
        row[cd] = 1
        return x.new_zeros(torch.broadcast_shapes(tuple(row), idx.shape)).squeeze(cd)
    out = torch.take_along_dim(x, idx, dim=cd).squeeze(cd)
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


@kernel("loss.pick_class")
def _pick_kernel(x, target, *, lead, cd: int, n_classes: int, ignore_index: int, masked: bool, class_off=0):
    idx, keep = _target_index(x, target, lead, cd, n_classes, ignore_index, masked, class_off)
    return _take(x, idx, keep, cd)


def _pick_rule(specs, cd, n_classes, ignore_index):
    """Per mesh dim (x [N, C, d...], target [N, d...], output like target):

        x S(C)                -> target R, out P(sum)   each class shard picks the targets in its range
        x S(k), k != C        -> target S(k'), out S(k') the same rows of both (k' = k without C)
        target S(j), x R/P    -> x S(j'), out S(j)      cut x locally to the target's rows
        otherwise             -> R
    """
    x, t = specs
    x_pl, t_pl, out_pl = [], [], []
    for px, pt in zip(x.placements, t.placements):
        if isinstance(px, Shard) and px.dim == cd:
            x_pl.append(px), t_pl.append(Replicate()), out_pl.append(Partial("sum"))
        elif isinstance(px, Shard):
            k = px.dim if px.dim < cd else px.dim - 1
            x_pl.append(px), t_pl.append(Shard(k)), out_pl.append(Shard(k))
        elif isinstance(pt, Shard):
            j = pt.dim if pt.dim < cd else pt.dim + 1
            x_pl.append(Shard(j)), t_pl.append(pt), out_pl.append(pt)
        else:
            x_pl.append(Replicate()), t_pl.append(Replicate()), out_pl.append(Replicate())
    x_in = spec_like(x, placements=x_pl)
    masked = any(isinstance(p, Shard) and p.dim == cd for p in x_pl)
    out = DTensorSpec(x.mesh, tuple(out_pl), t.shape, x.dtype)
    kwargs = {"cd": cd - x.ndim, "n_classes": n_classes, "ignore_index": ignore_index, "masked": masked}
    device_args = {"class_off": block_offsets(x_in, cd)} if masked else None
    return OpPlan((x_in, spec_like(t, placements=t_pl)), (out,), _pick_kernel, kwargs, device_args)


def _pick(logp: Tensor, target: Tensor, cd: int, ignore_index: int) -> Tensor:
    """``logp[i, target_i]`` (0 where the target is ignore_index), without gathering the class dim."""
    return dispatch("loss.pick_class", _pick_rule, [logp, target], (cd, logp.shape[cd], ignore_index))


# -- cross_entropy ----------------------------------------------------------------------------------

def _log_softmax(x: Tensor, cd: int) -> Tensor:
    dtype = x.dtype
    if dtype in (torch.float16, torch.bfloat16):  # torch's log_softmax computes in float32, rounds once
        x = x.float()
    m = _reduced(x.detach().amax(cd, keepdim=True))  # [N, 1, d...]: the shift changes no gradient
    z = x - m
    se = _reduced(z.exp().sum(cd, keepdim=True))  # [N, 1, d...]
    logp = z - se.log()
    return logp if logp.dtype == dtype else logp.to(dtype)


def _target_weights(target: Tensor, valid: Tensor, weight: Tensor) -> Tensor:
    """``weight[t_i]`` per target, 0 where it is ignored (an embedding lookup: vocab-parallel when the weight is
    sharded)."""
    return F.embedding(target.masked_fill(~valid, 0), weight.unsqueeze(1)).squeeze(-1) * valid


class _SumExpPick(torch.autograd.Function):
    """(sum(exp(x - m), C), x[t]) of one device block, with x's gradient written as one tensor:
    exp(x - m) * d_se (torch's derivative of exp(x - m).sum(C)), the pick's cotangent added in place at the
    targets. Torch's derivatives of the two as separate kernels give the same values as two logits-sized terms
    (the pick's a zero-filled scatter) summed afterwards into a tensor laid out as neither (so the GEMM behind
    the logits copied it again). ``m`` (the row max, detached by the caller) gets no gradient."""

    @staticmethod
    def forward(ctx, x, m, idx, keep, cd):
        e = torch.exp_(x - m)  # (in place: the shifted copy is not needed after; exp's own bits)
        picked = _take(x, idx, keep, cd)
        ctx.save_for_backward(e, idx, keep)  # (exp's result, as torch's ExpBackward saves it)
        ctx.cd = cd
        return e.sum(cd, keepdim=True), picked

    @staticmethod
    def backward(ctx, d_se, d_pick):
        e, idx, keep = ctx.saved_tensors
        cd = ctx.cd
        dx = d_se.expand(e.shape) * e  # torch's: sum's backward expands, exp's multiplies by its result
        if e.shape[cd]:
            src = torch.where(keep, d_pick, torch.zeros((), dtype=d_pick.dtype, device=d_pick.device)).unsqueeze(cd)
            dx.scatter_add_(cd, idx.expand(src.shape), src)  # (the pick's grid is x's: the rule's)
        return dx, None, None, None, None


@kernel("loss.sum_exp_pick")
def _sum_exp_pick_kernel(x, m, target, *, lead, cd: int, n_classes: int, ignore_index: int, masked: bool,
                         class_off=0):
    idx, keep = _target_index(x, target, lead, cd, n_classes, ignore_index, masked, class_off)
    return _SumExpPick.apply(x, m, idx, keep, cd)


def _sum_exp_pick_rule(specs, cd, n_classes, ignore_index):
    """(sum(exp(x - m), C), x[t]) for logits x, their row max m ([N, 1, d...]) and class-index targets t: x and t
    placed as the pick needs them (``_pick_rule``: every mesh dim of t's grid is one of x's); m replicated over
    class shards, elsewhere like x; a class shard's sum is a Partial(sum) term, the other dims keep x's layout."""
    x, _, t = specs
    pick = _pick_rule((x, t), cd, n_classes, ignore_index)
    x_in, t_in = pick.in_specs
    m_pl = tuple(Replicate() if isinstance(p, Shard) and p.dim == cd else p for p in x_in.placements)
    se_pl = tuple(Partial("sum") if isinstance(p, Shard) and p.dim == cd else p for p in x_in.placements)
    row = x.shape[:cd] + (1,) + x.shape[cd + 1:]
    return OpPlan((x_in, DTensorSpec(x.mesh, m_pl, row, x.dtype), t_in),
                  (DTensorSpec(x.mesh, se_pl, row, x.dtype), pick.out_specs[0]), _sum_exp_pick_kernel,
                  pick.kwargs, pick.device_args, multi_output=True)


def _nll_of_logits(x: Tensor, target: Tensor, weight, cd: int, ignore_index: int, reduction: str) -> Tensor:
    """Cross entropy of class-index targets as logsumexp(x) - x[t], without the [N, C, d...] log-probabilities:
    two passes over the logits forward (max, then the sum of exponentials) and the gradient
    softmax(x) - onehot(t) from torch's derivatives of those kernels, where the log_softmax form makes and
    differentiates four logits-sized tensors."""
    m = _reduced(x.detach().amax(cd, keepdim=True))  # [N, 1, d...]: keeps exp in range, changes no gradient
    # one kernel for the sum of exponentials and x[i, t_i] (0 where ignored): one gradient of x, not two summed
    se, picked = dispatch("loss.sum_exp_pick", _sum_exp_pick_rule, [x, m, target], (cd, x.shape[cd], ignore_index))
    lse = (m + _reduced(se).log()).squeeze(cd)  # [N, d...]
    valid = target != ignore_index
    nll = (lse - picked).masked_fill(~valid, 0.0)  # (a row of -inf logits must not leak NaN from 0 * nan)
    if weight is None:
        w_t = valid.to(x.dtype)
    else:
        w_t = _target_weights(target, valid, weight)
        nll = nll * w_t
    if reduction == "sum":
        return nll.sum()
    if reduction == "mean":
        return nll.sum() / w_t.sum()
    return nll


@kernel("loss.cross_entropy_rows")
def _rows_ce_kernel(x, target, *weight, lead, ignore_index: int, reduction: str):
    # x: lead + [n, C, d...] (whole classes), target: lead + [n, d...]. Every stacked device's positions are
    # rows of one fused call on [rows, C] (classes last: a view of logits laid out [.., C], as a language
    # model's are), their losses summed per device for "sum"
    check_targets(target, x.shape[lead + 1], ignore_index)
    grid = _broadcast_shape([x.shape[:lead], target.shape[:lead]])
    x, target = x.expand(grid + tuple(x.shape[lead:])), target.expand(grid + tuple(target.shape[lead:]))
    w = weight[0].reshape(-1, weight[0].shape[-1])[0] if weight else None  # (replicated: any copy)
    out = F.cross_entropy(x.movedim(lead + 1, -1).reshape(-1, x.shape[lead + 1]), target.reshape(-1), w,
                          ignore_index=ignore_index, reduction="none").reshape(target.shape)
    return out.sum(tuple(range(lead, out.ndim))) if reduction == "sum" else out


def _rows_ce_rule(specs, cd, ignore_index, reduction):
    """Class-index cross entropy with whole classes on every device, per mesh dim (x [N, C, d...], target
    [N, d...]): x S(k) -> target S(k'), the loss P(sum) ("sum") or S(k') ("none"); a sharded target cuts x
    to its rows; otherwise replicated. The weight is replicated."""
    x, t = specs[:2]
    x_pl, t_pl, out_pl = [], [], []
    for px, pt in zip(x.placements, t.placements):
        if isinstance(px, Shard):
            k = px.dim if px.dim < cd else px.dim - 1
            row = Shard(k)
        elif isinstance(pt, Shard):
            k, row = pt.dim, pt
            px = Shard(k if k < cd else k + 1)
        else:
            x_pl.append(Replicate()), t_pl.append(Replicate()), out_pl.append(Replicate())
            continue
        x_pl.append(px), t_pl.append(row), out_pl.append(Partial("sum") if reduction == "sum" else row)
    in_specs = (spec_like(x, placements=x_pl), spec_like(t, placements=t_pl)) + \
        tuple(spec_like(w, placements=(Replicate(),) * w.mesh.ndim) for w in specs[2:])
    out = DTensorSpec(x.mesh, tuple(out_pl), () if reduction == "sum" else t.shape, x.dtype)
    return OpPlan(in_specs, (out,), _rows_ce_kernel, {"ignore_index": ignore_index, "reduction": reduction})


def _rows_nll(x: Tensor, target: Tensor, weight, cd: int, ignore_index: int, reduction: str) -> Tensor:
    """Cross entropy of class-index targets when no device splits the classes: torch's fused loss on each
    device's rows (its log_softmax and its derivative), a sum per device, then the mean over the targets
    counted (weighted as torch weights them)."""
    operands = [x, target] + ([weight] if weight is not None else [])
    loss = dispatch("loss.cross_entropy_rows", _rows_ce_rule, operands,
                    (cd, ignore_index, "none" if reduction == "none" else "sum"))
    if reduction != "mean":
        return loss
    valid = target != ignore_index
    if weight is None:
        return loss / valid.to(x.dtype).sum()
    return loss / _target_weights(target, valid, weight).sum()


def _check_ce(x: Tensor, target: Tensor, weight, cd: int, label_smoothing: float) -> bool:
    """Validate the arguments like torch; True when ``target`` holds class probabilities."""
    if not x.dtype.is_floating_point:
        raise OpError(f"dtorch.cross_entropy: input must be floating point logits, got {x.dtype}")
    if x.ndim == 0:
        raise OpError("dtorch.cross_entropy: input must have a class dim ([C], [N, C] or [N, C, d1, ...]), got a 0-d tensor")
    if not 0.0 <= label_smoothing <= 1.0:
        raise OpError(f"dtorch.cross_entropy: label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    c = x.shape[cd]
    if weight is not None and (weight.ndim != 1 or weight.shape[0] != c):
        raise OpError(f"dtorch.cross_entropy: weight must be 1-D with one entry per class ({c}), got shape "
                      f"{list(weight.shape)}")
    probs = target.dtype.is_floating_point
    if probs:
        if tuple(target.shape) != tuple(x.shape):
            raise OpError(f"dtorch.cross_entropy: class-probability targets must have the input's shape "
                          f"{list(x.shape)}, got {list(target.shape)}")
        return True
    if target.dtype.is_complex or target.dtype == torch.bool:
        raise OpError(f"dtorch.cross_entropy: target must hold class indices (int64) or class probabilities "
                      f"(floating point), got {target.dtype}")
    want = x.shape[:cd] + x.shape[cd + 1:]
    if tuple(target.shape) != tuple(want):
        raise OpError(f"dtorch.cross_entropy: expected a target of shape {list(want)} (the input's shape "
                      f"{list(x.shape)} without the class dim {cd}), got {list(target.shape)}")
    return False


def _class_view(weight: Tensor, ndim: int, cd: int) -> Tensor:
    """weight [C] shaped to broadcast along the class dim of an ``ndim``-D input."""
    return weight if cd == ndim - 1 else weight.reshape((weight.shape[0],) + (1,) * (ndim - cd - 1))


@register(torch_fns=(F.cross_entropy,), functional=True, public=False)
def cross_entropy(input, target, weight=None, size_average=None, ignore_index: int = -100, reduce=None,
                  reduction: str = "mean", label_smoothing: float = 0.0):
    """``F.cross_entropy`` on logits [N, C, d...] ([C] for one sample) with class-index or class-probability
    targets. Logits sharded on the class dim are never gathered (module docstring)."""
    reduction = _reduction(reduction, size_average, reduce)
    if isinstance(target, torch.Tensor) and target.device.type == "cpu" and not target.dtype.is_floating_point \
            and isinstance(input, (Tensor, torch.Tensor)) and input.ndim > 0:
        check_targets(target, input.shape[1 if input.ndim > 1 else 0], ignore_index)  # before anything runs
    x, target, weight = to_dtensors("cross_entropy", [input, target, weight])
    if not isinstance(x, Tensor) or not isinstance(target, Tensor):
        raise OpError("dtorch.cross_entropy: input and target must be tensors")
    cd = 1 if x.ndim > 1 else 0
    probs = _check_ce(x, target, weight, cd, float(label_smoothing))
    operands = [x, target] + ([weight] if weight is not None else [])
    if all(all(isinstance(p, Replicate) for p in t.placements) for t in operands):
        # nothing is sharded: torch's own fused call on every device (its bits, its derivative)
        return dispatch("cross_entropy", _whole_ce_rule, operands,
                        (int(ignore_index), reduction, float(label_smoothing)))
    n_classes = x.shape[cd]
    eps = float(label_smoothing)
    x = _reduced(x)  # Partial logits (a row-parallel output): their terms reduce once here
    if not probs and eps == 0 and x.dtype in (torch.float32, torch.float64):
        if any(isinstance(p, Shard) and p.dim == cd for p in x.placements):
            return _nll_of_logits(x, target, weight, cd, ignore_index, reduction)
        if x.ndim > 1:  # every device holds whole rows of classes: torch's fused loss on them
            return _rows_nll(x, target, weight, cd, ignore_index, reduction)
    logp = _log_softmax(x, cd)
    w_b = None if weight is None else _class_view(weight, x.ndim, cd)
    if probs:
        if eps > 0:
            target = target * (1 - eps) + eps / n_classes
        prod = logp * target if w_b is None else logp * target * w_b
        if reduction == "none":
            return -prod.sum(cd)
        if reduction == "sum":
            return -prod.sum()
        return -prod.sum() / (x.numel() / n_classes)

    valid = target != ignore_index
    picked = _pick(logp, target, cd, ignore_index)  # [N, d...], 0 where ignored
    if weight is None:
        w_t = valid.to(x.dtype)
        nll = -picked
    else:
        w_t = _target_weights(target, valid, weight)
        nll = -(w_t * picked)
    if reduction == "sum":
        nll = nll.sum()
    elif reduction == "mean":
        denom = w_t.sum()
        nll = nll.sum() / denom
    if eps == 0:
        return nll
    smooth = -(logp.sum(cd) if w_b is None else (logp * w_b).sum(cd))
    smooth = smooth.masked_fill(~valid, 0.0)
    if reduction == "sum":
        smooth = smooth.sum()
    elif reduction == "mean":
        smooth = smooth.sum() / denom
    return (1 - eps) * nll + smooth * (eps / n_classes)


@kernel("loss.cross_entropy_whole")
def _whole_ce_kernel(x, target, *weight, lead=0, ignore_index, reduction, label_smoothing):
    grid = x.shape[:lead]
    x, target, *weight = [t.reshape(t.shape[lead:]) for t in (x, target, *weight)]  # (every grid dim is 1)
    kw = dict(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if x.ndim > 2 and not target.dtype.is_floating_point and x.movedim(1, -1).is_contiguous():
        # logits laid out [N, d.., C] and passed transposed (a language model's): rows of one call, as Hugging
        # Face's loss flattens them (torch's class-dim-1 kernel on this layout is 4x slower)
        out = F.cross_entropy(x.movedim(1, -1).reshape(-1, x.shape[1]), target.reshape(-1),
                              weight[0] if weight else None, **kw)
        out = out.reshape(target.shape) if reduction == "none" else out
    else:
        out = F.cross_entropy(x, target, weight[0] if weight else None, **kw)
    return out.reshape(tuple(grid) + tuple(out.shape))


def _whole_ce_rule(specs, ignore_index, reduction, label_smoothing):
    x = specs[0]
    cd = 1 if len(x.shape) > 1 else 0
    shape = x.shape[:cd] + x.shape[cd + 1:] if reduction == "none" else ()  # (the class dim reduced)
    return OpPlan(tuple(specs), (DTensorSpec(x.mesh, x.placements, shape, x.dtype),), _whole_ce_kernel,
                  {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": label_smoothing})


# -- mse_loss ---------------------------------------------------------------------------------------

@register(torch_fns=(F.mse_loss,), functional=True, public=False)
def mse_loss(input, target, size_average=None, reduce=None, reduction: str = "mean", weight=None):
    """``F.mse_loss``: (input - target)^2 (times ``weight``), then mean / sum / none, like torch (a target of
    another shape broadcasts, with torch's warning). Element-wise, so any layout stays as it is until the
    final reduction (a Partial scalar over sharded dims)."""
    reduction = _reduction(reduction, size_average, reduce)
    x, t, w = to_dtensors("mse_loss", [input, target, weight])
    if not isinstance(x, Tensor) or not isinstance(t, Tensor):
        raise OpError("dtorch.mse_loss: input and target must be tensors")
    if tuple(t.shape) != tuple(x.shape):
        warnings.warn(f"Using a target size ({torch.Size(t.shape)}) that is different to the input size "
                      f"({torch.Size(x.shape)}). This will likely lead to incorrect results due to broadcasting. "
                      "Please ensure they have the same size.", stacklevel=2)
    sq = (x - t).pow(2)
    if w is not None:
        if tuple(w.shape) != tuple(x.shape):
            raise OpError(f"dtorch.mse_loss: weight {list(w.shape)} must have the input's shape {list(x.shape)}")
        sq = sq * w
        if reduction == "mean":
            return sq.sum() / w.sum()
    if reduction == "none":
        return sq
    return sq.sum() if reduction == "sum" else sq.mean()
