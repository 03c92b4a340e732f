"""``Optimizer``: torch's optimizer base for dtorch parameters (param groups, state, state dicts).

It is a ``torch.optim.Optimizer`` subclass, so what torch builds on optimizers takes dtorch's:
``torch.optim.lr_scheduler.*`` (they check the type, read and write ``param_groups``, wrap ``step`` to
warn when the scheduler steps first), step / state-dict hooks (``register_step_pre_hook``, ...). torch's
base keeps the bookkeeping; what touches parameters is dtorch's own (dtorch tensors are not
``torch.Tensor`` instances): ``add_param_group``, ``zero_grad``, ``state_dict``, ``load_state_dict``.

The state of a parameter lives with it: each state tensor is a dtorch tensor on the parameter's mesh
with its placements (a Partial parameter's states are Replicate: their updates are not linear), so
every update is element-wise on each device's own blocks, with no communication. ``state_dict()`` has
torch's format (state keyed by parameter index, ``param_groups`` listing indices); ``load_state_dict``
takes dtorch or torch tensors (a state dict saved by ``torch.optim``) and lays each state out like its
parameter.
"""
from __future__ import annotations

from collections import defaultdict
from copy import deepcopy
from itertools import chain

import torch
from torch.optim.optimizer import required  # noqa: F401  (a default the caller must give, as in torch.optim)

from ..ops.factory import zeros_like
from ..placement import Partial, Replicate
from ..tensor import Tensor


def state_placements(p: Tensor) -> list:
    """The placements of ``p``'s optimizer states: ``p``'s own, a Partial mesh dim reduced."""
    return [Replicate() if isinstance(q, Partial) else q for q in p.placements]


def zeros_state(p: Tensor) -> Tensor:
    """A zero state tensor for ``p``: its shape, dtype, mesh and (state) placements."""
    return as_state(zeros_like(p, placements=state_placements(p)))


def as_state(t):
    """``t``, counted as optimizer state by the memory accounting (``Graph.get_memory_breakdown``)."""
    if isinstance(t, Tensor):
        t._graph.label_memory(t._h, "optimizer")
    return t


def scalar_dtype() -> torch.dtype:
    """The dtype of a ``step`` counter, as torch picks it."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


_TORCH_NAMES = {"lr": "learning rate", "eps": "epsilon value", "weight_decay": "weight_decay value",
                "momentum": "momentum value"}  # the words of torch.optim's errors


def check_hyperparameters(**values) -> None:
    """torch.optim's checks of non-negative options; ``lr`` may be a float or a 1-element tensor, as torch allows
    (a scheduler then ``fill_``s it in place, and each step reads its current value)."""
    for key, v in values.items():
        name = _TORCH_NAMES[key]
        if key == "lr" and isinstance(v, torch.Tensor):
            if v.numel() != 1:
                raise ValueError(f"Tensor lr must be 1-element, got shape {tuple(v.shape)}")
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"Invalid {name}: {v!r}; pass a Python number" + (" or a 1-element tensor"
                                                                               if key == "lr" else ""))
        if v < 0.0:
            raise ValueError(f"Invalid {name}: {v}")


def hyperparameter(v) -> float:
    """A group option's value now: a tensor lr is read at each step, so in-place changes take effect."""
    return v.item() if isinstance(v, torch.Tensor) else v


