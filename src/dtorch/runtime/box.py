"""Uneven layouts where some devices hold empty blocks (a batch smaller than dp x fsdp): the kernel runs once
on the stacked blocks of the busy devices only, and an idle device runs nothing.

A device is *idle* for a kernel when one of its input or output blocks is empty where another device's is not
(an output: a sliding window with no output row on that device, a slice that misses its block). The busy
devices must form a box of the mesh (a range per mesh dim: torch.chunk leaves the empty shards last) on which
every spec is even; their blocks then stack into one grid tensor of the box, as the in-process backend stacks
a whole mesh (``runtime/inprocess.py``). What an idle device's outputs are, without running anything there:

- ``project``: an output replicated on every mesh dim the box does not cover is the busy devices' value;
- ``empty``: an output block with no elements;
- ``zeros``: a gradient (a ``vjp:`` kernel) where every cotangent block there is empty (the VJP is linear in
  the cotangents: its terms are zeros);
- ``run``: anything else (a sum over an empty block: its zero term) runs the kernel on that device's blocks.

The in-process backend keeps the box grid on the output handle (``BoxShards``), so the next kernel on the same
box takes it as it is instead of stacking the blocks again.
"""
from __future__ import annotations

import numpy as np
import torch

from ..spec import DTensorSpec
from .kernels import VJP_PREFIX, varying


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class BoxPlan:
    """Where one kernel on one combination of specs runs: the box (``lo``, ``shape`` per mesh dim), each
    spec's grid shape on it, and each idle device's rule per output (module docstring)."""

    __slots__ = ("lo", "shape", "key_of", "in_grids", "out_grids", "local_out", "busy", "idle", "rules",
                 "coords", "vjp", "in_specs", "out_specs", "mesh", "_zero_rules", "trackable", "_grids",
                 "_layouts")

    def __init__(self, mesh, in_specs, out_specs, kernel_name: str, lo, shape, busy):
        self.mesh, self.in_specs, self.out_specs = mesh, in_specs, out_specs
        self.lo, self.shape = lo, shape
        self.coords = mesh.coordinates()
        self._grids, self._layouts = {}, {}  # caches: spec -> box grid shape; layouts of outputs and gradients
        self.busy = busy  # per device (mesh order): in the box
        self.idle = [n for n, b in enumerate(busy) if not b]
        self.in_grids = [self.grid_shape(s) for s in in_specs]
        self.out_grids = [self.grid_shape(s) for s in out_specs]
        self.local_out = [s.local_shape(self.coords[busy.index(True)]) for s in out_specs]
        self.vjp = kernel_name.startswith(VJP_PREFIX)
        partial_dims = [m for m in range(mesh.ndim) if shape[m] < mesh.shape[m]]
        self.rules = {}  # idle device -> per output: "project" | "empty" | "run" ("zeros" decided per call)
        for n in self.idle:
            rules = []
            for s in out_specs:
                if all(s.grid_shape()[m] == 1 for m in partial_dims):
                    rules.append("project")
                elif _numel(s.local_shape(self.coords[n])) == 0:
                    rules.append("empty")
                else:
                    rules.append("run")
            self.rules[n] = rules
        self._zero_rules = {}
        # every output is empty on every idle device: a kept local graph of the box is the whole computation
        # (the cotangents there are empty too, so the idle devices' gradient terms are zeros)
        self.trackable = all(r == "empty" for rules in self.rules.values() for r in rules)

    def grid_shape(self, spec: DTensorSpec) -> tuple:
        g = self._grids.get(spec)
        if g is None:
            g = self._grids[spec] = tuple(self.shape[m] if g > 1 else 1 for m, g in enumerate(spec.grid_shape()))
        return g

    def key(self, grid_shape) -> tuple:
        return (self.lo, self.shape, grid_shape)

    def index(self, n: int, grid_shape) -> tuple:
        """Device ``n``'s position in a box grid of ``grid_shape`` (a device off the box: projected on it)."""
        c = self.coords[n]
        return tuple(min(max(c[m] - self.lo[m], 0), self.shape[m] - 1) if g > 1 else 0
                     for m, g in enumerate(grid_shape))

    def rules_for(self, n: int, n_forward_inputs: int | None) -> list:
        """Device ``n``'s output rules; a gradient with every cotangent block here empty is zeros."""
        rules = self.rules[n]
        if not self.vjp or "run" not in rules:
            return rules
        key = (n, n_forward_inputs)
        out = self._zero_rules.get(key)
        if out is None:
            c = self.coords[n]
            cts_empty = all(_numel(s.local_shape(c)) == 0 for s in self.in_specs[n_forward_inputs:])
            out = self._zero_rules[key] = [("zeros" if cts_empty else "run") if r == "run" else r for r in rules]
        return out

    def layout(self, spec: DTensorSpec, rules) -> tuple:
        """Per device, how its block of an output laid out ``spec`` comes from the box grid: ("view", index in
        the box grid), ("empty" | "zeros", local shape) or ("run", None); ``rules(n)``: idle device n's rule."""
        g = self.grid_shape(spec)
        out = []
        for n in range(len(self.coords)):
            rule = "project" if self.busy[n] else rules(n)
            if rule == "project":
                out.append(("view", self.index(n, g)))
            elif rule == "run":
                out.append(("run", None))
            else:
                out.append((rule, spec.local_shape(self.coords[n])))
        return tuple(out)

    def out_layout(self, j: int, n_forward_inputs: int | None) -> tuple:
        key = ("out", j, n_forward_inputs)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = self.layout(self.out_specs[j],
                                                   lambda n: self.rules_for(n, n_forward_inputs)[j])
        return lay

    def grad_layout(self, spec: DTensorSpec) -> tuple:
        key = ("grad", spec)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = self.layout(spec, lambda n: self.idle_grad_rule(n, spec))
        return lay

    def whole(self, spec: DTensorSpec) -> bool:
        """The box grid of ``spec`` is its whole-mesh grid (it is replicated on every dim the box leaves)."""
        return self.grid_shape(spec) == spec.grid_shape()

    def idle_grad_rule(self, n: int, spec: DTensorSpec) -> str:
        """What idle device ``n`` holds of a gradient laid out ``spec`` from a kept box graph: the busy
        devices' value where it is replicated off the box, else nothing (empty) or a zero term."""
        if all(g == 1 for g, m, n_m in zip(spec.grid_shape(), self.shape, self.mesh.shape) if m < n_m):
            return "project"
        return "empty" if _numel(spec.local_shape(self.coords[n])) == 0 else "zeros"

    def stack(self, blocks: list, spec: DTensorSpec, grid_shape) -> torch.Tensor:
        """The box grid of a blocks-form input (replicas taken once)."""
        flat = {c: n for n, c in enumerate(self.coords)}
        picks = [blocks[flat[tuple(self.lo[m] + i[m] for m in range(len(i)))]] for i in np.ndindex(*grid_shape)]
        local = tuple(picks[0].shape)
        return torch.stack(picks).reshape(tuple(grid_shape) + local)

    def narrow(self, grid: torch.Tensor, grid_shape) -> torch.Tensor:
        """The box part of a whole-mesh grid. A dim the box covers with one device (``g`` 1) is cut too when the
        spec is sharded there (the grid holds every device's block); a grid dim of size 1 is one block that all
        devices share (replicated), the box's as it is."""
        for m, g in enumerate(grid_shape):
            if grid.shape[m] != g and grid.shape[m] > 1:
                grid = grid.narrow(m, self.lo[m], g)
        return grid

    def device_args(self, device_args: dict, device) -> dict:
        """The box's part of per-device values, cut to size 1 on the dims they are constant on: a value that
        only an idle device makes per-device (a window's length, 0 there) is one number on the box, as kernels
        that take it as a python int (``conv.window``'s length) need."""
        sl = tuple(slice(lo, lo + n) for lo, n in zip(self.lo, self.shape))
        return {k: varying(torch.as_tensor(np.asarray(v).reshape(self.mesh.shape)[sl], device=device))
                for k, v in device_args.items()}


def box_plan(mesh, in_specs, out_specs, kernel_name: str) -> BoxPlan | None:
    """The box plan for a kernel on these specs, or None when no device is idle or the busy ones are no box
    with every spec even on it."""
    if not in_specs:
        return None
    coords = mesh.coordinates()
    empties = []
    for s in tuple(in_specs) + tuple(out_specs):  # (an empty output: a window with no output rows here)
        e = [_numel(s.local_shape(c)) == 0 for c in coords]
        if any(e) and not all(e):
            empties.append(e)
    if not empties:
        return None
    busy = [not any(e[n] for e in empties) for n in range(len(coords))]
    if not any(busy):
        return None
    picked = [c for c, b in zip(coords, busy) if b]
    lo = tuple(min(c[m] for c in picked) for m in range(mesh.ndim))
    shape = tuple(max(c[m] for c in picked) - lo[m] + 1 for m in range(mesh.ndim))
    if len(picked) != _numel(shape):
        return None
    for s in tuple(in_specs) + tuple(out_specs):
        first = s.local_shape(picked[0])
        if any(s.local_shape(c) != first for c in picked[1:]):
            return None
    return BoxPlan(mesh, tuple(in_specs), tuple(out_specs), kernel_name, lo, shape, busy)
