"""nn ops: embedding, layer_norm, rms_norm, dropout (silu/gelu/relu are element-wise, in pointwise.py).

Embedding, per mesh dim (weight [V, D], ids any shape, output ids.shape + [D]):

    weight S(0) (vocab), ids R -> P(sum)  each device looks up the ids in its vocab range, zeros
                                          elsewhere: exactly one device contributes each row
    weight S(1) (embed), ids R -> S(-1)   a column block of every row
    weight P(op),        ids R -> P(op)   a lookup selects rows, so it commutes with any reduction
    weight R,          ids S(k) -> S(k)   each device looks up its own ids
    otherwise                  -> R       (a weight shard wins over an ids shard: ids are cheap to gather)

Norms: the normalized (trailing) dims must be whole on every device; other dims keep their shards,
partial inputs are reduced first (normalization is not linear). weight/bias are replicated.

Dropout: the mask is drawn for the global tensor by torch on the controller (the same values as
``torch.nn.functional.dropout`` for the same seed on CPU, whatever the layout), laid out like the
input, and applied by an element-wise multiply (linear, so Partial inputs stay Partial).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel, per_device
from ..spec import DTensorSpec, block_offsets
from ..tensor import Tensor
from .args import IndexOutOfRangeError
from .dispatch import OpPlan, dispatch
from .rules import meta_call, replicated, spec_like, static_value, to_dtensors
from .table import register

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# -- embedding -------------------------------------------------------------------------------------

def check_token_ids(ids: torch.Tensor, vocab: int) -> None:
    """Token ids must lie in [0, vocab), as torch requires (a vocab-sharded lookup would give zero rows).

    Where ids live on the CPU this is a plain check with a clear error. On an accelerator it is an
    asynchronous device assert (no host sync per call): a bad id fails the device like torch's own
    embedding does there, with this message.
    """
    if ids.numel() == 0:
        return
    if ids.device.type != "cpu":
        torch._assert_async(((ids >= 0) & (ids < vocab)).all(),
                            f"dtorch.embedding: a token id is out of range for an embedding of {vocab} rows")
        return
    lo, hi = torch.aminmax(ids)
    if lo < 0 or hi >= vocab:
        bad = int(ids[(ids < 0) | (ids >= vocab)].flatten()[0])  # the first offender, in order
        raise IndexOutOfRangeError(
            f"dtorch.embedding: token id {bad} out of range for an embedding of {vocab} rows; ids must lie in "
            f"[0, {vocab}) (check the tokenizer's vocabulary against num_embeddings)")


@kernel("embedding")
def _embedding_kernel(ids, weight, *, lead, masked: bool, vocab: int, vocab_off=0, padding_idx=None):
    vl, d = weight.shape[-2], weight.shape[-1]
    idx = ids.long()
    check_token_ids(idx, vocab)
    if masked:
        idx = idx - per_device(vocab_off, idx, lead)
        valid = (idx >= 0) & (idx < vl)
        idx = torch.where(valid, idx, 0)
    if vl == 0:  # an empty vocab shard (uneven split) contributes nothing
        return torch.zeros(idx.shape + (d,), dtype=weight.dtype, device=weight.device)
    if lead:
        # gather rows straight from each grid block (the weight block may be a strided view of a larger
        # table: flattening it into one 2-D table would copy the whole table on every call)
        # (grid dims of size 1 are dropped by a view, not indexed with 0: under autograd each such select's
        # backward would write the table's gradient into a zeroed full copy)
        index = [torch.arange(g, device=weight.device).reshape((g,) + (1,) * (idx.ndim - k - 1))
                 for k, g in enumerate(weight.shape[:lead]) if g != 1]
        table = weight.reshape([g for g in weight.shape[:lead] if g != 1] + [vl, d])
        out = table[tuple(index) + (idx,)]
    else:
        out = F.embedding(idx, weight)
    if masked:
        out = torch.where(valid.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
    if padding_idx is not None and out.requires_grad:  # (the backward's rerun) the padding row gets no gradient
        out = torch.where((ids == padding_idx).unsqueeze(-1), out.detach(), out)
    return out


def _embedding_rule(specs, padding_idx):
    ids, w = specs
    if w.ndim != 2:
        raise OpError(f"dtorch.embedding: weight must be 2-D [num_embeddings, embedding_dim], got shape {list(w.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise OpError(f"dtorch.embedding: input ids must be an integer tensor, got {ids.dtype}")
    mesh, nid = ids.mesh, ids.ndim
    ids_pl, w_pl, out_pl = [], [], []
    for pi, pw in zip(ids.placements, w.placements):
        if isinstance(pw, Shard):
            ids_pl.append(Replicate())
            w_pl.append(pw)
            out_pl.append(Partial("sum") if pw.dim == 0 else Shard(nid))
        elif isinstance(pw, Partial):
            ids_pl.append(Replicate())
            w_pl.append(pw)
            out_pl.append(pw)
        elif isinstance(pi, Shard):
            ids_pl.append(pi)
            w_pl.append(Replicate())
            out_pl.append(pi)
        else:
            ids_pl.append(Replicate())
            w_pl.append(Replicate())
            out_pl.append(Replicate())
    w_in = spec_like(w, placements=w_pl)
    out = DTensorSpec(mesh, tuple(out_pl), ids.shape + (w.shape[1],), w.dtype)
    masked = any(isinstance(p, Shard) and p.dim == 0 for p in w_pl)
    device_args = None
    if masked:
        device_args = {"vocab_off": block_offsets(w_in, 0)}
    kwargs = {"masked": masked, "vocab": w.shape[0]}
    if padding_idx is not None:  # (static_value's ("int", n)) only the gradient depends on it, like torch
        kwargs["padding_idx"] = padding_idx[1] % w.shape[0]
    return OpPlan((spec_like(ids, placements=ids_pl), w_in), (out,), _embedding_kernel, kwargs, device_args)


def _torch_embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    # torch.embedding takes the weight first, and -1 (F.embedding has made any other index positive) for none
    return embedding(indices, weight, None if padding_idx < 0 else padding_idx,
                     scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)


@register(rule=_embedding_rule, kernel=_embedding_kernel, torch_fns=(F.embedding, (torch.embedding, _torch_embedding)),
          functional=True)
def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    """``F.embedding``: rows of ``weight`` [V, D] for the ids in ``input``.

    ``padding_idx``, ``scale_grad_by_freq`` and ``sparse`` only change gradients in torch, so the
    forward value ignores them. Ids outside [0, V) raise, like torch, whatever the weight's layout:
    torch ids on the CPU are checked here, before anything runs; others by the kernel (``check_token_ids``).
    """
    if isinstance(input, torch.Tensor) and input.device.type == "cpu" and isinstance(weight, (Tensor, torch.Tensor)) \
            and weight.ndim == 2 and not (input.is_floating_point() or input.is_complex()):
        check_token_ids(input, weight.shape[0])  # the ids are on the controller already: no device is waited for
    if max_norm is not None:
        raise OpError("dtorch.embedding: max_norm renormalizes the weight in place, which dtorch never does; "
                      "renormalize the weight explicitly and call embedding without max_norm")
    ids, w = to_dtensors("embedding", [input, weight])
    if not isinstance(w, Tensor) or not isinstance(ids, Tensor):
        raise OpError("dtorch.embedding: input and weight must be tensors")
    if (scale_grad_by_freq or sparse) and w.requires_grad:
        raise OpError("dtorch.embedding: scale_grad_by_freq and sparse gradients are not supported; call it "
                      "without them (the gradient is then torch's dense one)")
    if padding_idx is not None:
        v = w.shape[0]
        if not -v <= padding_idx < v:
            raise OpError(f"dtorch.embedding: padding_idx {padding_idx} must be within num_embeddings ({v})")
    return dispatch("embedding", _embedding_rule, [ids, w], (static_value(padding_idx),))


# -- layer_norm / rms_norm -------------------------------------------------------------------------

@kernel("layer_norm", align=True)
def _layer_norm_kernel(x, *wb, k: int, eps: float, has_weight: bool, has_bias: bool):
    shape = tuple(x.shape[x.ndim - k:])
    if all(t.numel() == math.prod(shape) for t in wb):
        # the normalized dims are whole on every device and weight/bias are one copy: torch's own fused
        # kernel on the block (dims before them are batch to it), so the result is torch's bit for bit
        w = wb[0].reshape(shape) if has_weight else None
        b = wb[-1].reshape(shape) if has_bias else None
        return F.layer_norm(x, shape, w, b, eps)
    # weight/bias differ per device (the gradient kernel expands them over the grid): torch's math, by hand
    dims = tuple(range(-k, 0))
    xf = x.float() if x.dtype in _LOW_PRECISION else x
    mean = xf.mean(dims, keepdim=True)
    centered = xf - mean
    var = centered.square().mean(dims, keepdim=True)
    y = centered * torch.rsqrt(var + eps)
    if has_weight:
        y = y * wb[0]
    if has_bias:
        y = y + wb[-1]
    return y.to(x.dtype)


@kernel("rms_norm")
def _rms_norm_kernel(x, *w, k: int, eps: float, lead: int = 0):
    # mirrors torch's decomposition: upcast, x * rsqrt(mean(x^2) + eps) * weight, cast back
    dims = tuple(range(-k, 0))
    xf = x.float() if x.dtype in _LOW_PRECISION else x
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + eps)
    if w:
        wt = w[0]
        if wt.ndim < x.ndim:  # the weight's local dims under x's last ones, its grid dims under x's (the
            # alignment an aligned kernel gets from the runtime; here, so that a grid run is one bound call)
            wt = wt.reshape(wt.shape[:lead] + (1,) * (x.ndim - wt.ndim) + wt.shape[lead:])
        y = y * wt
    return y.type_as(x)


def _norm_rule(name, specs, normalized_shape, kw):
    x = specs[0]
    # The output has x's shape, and its dtype comes from torch on small tensors (meta_call's out_shape):
    # those are cut to at most 2 per dim, so the norm runs over their own trailing sizes. Shapes torch
    # refuses go to the meta run with the given normalized_shape instead, which raises torch's error.
    k = len(normalized_shape)
    fits = k <= x.ndim and x.shape[x.ndim - k:] == normalized_shape and all(
        s.shape == normalized_shape for s in specs[1:])

    def shape_of(xi):
        return tuple(xi.shape[xi.ndim - k:]) if fits else normalized_shape

    if name == "layer_norm":
        def meta(xi, *wb):
            w = wb[0] if kw["has_weight"] else None
            b = wb[-1] if kw["has_bias"] else None
            return F.layer_norm(xi, shape_of(xi), w, b)
    else:
        def meta(xi, *w):
            return F.rms_norm(xi, shape_of(xi), *w)
    out_meta = meta_call(meta, specs, out_shape=x.shape if fits else None)
    first_norm = x.ndim - len(normalized_shape)
    # dims before the normalized ones keep their shards; everything else must be whole
    pl = [p if isinstance(p, Shard) and p.dim < first_norm else Replicate() for p in x.placements]
    x_in = spec_like(x, placements=pl)
    out = DTensorSpec(x.mesh, tuple(pl), tuple(out_meta.shape), out_meta.dtype)
    kernel_fn = _layer_norm_kernel if name == "layer_norm" else _rms_norm_kernel
    return OpPlan((x_in,) + tuple(replicated(s) for s in specs[1:]), (out,), kernel_fn,
                  dict(kw, k=len(normalized_shape)))


def _layer_norm_rule(specs, normalized_shape, eps, has_weight, has_bias):
    return _norm_rule("layer_norm", specs, normalized_shape,
                      {"eps": eps, "has_weight": has_weight, "has_bias": has_bias})


def _rms_norm_rule(specs, normalized_shape, eps):
    return _norm_rule("rms_norm", specs, normalized_shape, {"eps": eps})


def _normalized_shape(normalized_shape) -> tuple:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(s) for s in normalized_shape)


def _torch_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return layer_norm(input, normalized_shape, weight, bias, eps)


@register(rule=_layer_norm_rule, kernel=_layer_norm_kernel,
          torch_fns=(F.layer_norm, (torch.layer_norm, _torch_layer_norm)), functional=True)
def layer_norm(input, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """``F.layer_norm`` over the trailing ``normalized_shape`` dims."""
    ns = _normalized_shape(normalized_shape)
    args = to_dtensors("layer_norm", [input, weight, bias])
    tensors = [a for a in args if a is not None]
    return dispatch("layer_norm", _layer_norm_rule, tensors, (ns, float(eps), weight is not None, bias is not None))


def _torch_rms_norm(input, normalized_shape, weight=None, eps=None):
    return rms_norm(input, normalized_shape, weight, eps)


@register(rule=_rms_norm_rule, kernel=_rms_norm_kernel, torch_fns=(F.rms_norm, (torch.rms_norm, _torch_rms_norm)),
          functional=True)
def rms_norm(input, normalized_shape, weight=None, eps: float | None = None):
    """``F.rms_norm`` over the trailing ``normalized_shape`` dims (``eps=None``: float32's machine epsilon,
    float64's for double inputs, like torch)."""
    ns = _normalized_shape(normalized_shape)
    args = to_dtensors("rms_norm", [input, weight])
    tensors = [a for a in args if a is not None]
    if eps is None:
        eps = torch.finfo(torch.float64 if tensors[0].dtype == torch.float64 else torch.float32).eps
    return dispatch("rms_norm", _rms_norm_rule, tensors, (ns, float(eps)))


# -- dropout ---------------------------------------------------------------------------------------

@register(torch_fns=(F.dropout, torch.dropout), functional=True)
def dropout(input, p: float = 0.5, training: bool = True, inplace: bool = False):
    """``F.dropout``. ``inplace`` is accepted but the result is always a new tensor (dtorch never writes
    into its inputs)."""
    if not 0.0 <= p <= 1.0:
        raise OpError(f"dtorch.dropout: probability has to be between 0 and 1, but got {p}")
    (input,) = to_dtensors("dropout", [input])
    if not isinstance(input, Tensor):
        raise OpError(f"dtorch.dropout expects a tensor, got {type(input).__name__}")
    if not training or p == 0.0:
        return input
    from .pointwise import mul

    if p == 1.0:
        return mul(input, 0.0)  # like torch: input * 0 (so inf/nan inputs give nan)
    spec = input.spec
    # the same recipe as torch's CPU dropout: empty_like(input).bernoulli_(1 - p).div_(1 - p)
    noise = torch.empty(spec.shape, dtype=spec.dtype).bernoulli_(1 - p).div_(1 - p)
    layout = [Replicate() if isinstance(pl, Partial) else pl for pl in spec.placements]
    return mul(input, Tensor(noise, device_mesh=spec.mesh, placements=layout))

