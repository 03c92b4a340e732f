"""dtorch.nn.functional: the functional ops (same semantics as torch.nn.functional)."""
from ..ops.table import FUNCTIONAL as _FUNCTIONAL

globals().update(_FUNCTIONAL)

# the original DTorch's list of the functions this module has (every entry: dtorch.nn.functional.<name>)
_function_names = sorted(_FUNCTIONAL)
