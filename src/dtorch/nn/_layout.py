"""Layout helpers shared by the modules: which mesh a module lives on, placements by mesh dim name."""
from __future__ import annotations

import contextlib
import threading

import torch

from ..autograd.fsdp import fsdp_placements
from ..context import get_default_device_mesh
from ..errors import MeshError
from ..mesh import DeviceMesh
from ..graph import Graph
from ..placement import Placement, Replicate, normalize_placements
from ..spec import DTensorSpec
from ..tensor import Tensor
from .parameter import Parameter


def module_mesh(device_mesh: DeviceMesh | None, device) -> DeviceMesh:
    """``device_mesh``, else a one-device mesh for ``device``, else the mesh of the current guard."""
    if device_mesh is not None and device is not None:
        raise MeshError("pass either device_mesh or device, not both")
    if device is not None:
        from ..ops.factory import mesh_for_device

        return mesh_for_device(device)
    mesh = get_default_device_mesh(device_mesh)
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"device_mesh must be a DeviceMesh, got {type(mesh).__name__}")
    return mesh


def placements_on(mesh: DeviceMesh, dim_name: str, placement: Placement) -> list[Placement]:
    """``placement`` on mesh dim ``dim_name``, ``Replicate()`` on every other dim (all Replicate if absent)."""
    idx = mesh.dim_name_index(dim_name)
    return [placement if i == idx else Replicate() for i in range(mesh.ndim)]


def make_param(full: torch.Tensor, mesh: DeviceMesh, placements) -> Parameter:
    """A parameter laid out as ``placements`` (None: Replicate), sharded over an "fsdp" mesh dim too."""
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    placements = fsdp_placements(mesh, placements, full.ndim)
    if not init_enabled():  # values about to be loaded: made where the devices are (no upload from here)
        graph = Graph.default_graph()
        spec = DTensorSpec(mesh, normalize_placements(placements, mesh.ndim, full.ndim, mesh.shape), tuple(full.shape),
                           full.dtype)
        return Parameter(Tensor._make(spec, graph.runtime.zeros(spec), graph))
    return Parameter(Tensor(full, device_mesh=mesh, placements=placements))


def on_mesh(x, mesh: DeviceMesh):
    """A torch tensor becomes a Replicate dtorch tensor on ``mesh`` (its gradient reaches it when it
    requires grad: ``to_dtensors``); a dtorch tensor on another mesh is moved there keeping its placements
    by mesh dim name. Anything else passes through."""
    if isinstance(x, torch.Tensor):
        from ..ops.rules import to_dtensors

        return to_dtensors("module input", [x], mesh_from=mesh)[0]
    if isinstance(x, Tensor) and x.device_mesh != mesh:
        return x.redistribute_by_dict(mesh, {}, default_placement_mode="keep")
    return x


def with_placement(x, dim_name: str, placement: Placement | None):
    """``x`` with ``placement`` on mesh dim ``dim_name`` (no-op when None or when the mesh lacks the dim)."""
    if placement is None or not isinstance(x, Tensor):
        return x
    idx = x.device_mesh.dim_name_index(dim_name)
    if idx is None or x.check_placement(idx, placement):
        return x
    return x.redistribute_by_dict(placements_dict={dim_name: placement})


_init_state = threading.local()


@contextlib.contextmanager
def skip_init():
    """Modules built inside skip random initialisation (their values are about to be loaded)."""
    prev = getattr(_init_state, "skip", False)
    _init_state.skip = True
    try:
        yield
    finally:
        _init_state.skip = prev


def init_enabled() -> bool:
    """Draw initial values? Not inside ``skip_init`` (values about to be loaded), nor on a backend without values
    (the meta backend: a model builds there without allocating its weights)."""
    return not getattr(_init_state, "skip", False) and Graph.default_graph().runtime.holds_values


def init_device() -> str:
    """Where a module makes the global tensor its parameter is laid out from: the CPU when values are drawn,
    else torch's meta device (only its shape and dtype are read)."""
    return "cpu" if init_enabled() else "meta"