class Optimizer(torch.optim.Optimizer):
    """Base class: ``param_groups`` (each a dict with ``params`` and per-group options), ``state``
    (parameter -> dict), ``zero_grad``, ``state_dict`` / ``load_state_dict``; subclasses define ``step``."""

    def __init__(self, params, defaults: dict):
        if isinstance(params, (Tensor, torch.Tensor)):
            raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, but "
                            f"got {type(params).__name__}; pass [tensor] or model.parameters()")
        # torch's base: hooks, the profiled step, then our add_param_group for each group
        super().__init__(list(params), dict(defaults))

    def __repr__(self):
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {group[k]}" for k in sorted(group) if k not in ("params", "param_names")]
        return "\n".join(lines) + "\n)"

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group).__name__}")
        group = dict(param_group)
        params = group["params"]
        if isinstance(params, (Tensor, torch.Tensor)):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("optimizer parameters need to be organized in ordered collections, but the ordering of "
                            "tensors in sets will change between runs. Please use a list instead.")
        else:
            params = list(params)
        names = None
        if params and isinstance(params[0], tuple):  # named parameters: (name, tensor)
            names = [n for n, _ in params]
            params = [p for _, p in params]
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"optimizer can only optimize dtorch Tensors, but one of the params is "
                                f"{type(p).__module__}.{type(p).__name__}; make it a dtorch parameter first "
                                "(dtorch.nn.Parameter(t, device_mesh=..., placements=...))")
            if not p.is_leaf:
                raise ValueError("can't optimize a non-leaf Tensor (one computed by an op); optimize the leaf it "
                                 "comes from, or x.detach().requires_grad_()")
        group["params"] = params
        if names is not None:
            group["param_names"] = names
        for name, default in self.defaults.items():
            if default is required and name not in group:
                raise ValueError(f"parameter group didn't specify a value of required optimization parameter {name}")
            group.setdefault(name, default)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if len({id(p) for p in params}) != len(params) or any(id(p) in seen for p in params):
            raise ValueError("some parameters appear in more than one parameter group (or twice in one); list each "
                             "parameter once")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients: drop them (``set_to_none``, the default) or write zeros into them."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    with torch.no_grad():
                        p.grad.zero_()

    def _closure_loss(self, closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    # -- state dicts (torch's format) ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``{"state": {index: {name: value}}, "param_groups": [{options..., "params": [indices]}]}``: parameters
        numbered in group order, as torch does. State tensors are the optimizer's own dtorch tensors. The
        state-dict hooks run as in torch."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        index: dict = {}
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                index.setdefault(id(p), len(index))
            packed["params"] = [index[id(p)] for p in group["params"]]
            groups.append(packed)
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if id(p) in index}
        state_dict = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer's structure (from a dtorch or a torch optimizer): each state
        tensor is copied onto its parameter's mesh with the parameter's (state) placements and dtype."""
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = deepcopy(state_dict["param_groups"])  # not the caller's lists (torch copies them too)
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}) "
                             f"than this optimizer ({len(self.param_groups)})")
        for n, (g, s) in enumerate(zip(self.param_groups, saved_groups)):
            if len(g["params"]) != len(s["params"]):
                raise ValueError(f"loaded state dict contains a parameter group ({n}) that doesn't match the size of "
                                 f"optimizer's group: {len(s['params'])} parameters saved, {len(g['params'])} here")
        params_by_index = dict(zip(chain.from_iterable(s["params"] for s in saved_groups),
                                   chain.from_iterable(g["params"] for g in self.param_groups)))
        state: defaultdict = defaultdict(dict)
        for k, saved in state_dict["state"].items():
            p = params_by_index.get(k)
            if p is None:
                continue  # torch ignores states of parameters no group lists
            state[p] = {name: _load_value(p, name, v) for name, v in saved.items()}
        self.state = state
        new_groups = []
        for g, s in zip(self.param_groups, saved_groups):
            ng = {k: v for k, v in s.items() if k not in ("params", "param_names")}
            ng["params"] = g["params"]
            if "param_names" in g:
                ng["param_names"] = g["param_names"]
            new_groups.append(ng)
        self.param_groups = new_groups
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _load_value(p: Tensor, name: str, v):
    return as_state(_loaded_value(p, name, v))


def _loaded_value(p: Tensor, name: str, v):
    if name == "step":  # a host-side counter, as in torch (not a device tensor)
        if isinstance(v, Tensor):
            v = v.to_torch()
        return v.detach().clone().to(scalar_dtype()) if isinstance(v, torch.Tensor) else v
    if isinstance(v, Tensor):
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"state {name!r} has shape {tuple(v.shape)}, its parameter {tuple(p.shape)}")
        v = v.to(p.dtype) if v.dtype != p.dtype else v
        out = v.redistribute(p.device_mesh, state_placements(p))
        return out.clone() if out is v else out  # never share storage with the source optimizer's state
    if isinstance(v, torch.Tensor):
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"state {name!r} has shape {tuple(v.shape)}, its parameter {tuple(p.shape)}")
        return Tensor(v.detach().to(p.dtype), device_mesh=p.device_mesh, placements=state_placements(p))
    return v
