"""The autograd attributes of ``dtorch.Tensor`` (``requires_grad``, ``.grad``, ``.backward()``, ...),
installed on the class by ``dtorch/__init__`` (tensor.py stays below the ops the backward runs)."""
from __future__ import annotations

import collections

from torch.utils.hooks import RemovableHandle

from ..tensor import Tensor
from .dispatched import IdentityNode
from .engine import as_grad_of, run_backward
from .mode import is_grad_enabled
from .node import AutogradMeta, attach, requires_grad
from .redistribute import redistribute


def _get_requires_grad(self) -> bool:
    return requires_grad(self)


def _set_requires_grad(self, value: bool) -> None:
    ag = self._ag
    if ag is not None and ag.grad_fn is not None:
        if not value:
            raise RuntimeError("you can only change requires_grad flags of leaf variables. If you want to use a "
                               "computed variable in a subgraph that doesn't require differentiation use "
                               "var_no_grad = var.detach().")
        return
    if value and not (self.dtype.is_floating_point or self.dtype.is_complex):
        raise RuntimeError("only Tensors of floating point and complex dtype can require gradients")
    if ag is None:
        if value:
            self._ag = AutogradMeta(requires_grad=True)
        return
    ag.requires_grad = bool(value)


def requires_grad_(self, requires_grad: bool = True):
    _set_requires_grad(self, requires_grad)
    return self


def _get_grad(self):
    ag = self._ag
    return None if ag is None else ag.grad


def _set_grad(self, value) -> None:
    if value is not None:
        if not isinstance(value, Tensor):
            raise TypeError(f"assigned grad expected to be a dtorch.Tensor or None but got {type(value).__name__}")
        if tuple(value.shape) != tuple(self.shape):
            raise RuntimeError(f"assigned grad has data of a different size: {tuple(value.shape)} vs the tensor's "
                               f"{tuple(self.shape)}")
        if value.device_mesh != self.device_mesh:
            raise RuntimeError(f"assigned grad lives on {value.device_mesh}, the tensor on {self.device_mesh}")
        value = as_grad_of(value, self._spec)
    ag = self._ag
    if ag is None:
        if value is None:
            return
        ag = self._ag = AutogradMeta()
    ag.grad = value


def _grad_fn(self):
    ag = self._ag
    return None if ag is None else ag.grad_fn


def _is_leaf(self) -> bool:
    ag = self._ag
    return ag is None or ag.grad_fn is None


def backward(self, gradient=None, retain_graph=None, create_graph: bool = False, inputs=None) -> None:
    """Accumulate the gradient of this tensor into ``.grad`` of every leaf it depends on (like torch)."""
    if create_graph:
        raise NotImplementedError("create_graph=True (higher-order gradients) is not supported by dtorch yet")
    if inputs is not None:
        raise NotImplementedError("backward(inputs=...) is not supported; use dtorch.autograd.grad(out, inputs)")
    run_backward([self], [gradient], retain_graph=bool(retain_graph))


def retain_grad(self) -> None:
    ag = self._ag
    if ag is None or (ag.grad_fn is None and not ag.requires_grad):
        raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
    if ag.grad_fn is None:
        return  # a leaf keeps its grad anyway
    node = ag.grad_fn
    if node.retained is None:
        node.retained = {}
    node.retained[ag.output_nr] = ag
    ag.retains_grad = True


def register_hook(self, hook):
    """``hook(grad)`` is called with this tensor's gradient (a dtorch tensor) each time a backward computes
    it; a tensor it returns replaces the gradient. On a leaf it sees the summed gradient before it is
    stored in ``.grad``. Returns a handle whose ``remove()`` unregisters it (torch's)."""
    ag = self._ag
    if ag is None or not requires_grad(self):
        raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
    if ag.hooks is None:
        ag.hooks = collections.OrderedDict()  # (RemovableHandle keeps a weak reference to it)
    handle = RemovableHandle(ag.hooks)
    ag.hooks[handle.id] = hook
    if ag.grad_fn is not None:  # a non-leaf: the walk looks its output up on the node that makes it
        node = ag.grad_fn
        if node.retained is None:
            node.retained = {}
        node.retained[ag.output_nr] = ag
    return handle


def _retains_grad(self) -> bool:
    ag = self._ag
    return ag is not None and ag.retains_grad


def clone(self, *, memory_format=None):
    """A new Tensor object with the same value. The blocks are copied lazily: an in-place write to either
    tensor copies first (the runtime's copy-on-write), so neither sees the other's. Differentiable."""
    out = type(self)._make(self._spec, self._graph.runtime.alias(self._h, self._spec), self._graph)
    if self._ag is not None and is_grad_enabled() and requires_grad(self):
        attach(IdentityNode("clone", self), [out])
    return out


# detach(): ops/views.py (a view: the same storage, no history)


def detach_(self):
    self._ag = None
    return self


def install(cls) -> None:
    cls.requires_grad = property(_get_requires_grad, _set_requires_grad)
    cls.requires_grad_ = requires_grad_
    cls.grad = property(_get_grad, _set_grad)
    cls.grad_fn = property(_grad_fn)
    cls.is_leaf = property(_is_leaf)
    cls.backward = backward
    cls.retain_grad = retain_grad
    cls.register_hook = register_hook
    cls.retains_grad = property(_retains_grad)
    cls.clone = clone
    cls.detach_ = detach_
    cls.redistribute = redistribute
