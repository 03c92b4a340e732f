"""Helpers the op families' rules and entry points share: spec arithmetic, output shapes from torch's meta
kernels, torch tensors among the arguments made dtorch tensors, hashable static arguments."""
from __future__ import annotations

from typing import Callable

import torch

from ..autograd.mode import is_grad_enabled as _grad_enabled
from ..autograd.torch_leaves import torch_leaf
from ..placement import Replicate
from ..runtime.kernels import broadcast_shape as _broadcast_shape
from ..spec import DTensorSpec
from ..tensor import Tensor, as_torch


def spec_like(spec: DTensorSpec, *, placements=None, shape=None, dtype=None) -> DTensorSpec:
    return DTensorSpec(spec.mesh, tuple(placements) if placements is not None else spec.placements,
                       tuple(shape) if shape is not None else spec.shape, dtype if dtype is not None else spec.dtype)


def replicated(spec: DTensorSpec) -> DTensorSpec:
    return spec_like(spec, placements=(Replicate(),) * spec.mesh.ndim)


def meta_call(fn: Callable, specs, *args, out_shape=None, **kwargs):
    """Run a torch function on meta tensors of ``specs``' global shapes: output shapes and dtypes, no data.

    Many ops' meta kernels are torch's Python references, and the first call of one imports
    ``torch._dynamo`` (seconds, on the first op after ``import dtorch``). Callers that know the output
    shape pass it as ``out_shape`` ("broadcast": the broadcast of the input shapes, for element-wise ops):
    the dtypes then come from ``fn`` on small real CPU tensors of the inputs' ranks and dtypes, which
    never reaches those kernels. When that run fails or gives other ranks, the meta tensors decide (and
    raise torch's own error).
    """
    if out_shape is not None:
        out = _meta_from_small_call(fn, specs, out_shape, args, kwargs)
        if out is not None:
            return out
    metas = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in specs]
    return fn(*metas, *args, **kwargs)


def _meta_from_small_call(fn, specs, out_shape, args, kwargs):
    if out_shape == "broadcast":
        out_shape = _broadcast_shape([s.shape for s in specs])
        if out_shape is None:
            return None  # not broadcastable: the op's own error comes from the meta run
    # sizes capped at 2: a handful of elements, yet size-1 dims still broadcast and 2-element
    # reductions (var, std) stay well defined; ones are in every op's domain (division, log, pow)
    smalls = [torch.ones(tuple(min(n, 2) for n in s.shape), dtype=s.dtype) for s in specs]
    try:
        out = fn(*smalls, *args, **kwargs)
    except Exception:  # noqa: BLE001  (the meta run gives the error, with torch's message)
        return None
    outs = out if isinstance(out, tuple) else (out,)
    if not all(isinstance(o, torch.Tensor) and o.ndim == len(out_shape) for o in outs):
        return None
    metas = tuple(torch.empty(out_shape, dtype=o.dtype, device="meta") for o in outs)
    return metas if isinstance(out, tuple) else metas[0]


def to_dtensors(name: str, args, mesh_from=None) -> list:
    """dtorch tensors among ``args``; torch tensors become Replicate dtorch tensors on the same mesh,
    in the first dtorch tensor's Graph (which need not be this thread's default). A torch tensor that
    requires grad (grad mode on) becomes a leaf whose gradient the backward hands to it
    (``autograd.torch_leaves``)."""
    first = next((a for a in args if isinstance(a, Tensor)), None)
    mesh = mesh_from if mesh_from is not None or first is None else first.device_mesh
    out = []
    for a in args:
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, torch.Tensor):
            if first is None:
                t = Tensor(a, device_mesh=mesh)
            else:
                graph = first._graph
                full = as_torch(a, None, graph)
                spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(full.shape), full.dtype)
                t = Tensor._make(spec, graph.runtime.from_global(full, spec), graph)
            out.append(torch_leaf(t, a) if a.requires_grad and _grad_enabled() else t)
        else:
            out.append(a)
    return out


def static_value(v):
    """A hashable stand-in for a static argument (slices, lists) that keeps types apart (1 vs True vs 1.0)."""
    if isinstance(v, slice):
        return ("slice", v.start, v.stop, v.step)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(static_value(x) for x in v)
    if isinstance(v, bool) or isinstance(v, (int, float, complex)):
        return (type(v).__name__, v)
    return v

