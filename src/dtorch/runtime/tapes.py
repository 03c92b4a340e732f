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


def drop_values(t: torch.Tensor) -> None:
    """Let ``t`` (a leaf or an output of a local graph) go of its storage, keeping its shape and its place in
    the graph: its data becomes one element broadcast (torch's saved tensors keep their own references)."""
    key = (t.dtype, t.device)
    one = _SCALARS.get(key)
    if one is None:
        one = _SCALARS[key] = torch.zeros((), dtype=t.dtype, device=t.device)
    t.data = one.expand(t.shape)


def saved_tensors(outs):
    """The tensors torch's autograd graph behind ``outs`` saved for the backward (its nodes' ``_saved_*``
    attributes), walking the graph down to the leaves."""
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
        stack.extend(nxt for nxt, _ in fn.next_functions)


_SAVED_NAMES: dict = {}


def _saved_names(cls, fn) -> tuple:
    """The ``_saved_*`` attribute names of an autograd node class (``dir`` is slow: once per class)."""
    names = _SAVED_NAMES.get(cls)
    if names is None:
        names = _SAVED_NAMES[cls] = tuple(n for n in dir(fn) if n.startswith("_saved_"))
    return names
