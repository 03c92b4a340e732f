"""dtorch.nn: modules whose parameters are dtorch tensors."""
from . import functional, utils  # noqa: F401
from .containers import ModuleDict, ModuleList, Sequential
from .layers import (GELU, Dropout, Embedding, EmbeddingWithReplicateOutput, Identity, LayerNorm, ReLU, RMSNorm,
                     SiLU)
from .linear import (ColumnParallelLinear, ColumnParallelLinearWithReplicateInputOutput,
                     ColumnParallelLinearWithReplicateOutput, Linear, ReplicateParallelLinear, RowParallelLinear,
                     RowParallelLinearWithReplicateOutput)
from ._layout import skip_init
from .module import Module, ModuleAssignmentError, Parameter, StateDictError

__all__ = [
    "Module", "Parameter", "StateDictError", "ModuleAssignmentError", "Linear", "ColumnParallelLinear", "ColumnParallelLinearWithReplicateOutput",
    "ColumnParallelLinearWithReplicateInputOutput", "RowParallelLinear", "RowParallelLinearWithReplicateOutput",
    "ReplicateParallelLinear", "Embedding", "EmbeddingWithReplicateOutput", "RMSNorm", "LayerNorm", "Dropout",
    "SiLU", "GELU", "ReLU", "Identity", "Sequential", "ModuleList", "ModuleDict", "functional", "skip_init",
]
