"""What a kept local autograd graph holds: the tape arithmetic the in-process and meta backends share.

A backend that keeps each device's local torch graph from the forward (``Executable.run_tracked``) hands
big inputs to the kernel as views (``as_views``) and, after the run, lets the leaves and big outputs drop
their values (``drop_values``): what stays alive is what torch's graph saved (``saved_tensors``). The
meta backend runs the same steps on meta tensors to learn, per plan, what the in-process backend's graph
would hold: the same inputs released, the same outputs saved, the same bytes (memory accounting).
"""
from __future__ import annotations

import weakref

import torch

# Inputs and outputs of at least this many elements are held by a kept local graph only if torch's graph
# saved them (run_tracked): below it, dropping a tensor's values would cost more than the memory is worth.
RELEASE_NUMEL = 1 << 15


def as_views(xs: list) -> list:
    """Big inputs become views (in place in ``xs``): once the run's locals are gone a view lives on only if
    torch's graph saved it. [(position, weak reference to the view)]."""
    views = []
    for i in range(len(xs)):
        if xs[i].numel() >= RELEASE_NUMEL:
            xs[i] = xs[i].view_as(xs[i])
            views.append((i, weakref.ref(xs[i])))
    return views


_SCALARS: dict = {}
# (dtype, device, shape) -> that one element broadcast to the shape: ``t.data = d`` copies ``d``'s metadata and
# storage reference into ``t`` (not ``d`` itself), so one broadcast serves every tensor of its shape
_DROPPED: dict = {}


def drop_values(t: torch.Tensor) -> None:
    """Let ``t`` (a leaf or an output of a local graph) go of its storage, keeping its shape and its place in
    the graph: its data becomes one element broadcast (torch's saved tensors keep their own references)."""
    dtype, device, shape = t.dtype, t.device, t.shape
    dropped = _DROPPED.get((dtype, device, shape))
    if dropped is None:
        one = _SCALARS.get((dtype, device))
        if one is None:
            one = _SCALARS[(dtype, device)] = torch.zeros((), dtype=dtype, device=device)
        dropped = one.expand(shape)
        if len(_DROPPED) < 4096:  # (a bound: a model has a few shapes, a shape sweep many)
            _DROPPED[(dtype, device, shape)] = dropped
    t.data = dropped


def drop_output_values(outs) -> None:
    """Let the big outputs of a kept local graph go of their values (``drop_values``), and the tensor an output
    is a view of too (a GEMM's result reshaped): a view keeps its base, and so its base's storage, alive
    whatever its own data becomes. A base stays whole where torch's graph saved its storage (then a saved
    tensor may be the base itself, whose values the backward reads)."""
    bases = []
    for y in outs:
        if y.grad_fn is not None and y.numel() >= RELEASE_NUMEL:
            if y._base is not None and y._base.grad_fn is not None:
                bases.append(y._base)
            drop_values(y)
    if bases:
        # one base (a kernel's one output reshaped): only its producer and the nodes above it (its consumers)
        # can have saved its storage; the nodes below ran before it existed, so the walk stops at its producer
        stop = bases[0].grad_fn if len(bases) == 1 else None
        saved = {t.untyped_storage()._cdata for t in saved_tensors(outs, stop)}
        for b in bases:
            if b.untyped_storage()._cdata not in saved:
                drop_values(b)


