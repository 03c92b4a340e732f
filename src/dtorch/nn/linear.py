"""Linear layers with tensor parallelism on one mesh dim (``tp_dim``, default "tp").

``y = x @ W.T + b`` with ``W: [out, in]``. On the tp dim (Megatron's split):

    col: W Shard(0), b Shard(0)   x R        -> y S(-1)   each device computes its output columns
    row: W Shard(1), b R          x S(-1)    -> y P       each device sums over its input slice; the
                                                          bias joins the partial sum once
    None: W R, b R                x any      -> y like x  no tensor parallelism

Every other mesh dim holds the weights replicated. The presets move the input and output to the
placements their names promise (on the tp dim only; other dims keep theirs).
"""
from __future__ import annotations

import math

import torch

from ..graph import Graph
from ..placement import Replicate, Shard
from . import functional as F
from ._layout import init_device, init_enabled, make_param, module_mesh, on_mesh, placements_on, with_placement
from .module import Module

_SHARD_TYPES = {None: Replicate(), "col": Shard(0), "row": Shard(1)}


class Linear(Module):
    # placements on the tp dim that inputs / outputs are moved to (None: leave them as they come)
    input_tp_placement = None
    output_tp_placement = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 device_mesh=None, *, tp_dim: str = "tp", tp_shard_type: str | None = None):
        super().__init__()
        if tp_shard_type not in _SHARD_TYPES:
            raise ValueError(f"tp_shard_type must be 'col', 'row' or None, got {tp_shard_type!r}")
        self.in_features, self.out_features = in_features, out_features
        self.tp_dim, self.tp_shard_type = tp_dim, tp_shard_type
        mesh = module_mesh(device_mesh, device)
        dtype = dtype or Graph.default_graph().default_dtype
        # torch.nn.Linear's initialisation, drawn in the same order from torch's generator
        w = torch.empty(out_features, in_features, dtype=dtype, device=init_device())
        if init_enabled():
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        self.weight = make_param(w, mesh, placements_on(mesh, tp_dim, _SHARD_TYPES[tp_shard_type]))
        if bias:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
            b = torch.empty(out_features, dtype=dtype, device=init_device())
            if init_enabled():
                b.uniform_(-bound, bound)
            bias_tp = Shard(0) if tp_shard_type == "col" else Replicate()
            self.bias = make_param(b, mesh, placements_on(mesh, tp_dim, bias_tp))
        else:
            self.register_parameter("bias", None)

    def redistribute_input(self, x, *args, **kwargs):
        x = with_placement(on_mesh(x, self.weight.device_mesh), self.tp_dim, self.input_tp_placement)
        return (x, *args), kwargs

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)  # [..., in] @ [in, out] -> [..., out]

    def redistribute_output(self, y):
        return with_placement(y, self.tp_dim, self.output_tp_placement)

    def extra_repr(self):
        tp = f", tp_dim={self.tp_dim!r}, tp_shard_type={self.tp_shard_type!r}" if self.tp_shard_type else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}{tp}"


def _preset(name: str, shard_type, input_tp, output_tp, doc: str):
    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, device_mesh=None, *,
                 tp_dim="tp"):
        Linear.__init__(self, in_features, out_features, bias, device, dtype, device_mesh, tp_dim=tp_dim,
                        tp_shard_type=shard_type)

    return type(name, (Linear,), {"__init__": __init__, "__doc__": doc, "input_tp_placement": input_tp,
                                  "output_tp_placement": output_tp, "__module__": __name__})


ColumnParallelLinear = _preset(
    "ColumnParallelLinear", "col", None, None,
    "Weight Shard(0) on tp; the output stays sharded on its last dim (feed it to a RowParallelLinear).")
ColumnParallelLinearWithReplicateOutput = _preset(
    "ColumnParallelLinearWithReplicateOutput", "col", None, Replicate(),
    "Weight Shard(0) on tp; the output is all-gathered to Replicate on tp.")
ColumnParallelLinearWithReplicateInputOutput = _preset(
    "ColumnParallelLinearWithReplicateInputOutput", "col", Replicate(), Replicate(),
    "Weight Shard(0) on tp; input and output Replicate on tp.")
RowParallelLinear = _preset(
    "RowParallelLinear", "row", Shard(-1), None,
    "Weight Shard(1) on tp; the input is sharded on its last dim (free when it is replicated), the output "
    "is left Partial on tp so the reduction can be fused with what follows.")
RowParallelLinearWithReplicateOutput = _preset(
    "RowParallelLinearWithReplicateOutput", "row", Shard(-1), Replicate(),
    "Weight Shard(1) on tp; the partial output is all-reduced to Replicate on tp.")
ReplicateParallelLinear = _preset(
    "ReplicateParallelLinear", None, Replicate(), Replicate(),
    "No tensor parallelism: weight, input and output Replicate on tp.")

__all__ = ["Linear", "ColumnParallelLinear", "ColumnParallelLinearWithReplicateOutput",
           "ColumnParallelLinearWithReplicateInputOutput", "RowParallelLinear",
           "RowParallelLinearWithReplicateOutput", "ReplicateParallelLinear"]
