"""The in-process backend's kept local graphs: an executable's run with torch's autograd recording the grid (or
box) computation, and its vector-Jacobian product from that graph in the backward (no recomputation).
Mixed into ``inprocess._Executable``, whose attributes (``kernel``, ``nd``, ``box``, ``grid``, ``in_specs``,
``in_reshape``, ``out_fix``, ``runtime``) and input/output helpers it uses."""
from __future__ import annotations

import numpy as np
import torch

from .grids import unbased
from .kernels import as_terms, broadcast_pair, broadcast_shape, varying
from .shards import BoxShards, Shards, SummedShards
from .tapes import Leaves, as_views as _as_views, drop_output_values, run_keeping_graph, \
    saved_tensors as _saved_tensors


class TrackedRuns:
    # What a grid executable's kept graphs need that depends on its specs alone, made on its first tracked run
    # (``_tracked_shapes``): (the grid its inputs span, each output's full grid shape). A grid handle of an
    # even spec is a tensor of exactly ``spec.grid_shape() + spec.even_local_shape()`` (the grid form's
    # invariant, inprocess.py's docstring), so the shapes of the tensors a run gets are known from the specs.
    tracked_shapes = None
    plain_kwargs = None  # the last kwargs dict seen that holds no tensor (a plan's own: the same dict each run)
    # (the tape's grid, cotangent specs, gradient specs) -> what vjp_tracked does per gradient (``_vjp_plan``),
    # and (ids of a call site's spec lists) -> (those lists, the tape's grid, that plan)
    vjp_plans = vjp_sites = None

    def run_tracked(self, handles, kwargs, device_args, diff, refetch=()):
        """Run with torch's autograd recording the grid computation of the ``diff`` inputs; (output handles,
        tape) or None when this executable runs device by device.

        The tape holds the graph, not the values: a big input reaches the kernel as a view of its leaf, and
        the leaf and the big outputs drop their values after the run, so what stays alive is what torch's
        graph saved (as torch keeps it). The tape's ``released`` names the inputs nothing of it holds now.
        ``refetch``: input positions the caller makes again for the backward (``vjp_tracked``'s ``refetched``):
        the graph saves where they lie instead of them (``tapes.Refetch``)."""
        box = self.box
        if not self.grid and (box is None or not box.trackable):
            return None
        leaf = Leaves(diff, refetch)

        with torch.enable_grad():
            if box is None:
                xs, kwargs = self._grid_inputs(handles, kwargs, device_args, leaf)
            else:
                xs, kwargs = self._box_inputs(handles, kwargs, device_args, leaf)
            views = _as_views(xs)
            # per-device values (grid-shaped tensors) keep only the grid dims they vary on; a dict without
            # tensors is passed as it is (_grid_inputs gives a plan's dict back as the same object every run)
            plain = kwargs is self.plain_kwargs
            if not plain:
                if device_args or any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                    kwargs = {k: varying(v) if isinstance(v, torch.Tensor) and v.ndim == self.nd else v
                              for k, v in kwargs.items()}
                else:
                    self.plain_kwargs, plain = kwargs, True
            out, hooks = run_keeping_graph(self.kernel.fn, xs, kwargs, refetch)
        outs = out if isinstance(out, tuple) else (out,)
        if box is None:
            in_grid, out_shapes = self.tracked_shapes or self._tracked_shapes()
            res = []
            for y, (g, local), shape in zip(outs, self.out_fix, out_shapes):
                y = y.detach()
                res.append(Shards(grid=y if y.shape == shape else self._fit(y, g, local, self.kernel.name)[0]))
        else:
            res = self._box_outputs([y.detach() for y in outs], handles, None, None)
        if plain and box is None:
            grid = in_grid
        else:
            grid = broadcast_shape([x.shape[: self.nd] for x in leaf.all + xs] + [
                v.shape for v in kwargs.values() if isinstance(v, torch.Tensor) and v.ndim == self.nd])
        measured = None
        if self.runtime().measure_tapes:  # (memory accounting: the storages of the inputs and of each output)
            measured = ({t.untyped_storage().data_ptr() for t in xs},
                        tuple(y.untyped_storage().data_ptr() for y in outs))
        del xs, out
        leaf.release()
        drop_output_values(outs)
        released = tuple(i for i, ref in views if ref() is None)
        return res, _Tape(leaf.all, outs, grid, released, measured, hooks)

    def _tracked_shapes(self):
        """``tracked_shapes`` (a grid executable): the inputs' grid as the kernel takes them (aligned inputs
        reshaped, ``in_reshape``), and each output's full shape."""
        shapes = self.in_reshape or [None] * len(self.in_specs)
        in_grid = broadcast_shape([s.grid_shape() if r is None else r[: self.nd] for s, r in zip(self.in_specs, shapes)])
        self.tracked_shapes = (in_grid, [tuple(g) + tuple(local) for g, local in self.out_fix])
        return self.tracked_shapes

    def tape_released(self, tape) -> tuple:
        return tape.released

    def tape_saved_outputs(self, tape) -> tuple:
        """The outputs whose values torch's graph saved (exp's, softmax's): walks the graph (memory
        accounting only)."""
        if tape.measured is None:
            return ()
        saved = {t.untyped_storage().data_ptr() for t in _saved_tensors(tape.outs)}
        return tuple(k for k, ptr in enumerate(tape.measured[1]) if ptr in saved)

    def tape_bytes(self, tape) -> int:
        """What torch's graph of the grid computation saves besides the inputs and outputs (softmax
        probabilities, normalised activations, ...), per device: the saved storages' bytes over the number of
        devices the grid computation spans (a replicated computation is held whole by each device)."""
        if tape.measured is None:
            return 0
        known = tape.measured[0] | set(tape.measured[1])
        extra = {}
        for t in _saved_tensors(tape.outs):
            s = t.untyped_storage()
            ptr = s.data_ptr()
            if ptr not in known:
                extra[ptr] = s.nbytes()
        cells = int(np.prod(tape.grid)) if tape.grid else 1
        return sum(extra.values()) // max(cells, 1)

    def vjp_tracked(self, tape, cotangents, ct_specs, has_ct, grad_specs, refetched=None) -> list:
        """The gradients of the tracked inputs (laid out as ``grad_specs``) for the outputs' cotangents;
        ``refetched``: {input position: handle} of the inputs ``run_tracked`` was told are made again."""
        leaves, outs = tape.leaves, tape.outs
        rt = self.runtime()
        box = self.box
        if box is None:
            cts = [h.grid if h.grid is not None else rt.as_grid(h, s) for h, s in zip(cotangents, ct_specs)]
            fits = self._vjp_plan(tape.grid, ct_specs, grad_specs)
        else:
            cts = [self._box_grid(h, s) for h, s in zip(cotangents, ct_specs)]
            grid = broadcast_shape([tape.grid] + [c.shape[: self.nd] for c in cts])
        hooks = tape.hooks
        if hooks is not None:
            values = {}
            for i, h in refetched.items():
                if box is not None:
                    values[i] = self._box_align(i, self._box_grid(h, self.in_specs[i]))
                    continue
                x = h.grid if h.grid is not None else rt.as_grid(h, self.in_specs[i])
                if self.in_reshape is not None and self.in_reshape[i] is not None:
                    x = x.reshape(self.in_reshape[i])
                values[i] = x
            hooks.values = values
        try:
            with torch.enable_grad():  # (the expand of an output to its cotangent's grid is part of the graph)
                ys, gs = [], []
                for y, c in zip([y for y, h in zip(outs, has_ct) if h], cts):
                    if y.requires_grad:
                        y, c = broadcast_pair(y, c)
                        ys.append(y)
                        gs.append(c)
                # retain_graph: the tape may be differentiated again (backward(retain_graph=True) twice); its
                # saved tensors are freed with the tape itself, when the op's node releases it
                grads = _grad(tuple(ys), tuple(leaves), tuple(gs)) if ys else [None] * len(leaves)
        finally:
            if hooks is not None:
                hooks.values = None  # (the inputs made again go with this call)
        res = []
        if box is None:
            nd = self.nd
            for x, g, (terms, target, local, shape) in zip(leaves, grads, fits):
                if g is None:
                    g = torch.zeros_like(x)
                if terms is not None:
                    # summed by torch over the grid dims the input was broadcast on: the terms are made only if
                    # something reads them as such, not for the reduction that takes their sum (SummedShards)
                    lazy = SummedShards(unbased(g), target)
                    if lazy.summed and lazy.terms_shape() == shape:
                        res.append(lazy)
                        continue
                    g = as_terms(g, terms, nd)
                res.append(Shards(grid=unbased(g if g.shape == shape else self._fit(g, target, local, "vjp")[0])))
            return res
        for x, g, spec in zip(leaves, grads, grad_specs):
            # summed over devices where the layout keeps terms apart: Partial terms; where it is Replicate
            # (the caller folded the reduction of a parameter's gradient into the GEMM), the sum is the value
            target = box.grid_shape(spec)
            g = as_terms(torch.zeros_like(x) if g is None else g, tuple(n if t > 1 else 1 for n, t in zip(grid, target)),
                         self.nd)
            res.append(self._box_gradient(g, spec, target))
        return res

    def _vjp_plan(self, grid, ct_specs, grad_specs) -> list:
        """What ``vjp_tracked`` does with each gradient of a grid executable's tape, from the specs alone (per
        tape grid, cotangent specs and gradient specs, once): [(the grid its Partial terms span, None where
        no dim can hold terms; its spec's grid shape; its local shape; its full shape)].

        A gradient comes summed over the devices where the layout keeps terms apart: Partial terms
        (``as_terms``); where it is Replicate (the caller folded the reduction of a parameter's gradient into
        the GEMM), the sum is the value. The grid is the tape's broadcast with the cotangents' (each of exactly
        its spec's grid shape: the grid form's invariant)."""
        # a replay passes each call site's own spec lists every step: found by identity (the entry holds the
        # lists, so their ids stay theirs; eager builds new ones, which nothing changes after the call)
        sites = self.vjp_sites
        site = sites.get((id(ct_specs), id(grad_specs))) if sites is not None else None
        if site is not None and site[0] is ct_specs and site[1] is grad_specs and site[2] == grid:
            return site[3]
        plans = self.vjp_plans
        if plans is None:
            plans, sites = self.vjp_plans, self.vjp_sites = {}, {}
        key = (grid, tuple(ct_specs), tuple(grad_specs))
        fits = plans.get(key)
        if fits is None:
            full = broadcast_shape([grid] + [s.grid_shape() for s in ct_specs])
            fits = []
            for spec in grad_specs:
                target, local = spec.grid_shape(), spec.even_local_shape()
                terms = tuple(n if t > 1 else 1 for n, t in zip(full, target))
                fits.append((terms if any(n > 1 for n in terms) else None, target, local, tuple(target) + tuple(local)))
            if len(plans) >= 64:  # (bounds: per-device values may vary the tape's grid from run to run)
                plans.clear()
            plans[key] = fits
        if len(sites) >= 256:  # (eager's lists come and go)
            sites.clear()
        sites[(id(ct_specs), id(grad_specs))] = (ct_specs, grad_specs, grid, fits)
        return fits

    def _box_gradient(self, g, spec, target):
        """A gradient of a kept box graph laid out over the whole mesh (idle devices: ``idle_grad_rule``)."""
        box = self.box
        g = self._fit(g, target, spec.local_shape(box.coords[box.busy.index(True)]), "vjp")[0]
        rt = self.runtime()
        grid = rt.use_grid(spec)
        if grid and box.whole(spec):
            return Shards(grid=g)
        made: dict = {}
        blocks = []
        for kind, arg in box.grad_layout(spec):
            b = made.get((kind, arg))
            if b is None:
                b = g[arg] if kind == "view" else (g.new_empty if kind == "empty" else g.new_zeros)(arg)
                if kind != "zeros":
                    made[(kind, arg)] = b
            blocks.append(b)
        return rt._make(spec, blocks=blocks) if grid else BoxShards(blocks, box.key(target), g)


