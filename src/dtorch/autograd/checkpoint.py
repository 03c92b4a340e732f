"""Activation checkpointing: run a block without keeping its activations; recompute them in the backward.

``checkpoint(fn, *args)`` runs ``fn`` under no_grad and records one node for the whole block. Its backward
runs ``fn`` again with grad enabled on detached copies of the inputs, with the random state the forward had
(dropout draws the same masks), and backpropagates through that fresh graph: the inputs' gradients flow on,
and the gradients of the leaves inside (the block's parameters) join the enclosing backward, which stores
them (summed with their other uses) or returns them (``autograd.grad``). Memory between the forward and the
backward: the block's inputs only.

``torch.utils.checkpoint.checkpoint`` (and ``checkpoint_sequential``) called with dtorch tensors among the
arguments comes here (``route_torch_checkpoint``), whatever ``use_reentrant`` says: torch's own forms cannot
see dtorch tensors (its reentrant form runs the block under no_grad and returns outputs without history; its
non-reentrant form hooks torch's saved tensors, which dtorch's graph does not keep).
"""
from __future__ import annotations

import warnings

import torch

from ..tensor import Tensor
from .engine import backward_within
from .node import Node, attach, requires_grad


class CheckpointNode(Node):
    __slots__ = ("fn", "args", "kwargs", "positions", "rng_state")
    name = "checkpoint"

    def __init__(self, fn, args, kwargs, positions, n_out, rng_state):
        super().__init__([args[i] for i in positions], n_out)
        self.fn, self.args, self.kwargs, self.positions = fn, args, kwargs, positions
        self.rng_state = rng_state

    def release(self):
        super().release()
        self.args = self.kwargs = None

    def apply(self, grads):
        args = list(self.args)
        detached = []
        for i in self.positions:
            d = args[i].detach().requires_grad_()
            args[i] = d
            detached.append(d)
        with torch.random.fork_rng(devices=[], enabled=self.rng_state is not None):
            if self.rng_state is not None:
                torch.set_rng_state(self.rng_state)
            with torch.enable_grad():
                out = self.fn(*args, **self.kwargs)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and requires_grad(o)]
        if not pairs:
            return [None] * len(detached)
        return backward_within([o for o, _ in pairs], [g for _, g in pairs], detached)


def checkpoint(fn, *args, use_reentrant=None, preserve_rng_state: bool = True, **kwargs):
    """``torch.utils.checkpoint.checkpoint`` for dtorch blocks: ``fn(*args, **kwargs)`` whose activations are
    recomputed in the backward instead of kept. ``use_reentrant`` is accepted for torch's signature and
    changes nothing (the gradients are those of torch's non-reentrant form: they reach ``autograd.grad``
    too); ``preserve_rng_state``: the recomputation draws the random numbers the forward drew."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    positions = [i for i, a in enumerate(args) if isinstance(a, Tensor) and requires_grad(a)]
    rng_state = torch.get_rng_state() if preserve_rng_state else None
    with torch.no_grad():
        out = fn(*args, **kwargs)
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    # a block with parameters inside records a node even when no input requires grad (the first layer)
    node = CheckpointNode(fn, tuple(args), kwargs, positions, len(outs), rng_state)
    attach(node, [o if isinstance(o, Tensor) else None for o in outs])
    return out


# -- torch.utils.checkpoint on dtorch tensors -------------------------------------------------------------

_TORCH_ONLY_OPTIONS = ("context_fn", "determinism_check", "debug", "early_stop")


def _holds_dtorch(values) -> bool:
    for v in values:
        if isinstance(v, Tensor):
            return True
        if isinstance(v, (list, tuple)) and any(isinstance(x, Tensor) for x in v):
            return True
        if isinstance(v, dict) and any(isinstance(x, Tensor) for x in v.values()):
            return True
    return False


def _torch_checkpoint_on_dtorch(function, *args, use_reentrant=None, **kwargs):
    """``torch.utils.checkpoint.checkpoint(function, *args, ...)`` with dtorch tensors among ``args``: torch's
    argument checks and warning, then dtorch's ``checkpoint``."""
    from torch.utils import checkpoint as tc

    if use_reentrant is None:  # torch's own warning, word for word
        warnings.warn(
            "torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly. Starting in PyTorch "
            "2.9, calling checkpoint without use_reentrant will raise an exception. use_reentrant=False is "
            "recommended, but if you need to preserve the current default behavior, you can pass "
            "use_reentrant=True. Refer to docs for more details on the differences between the two variants.",
            stacklevel=3)
        use_reentrant = True
    preserve = kwargs.pop("preserve_rng_state", True)
    options = {k: kwargs.pop(k) for k in _TORCH_ONLY_OPTIONS if k in kwargs}
    if use_reentrant and kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(arg for arg in kwargs))
    context_fn = options.get("context_fn", tc.noop_context_fn)
    if use_reentrant and (context_fn is not tc.noop_context_fn or options.get("debug", False) is not False):
        raise ValueError("Passing `context_fn` or `debug` is only supported when use_reentrant=False.")
    if context_fn is not tc.noop_context_fn:
        raise NotImplementedError(
            "torch.utils.checkpoint(..., context_fn=...) (selective activation checkpointing) is not supported on "
            "dtorch tensors: its policies see torch's dispatch of local kernels, not dtorch ops. Drop context_fn to "
            "recompute the whole block, or call dtorch.autograd.checkpoint.checkpoint on the parts to recompute")
    return checkpoint(function, *args, preserve_rng_state=preserve, **kwargs)


def route_torch_checkpoint() -> None:
    """Make ``torch.utils.checkpoint.checkpoint`` run dtorch's ``checkpoint`` when dtorch tensors are among its
    arguments (torch's own otherwise, unchanged). Called once by ``import dtorch``.

    torch's ``checkpoint`` is a wrapper (``torch._disable_dynamo``) that calls, on every call, the function
    cached on the original as ``__dynamo_disable``: setting that reroutes every reference to it, including
    ones taken before dtorch was imported (``from torch.utils.checkpoint import checkpoint`` in transformers).
    Where a torch version lacks that wrapper, the module attribute is replaced instead."""
    from torch.utils import checkpoint as tc

    entry = tc.checkpoint
    if getattr(entry, "_dtorch_routed", False):
        return
    original = getattr(entry, "__wrapped__", None)
    torch_call = None  # torch's checkpoint without the routing (dynamo disabled, as torch calls it)

    def routed(function, *args, **kwargs):
        if _holds_dtorch(args) or _holds_dtorch(kwargs.values()):
            return _torch_checkpoint_on_dtorch(function, *args, **kwargs)
        return torch_call(function, *args, **kwargs)

    if original is not None and _calls_dynamo_disable(entry):
        disabled = []

        def torch_call(*args, **kwargs):  # noqa: F811  (torch's own lazy import of dynamo, on first use)
            if not disabled:
                import torch._dynamo

                disabled.append(torch._dynamo.disable(original, True, wrapping=False))
            return disabled[0](*args, **kwargs)

        original.__dynamo_disable = routed
        entry._dtorch_routed = True
    else:
        torch_call = entry
        routed._dtorch_routed = True
        routed.__wrapped__ = entry
        tc.checkpoint = routed


def _calls_dynamo_disable(entry) -> bool:
    code = getattr(entry, "__code__", None)
    return code is not None and "__dynamo_disable" in code.co_names + code.co_consts
