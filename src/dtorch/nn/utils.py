"""Gradient clipping (``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_``) for dtorch parameters, and
``copy_parameters_``: one model's parameters written into another's, each in its own layout (weight sync).

The total norm never gathers a parameter or a gradient. Per gradient, each device reduces its own
block (sum of |g|^p, or max/min |g|): over sharded mesh dims that is a Partial scalar. On each mesh
the per-gradient scalars are stacked (replicated ones turned Partial locally, no communication) and
reduced once: one all-reduce of a [number of gradients] vector per mesh dim that shards some
gradient, none for replicated gradients. Then, as torch does, the total is the p-norm of the
per-gradient norms (those of other meshes moved to the first one: a few scalars).
"""
from __future__ import annotations

import math

import torch

from ..ops.reduce import norm as _norm
from ..ops.cat import cat as _cat, stack as _stack
from ..autograd.mode import no_grad
from ..placement import Partial, Replicate
from ..ops.copy_tensors import BUCKET_BYTES, copy_tensors_
from ..tensor import Tensor

_LOW_PRECISION = (torch.float16, torch.bfloat16)

__all__ = ["clip_grad_norm_", "clip_grad_value_", "get_total_norm", "clip_grads_with_norm_", "copy_parameters_"]


def _tensors(tensors, what: str) -> list:
    if isinstance(tensors, (Tensor, torch.Tensor)):
        tensors = [tensors]
    out = list(tensors)
    for t in out:
        if not isinstance(t, Tensor):
            raise TypeError(f"dtorch.nn.utils: {what} must be dtorch tensors, got {type(t).__module__}."
                            f"{type(t).__name__}; make it a dtorch tensor first (dtorch.Tensor(t, device_mesh=...))")
    return out


def _local(g: Tensor, p: float) -> tuple:
    """Each device's reduction of its block of ``g`` and the Partial op that completes it."""
    x = g.float() if g.dtype in _LOW_PRECISION else g
    if p == math.inf:
        return x.abs().amax(), "max"
    if p == -math.inf:
        return x.abs().amin(), "min"
    if p == 0:
        return (x != 0).to(x.dtype).sum(), "sum"  # (cast first: a Partial count would be reduced to cast it)
    if p == 1:
        return x.abs().sum(), "sum"
    if p == 2:
        return (x * x).sum(), "sum"
    return x.abs().pow(p).sum(), "sum"


def _mesh_norms(grads: list, p: float) -> Tensor:
    """The norm of each of ``grads`` (all on one mesh), as a Replicate [len(grads)] vector."""
    locals_, op = zip(*[_local(g, p) for g in grads])
    op = op[0]
    mesh = grads[0].device_mesh
    partial_dims = {m for s in locals_ for m, q in enumerate(s.placements) if isinstance(q, Partial)}
    target = [Partial(op) if m in partial_dims else Replicate() for m in range(mesh.ndim)]
    dtype = locals_[0].dtype
    for s in locals_[1:]:
        dtype = torch.promote_types(dtype, s.dtype)
    # replicated terms become partial locally (one device holds the value): every term then stacks as it is
    vec = _stack([s.to(dtype).redistribute(mesh, target) for s in locals_])
    vec = vec.redistribute(mesh, [Replicate()] * mesh.ndim)  # the one all-reduce per partial mesh dim
    if p in (0, 1) or math.isinf(p):
        return vec
    return vec.sqrt() if p == 2 else vec.pow(1.0 / p)


def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None) -> Tensor:
    """``torch.nn.utils.get_total_norm``: the ``norm_type``-norm of the norms of ``tensors``, a Replicate 0-d
    dtorch tensor on the first tensor's mesh (``foreach`` is accepted for torch compatibility)."""
    p = float(norm_type)
    tensors = _tensors(tensors, "tensors")
    if not tensors:
        return Tensor(torch.tensor(0.0))
    by_mesh: dict = {}
    for t in tensors:
        by_mesh.setdefault(t.device_mesh, []).append(t)
    first = tensors[0].device_mesh
    out_dtype = tensors[0].dtype
    for t in tensors[1:]:
        out_dtype = torch.promote_types(out_dtype, t.dtype)
    norms = []
    for mesh, ts in by_mesh.items():
        n = _mesh_norms(ts, p)
        norms.append(n if mesh == first else n.redistribute(first, [Replicate()] * first.ndim))
    norms = norms[0] if len(norms) == 1 else _cat(norms)
    total = _norm(norms.to(out_dtype), p)
    if error_if_nonfinite:
        value = total.item()
        if math.isnan(value) or math.isinf(value):
            raise RuntimeError(
                f"The total norm of order {p} for gradients from `parameters` is non-finite, so it cannot be "
                "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
                "`error_if_nonfinite=False`")
    return total


