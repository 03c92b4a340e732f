"""CNN modules: convolutions, batch/group norm, pooling, flatten, upsample and the remaining activations.

Initialisation and state-dict names are torch.nn's, so ``load_state_dict(torch_module.state_dict())``
works. ``Conv1d/Conv2d(tp_shard_type=...)`` split the channels over the ``tp_dim`` mesh dim like the
linear layers do:

    "col": weight Shard(0) (output channels), bias Shard(0); the output is Shard(1) (channels) on tp
    "row": weight Shard(1) (input channels); the input is moved to Shard(1) (free after a "col" conv),
           the output is Partial(sum) on tp (the bias joins the sum once)
    None:  weight and bias replicated
"""
from __future__ import annotations

import math

import torch

from ..graph import Graph
from ..placement import Replicate, Shard
from . import functional as F
from ._layout import init_enabled, make_param, module_mesh, on_mesh, placements_on, with_placement
from .module import Module

_SHARD = {None: Replicate(), "col": Shard(0), "row": Shard(1)}


def _ntuple(v, n: int) -> tuple:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,) * n


def _dtensor(x):
    """A torch tensor becomes a replicated dtorch tensor on the default mesh (ops that take only dtorch tensors)."""
    if isinstance(x, torch.Tensor):
        from ..context import get_default_device_mesh

        return on_mesh(x, get_default_device_mesh())
    return x


class _ConvNd(Module):
    _nd = 2

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", device=None, dtype=None,
                 device_mesh=None, *, tp_dim: str = "tp", tp_shard_type: str | None = None):
        super().__init__()
        nd = self._nd
        if groups <= 0 or in_channels % groups or out_channels % groups:
            raise ValueError(f"in_channels ({in_channels}) and out_channels ({out_channels}) must be divisible by "
                             f"groups ({groups})")
        if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
            raise ValueError(f"padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got {padding_mode!r}")
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(f"invalid padding string {padding!r}, should be one of ['valid', 'same']")
            if padding == "same" and any(s != 1 for s in _ntuple(stride, nd)):
                raise ValueError("padding='same' is not supported for strided convolutions")
        if tp_shard_type not in _SHARD:
            raise ValueError(f"tp_shard_type must be 'col', 'row' or None, got {tp_shard_type!r}")
        if tp_shard_type is not None and groups != 1:
            raise ValueError("tp_shard_type needs groups=1 (grouped convolutions shard their channels with the input)")
        self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
        self.kernel_size = _ntuple(kernel_size, nd)
        self.stride, self.dilation = _ntuple(stride, nd), _ntuple(dilation, nd)
        self.padding = padding if isinstance(padding, str) else _ntuple(padding, nd)
        self.padding_mode, self.tp_dim, self.tp_shard_type = padding_mode, tp_dim, tp_shard_type
        mesh = module_mesh(device_mesh, device)
        dtype = dtype or Graph.default_graph().default_dtype
        # torch.nn.ConvNd.reset_parameters, drawn in the same order from torch's generator
        w = torch.empty((out_channels, in_channels // groups) + self.kernel_size, dtype=dtype)
        if init_enabled():
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        self.weight = make_param(w, mesh, placements_on(mesh, tp_dim, _SHARD[tp_shard_type]))
        if bias:
            b = torch.empty(out_channels, dtype=dtype)
            if init_enabled():
                fan_in = (in_channels // groups) * math.prod(self.kernel_size)
                bound = 1 / math.sqrt(fan_in) if fan_in else 0
                torch.nn.init.uniform_(b, -bound, bound)
            self.bias = make_param(b, mesh, placements_on(mesh, tp_dim, Shard(0) if tp_shard_type == "col" else Replicate()))
        else:
            self.register_parameter("bias", None)

    def redistribute_input(self, x, *args, **kwargs):
        x = on_mesh(x, self.weight.device_mesh)
        if self.tp_shard_type == "row":
            x = with_placement(x, self.tp_dim, Shard(1))
        elif self.tp_shard_type == "col":
            x = with_placement(x, self.tp_dim, Replicate())
        return (x, *args), kwargs

    def forward(self, x):
        fn = getattr(F, f"conv{self._nd}d")
        padding = self.padding
        if self.padding_mode != "zeros":
            pads = []
            for k in reversed(range(self._nd)):  # F.pad lists the last dim first
                if padding == "same":  # torch puts the odd row on the right
                    total = self.dilation[k] * (self.kernel_size[k] - 1)
                    pads += [total // 2, total - total // 2]
                else:
                    p = 0 if padding == "valid" else padding[k]
                    pads += [p, p]
            x = F.pad(x, tuple(pads), mode=self.padding_mode)
            padding = 0
        return fn(x, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)

    def extra_repr(self):
        s = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if self.padding != (0,) * self._nd:
            s += f", padding={self.padding}"
        if self.dilation != (1,) * self._nd:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.bias is None:
            s += ", bias=False"
        if self.tp_shard_type:
            s += f", tp_dim={self.tp_dim!r}, tp_shard_type={self.tp_shard_type!r}"
        return s


class Conv1d(_ConvNd):
    """``torch.nn.Conv1d`` on [N, C, L]."""
    _nd = 1


class Conv2d(_ConvNd):
    """``torch.nn.Conv2d`` on [N, C, H, W]; shard H or W of the input for spatial parallelism (halo exchange)."""
    _nd = 2


class BatchNorm2d(Module):
    """``torch.nn.BatchNorm2d``: in training the statistics are reduced over every batch and spatial shard
    (all-reduces of per-channel sums) and the running statistics are updated in place; weight, bias and the
    running statistics are replicated."""

    _expected_dim = 4

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device=None, dtype=None, device_mesh=None):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        mesh = module_mesh(device_mesh, device)
        dtype = dtype or Graph.default_graph().default_dtype
        if affine:
            self.weight = make_param(torch.ones(num_features, dtype=dtype), mesh, None)
            self.bias = make_param(torch.zeros(num_features, dtype=dtype), mesh, None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        if track_running_stats:
            from ..tensor import Tensor

            self.register_buffer("running_mean", Tensor(torch.zeros(num_features, dtype=dtype), device_mesh=mesh))
            self.register_buffer("running_var", Tensor(torch.ones(num_features, dtype=dtype), device_mesh=mesh))
            self.register_buffer("num_batches_tracked", Tensor(torch.tensor(0, dtype=torch.long), device_mesh=mesh))
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self._mesh = mesh

    def forward(self, x):
        x = on_mesh(x, self._mesh)
        if x.ndim != self._expected_dim:
            raise ValueError(f"expected {self._expected_dim}D input (got {x.ndim}D input)")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, like torch
                factor = 1.0 / float(self.num_batches_tracked.item())
        use_batch = self.training or self.running_mean is None
        return F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                            self.running_var if not self.training or self.track_running_stats else None,
                            self.weight, self.bias, use_batch, factor, self.eps)

    def extra_repr(self):
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
                f"track_running_stats={self.track_running_stats}")


class GroupNorm(Module):
    """``torch.nn.GroupNorm``; weight and bias replicated."""

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True, device=None,
                 dtype=None, device_mesh=None):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        mesh = module_mesh(device_mesh, device)
        dtype = dtype or Graph.default_graph().default_dtype
        if affine:
            self.weight = make_param(torch.ones(num_channels, dtype=dtype), mesh, None)
            self.bias = make_param(torch.zeros(num_channels, dtype=dtype), mesh, None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x):
        return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"


class _Pool(Module):
    def __init__(self, kernel_size, stride=None, padding=0, **kw):
        super().__init__()
        self.kernel_size, self.stride, self.padding = kernel_size, stride if stride is not None else kernel_size, padding
        self.kw = kw

    def extra_repr(self):
        extra = "".join(f", {k}={v}" for k, v in self.kw.items())
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}{extra}"


