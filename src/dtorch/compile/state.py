"""The Python state a traced step reads and changes: its dtorch tensors, modules and optimizers.

A step finds its tensors through its arguments, its closure and the globals its code names (a model, an
optimizer, a batch). ``walk`` collects the dtorch tensors reachable from there (parameters, their ``.grad``,
optimizer states, a batch), the modules and the optimizers. Taken before and after the trace, the two walks say
what the replay must do to Python objects as eager did: a tensor that now holds another handle (a copy-on-write
write), how many in-place writes it had (``_version``), a ``.grad`` set, replaced or dropped. A tensor made
during the trace and kept somewhere other than ``.grad`` (an optimizer's first step makes its states) means the
trace is a warm-up, not a steady step: it is not kept, the next call traces again.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch

from ..nn.module import Module
from ..tensor import Tensor

_MAX_OBJECTS = 200_000
# objects whose insides hold no tensors of the step (or only the runtime's own)
_OPAQUE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, str, bytes,
           int, float, bool, complex, type(None), torch.Tensor, torch.dtype, torch.device, torch.Size, range)
_SKIP_MODULES = ("dtorch.graph", "dtorch.runtime", "dtorch.mesh", "dtorch.spec", "dtorch.placement", "numpy",
                 "torch.", "threading", "weakref", "collections.abc")


@dataclass
class Found:
    """What a walk found: tensors (with their argument path when they are one of the step's arguments or
    directly inside one), modules, optimizers, and the torch tensors among the arguments (by path)."""
    tensors: dict = field(default_factory=dict)  # id -> (Tensor, path or None)
    modules: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    torch_args: list = field(default_factory=list)  # (path, torch.Tensor)
    truncated: bool = False


def arg_leaves(x, path=(), out=None) -> list:
    """(path, leaf) for the leaves of the arguments, through tuples, lists and dicts (their structure)."""
    out = [] if out is None else out
    t = type(x)
    if t in (tuple, list):
        for n, v in enumerate(x):
            arg_leaves(v, path + (n,), out)
    elif t is dict:
        for k, v in x.items():
            arg_leaves(v, path + (k,), out)
    else:
        out.append((path, x))
    return out


def at(args, path):
    for k in path:
        args = args[k]
    return args


def roots(fn) -> list:
    """The objects ``fn`` reaches besides its arguments: itself (a callable object), its ``self``, closure cells and
    the globals its code names."""
    out = [fn]  # a callable object (a module compiled as a whole) holds its tensors itself
    self = getattr(fn, "__self__", None)
    if self is not None:
        out.append(self)
        fn = fn.__func__
    fn = getattr(fn, "__wrapped__", fn)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    code, glob = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    if code is not None:
        out += [glob[n] for n in code.co_names if n in glob]
    return out


def walk(args, extra_roots) -> Found:
    found = Found()
    seen = set()
    stack = []
    for path, leaf in arg_leaves(args):
        if isinstance(leaf, Tensor):
            found.tensors[id(leaf)] = (leaf, path)
            seen.add(id(leaf))
            _grad(leaf, stack)
        elif isinstance(leaf, torch.Tensor):
            found.torch_args.append((path, leaf))
        else:
            stack.append(leaf)
    stack += extra_roots
    count = 0
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, _OPAQUE):
            continue
        seen.add(id(x))
        count += 1
        if count > _MAX_OBJECTS:
            found.truncated = True
            break
        if isinstance(x, Tensor):
            found.tensors[id(x)] = (x, None)
            _grad(x, stack)
            continue
        t = type(x)
        if t in (list, tuple, set, frozenset):
            stack.extend(x)
            continue
        if isinstance(x, dict):
            stack.extend(x.values())
            stack.extend(k for k in x if isinstance(k, Tensor))
            continue
        if t.__module__.startswith(_SKIP_MODULES) or t.__module__ in ("torch", "builtins"):
            if not isinstance(x, torch.optim.Optimizer):
                continue
        if isinstance(x, Module):
            found.modules.append(x)
        elif isinstance(x, torch.optim.Optimizer):
            found.optimizers.append(x)
        d = getattr(x, "__dict__", None)
        if d is not None:
            stack.extend(d.values())
        for name in getattr(t, "__slots__", ()):
            v = getattr(x, name, None)
            if v is not None:
                stack.append(v)
    return found


def _grad(t: Tensor, stack: list) -> None:
    ag = t._ag
    if ag is not None and ag.grad is not None:
        stack.append(ag.grad)


def hooks_of(found: Found) -> str | None:
    """A user hook the replay would skip (Python code run by a module's call or a tensor's backward), named."""
    for m in found.modules:
        if m._forward_pre_hooks or m._forward_hooks:
            return f"{type(m).__name__} has forward hooks (Python code a replay does not run)"
    for t, _ in found.tensors.values():
        ag = t._ag
        if ag is not None and ag.hooks:
            return f"a tensor of shape {list(t.shape)} has hooks from register_hook (Python code a replay does not run)"
    return None


def writes(t: Tensor) -> tuple:
    return getattr(t, "_writes", 0), getattr(t, "_quiet", 0)
