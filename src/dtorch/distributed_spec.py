"""Alias module for code written against the original docs: mesh and placements."""
from .context import get_default_device_mesh  # noqa: F401
from .mesh import DeviceMesh, assign_layers_to_stages, init_device_mesh  # noqa: F401
from .placement import Partial, Placement, Replicate, Shard  # noqa: F401