def saved_tensors(outs, stop=None):
    """The tensors torch's autograd graph behind ``outs`` saved for the backward (its nodes' ``_saved_*``
    attributes), walking the graph down to the leaves; not below the node ``stop`` (its own saved tensors
    included)."""
    seen, stack = set(), [y.grad_fn for y in outs if y.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in _saved_names(type(fn), fn):
            try:
                v = getattr(fn, name)
            except RuntimeError:  # freed already
                continue
            for t in (v if isinstance(v, (tuple, list)) else (v,)):
                if isinstance(t, torch.Tensor):
                    yield t
        if fn is not stop:
            stack.extend(nxt for nxt, _ in fn.next_functions)


_SAVED_NAMES: dict = {}


def _saved_names(cls, fn) -> tuple:
    """The ``_saved_*`` attribute names of an autograd node class (``dir`` is slow: once per class)."""
    names = _SAVED_NAMES.get(cls)
    if names is None:
        names = tuple(n for n in dir(fn) if n.startswith("_saved_"))
        if isinstance(fn, torch.autograd.function.BackwardCFunction):  # a kernel's own autograd.Function
            names += ("saved_tensors",)
        _SAVED_NAMES[cls] = names
    return names


class Refetch:
    """Saved tensors of a kept local graph that are (views of) inputs the caller makes again for the backward
    (fsdp-gathered weights): the graph keeps where each view lies, not the values.

    ``pack`` and ``unpack`` are the graph's ``torch.autograd.graph.saved_tensors_hooks`` while the kernel
    runs. ``inputs``: the kernel's input tensors by position; ``positions``: those made again. In the backward
    the caller sets ``values`` (position -> the input made again, laid out as the kernel took it) around the
    differentiation; outside it (a memory walk of the graph) a refetched tensor reads as an empty tensor."""

    __slots__ = ("storages", "bases", "values")

    def __init__(self, inputs: list, positions: tuple):
        # storage identity (``_cdata``: meta tensors have no data pointer) -> position, while the kernel runs
        self.storages = {inputs[i].untyped_storage()._cdata: i for i in positions}
        # position -> (size, stride, storage offset) of the input as the kernel took it
        self.bases = {i: (inputs[i].shape, inputs[i].stride(), inputs[i].storage_offset()) for i in positions}
        self.values = None

    def pack(self, t: torch.Tensor):
        i = self.storages.get(t.untyped_storage()._cdata) if self.storages else None
        if i is None:
            return t
        return (i, t.shape, t.stride(), t.storage_offset(), t.dtype, t.device)

    def unpack(self, packed):
        if type(packed) is not tuple:
            return packed
        i, size, stride, offset, dtype, device = packed
        values = self.values
        if values is None:
            return torch.empty(0, dtype=dtype, device=device)
        base_size, base_stride, base_offset = self.bases[i]
        x = values[i]
        if tuple(x.shape) != tuple(base_size) or x.stride() != base_stride:  # lay it out as the forward's input
            x = torch.empty_strided(base_size, base_stride, dtype=x.dtype, device=x.device).copy_(x)
            return x.as_strided(size, stride, offset - base_offset)
        return x.as_strided(size, stride, x.storage_offset() + offset - base_offset)

    def done_packing(self) -> None:
        """The forward ran: storage identities may be reused from now on."""
        self.storages = None


class Leaves:
    """The differentiated inputs of a kept local graph, made as the kernel's inputs are read (``leaf(i, x)``:
    input ``i`` detached into a leaf where ``diff[i]``), and what the run lets go of after it (``release``)."""

    __slots__ = ("diff", "refetch", "all", "refetched")

    def __init__(self, diff, refetch):
        self.diff, self.refetch, self.all, self.refetched = diff, refetch, [], []

    def __call__(self, i, x):
        if self.diff[i]:
            x = x.detach().requires_grad_()
            self.all.append(x)
            if i in self.refetch:
                self.refetched.append(x)
        return x

    def release(self) -> None:
        """Drop the values of the big leaves and of the refetched ones (the graph saved places for those)."""
        for t in self.all:
            if t.numel() >= RELEASE_NUMEL or (self.refetched and any(t is r for r in self.refetched)):
                drop_values(t)
        self.refetched = []


def run_keeping_graph(fn, xs: list, kwargs: dict, refetch):
    """``fn(*xs, **kwargs)`` as torch records it; with ``refetch`` positions the graph saves places for those
    inputs instead of them (``Refetch``). Returns (the output, the hooks or None)."""
    if not refetch:
        return fn(*xs, **kwargs), None
    hooks = Refetch(xs, refetch)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        out = fn(*xs, **kwargs)
    hooks.done_packing()
    return out, hooks
