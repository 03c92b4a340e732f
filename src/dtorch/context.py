"""The default mesh and dtype of the current thread (what ``device_mesh_guard`` / ``dtype_guard`` set).

A base-layer module: it knows meshes and dtypes, nothing about graphs, tensors or backends, so every
layer may ask "which mesh do new tensors go to?" without importing the controller. The stacks are
per thread: a guard entered in one thread is never seen by another. ``Graph.device_mesh_guard`` and
``Graph.dtype_guard`` are these guards.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from .errors import MeshError
from .mesh import DeviceMesh

_CPU = DeviceMesh("cpu")  # the mesh new tensors use outside every guard: one CPU device


class _Stacks(threading.local):
    def __init__(self):
        self.mesh: list[DeviceMesh] = []
        self.dtype: list[torch.dtype] = []


_state = _Stacks()


def default_device_mesh() -> DeviceMesh:
    """The innermost ``device_mesh_guard`` of this thread, else a one-device CPU mesh."""
    stack = _state.mesh
    return stack[-1] if stack else _CPU


def default_dtype() -> torch.dtype:
    """The innermost ``dtype_guard`` of this thread, else torch's default dtype."""
    stack = _state.dtype
    return stack[-1] if stack else torch.get_default_dtype()


def get_default_device_mesh(device_mesh: DeviceMesh | None = None) -> DeviceMesh:
    """``device_mesh`` when given, else this thread's default mesh."""
    return default_device_mesh() if device_mesh is None else device_mesh


@contextlib.contextmanager
def device_mesh_guard(mesh: DeviceMesh | str):
    """Tensors and modules created inside (in this thread) live on ``mesh``; guards nest. A device type
    (``"cuda"``, ``"cpu"``) is a one-device mesh of that type."""
    if isinstance(mesh, str):
        mesh = DeviceMesh(mesh)
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"device_mesh_guard needs a DeviceMesh, got {type(mesh).__name__} (or a device type, e.g. "
                        "'cuda', for a one-device mesh)")
    stack = _state.mesh
    stack.append(mesh)
    try:
        yield mesh
    finally:
        stack.pop()


@contextlib.contextmanager
def dtype_guard(dtype: torch.dtype):
    """Floating-point data created inside (in this thread) defaults to ``dtype``; guards nest."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype_guard needs a torch.dtype, got {dtype!r}")
    stack = _state.dtype
    stack.append(dtype)
    try:
        yield dtype
    finally:
        stack.pop()
