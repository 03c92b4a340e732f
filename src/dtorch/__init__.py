"""dtorch: single-controller distributed tensors for PyTorch.

Write single-device PyTorch code, declare a DeviceMesh and the placements of tensors, and dtorch
shards data, propagates placements through every operator and inserts the collectives.
"""
from . import distributed_spec  # noqa: F401
from .commlog import CommLog
from .errors import DeviceUnavailableError, DTorchError, MeshError, OpError, PlacementError, RuntimeBackendError
from .future import TensorFuture, VoidFutureCollect
from .graph import Graph, GraphOption, default_graph
from .context import get_default_device_mesh
from .mesh import DeviceMesh, assign_layers_to_stages, init_device_mesh
from .placement import Partial, Placement, Replicate, Shard
from .spec import DTensorSpec
from .tensor import Tensor
from . import ops as _ops
from .ops.table import PUBLIC as _PUBLIC

# the one place Tensor gets its operator methods (x.sum(), x + y, x.T): the op table
Tensor._install_ops(_ops.TABLE, **_ops.TENSOR_HOOKS)
globals().update(_PUBLIC)

# torch's spellings of comparison ops (dtorch.greater, x.less_equal(y)): the same op as gt/ge/lt/le/ne
from .ops.pointwise import ALIASES as _ALIASES  # noqa: E402

for _op, _alias in _ALIASES.items():
    globals()[_alias] = _PUBLIC[_op]

# torch's dtypes and helpers under dtorch (code written for the original DTorch: dtorch.float16, dtorch.finfo,
# dtorch.Size, dtorch.from_numpy, ...); a dtorch name of its own is never replaced
import torch as _torch  # noqa: E402

for _name in ("dtype", "finfo", "iinfo", "Size", "device", "Generator", "from_numpy", "manual_seed",
              "get_default_dtype", "set_default_dtype", "promote_types",
              "can_cast", "inference_mode", "inf", "nan", "pi", "e",
              "bool", "uint8", "int8", "int16", "short", "int32", "int", "int64", "long", "float16", "half",
              "bfloat16", "float32", "float", "float64", "double", "complex64", "cfloat", "complex128", "cdouble",
              "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if _name not in globals() and hasattr(_torch, _name):
        globals()[_name] = getattr(_torch, _name)
from . import autograd  # noqa: E402
from .autograd import enable_grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: E402,F401
from .autograd.fsdp import MixedPrecisionPolicy  # noqa: E402,F401
from .autograd.tensor_methods import install as _install_autograd  # noqa: E402

_install_autograd(Tensor)
# torch.autograd.backward(loss) / torch.autograd.grad(loss, [w]) on dtorch tensors: dtorch's own (not ops of the table)
from .ops.table import TORCH_FUNCTIONS as _TORCH_FUNCTIONS  # noqa: E402

_TORCH_FUNCTIONS[_torch.autograd.backward] = autograd.backward
_TORCH_FUNCTIONS[_torch.autograd.grad] = autograd.grad
from .autograd.checkpoint import route_torch_checkpoint as _route_torch_checkpoint  # noqa: E402

_route_torch_checkpoint()  # torch.utils.checkpoint.checkpoint on dtorch tensors: dtorch's checkpoint

from .visualize import visualize_sharding  # noqa: E402
from . import testing  # noqa: E402,F401
from . import nn  # noqa: E402,F401
from . import optim  # noqa: E402,F401
from . import pipeline  # noqa: E402,F401
from .compile import compile  # noqa: E402,F401  (dtorch.compile: the function, with .explain)
from . import recovery  # noqa: E402,F401

DTensor = Tensor

__version__ = "0.1.0"


def __getattr__(name: str):
    # dtorch.rl (RL post-training: it builds on dtorch.models) is imported on first use
    if name == "rl":
        import importlib

        return importlib.import_module(".rl", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