@torch.no_grad()
def clip_grads_with_norm_(parameters, max_norm: float, total_norm: Tensor, foreach=None) -> None:
    """``torch.nn.utils.clip_grads_with_norm_``: scale every gradient in place by
    ``min(1, max_norm / (total_norm + 1e-6))``."""
    grads = [p.grad for p in _tensors(parameters, "parameters") if p.grad is not None]
    if not grads:
        return
    coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    moved: dict = {coef.device_mesh: coef}
    for g in grads:
        mesh = g.device_mesh
        c = moved.get(mesh)
        if c is None:
            c = moved[mesh] = coef.redistribute(mesh, [Replicate()] * mesh.ndim)
        g.mul_(c)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach=None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_``: the total norm of the gradients (as if they were one vector) as a
    0-d dtorch tensor, and every gradient scaled in place so that it is at most ``max_norm``. Computed
    without gathering any gradient (module docstring)."""
    params = _tensors(parameters, "parameters")
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        mesh = params[0].device_mesh if params else None
        return Tensor(torch.tensor(0.0), device_mesh=mesh)
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    clip_grads_with_norm_(params, max_norm, total, foreach)
    return total


@torch.no_grad()
def clip_grad_value_(parameters, clip_value: float, foreach=None) -> None:
    """``torch.nn.utils.clip_grad_value_``: clamp every gradient to [-clip_value, clip_value] in place."""
    clip_value = float(clip_value)
    for p in _tensors(parameters, "parameters"):
        if p.grad is not None:
            p.grad.clamp_(min=-clip_value, max=clip_value)


def copy_parameters_(dst_model, src_model, *, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Write every parameter of ``src_model`` into the storage of ``dst_model``'s parameter of the same name,
    in ``dst_model``'s layout (its meshes, placements and dtype): the weight sync of RL post-training, from a
    trainer's layout to a rollout model's, on the same devices or on others. Returns the bytes that changed
    device.

    Device to device, never through the controller: each destination device receives only the regions of
    its blocks it does not hold already, from one device holding them, in batched moves of about
    ``bucket_bytes`` (``ops.copy_tensors``). The parameters keep their identity (an optimizer's references
    stay valid); no autograd history is recorded. A parameter held in another form than it is saved (kv heads
    repeated for tp wider than their count) is converted on the source's devices first. The names must match
    both ways and the shapes pair by pair: one error lists every problem, before anything is written."""
    dst = _named_parameters(dst_model, "dst_model")
    src = _named_parameters(src_model, "src_model")
    missing = [k for k in dst if k not in src]
    unexpected = [k for k in src if k not in dst]
    problems = []
    if missing:
        problems.append("missing in src_model: " + ", ".join(missing))
    if unexpected:
        problems.append("not in dst_model: " + ", ".join(unexpected))
    targets, sources, seen = [], [], set()
    for key, (p, form) in dst.items():
        if key not in src or id(p) in seen:  # (a tied parameter is written once, from its first name)
            continue
        seen.add(id(p))
        q, src_form = src[key]
        if _saved_shape(p, form) != _saved_shape(q, src_form):
            problems.append(f"{key}: {list(q.shape)} in src_model, {list(p.shape)} in dst_model")
            continue
        if tuple(q.shape) != tuple(p.shape):  # another held form: through the saved one, on q's devices
            with no_grad():
                q = src_form.save(q) if src_form else q
                q = form.load(q) if form else q
        targets.append(p)
        sources.append(q)
    if problems:
        raise ValueError(f"copy_parameters_({type(dst_model).__name__}, {type(src_model).__name__}): the models' "
                         "parameters do not correspond: " + "; ".join(problems)
                         + ". Both models must be the same architecture (e.g. one config, two layouts).")
    return copy_tensors_(targets, sources, bucket_bytes=bucket_bytes)


def _named_parameters(model, what: str) -> dict:
    """name -> (parameter, the form it is saved in or None), every name of a tied parameter included."""
    entries = getattr(model, "_state_entries", None)
    if entries is None:
        raise TypeError(f"copy_parameters_: {what} must be a dtorch.nn.Module, got {type(model).__name__}")
    return {key: (t, mod._saved_form(name)) for key, mod, name, t in entries() if name in mod._parameters}


def _saved_shape(t: Tensor, form) -> tuple:
    return tuple(form.saved_shape(t.shape)) if form else tuple(t.shape)