class MaxPool2d(_Pool):
    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False):
        super().__init__(kernel_size, stride, padding, dilation=dilation, return_indices=return_indices,
                         ceil_mode=ceil_mode)

    def forward(self, x):
        return F.max_pool2d(x, self.kernel_size, self.stride, self.padding, **self.kw)


class AvgPool2d(_Pool):
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override=None):
        super().__init__(kernel_size, stride, padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                         divisor_override=divisor_override)

    def forward(self, x):
        return F.avg_pool2d(x, self.kernel_size, self.stride, self.padding, **self.kw)


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, x):
        return F.adaptive_avg_pool2d(x, self.output_size)

    def extra_repr(self):
        return f"output_size={self.output_size}"


class GlobalAvgPool2d(Module):
    """The original DTorch's global average pooling: the mean over H and W, ``[N, C, H, W] -> [N, C, 1, 1]``
    (``[C, H, W] -> [C, 1, 1]``): ``AdaptiveAvgPool2d(1)``, the shape ONNX's GlobalAveragePool and MXNet's
    GlobalAvgPool2D give. A sharded H or W gives Partial(sum) (each device's share of the mean), no gather."""

    def forward(self, x):
        return F.adaptive_avg_pool2d(x, 1)


class Flatten(Module):
    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        return _dtensor(x).flatten(self.start_dim, self.end_dim)

    def extra_repr(self):
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Upsample(Module):
    def __init__(self, size=None, scale_factor=None, mode: str = "nearest", align_corners=None,
                 recompute_scale_factor=None):
        super().__init__()
        self.size, self.scale_factor, self.mode = size, scale_factor, mode
        self.align_corners, self.recompute_scale_factor = align_corners, recompute_scale_factor

    def forward(self, x):
        return F.interpolate(x, self.size, self.scale_factor, self.mode, self.align_corners,
                             recompute_scale_factor=self.recompute_scale_factor)

    def extra_repr(self):
        what = f"scale_factor={self.scale_factor}" if self.scale_factor is not None else f"size={self.size}"
        return f"{what}, mode={self.mode!r}"


class Sigmoid(Module):
    def forward(self, x):
        return F.sigmoid(x)


class Tanh(Module):
    def forward(self, x):
        return F.tanh(x)


class Softmax(Module):
    def __init__(self, dim: int | None = None):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return F.softmax(_dtensor(x), self.dim)

    def extra_repr(self):
        return f"dim={self.dim}"


class LeakyReLU(Module):
    def __init__(self, negative_slope: float = 1e-2, inplace: bool = False):
        super().__init__()
        self.negative_slope, self.inplace = negative_slope, inplace

    def forward(self, x):
        return F.leaky_relu(x, self.negative_slope)

    def extra_repr(self):
        return f"negative_slope={self.negative_slope}"


class ELU(Module):
    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        super().__init__()
        self.alpha, self.inplace = alpha, inplace

    def forward(self, x):
        return F.elu(x, self.alpha)

    def extra_repr(self):
        return f"alpha={self.alpha}"


class Mish(Module):
    def __init__(self, inplace: bool = False):
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return F.mish(x)


__all__ = ["Conv1d", "Conv2d", "BatchNorm2d", "GroupNorm", "MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d",
           "GlobalAvgPool2d", "Flatten",
           "Upsample", "Sigmoid", "Tanh", "Softmax", "LeakyReLU", "ELU", "Mish"]
