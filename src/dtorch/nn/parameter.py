"""``dtorch.nn.parameter``: ``Parameter`` and ``Buffer`` under the names torch (and the original DTorch) use.

``Buffer(data, persistent=True)`` marks a tensor that a module attribute assignment registers as a buffer
(``self.running_mean = Buffer(dtorch.zeros(4))``), like ``torch.nn.Buffer``.
"""
from __future__ import annotations

from ..mesh import DeviceMesh
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


def __getattr__(name):
    # Parameter lives in module.py, which imports Buffer from here: resolved on first use (no import cycle)
    if name == "Parameter":
        from .module import Parameter

        return Parameter
    raise AttributeError(f"module 'dtorch.nn.parameter' has no attribute {name!r}")


__all__ = ["Buffer", "Parameter"]
