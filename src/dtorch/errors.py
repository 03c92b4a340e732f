"""Typed errors. Messages carry the op, the specs involved and what to change."""


class DTorchError(Exception):
    """Base class of every dtorch error."""


class MeshError(DTorchError, ValueError):
    """A DeviceMesh was built or used wrongly."""


class PlacementError(DTorchError, ValueError):
    """Placements do not fit the mesh or the tensor."""


class OpError(DTorchError, ValueError):
    """An operator got inputs it cannot run on (shapes, meshes or placements)."""


class RuntimeBackendError(DTorchError, RuntimeError):
    """The runtime failed to run an op, a collective or a transfer."""


class MetaBackendError(RuntimeBackendError):
    """A value was asked of the meta backend (``to_torch()``, ``.item()``), which holds shapes and dtypes only."""


class DeviceUnavailableError(DTorchError, RuntimeError):
    """A mesh names devices this machine does not have."""


class AttentionInputError(OpError, RuntimeError):
    """scaled_dot_product_attention got arguments torch itself rejects; torch raises RuntimeError for
    them, so this is one too (code written against torch's ``except RuntimeError`` keeps working)."""


class CheckpointError(DTorchError, ValueError):
    """A checkpoint directory cannot be loaded: missing or unreadable files, or another model type."""
