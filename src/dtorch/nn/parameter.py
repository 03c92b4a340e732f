"""``dtorch.nn.parameter``: ``Parameter`` and ``Buffer``, where torch keeps them (``torch.nn.parameter``).

``Buffer(data, persistent=True)`` marks a tensor that a module attribute assignment registers as a buffer
(``self.running_mean = Buffer(dtorch.zeros(4))``), like ``torch.nn.Buffer``.
"""
from __future__ import annotations

import torch

from ..autograd.node import AutogradMeta
from ..mesh import DeviceMesh
from ..ops.views import replace_storage
from ..tensor import Tensor


class Buffer(Tensor):
    """A dtorch tensor that becomes a module buffer when assigned as a module attribute."""

    __slots__ = ("persistent",)

    def __init__(self, data=None, *, persistent: bool = True, device_mesh: DeviceMesh | None = None, placements=None):
        if data is None:
            super().__init__(device_mesh=device_mesh, placements=placements)
        else:
            super().__init__(data, device_mesh=device_mesh, placements=placements)
        self.persistent = bool(persistent)


class Parameter(Tensor):
    """A dtorch tensor registered as a module parameter (``Parameter(data)`` shares ``data``'s storage)."""

    __slots__ = ()

    def __init__(self, data=None, requires_grad: bool = True, *, device_mesh: DeviceMesh | None = None, placements=None):
        super().__init__(torch.empty(0) if data is None else data, device_mesh=device_mesh, placements=placements)
        # a leaf of its own (never the history of ``data``); requires grad like torch.nn.Parameter
        self._ag = AutogradMeta(requires_grad=True) if requires_grad and self.dtype.is_floating_point else None
        self._graph.label_memory(self._h, "params")

    def _set(self, value: Tensor) -> None:
        """Take ``value``'s storage and layout in place, so every holder of this parameter sees it (``p.data = value``:
        a handle of its own on value's blocks, an in-place write to either copies first; views of the old storage
        keep it, ops/views.replace_storage)."""
        # the old storage is freed (and leaves the memory stats) when its last holder lets go of it
        replace_storage(self, value)
        ag = self._ag
        self._graph.label_memory(self._h, "params")
        if ag is not None and ag.grad is not None and ag.grad._spec.shape != value._spec.shape:
            ag.grad = None

    def __repr__(self):
        return "Parameter containing:\n" + super().__repr__()


__all__ = ["Buffer", "Parameter"]
