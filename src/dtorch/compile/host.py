"""Host torch computation inside a traced step: what the replay must compute again on the controller.

A step takes torch tensors (token ids, masks) and turns them into the blocks it lays out (padding, shifting the
labels, positions). That is torch code on the controller, not dtorch dispatch, so the recorder watches it with a
``TorchFunctionMode``: a torch op is *tracked* when an input is tracked (the step's torch arguments, and
everything computed from them) or when it makes a fresh tensor (a factory, a random draw into a fresh tensor: the
replay draws again, so the generator advances as eager's does). Tracked ops are recorded as host entries and run
again, first thing, at every replay; a placement of a tracked tensor takes the new value.

A tracked value read back to Python (``.item()``, ``.tolist()``, ``bool(mask.any())``) decides Python the replay
does not run again: it becomes a guard (the replay recomputes it and retraces when it differs). Tensor metadata
(shape, dtype, ...) needs no guard: the arguments' shapes and dtypes are guarded already. Persistent host tensors
the step did not make (an optimizer's step count) are not tracked: the code that changes them declares it
(``dtorch.capture``).
"""
from __future__ import annotations

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from .record import Entry, Recorder, Slot, leaves

# torch functions that make a fresh tensor from Python values alone
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.as_tensor,
              torch.rand, torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye, torch.empty_strided}
# Tensor methods whose Python result is metadata (fixed by the guarded shapes and dtypes), not a value
_METADATA = {"dim", "size", "numel", "stride", "is_floating_point", "is_complex", "is_contiguous", "data_ptr",
             "element_size", "__len__", "storage_offset", "is_signed", "nelement", "ndimension", "get_device",
             "untyped_storage", "is_inference", "__hash__", "__get__", "_is_view", "is_sparse", "is_quantized",
             "__torch_function__", "__reduce_ex__", "requires_grad_", "__repr__", "__format__"}


def _tensors(x, out: list) -> list:
    return leaves(x, _is_tensor, out)


def _is_tensor(x) -> bool:
    return isinstance(x, torch.Tensor)


class HostTracker(TorchFunctionMode):
    """Records the tracked host torch ops of a trace into ``rec`` (module doc)."""

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    def track(self, t: torch.Tensor) -> Slot:
        """Make ``t`` (a torch argument of the step) tracked: its slot."""
        return self.rec.new_slot(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if rec.passthrough:  # a kernel running inside a recorded runtime call, or another thread's work
            return func(*args, **kwargs)
        tracked = any(rec.slot_of(t) is not None for t in _tensors((args, kwargs), []))
        if not tracked and func not in _FACTORIES:
            return func(*args, **kwargs)
        tpl_args = self.template(args)
        tpl_kwargs = self.template(kwargs)
        out = func(*args, **kwargs)
        made = _tensors(out, [])
        if made:
            rec.entries.append(Entry("host", func, None, tpl_args, tpl_kwargs, self.outputs(out)))
        elif getattr(func, "__name__", "") not in _METADATA and not isinstance(out, (torch.Size, torch.dtype,
                                                                                      torch.device)):
            rec.entries.append(Entry("guard", func, None, tpl_args, tpl_kwargs, comparable(out)))
        return out

    def template(self, x):
        """``x`` with every tracked tensor as its slot (live values too)."""
        if isinstance(x, torch.Tensor):
            s = self.rec.slot_of(x)
            return x if s is None else s
        t = type(x)
        if t in (list, tuple):
            return t(self.template(v) for v in x)
        if t is dict:
            return {k: self.template(v) for k, v in x.items()}
        return self.rec.template(x)

    def outputs(self, out):
        if isinstance(out, torch.Tensor):
            return self.rec.new_slot(out)
        if type(out) in (list, tuple) or isinstance(out, tuple):  # (torch's named tuples: max, sort, ...)
            return [self.outputs(v) for v in out]
        return None


def comparable(value):
    """A host value read as guards compare it (arrays by content)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    return value


def same(value, expected) -> bool:
    return comparable(value) == expected
