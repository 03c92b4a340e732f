"""dtorch: single-controller distributed tensors for PyTorch.

Write single-device PyTorch code, declare a DeviceMesh and the placements of tensors, and dtorch
shards data, propagates placements through every operator and inserts the collectives.
"""
from . import distributed_spec  # noqa: F401
from .commlog import CommLog
from .errors import DeviceUnavailableError, DTorchError, MeshError, OpError, PlacementError, RuntimeBackendError
from .future import TensorFuture
from .graph import Graph, default_graph
from .context import get_default_device_mesh
from .mesh import DeviceMesh, assign_layers_to_stages, init_device_mesh
from .placement import Partial, Placement, Replicate, Shard
from .spec import DTensorSpec
from .tensor import Tensor
from . import ops as _ops
from .ops.registry import PUBLIC as _PUBLIC

# the one place Tensor gets its operator methods (x.sum(), x + y, x.T): the op table
Tensor._install_ops(_ops.TABLE, **_ops.TENSOR_HOOKS)
globals().update(_PUBLIC)
from . import autograd  # noqa: E402
from .autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: E402,F401
from .autograd.tensor_methods import install as _install_autograd  # noqa: E402

_install_autograd(Tensor)

from .visualize import visualize_sharding  # noqa: E402
from . import testing  # noqa: E402,F401
from . import nn  # noqa: E402,F401
from . import optim  # noqa: E402,F401
from . import pipeline  # noqa: E402,F401

DTensor = Tensor

__version__ = "0.1.0"
