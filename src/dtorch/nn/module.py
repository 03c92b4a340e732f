"""Module: ``torch.nn.Module``'s API over dtorch tensors (``Parameter``: nn/parameter.py, as in torch).

Parameters and buffers are dtorch tensors laid out on a mesh; ``state_dict`` gathers them into full
torch tensors and ``load_state_dict`` cuts full torch tensors back into each parameter's layout, so a
checkpoint of the single-device torch model loads into any parallel layout. ``__call__`` runs
``redistribute_input -> forward -> redistribute_output``: the two hooks are where a module states the
layout it wants in and hands out.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Iterator, NamedTuple

import torch
from torch.utils.hooks import RemovableHandle

from .._collector import collector_paused
from ..autograd.fsdp import module_unit
from ..autograd.mode import no_grad
from ..context import get_default_device_mesh
from ..errors import DTorchError
from ..mesh import DeviceMesh
from ..ops.copy_tensors import copy_tensors_
from ..tensor import Tensor
from .parameter import Buffer, Parameter


class StateDictError(DTorchError, RuntimeError):
    """A state dict does not fit the module (missing, unexpected or mis-shaped keys)."""


class ModuleAssignmentError(DTorchError, TypeError):
    """A torch.nn module was given to a dtorch.nn module as a child (it would hold torch tensors)."""


class _IncompatibleKeys(NamedTuple):
    missing_keys: list
    unexpected_keys: list


class RepeatedRows:
    """How a parameter held with repeated row blocks is saved.

    The held tensor repeats each block of ``block`` rows (dim 0) of the saved tensor ``repeats`` times in a
    row. Used for kv heads replicated over tp: each tp device holds the kv head its query heads use (as
    Megatron and vLLM do), while the state dict and checkpoints keep one copy of each head (Hugging Face's).
    """

    def __init__(self, block: int, repeats: int):
        self.block, self.repeats = block, repeats

    def saved_shape(self, held_shape) -> tuple:
        return (held_shape[0] // self.repeats, *held_shape[1:])

    def save(self, held: torch.Tensor) -> torch.Tensor:
        return held.unflatten(0, (-1, self.repeats, self.block))[:, 0].flatten(0, 1)

    def load(self, saved: torch.Tensor) -> torch.Tensor:
        return saved.unflatten(0, (-1, self.block)).repeat_interleave(self.repeats, 0).flatten(0, 1)

    def tie_grad(self, grad: Tensor) -> Tensor:
        """The gradient of the held tensor when its repeated copies are one parameter: each copy gets the sum
        over the copies (so an optimizer step keeps them equal)."""
        rest = tuple(grad.shape[1:])
        g = grad.reshape((-1, self.repeats, self.block) + rest).sum(1, keepdim=True)
        return g.expand((g.shape[0], self.repeats, self.block) + rest).reshape(tuple(grad.shape))

    def held_slice(self, saved_slice) -> "_HeldSlice":
        """A view of a safetensors slice of the saved tensor (``get_shape``, ``[...]``) in the held layout, so a
        device's block is read straight from the rows it repeats."""
        return _HeldSlice(self, saved_slice)


class _HeldSlice:
    def __init__(self, form: RepeatedRows, saved_slice):
        self.form, self.saved = form, saved_slice

    def get_shape(self):
        shape = list(self.saved.get_shape())
        return [shape[0] * self.form.repeats, *shape[1:]]

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        start, stop, _ = index[0].indices(self.get_shape()[0])
        held = torch.arange(start, stop)
        f = self.form
        rows = held // (f.block * f.repeats) * f.block + held % f.block  # held row -> saved row
        if rows.numel() == 0:
            return self.saved[(slice(0, 0),) + tuple(index[1:])]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        return self.saved[(slice(lo, hi),) + tuple(index[1:])][rows - lo]


# dtorch.nn's own module classes by name (filled as they are defined): the twin to name when a torch module of that
# name is given as a child
_NN_CLASSES: dict[str, type] = {}


def _check_module(owner, name: str, value) -> None:
    """torch.nn modules cannot be children: their torch tensors would be missed by parameters(), state_dict()
    and to(), silently. Name the dtorch.nn module to build instead."""
    if not isinstance(value, torch.nn.Module):
        return
    kind = type(value).__name__
    twin = _NN_CLASSES.get(kind)
    if isinstance(twin, type) and issubclass(twin, Module):
        fix = f"build a dtorch.nn.{kind} instead (same arguments; its parameters are dtorch tensors on a mesh)"
    else:
        fix = f"dtorch.nn has no {kind}: write it as a dtorch.nn.Module subclass"
    raise ModuleAssignmentError(
        f"cannot register the torch module {type(value).__module__}.{kind} as {name!r} of {type(owner).__name__}: "
        f"dtorch.nn modules hold only dtorch.nn modules; {fix}, and copy torch weights in with "
        f"load_state_dict(torch_module.state_dict())")


def _as_dtensor(value, what: str) -> Tensor:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, torch.Tensor):
        return Tensor(value, device_mesh=get_default_device_mesh())
    raise TypeError(f"{what} must be a dtorch.Tensor or a torch.Tensor, got {type(value).__name__}")


