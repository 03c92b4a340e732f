"""dtorch.nn.functional: the functional ops (same semantics as torch.nn.functional)."""
from ..ops.registry import FUNCTIONAL as _FUNCTIONAL

globals().update(_FUNCTIONAL)
