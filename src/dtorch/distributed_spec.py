"""Alias module for code written against the original docs: mesh and placements."""
from .mesh import DeviceMesh, assign_layers_to_stages, get_default_device_mesh, init_device_mesh  # noqa: F401
from .placement import Partial, Placement, Replicate, Shard  # noqa: F401