class Module:
    training: bool

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__module__.startswith("dtorch.nn.") and not cls.__name__.startswith("_"):
            _NN_CLASSES.setdefault(cls.__name__, cls)

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_saved_forms", {})  # parameter name -> RepeatedRows (held != saved layout)
        object.__setattr__(self, "training", True)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward(); define forward(self, ...)")

    # -- the layout hooks ---------------------------------------------------------------------------
    def redistribute_input(self, *args, **kwargs):
        """Lay the inputs out the way ``forward`` wants them; returns ``(args, kwargs)``."""
        return args, kwargs

    def redistribute_output(self, output):
        """Lay the output out the way callers get it."""
        return output

    # per-module forward hooks (register_forward_pre_hook / register_forward_hook): handle id -> hook, made
    # on the first registration (None until then: a call without hooks reads two class attributes)
    _forward_pre_hooks = None
    _forward_hooks = None

    @collector_paused
    def __call__(self, *args, **kwargs):
        if self._forward_pre_hooks or self._forward_hooks:
            return _call_with_hooks(self, args, kwargs)
        return self._call(*args, **kwargs)

    def _call(self, *args, **kwargs):
        args, kwargs = self.redistribute_input(*args, **kwargs)
        return self.redistribute_output(self.run_forward(args, kwargs))

    def run_forward(self, args: tuple, kwargs: dict):
        """``forward`` on laid-out inputs; under fully sharded data parallel the unit's parameters are gathered
        on the "fsdp" dim just before it and let go after it (autograd/fsdp.py: the backward gathers them again)."""
        unit = module_unit(self)
        return self.forward(*args, **kwargs) if unit is None else unit.run(self, args, kwargs)

    # -- forward hooks (torch's; the globally registered torch.nn.modules.module hooks do not run) -------
    def register_forward_pre_hook(self, hook, *, prepend: bool = False, with_kwargs: bool = False):
        """``hook(module, args) -> None or new args`` (``with_kwargs``: ``hook(module, args, kwargs) -> None or
        (new args, new kwargs)``) before each call, on the arguments as the caller passed them (before the
        module lays them out); returns a handle whose ``remove()`` unregisters it."""
        return self._add_hook("_forward_pre_hooks", hook, prepend, {"with_kwargs": with_kwargs})

    def register_forward_hook(self, hook, *, prepend: bool = False, with_kwargs: bool = False,
                              always_call: bool = False):
        """``hook(module, args, output) -> None or new output`` (``with_kwargs``: ``hook(module, args, kwargs,
        output)``) after each call, on the output as the caller gets it; ``always_call``: also when the
        forward raised. Returns a handle whose ``remove()`` unregisters it."""
        return self._add_hook("_forward_hooks", hook, prepend, {"with_kwargs": with_kwargs, "always_call": always_call})

    def _add_hook(self, table: str, hook, prepend: bool, flags: dict):
        d = self.__dict__
        if table not in d:  # (OrderedDicts: RemovableHandle keeps weak references to them)
            d[table] = OrderedDict()
            for flag in flags:
                d[f"{table}_{flag}"] = OrderedDict()
        hooks = d[table]
        handle = RemovableHandle(hooks, extra_dict=[d[f"{table}_{flag}"] for flag in flags])
        hooks[handle.id] = hook
        for flag, on in flags.items():
            if on:
                d[f"{table}_{flag}"][handle.id] = True
        if prepend:
            hooks.move_to_end(handle.id, last=False)
        return handle

    def register_full_backward_hook(self, hook, prepend: bool = False):
        raise NotImplementedError(
            f"{type(self).__name__}.register_full_backward_hook is not supported by dtorch modules. Register a "
            "forward hook that calls register_hook on the output (its gradient) or on the inputs that require grad")

    register_backward_hook = register_full_backward_hook

    def first_param_device_mesh(self) -> DeviceMesh | None:
        for t in self.parameters():
            return t.device_mesh
        for t in self.buffers():
            return t.device_mesh
        return None

    # -- registration ------------------------------------------------------------------------------
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"call super().__init__() in {type(self).__name__}.__init__ before assigning attributes")
        params, buffers, modules = self._parameters, self._buffers, self._modules
        if isinstance(value, torch.nn.Parameter):
            value = self._from_torch_parameter(name, value)
        _check_module(self, name, value)
        if isinstance(value, Parameter):
            self._drop(name)
            params[name] = value
        elif name in params:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} as parameter {name!r} "
                                "(dtorch.nn.Parameter or None expected)")
            params[name] = None
        elif isinstance(value, Module):
            self._drop(name)
            modules[name] = value
        elif name in modules:
            if value is not None:
                raise TypeError(f"cannot assign {type(value).__name__} as child module {name!r} "
                                "(dtorch.nn.Module or None expected)")
            modules[name] = None
        elif isinstance(value, (Buffer, torch.nn.Buffer)):  # (the original DTorch's and torch's buffer marker)
            self.register_buffer(name, value, persistent=value.persistent)
        elif name in buffers:
            buffers[name] = None if value is None else _as_dtensor(value, f"buffer {name!r}")
        else:
            object.__setattr__(self, name, value)

    def _from_torch_parameter(self, name: str, value: torch.nn.Parameter) -> Parameter:
        """A torch parameter becomes a dtorch one: laid out like the parameter it replaces when the shapes
        match (a tp-sharded weight stays sharded), else replicated on the default mesh like a torch buffer."""
        old = self._parameters.get(name)
        if old is not None and tuple(old.shape) == tuple(value.shape):
            return Parameter(Tensor(value, device_mesh=old.device_mesh, placements=old.placements))
        return Parameter(_as_dtensor(value, f"parameter {name!r}"))

    def _drop(self, name):
        self.__dict__.pop(name, None)
        for d in (self._parameters, self._buffers, self._modules, self._saved_forms):
            d.pop(name, None)
        self._non_persistent.discard(name)

    def __getattr__(self, name):
        d = self.__dict__
        gathered = d.get("_unsharded")
        if gathered is not None and name in gathered:
            return gathered[name]
        for table in ("_parameters", "_buffers", "_modules"):
            t = d.get(table)
            if t is not None and name in t:
                return t[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name):
        if name in self._parameters or name in self._buffers or name in self._modules:
            self._drop(name)
        else:
            object.__delattr__(self, name)

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        if isinstance(param, torch.nn.Parameter):
            param = self._from_torch_parameter(name, param)
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot register {type(param).__name__} as parameter {name!r} "
                            "(dtorch.nn.Parameter or None expected)")
        self._drop(name)
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor, persistent: bool = True) -> None:
        if "." in name or not name:
            raise KeyError(f"buffer name can't be empty or contain '.', got {name!r}")
        value = None if tensor is None else _as_dtensor(tensor, f"buffer {name!r}")
        self._drop(name)
        self._buffers[name] = value
        if not persistent:
            self._non_persistent.add(name)

    def add_module(self, name: str, module: "Module | None") -> None:
        _check_module(self, name, module)
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a dtorch.nn.Module subclass")
        if "." in name or not name:
            raise KeyError(f"module name can't be empty or contain '.', got {name!r}")
        self._drop(name)
        self._modules[name] = module

    register_module = add_module

    def get_submodule(self, target: str) -> "Module":
        mod = self
        for part in target.split(".") if target else []:
            if part not in mod._modules:
                raise AttributeError(f"{type(mod).__name__} has no submodule {part!r} (looking up {target!r})")
            mod = mod._modules[part]
        return mod

    # -- traversal ---------------------------------------------------------------------------------
    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True) -> Iterator:
        memo = set() if memo is None else memo
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, mod in self._modules.items():
            if mod is not None:
                yield from mod.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)

    def modules(self) -> Iterator["Module"]:
        for _, m in self.named_modules():
            yield m

    def named_children(self) -> Iterator:
        seen = set()
        for name, mod in self._modules.items():
            if mod is not None and id(mod) not in seen:
                seen.add(id(mod))
                yield name, mod

    def children(self) -> Iterator["Module"]:
        for _, m in self.named_children():
            yield m

    def _named_members(self, table: str, prefix: str, recurse: bool, remove_duplicate: bool = True):
        seen = set()
        mods = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) if recurse else [(prefix, self)]
        for mod_prefix, mod in mods:
            for name, t in getattr(mod, table).items():
                if t is None or (remove_duplicate and id(t) in seen):
                    continue
                seen.add(id(t))
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), t

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def apply(self, fn) -> "Module":
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # -- state dicts -------------------------------------------------------------------------------
    def _state_entries(self, prefix: str = ""):
        """(key, owner module, attribute name, tensor) for every parameter and persistent buffer."""
        for mod_prefix, mod in self.named_modules(prefix=prefix.rstrip(".")):
            dot = f"{mod_prefix}." if mod_prefix else ""
            for name, p in mod._parameters.items():
                if p is not None:
                    yield dot + name, mod, name, p
            for name, b in mod._buffers.items():
                if b is not None and name not in mod._non_persistent:
                    yield dot + name, mod, name, b

    def _saved_form(self, name: str) -> RepeatedRows | None:
        """How parameter ``name`` is saved when its held layout differs (see RepeatedRows); None: as held."""
        return self._saved_forms.get(name)

    def state_dict(self, *, destination=None, prefix: str = "", keep_vars: bool = False) -> "OrderedDict":
        """Every parameter and persistent buffer; full torch tensors (``keep_vars=True``: the dtorch tensors, as
        held). A parameter shared by several modules (tied weights) appears under each name, like torch."""
        out = OrderedDict() if destination is None else destination
        for key, mod, name, t in self._state_entries(prefix):
            form = mod._saved_form(name)
            if keep_vars:
                out[key] = t
            else:
                out[key] = form.save(t.to_torch()) if form else t.to_torch()
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load full tensors (torch or dtorch), each cut into its parameter's mesh and placements.

        A parameter shared under several names (tied weights) loads from whichever of its names the state dict
        has (a Hugging Face state dict of a tied model may lack ``lm_head.weight``); if it has several, the
        last one wins, as in torch. Everything is checked before anything is loaded: on error the module is
        unchanged.
        """
        entries = list(self._state_entries())
        expected = {key for key, *_ in entries}
        names_of: dict = {}
        for key, _, _, t in entries:
            names_of.setdefault(id(t), []).append(key)
        missing = [key for key, _, _, t in entries if not any(k in state_dict for k in names_of[id(t)])]
        unexpected = [key for key in state_dict if key not in expected]
        problems = []
        for key, mod, name, t in entries:
            if key in state_dict:
                v = state_dict[key]
                form = mod._saved_form(name)
                shapes = {tuple(t.shape)} | ({form.saved_shape(t.shape)} if form else set())
                if not isinstance(v, (torch.Tensor, Tensor)):
                    problems.append(f'While copying the parameter named "{key}", expected a torch.Tensor or '
                                    f"dtorch.Tensor in the state dict, got {type(v).__name__}.")
                elif tuple(v.shape) not in shapes:
                    want = form.saved_shape(t.shape) if form else t.shape
                    problems.append(f"size mismatch for {key}: copying a param with shape {v.shape} from checkpoint, "
                                    f"the shape in current model is {torch.Size(want)}.")
        if strict:
            if unexpected:
                problems.insert(0, "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
            if missing:
                problems.insert(0, "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        if problems:
            raise StateDictError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(problems))
        on_devices = {}  # dtorch values of this Graph: written device to device, in batches (weight sync's path)
        for key, mod, name, t in entries:
            if key in state_dict:
                v = state_dict[key]
                form = mod._saved_form(name)
                here = isinstance(v, Tensor) and v._graph is t._graph
                if form is not None and tuple(v.shape) != tuple(t.shape):  # the saved layout: repeat the rows
                    v = form.load(v if here or not isinstance(v, Tensor) else v.to_torch())
                if here:
                    on_devices[id(t)] = (t, v)  # (a tied parameter: the last of its names wins)
                    continue
                value = Tensor(v, device_mesh=t.device_mesh, placements=t.placements, dtype=t.dtype)
                if isinstance(t, Parameter):
                    t._set(value)
                else:
                    mod._buffers[name] = value
        if on_devices:
            with no_grad():
                copy_tensors_(*zip(*on_devices.values()))
        return _IncompatibleKeys(missing, unexpected)

    # -- dtype, mode -------------------------------------------------------------------------------
    # buffers that ``to(dtype)`` leaves in float32 (rotary frequencies: Hugging Face keeps them float32 in a
    # bfloat16 model, and the cos/sin tables computed from them are only accurate at large positions in float32)
    _float32_buffers: tuple = ()

    def to(self, *args, **kwargs) -> "Module":
        """``to(dtype)`` casts floating parameters and buffers (except a module's ``_float32_buffers``);
        ``to(device_mesh)`` moves them to a mesh."""
        seen = set()
        for mod in self.modules():
            for name, p in mod._parameters.items():
                if p is not None and id(p) not in seen:  # a shared (tied) parameter is converted once
                    seen.add(id(p))
                    p._set(_convert(p, args, kwargs))
            for name, b in mod._buffers.items():
                if b is not None:
                    keep = name in mod._float32_buffers
                    mod._buffers[name] = _convert(b, args, kwargs, keep_dtype=keep)
        return self

    def float(self) -> "Module":
        return self.to(torch.float32)

    def half(self) -> "Module":
        return self.to(torch.float16)

    def bfloat16(self) -> "Module":
        return self.to(torch.bfloat16)

    def train(self, mode: bool = True) -> "Module":
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    with no_grad():
                        p.grad.zero_()

    # -- printing ----------------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        lines = [f"({name}): " + repr(m).replace("\n", "\n  ") for name, m in self._modules.items()]
        extra = self.extra_repr()
        if not lines:
            return f"{type(self).__name__}({extra})"
        body = "\n  ".join(([extra] if extra else []) + lines)
        return f"{type(self).__name__}(\n  {body}\n)"

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._parameters) | set(self._buffers) | set(self._modules))


def _call_with_hooks(module: Module, args: tuple, kwargs: dict):
    """``module(*args, **kwargs)`` with its forward pre-hooks and forward hooks, as ``torch.nn.Module`` runs them."""
    d = module.__dict__
    pre = d.get("_forward_pre_hooks") or {}
    for hook_id, hook in list(pre.items()):
        if hook_id in d["_forward_pre_hooks_with_kwargs"]:
            res = hook(module, args, kwargs)
            if res is not None:
                if not (isinstance(res, tuple) and len(res) == 2):
                    raise RuntimeError(f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but "
                                       f"got {res}.")
                args, kwargs = res
        else:
            res = hook(module, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
    post = d.get("_forward_hooks") or {}
    with_kwargs = d.get("_forward_hooks_with_kwargs", ())
    always = d.get("_forward_hooks_always_call", ())
    called, result = set(), None

    def run(hook_id, hook, result):
        res = hook(module, args, kwargs, result) if hook_id in with_kwargs else hook(module, args, result)
        return result if res is None else res

    try:
        result = module._call(*args, **kwargs)
        for hook_id, hook in list(post.items()):
            called.add(hook_id)
            result = run(hook_id, hook, result)
        return result
    except Exception:
        for hook_id, hook in list(post.items()):
            if hook_id in always and hook_id not in called:
                try:
                    result = run(hook_id, hook, result)
                except Exception as exc:  # noqa: BLE001  (torch's: the forward's error is the one raised)
                    warnings.warn("module forward hook with ``always_call=True`` raised an exception that was "
                                  f"silenced as another error was raised in forward: {exc}", stacklevel=2)
        raise


def _convert(t: Tensor, args, kwargs, keep_dtype: bool = False) -> Tensor:
    dtype = None if keep_dtype else kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)), None)
    mesh = kwargs.get("device_mesh") or next((a for a in args if isinstance(a, DeviceMesh)), None)
    if dtype is not None and not t.dtype.is_floating_point:
        dtype = None  # like torch: integer tensors keep their dtype
    out = t
    if dtype is not None:
        out = out.to(dtype)
    if mesh is not None:
        out = out.to(mesh)
    return out
