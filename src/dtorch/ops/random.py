"""The global-view RNG: in-place random fills (``x.normal_()``, ``uniform_``, ``bernoulli_``, ``random_``,
``exponential_``, ...) and ``torch.nn.init`` on dtorch tensors.

A random value is drawn once, for the whole (global) tensor, by torch on the controller: the very call
torch makes on one CPU device (same shape, same dtype, the global generator or the ``generator`` given).
It is then laid out in the target's placements and written into the target's own storage (``copy_``:
each device receives only its block, nothing is gathered, the object keeps its identity). So, for the
same seed, the values equal torch's on one device in every layout, and the generator advances exactly
as torch's does: a sequence of draws after ``torch.manual_seed`` matches torch's sequence. This is
layout-invariant initialisation: sharding then initialising gives what initialising then sharding gives.

The cost: every value drawn passes through the controller once (fine for initialising the models a
simulation holds; on the process backend each device receives its block from the controller).

``torch.nn.init``: the functions torch routes to ``__torch_function__`` (``normal_``, ``uniform_``,
``constant_``, ``kaiming_uniform_``) run torch's own function on a controller tensor of the target's shape
and dtype, then write it. The others (``zeros_``, ``ones_``, ``xavier_*``, ``kaiming_normal_``,
``trunc_normal_``, ``sparse_``, ``dirac_``) are torch's code calling the methods here and ordinary
dtorch ops; each random call draws the global value, so they are layout-invariant too.
"""
from __future__ import annotations

import torch

from ..autograd.mode import is_grad_enabled, no_grad
from ..errors import OpError
from ..tensor import Tensor
from .inplace import InplaceError, copy_
from .table import register


class RandomOpError(OpError, RuntimeError):
    """A random fill torch refuses too (an integer tensor for ``normal_``, a negative ``std``...); the
    target is left unchanged."""


def write_global(target: Tensor, full: torch.Tensor) -> Tensor:
    """Write the global value ``full`` (a torch tensor of ``target``'s shape and dtype) into ``target``'s own
    storage: laid out in its placements (each device gets its block), copied in place."""
    spec = target._spec
    graph = target._graph
    src = Tensor._make(spec, graph.runtime.from_global(full, spec), graph)
    return copy_(target, src)


def _whole(value):
    return value.to_torch() if isinstance(value, Tensor) else value


def _check_target(name: str, target) -> None:
    if not isinstance(target, Tensor):
        raise OpError(f"dtorch {name} expects a dtorch.Tensor to write into, got {type(target).__name__}")
    ag = target._ag
    if is_grad_enabled() and ag is not None and ag.requires_grad and ag.grad_fn is None:
        raise InplaceError(f"dtorch {name}: a leaf tensor that requires grad is being used in an in-place operation; "
                           f"call it inside `with torch.no_grad():` (torch.nn.init does) or on a tensor without grad")


def _draw(name: str, target: Tensor, fill) -> Tensor:
    """``fill(full)`` on a fresh torch tensor of ``target``'s global shape and dtype, then written into ``target``."""
    _check_target(name, target)
    # (on a backend without values, a meta tensor: nothing allocated, nothing drawn)
    full = torch.empty(tuple(target.shape), dtype=target.dtype,
                       device="cpu" if target._graph.runtime.holds_values else "meta")
    try:
        fill(full)
    except (RuntimeError, ValueError) as exc:  # (a TypeError for bad arguments stays torch's own)
        raise RandomOpError(f"dtorch {name} on a {target.dtype} tensor of shape {list(target.shape)}: {exc}") from exc
    return write_global(target, full)


# -- in-place random methods -------------------------------------------------------------------------------

def _random_method(name: str):
    def method(self, *args, **kwargs):
        args = [_whole(a) for a in args]  # (bernoulli_'s probability tensor is read whole, as torch reads it)
        kwargs = {k: _whole(v) for k, v in kwargs.items()}
        return _draw(f"Tensor.{name}", self, lambda full: getattr(full, name)(*args, **kwargs))

    method.__name__ = name
    method.__doc__ = (f"``torch.Tensor.{name}``: the global value drawn by torch on the controller (the same values "
                      f"and generator use as torch on one device, whatever the layout), written in place.")
    return method


RANDOM_METHODS = ("normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_",
                  "log_normal_")

for _name in RANDOM_METHODS:
    register(_name, public=False, methods=(_name,))(_random_method(_name))


# -- torch.nn.init ---------------------------------------------------------------------------------------------

def _torch_init(init_fn):
    """The dtorch side of a ``torch.nn.init`` function torch hands to ``__torch_function__``: torch's own
    function on the controller, written into the target (``tensor`` is passed by keyword by torch)."""
    def fn(tensor=None, *args, **kwargs):
        if tensor is None and args:
            tensor, args = args[0], args[1:]
        name = f"torch.nn.init.{init_fn.__name__}"
        with no_grad():
            _draw(name, tensor, lambda full: init_fn(full, *args, **kwargs))
        return tensor

    fn.__name__ = f"init_{init_fn.__name__}"
    fn.__doc__ = f"``torch.nn.init.{init_fn.__name__}`` on a dtorch tensor (drawn globally, written in place)."
    return fn


INIT_FUNCTIONS = (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.constant_,
                  torch.nn.init.kaiming_uniform_)

for _fn in INIT_FUNCTIONS:
    register(f"init.{_fn.__name__}", public=False, torch_fns=(_fn,))(_torch_init(_fn))
