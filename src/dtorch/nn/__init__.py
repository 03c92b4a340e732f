"""dtorch.nn: modules whose parameters are dtorch tensors."""
from . import functional, parameter, utils  # noqa: F401
from .containers import ModuleDict, ModuleList, Sequential
from .conv import *  # noqa: F401,F403  (Conv1d, Conv2d, BatchNorm2d, ... pooling, activations: conv.__all__)
from . import conv as _conv
from .layers import (GELU, Dropout, Embedding, EmbeddingWithReplicateOutput, Identity, LayerNorm, ReLU, RMSNorm,
                     SiLU)
from .linear import (ColumnParallelLinear, ColumnParallelLinearWithReplicateInputOutput,
                     ColumnParallelLinearWithReplicateOutput, Linear, ReplicateParallelLinear, RowParallelLinear,
                     RowParallelLinearWithReplicateOutput)
from ._layout import skip_init
from .fully_shard import MixedPrecisionPolicy, fully_shard, fully_shard_modules
from .module import Module, ModuleAssignmentError, Parameter, StateDictError

__all__ = [
    "Module", "Parameter", "StateDictError", "ModuleAssignmentError", "Linear", "ColumnParallelLinear", "ColumnParallelLinearWithReplicateOutput",
    "ColumnParallelLinearWithReplicateInputOutput", "RowParallelLinear", "RowParallelLinearWithReplicateOutput",
    "ReplicateParallelLinear", "Embedding", "EmbeddingWithReplicateOutput", "RMSNorm", "LayerNorm", "Dropout",
    "SiLU", "GELU", "ReLU", "Identity", "Sequential", "ModuleList", "ModuleDict", "functional", "skip_init",
    "fully_shard", "fully_shard_modules", "MixedPrecisionPolicy",
] + _conv.__all__
