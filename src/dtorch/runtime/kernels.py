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


def get_kernel(name: str) -> Kernel:
    return _REGISTRY[name]


def per_device(value, like: torch.Tensor, lead: int):
    """A per-device value shaped to broadcast against ``like`` (whose first ``lead`` dims are grid dims)."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.reshape(tuple(value.shape) + (1,) * (like.ndim - value.ndim)).to(like.device)
