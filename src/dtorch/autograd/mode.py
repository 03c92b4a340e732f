"""Whether ops record autograd history: torch's own grad mode (``torch.no_grad()`` and ``dtorch.no_grad()``
are one switch, per thread), so code ported from PyTorch keeps its ``with torch.no_grad():`` blocks."""
from __future__ import annotations

import contextlib
import threading

import torch

is_grad_enabled = torch.is_grad_enabled
no_grad = torch.no_grad
enable_grad = torch.enable_grad
set_grad_enabled = torch.set_grad_enabled

_backward = threading.local()


@contextlib.contextmanager
def backward_pass():
    """Marks the backward walk (``engine.run_backward``): forwards run inside it are recomputations."""
    state = _backward
    state.depth = getattr(state, "depth", 0) + 1
    state.count = getattr(state, "count", 0) + 1
    try:
        yield
    finally:
        state.depth -= 1


def in_backward() -> bool:
    return getattr(_backward, "depth", 0) > 0


def backward_count() -> int:
    """How many backward passes this thread has started (fsdp units learn their order within one)."""
    return getattr(_backward, "count", 0)
