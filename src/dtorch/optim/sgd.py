"""SGD with torch's update (``torch.optim.sgd._single_tensor_sgd``, in its order of operations)."""
from __future__ import annotations

import torch

from .. import capture
from .optimizer import Optimizer, check_hyperparameters, hyperparameter, as_state


class SGD(Optimizer):
    """``torch.optim.SGD`` for dtorch parameters: momentum, dampening, Nesterov, weight decay, maximize.
    The momentum buffer has the parameter's placements; the update is element-wise on each device's block."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0, dampening: float = 0, weight_decay: float = 0,
                 nesterov: bool = False, *, maximize: bool = False, foreach=None, differentiable: bool = False,
                 fused=None):
        check_hyperparameters(lr=lr, momentum=momentum, weight_decay=weight_decay)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if differentiable or fused:
            raise NotImplementedError("dtorch.optim.SGD: differentiable=True and fused=True are not supported")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize, foreach=foreach, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()``'s loss when given."""
        loss = self._closure_loss(closure)
        for group in self.param_groups:
            lr, momentum, dampening = hyperparameter(group["lr"]), group["momentum"], group["dampening"]
            weight_decay, nesterov, maximize = group["weight_decay"], group["nesterov"], group["maximize"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if maximize else p.grad
                if weight_decay != 0:
                    grad = grad.add(p, alpha=weight_decay)
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = as_state(grad.detach().clone())
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                    grad = grad.add(buf, alpha=momentum) if nesterov else buf
                p.add_(grad, alpha=capture.live(_step_scale, group))
        return loss


def _step_scale(group) -> float:
    """-lr, read at each step (a step capture recomputes it at each replay: ``dtorch.capture.live``)."""
    return -hyperparameter(group["lr"])
