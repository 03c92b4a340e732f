"""Test helpers: compare dtorch and torch tensors; ask whether a Graph can run a mesh."""
from __future__ import annotations

import torch

from .graph import Graph
from .mesh import DeviceMesh
from .tensor import Tensor


def is_graph_satisfy(graph: Graph, mesh: DeviceMesh) -> bool:
    return graph.satisfy(mesh)


def to_torch(x):
    if isinstance(x, Tensor):
        return x.to_torch()
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x)


def assert_close(actual, expected, *, rtol: float | None = None, atol: float | None = None, **kwargs) -> None:
    """``torch.testing.assert_close`` for any mix of torch and dtorch tensors (compared on the CPU)."""
    a, e = to_torch(actual).cpu(), to_torch(expected).cpu()
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, **kwargs)
