"""Local kernels: what one device computes on its blocks.

A kernel is a module-level function over local torch tensors, registered by name so another process
can run it from an op record. Kernels are written against the *trailing* dims of their inputs (dims
are passed negative), because the in-process backend may call them once for all simulated devices
on stacked blocks with leading mesh (grid) dims. ``lead`` tells a kernel how many such dims there
are (0 when it runs on one device).

Per-device values (a shard's offset, a ring step's block index) arrive as python numbers on one
device and as tensors of the grid's shape when stacked; ``per_device(value, like)`` makes either
broadcast against a local tensor.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

_REGISTRY: dict[str, "Kernel"] = {}


@dataclass(frozen=True)
class Kernel:
    name: str
    fn: Callable
    # Pad every tensor input's local rank to the same length (after the grid dims) so torch's
    # right-aligned broadcasting lines up local dims, not grid dims (element-wise ops, matmul).
    align: bool = False
    # Optional ``bind(kwargs, lead, out_shapes) -> callable | None``: the kernel with these keyword
    # arguments as a plain function of its input tensors (``lead`` leading grid dims; ``out_shapes``: the
    # full shapes its outputs have), e.g. ``torch.add`` itself. A runtime that calls one kernel many times
    # with the same arguments and input shapes (the in-process grid) calls that instead, skipping the
    # argument handling; None: no such shortcut for these arguments.
    bind: Callable | None = None

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def kernel(name: str, *, align: bool = False, bind: Callable | None = None):
    def deco(fn):
        if name in _REGISTRY and _REGISTRY[name].fn is not fn:
            raise RuntimeError(f"kernel {name!r} registered twice")
        k = Kernel(name, fn, align, bind)
        _REGISTRY[name] = k
        return k

    return deco


def broadcast_shape(shapes) -> tuple | None:
    """torch's broadcast of ``shapes``, or None where they do not broadcast (torch.broadcast_shapes
    itself imports sympy on its first call: seconds, on the first op that needs it)."""
    out = [1] * max((len(s) for s in shapes), default=0)
    for shape in shapes:
        for k, n in enumerate(shape, start=len(out) - len(shape)):
            if out[k] == 1:
                out[k] = n
            elif n not in (1, out[k]):
                return None
    return tuple(out)


def varying(v: torch.Tensor) -> torch.Tensor:
    """A per-device value (one entry per grid position) with the dims it is constant on cut to size 1."""
    for d in range(v.ndim):
        first = v.narrow(d, 0, 1)
        if v.shape[d] > 1 and bool((v == first).all()):
            v = first
    return v


def broadcast_pair(y: torch.Tensor, c: torch.Tensor):
    """An output and its cotangent at one shape (either may hold a grid dim once that the other varies on)."""
    if y.shape == c.shape:
        return y, c
    shape = broadcast_shape([y.shape, c.shape])
    return y.expand(shape), c.expand(shape)


def as_terms(g: torch.Tensor, grid: tuple, lead: int) -> torch.Tensor:
    """``g`` (a gradient summed over the grid dims where it has size 1 and ``grid`` does not) as per-device
    Partial terms: the sum on index 0 of each such dim, zeros elsewhere."""
    summed = [d for d in range(lead) if g.shape[d] == 1 and grid[d] > 1]
    if not summed:
        return g
    shape = list(g.shape)
    for d in summed:
        shape[d] = grid[d]
    out = g.new_zeros(shape)
    out[tuple(slice(0, 1) if d in summed else slice(None) for d in range(lead))] = g
    return out


def get_kernel(name: str) -> Kernel:
    k = _REGISTRY.get(name)
    if k is None and name.startswith(VJP_PREFIX):
        k = vjp_kernel(get_kernel(name[len(VJP_PREFIX):]))
    if k is None:
        raise KeyError(name)
    return k


VJP_PREFIX = "vjp:"


def vjp_kernel(forward: Kernel) -> Kernel:
    """The vector-Jacobian product of ``forward`` on local blocks, by torch's own autograd.

    ``fn(*inputs, *cotangents, lead, vjp=(diff, has_ct[, summed]), **forward_kwargs)``: ``diff[i]`` says whether
    input i gets a gradient, ``has_ct[j]`` whether output j has a cotangent (those come after the inputs, in
    order). Returns the gradients of the ``diff`` inputs, each of its input's block shape; ``summed[k]`` (one
    per gradient, stacked grids only): the k-th comes back summed over the grid dims its input is
    broadcast on, not as per-device terms (the caller lays it out Replicate there). The forward is
    recomputed on the blocks (cheap next to communication; no state is kept on the devices between the
    forward and the backward). A derived kernel, so every backend finds it by name (``vjp:<forward>``).
    """
    name = VJP_PREFIX + forward.name
    k = _REGISTRY.get(name)
    if k is not None:
        return k
    wants_lead = "lead" in inspect.signature(forward.fn).parameters
    fwd, align = forward.fn, forward.align

    def fn(*args, lead=0, vjp, **kw):
        diff, has_ct, *rest = vjp
        summed = rest[0] if rest else ()
        n_in = len(diff)
        xs, cts = args[:n_in], args[n_in:]
        # Stacked grids store a replicated block once (grid dim 1). Where the computation differs over a grid
        # dim the block is broadcast on (another input or a cotangent varies there, or a per-device value
        # such as a shard's offset does), torch's autograd sums the devices' gradients over it: the global
        # gradient, which the devices' Partial terms add up to. It is returned as such terms: the sum on the
        # first device of the dim, zeros on the others. (No input is expanded: a weight broadcast over the
        # batch grid stays one matrix, so its gradient is one GEMM over all devices' rows.)
        if lead:  # per-device values come over the whole mesh: keep only the grid dims they vary on
            kw = {k: varying(v) if isinstance(v, torch.Tensor) and v.ndim == lead else v for k, v in kw.items()}
        grid = broadcast_shape([t.shape[:lead] for t in args] + [v.shape for v in kw.values()
                                if isinstance(v, torch.Tensor) and v.ndim == lead]) if lead else ()
        rank = max((x.ndim - lead for x in xs if isinstance(x, torch.Tensor)), default=0)
        with torch.enable_grad():
            leaves, call = [], []
            for x, d in zip(xs, diff):
                if d:
                    x = x.detach().requires_grad_()
                    leaves.append(x)
                if align and x.ndim - lead < rank:  # what the executable does for aligned kernels
                    x = x.reshape(x.shape[:lead] + (1,) * (rank - x.ndim + lead) + x.shape[lead:])
                call.append(x)
            out = fwd(*call, lead=lead, **kw) if wants_lead else fwd(*call, **kw)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [broadcast_pair(y, c) for y, c in zip([y for y, h in zip(outs, has_ct) if h], cts) if y.requires_grad]
            grads = (torch.autograd.grad([y for y, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
                     if pairs else [None] * len(leaves))
        grads = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]
        return tuple(g if k < len(summed) and summed[k] else as_terms(g, grid, lead) for k, g in enumerate(grads))

    k = _REGISTRY[name] = Kernel(name, fn)
    return k


def per_device(value, like: torch.Tensor, lead: int):
    """A per-device value shaped to broadcast against ``like`` (whose first ``lead`` dims are grid dims)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.reshape(tuple(value.shape) + (1,) * (like.ndim - value.ndim)).to(like.device)
