"""Copy-on-write for in-place kernels: may a block be written where it lies?

Handles and blocks are shared freely (replicas hold one tensor object, views and aliases share
storage), so a writer first asks whether anything else can see the block: another Python reference to
the tensor object (another handle, a replica slot), another tensor on its storage (a view handed out by
``local_blocks``, a block cut from it, its base), or elements stored twice (an expanded replica). If so,
it copies first and writes the copy; nobody else sees the change.
"""
from __future__ import annotations

import sys

import torch

# sys.getrefcount counts its own argument and this function's parameter on top of the holders'
_CALL_REFS = 2
# the tensor's own reference to its storage plus the temporary storage object ``untyped_storage()`` makes
_STORAGE_REFS = 2


def writable(t: torch.Tensor, holder_refs: int = 1) -> bool:
    """True when ``t`` may be written in place: its holder (``holder_refs`` references, e.g. the replica
    slots of one handle) is the only one that can see it."""
    if sys.getrefcount(t) > holder_refs + _CALL_REFS:
        return False
    if torch._C._storage_Use_Count(t.untyped_storage()._cdata) > _STORAGE_REFS:
        return False
    return not torch._debug_has_internal_overlap(t)


def private_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy nobody else sees (dense, no stride-0 dims), to write into. A dense ``t`` keeps its strides: a
    grid in the full tensor's layout (``runtime/grids.py``) stays in it, and its all-gathers stay views."""
    return t.clone(memory_format=torch.preserve_format)
