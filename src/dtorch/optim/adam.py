"""Adam and AdamW with torch's update (``torch.optim.adam._single_tensor_adam``, in its order of operations:
the same float32 results up to rounding of fused kernels). As in torch, AdamW is Adam with
``decoupled_weight_decay=True``: the weights shrink by ``lr * weight_decay`` before the update, where Adam's
weight decay is an L2 term added to the gradient."""
from __future__ import annotations

import torch

from .. import capture
from ..autograd.kernel_entry import write_local
from ..ops.pointwise import addcmul, maximum
from ..runtime.kernels import kernel
from .optimizer import Optimizer, check_hyperparameters, hyperparameter, scalar_dtype, zeros_state


class Adam(Optimizer):
    """``torch.optim.Adam`` for dtorch parameters. ``exp_avg``, ``exp_avg_sq`` (and ``max_exp_avg_sq`` with
    amsgrad) have the parameter's placements; ``step`` is a host-side float tensor, as in torch."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, *, foreach=None, maximize: bool = False, capturable: bool = False,
                 differentiable: bool = False, fused=None, decoupled_weight_decay: bool = False):
        check_hyperparameters(lr=lr, eps=eps, weight_decay=weight_decay)
        for i, b in enumerate(betas):
            if not isinstance(b, (int, float)) or not 0.0 <= b < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {b!r}")
        if capturable or differentiable or fused:
            raise NotImplementedError(f"dtorch.optim.{type(self).__name__}: capturable, differentiable and fused are "
                                      "not supported")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable, differentiable=differentiable,
                        fused=fused, decoupled_weight_decay=decoupled_weight_decay)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()``'s loss when given."""
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            lr, (beta1, beta2), eps = hyperparameter(group["lr"]), group["betas"], group["eps"]
            weight_decay, amsgrad, maximize = group["weight_decay"], group["amsgrad"], group["maximize"]
            decoupled = group.get("decoupled_weight_decay", False)
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if maximize else p.grad
                if weight_decay != 0 and not decoupled:  # Adam's L2 penalty: part of the gradient
                    grad = grad.add(p, alpha=weight_decay)
                decay = weight_decay if decoupled else 0.0  # AdamW's: p *= 1 - lr * weight_decay
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=scalar_dtype())
                    state["exp_avg"] = zeros_state(p)
                    state["exp_avg_sq"] = zeros_state(p)
                    if amsgrad:
                        state["max_exp_avg_sq"] = zeros_state(p)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                capture.effect(_count_step, state)
                if not amsgrad and _same_layout(p, grad, exp_avg, exp_avg_sq):
                    _fused_update(p, grad, exp_avg, exp_avg_sq, group, state, decay)
                    continue
                capture.refuse(f"dtorch.optim.{type(self).__name__}'s unfused update (amsgrad, or states laid out "
                               "unlike their parameter) hands its step-dependent scalars to ops as Python values")
                if decay != 0:
                    p.mul_(1 - lr * decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2)
                exp_avg_sq.copy_(addcmul(exp_avg_sq, grad, grad, value=1 - beta2))  # torch's addcmul_
                step = state["step"].item()
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2 ** 0.5
                if amsgrad:
                    max_sq = state["max_exp_avg_sq"]
                    max_sq.copy_(maximum(max_sq, exp_avg_sq))
                    denom = (max_sq.sqrt() / bias_correction2_sqrt).add(eps)
                else:
                    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add(eps)
                # torch's p.addcdiv_(exp_avg, denom, value=-step_size): p + (value * exp_avg) / denom
                p.add_(exp_avg.mul(-step_size).div(denom))
        return loss


class AdamW(Adam):
    """``torch.optim.AdamW``: Adam with decoupled weight decay (default 1e-2)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False, *, maximize: bool = False, foreach=None, capturable: bool = False,
                 differentiable: bool = False, fused=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize,
                         capturable=capturable, differentiable=differentiable, fused=fused,
                         decoupled_weight_decay=True)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # as torch's AdamW: loaded groups stay decoupled
            group["decoupled_weight_decay"] = True


# -- the update as three in-place kernels on each device's blocks: torch's own lines, one pass each ----------

@kernel("optim.adamw_avg")
def _avg_kernel(exp_avg, grad, *, beta1):
    exp_avg.lerp_(grad, 1 - beta1)


@kernel("optim.adamw_sq")
def _sq_kernel(exp_avg_sq, grad, *, beta2):
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad.conj(), value=1 - beta2)


@kernel("optim.adamw_param")
def _param_kernel(p, exp_avg, exp_avg_sq, *, decay, step_size, bias_correction2_sqrt, eps):
    if decay != 1:
        p.mul_(decay)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-step_size)


def _same_layout(*ts) -> bool:
    first = ts[0]._spec
    return all(t._spec.placements == first.placements and t._spec.mesh == first.mesh and t._graph is ts[0]._graph
               for t in ts[1:]) and not any(p.is_partial() for p in first.placements)


def _write(kern, target, inputs, **kw) -> None:
    write_local(f"optim.{kern.name}", kern, target, inputs, kw)


def _count_step(state) -> None:
    state["step"] += 1


def _param_scalars(group, state, decoupled_decay) -> dict:
    """The last pass's scalars: they change with the step count and the lr (a step capture recomputes them at
    each replay: ``dtorch.capture.live``)."""
    lr, (beta1, beta2), step = hyperparameter(group["lr"]), group["betas"], state["step"].item()
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    return dict(decay=1 - lr * decoupled_decay, step_size=lr / bias_correction1,
                bias_correction2_sqrt=bias_correction2 ** 0.5, eps=group["eps"])


def _fused_update(p, grad, exp_avg, exp_avg_sq, group, state, decoupled_decay) -> None:
    """torch's ``_single_tensor_adam`` on every device's blocks of ``p`` and its states, which share ``p``'s
    layout: no communication, three in-place passes (``decoupled_decay``: AdamW's weight decay, else 0)."""
    beta1, beta2 = group["betas"]
    _write(_avg_kernel, exp_avg, [grad], beta1=beta1)
    _write(_sq_kernel, exp_avg_sq, [grad], beta2=beta2)
    write_local("optim.adamw_param", _param_kernel, p, [exp_avg, exp_avg_sq],
                capture.live(_param_scalars, group, state, decoupled_decay))