try:  # torch's C++ engine, as torch.autograd.grad calls it
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # (a torch without it)
    _engine_run_backward = None


def _grad(outputs: tuple, inputs: tuple, grad_outputs: tuple):
    """``torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, retain_graph=True)``: the same
    call into torch's engine without the Python wrapper's checks and conversions, which a kept graph never
    needs (each cotangent has its output's shape and dtype: ``broadcast_pair``, and the node cast it; the
    engine checks them again itself) and which cost as much as a small op's backward."""
    if _engine_run_backward is None:
        return torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True, retain_graph=True)
    return _engine_run_backward(outputs, grad_outputs, True, False, inputs, True, accumulate_grad=False)


class _Tape:
    """What ``run_tracked`` keeps: the leaves (the differentiated inputs) and outputs of the local graph, the
    grid it spans, the input positions nothing of it holds (``released``), and, while the memory is measured,
    (the storages of its inputs, those of its outputs)."""

    # (__weakref__: a step capture names tapes by slot without keeping them, and their saved tensors, alive)
    __slots__ = ("leaves", "outs", "grid", "released", "measured", "hooks", "__weakref__")

    def __init__(self, leaves, outs, grid, released, measured, hooks=None):
        self.leaves, self.outs, self.grid, self.released, self.measured = leaves, outs, grid, released, measured
        self.hooks = hooks  # tapes.Refetch: the inputs made again for the backward
