"""The in-process backend: every device of a mesh lives in this process.

Storage of one DTensor takes one of two forms:

* grid: when every device holds a block of the same shape and the mesh maps to one torch device,
  the blocks are stacked into one tensor ``[*grid_shape, *local_shape]``. ``grid_shape`` has the
  mesh size on mesh dims where devices differ (Shard, Partial) and 1 where they agree (Replicate),
  so replicas are stored once. A kernel then runs once for all simulated devices, and collectives
  are reshapes and reductions of that tensor.
* blocks: a list of per-device tensors in mesh order (uneven shards, or one GPU per device).
  Replicas may share one tensor object: blocks are never written in place.

Both forms give every device exactly the block ``DTensorSpec.local_box`` defines. The block arithmetic
both forms share with the other backends (cutting shards, reducing Partial terms in the documented
order, cutting and assembling global values) is ``runtime/blocks.py``.
"""
from __future__ import annotations

import functools
import inspect
import weakref
from functools import lru_cache

import numpy as np
import torch

from .._lru import LRU
from ..errors import RuntimeBackendError
from ..placement import Partial
from ..spec import DTensorSpec
from .box import box_plan
from .blocks import assemble, cut_global
from .cow import private_copy, writable
from .grids import global_to_grid, grid_to_global
from .devices import DeviceConfig, read_device_config, torch_devices
from .inprocess_collectives import GridCollectives
from .inprocess_tracked import TrackedRuns
from .interface import Executable, Runtime
from .kernels import Kernel
from .inprocess_move_into import move_into
from .shards import BoxShards, Shards, add_sums


# ------------------------------------------------------------------------------------------------


class InProcessRuntime(GridCollectives, Runtime):
    name = "inprocess"
    handles_in_process = True

    def __init__(self, device_config: DeviceConfig | None = None):
        self.config = device_config or read_device_config()
        self._exec_cache = LRU("inprocess.executables", 4096)  # (kernel, in specs, out specs) -> _Executable

    # -- devices ---------------------------------------------------------------------------------
    def devices(self, mesh) -> tuple[torch.device, ...]:
        return torch_devices(mesh, self.config)

    def grid_device(self, mesh) -> torch.device | None:
        """The one torch device all of ``mesh`` runs on, else None."""
        return _grid_device(torch_devices(mesh, self.config))

    def use_grid(self, spec: DTensorSpec) -> bool:
        return spec.is_even() and self.grid_device(spec.mesh) is not None

    # -- conversions -----------------------------------------------------------------------------
    def as_grid(self, h: Shards, spec: DTensorSpec) -> torch.Tensor:
        if h.grid is not None:
            return h.grid
        g = spec.grid_shape()
        coords = spec.mesh.coordinates()
        flat = {c: n for n, c in enumerate(coords)}
        picks = []
        for c in np.ndindex(*g):
            picks.append(h.blocks[flat[tuple(c)]])  # c has 0 on replicated dims
        x = torch.stack(picks) if picks else torch.empty(0)
        return x.reshape(tuple(g) + spec.even_local_shape())

    def local_blocks(self, h: Shards, spec: DTensorSpec) -> list[torch.Tensor]:
        if h.blocks is not None:
            return h.blocks
        x = h.grid
        g = x.shape[: spec.mesh.ndim]
        return [x[tuple(c if n > 1 else 0 for c, n in zip(coord, g))] for coord in spec.mesh.coordinates()]

    def _make(self, spec: DTensorSpec, grid=None, blocks=None) -> Shards:
        """Store a result in the form its spec calls for."""
        if self.use_grid(spec):
            if grid is None:
                return Shards(grid=self.as_grid(Shards(blocks=blocks), spec))
            return Shards(grid=grid)
        if blocks is None:
            blocks = self.local_blocks(Shards(grid=grid), spec)
        return Shards(blocks=blocks)

    # -- placement of global values ---------------------------------------------------------------
    def from_global(self, full: torch.Tensor, spec: DTensorSpec) -> Shards:
        dev = self.grid_device(spec.mesh)
        if dev is not None and spec.is_even():
            return Shards(grid=global_to_grid(full.to(dev), spec))
        devs = self.devices(spec.mesh)
        blocks = []
        for dev, coord, b in zip(devs, spec.mesh.coordinates(), cut_global(full, spec)):
            # None: a sum Partial's zeros (the value sits on index 0 of that mesh dim)
            blocks.append(torch.zeros(spec.local_shape(coord), dtype=full.dtype, device=dev) if b is None else b.to(dev))
        return Shards(blocks=blocks)

    def from_blocks(self, blocks, spec: DTensorSpec) -> Shards:
        devs = self.devices(spec.mesh)
        return self._make(spec, blocks=[b.detach().to(d) for b, d in zip(blocks, devs)])

    def to_global(self, h: Shards, spec: DTensorSpec) -> torch.Tensor:
        if h.grid is not None:
            out = grid_to_global(h.grid, spec)
            # reshapes of the grid may be views of it: the caller gets a tensor of its own
            return out.clone() if out.untyped_storage().data_ptr() == h.grid.untyped_storage().data_ptr() else out
        # Partial terms reduce in mesh-dim order, outer first, exactly as the planner's all_reduce steps
        # (and the grid form) do: with mixed reduce ops the order is part of the meaning.
        return assemble(h.blocks, spec, self.devices(spec.mesh)[0])

    # -- in place ----------------------------------------------------------------------------------
    def write(self, kernel: Kernel, target: Shards, target_spec: DTensorSpec, inputs, in_specs, kwargs,
              device_args=None) -> Shards:
        """The in-place kernel on ``target``'s own blocks; a block anyone else can see is copied first."""
        specs = (target_spec,) + tuple(in_specs)
        if target.grid is not None:
            if not writable(target.grid):
                target = Shards(grid=private_copy(target.grid))
            self.executable(kernel, specs, ()).run([target] + list(inputs), kwargs, device_args)
            return target
        # blocks form: replicas may hold one tensor object; each distinct block is written once, with the
        # inputs of the first device holding it (replicas' inputs are equal: the plan laid them out so)
        blocks = target.blocks
        slots: dict = {}
        for n in range(len(blocks)):  # no loop variable may keep a block referenced: writable() counts them
            slots.setdefault(id(blocks[n]), []).append(n)
        if not all(writable(blocks[ns[0]], holder_refs=len(ns)) for ns in slots.values()):
            copies = {key: private_copy(blocks[ns[0]]) for key, ns in slots.items()}
            target = Shards(blocks=[copies[id(blocks[n])] for n in range(len(blocks))])
            blocks = target.blocks
        ins = [self.local_blocks(h, s) for h, s in zip(inputs, in_specs)]
        wants_lead = "lead" in inspect.signature(kernel.fn).parameters
        coords = target_spec.mesh.coordinates()
        for ns in slots.values():
            n = ns[0]
            kw = kwargs
            if device_args:
                kw = dict(kw, **{k: np.asarray(v)[coords[n]].item() for k, v in device_args.items()})
            if wants_lead:
                kw = dict(kw, lead=0)
            kernel.fn(blocks[n], *[b[n] for b in ins], **kw)
        return target

    def write_grid_call(self, kernel: Kernel, target_spec: DTensorSpec, in_specs, device_args):
        """``(f, writable, handle of a grid)`` when ``write`` of these specs is one in-place call ``f(target grid,
        *input grids, **kwargs)`` (for dtorch.compile's backend="inductor" to fuse it), else None. ``writable(h,
        spec)``: ``h``, or a handle of a private copy when anyone else can see its grid, as ``write`` decides."""
        if device_args:
            return None
        ex = self.executable(kernel, (target_spec,) + tuple(in_specs), ())
        if not ex.grid or ex.in_reshape is not None:
            return None
        return (functools.partial(kernel.fn, lead=ex.nd) if ex.wants_lead else kernel.fn), self._writable, Shards

    def _writable(self, h: Shards, spec: DTensorSpec) -> Shards:
        if h.grid is None:  # (a stack of the blocks is a grid of its own)
            return Shards(grid=self.as_grid(h, spec))
        return h if writable(h.grid) else Shards(grid=private_copy(h.grid))

    def alias(self, h: Shards, spec: DTensorSpec) -> Shards:
        # views: new tensor objects on the same storage, so copy-on-write sees the second holder
        if h.grid is not None:
            return Shards(grid=h.grid.view(h.grid.shape))
        views: dict = {}
        return Shards(blocks=[views.setdefault(id(b), b.view(b.shape)) for b in h.blocks])

    # -- local kernels ---------------------------------------------------------------------------
    def executable(self, kernel: Kernel, in_specs, out_specs) -> "_Executable":
        key = (kernel.name, tuple(in_specs), tuple(out_specs))
        ex = self._exec_cache.get(key)
        if ex is None:
            ex = self._exec_cache[key] = _Executable(self, kernel, key[1], key[2])
        return ex

    def move(self, h: Shards, before: DTensorSpec, after: DTensorSpec, same_layout: bool) -> Shards:
        if same_layout:
            dst_dev = self.grid_device(after.mesh)
            if h.grid is not None and dst_dev is not None:
                return Shards(grid=h.grid.to(dst_dev))
            devs = self.devices(after.mesh)
            return self._make(after, blocks=[b.to(d) for b, d in zip(self.local_blocks(h, before), devs)])
        return self.from_global(self.to_global(h, before), after)

    def move_into(self, moves) -> list:
        return move_into(self, moves, Shards)  # (Shards: the storage type, built here)


@lru_cache(maxsize=4096)
def _grid_device(devs: tuple) -> torch.device | None:
    first = devs[0]
    return first if all(d == first for d in devs) else None


class _Executable(TrackedRuns, Executable):
    """One kernel on one combination of input/output specs (cached by the runtime, shared by every plan
    with that kernel and those specs).

    Grid mode (every spec even, the mesh on one torch device): the kernel runs once on the stacked
    grid tensors. A first run checks what comes out: local shapes must be the specs', and grid dims
    the kernel left at 1 (or broadcast) are fixed. When that run needed no fix, no input reshape and
    no per-device arguments, the executable becomes *direct*: later runs hand the grids to the kernel
    and wrap what it returns, nothing else. When the same kwargs dict (a plan's own) comes twice in a
    row, the kernel is bound to it (``Kernel.bind``, e.g. ``torch.add`` itself), so the steady state of
    element-wise and view ops is the torch call on the grids. Otherwise the kernel runs once per device
    on its block.
    """

    def __init__(self, rt: InProcessRuntime, kernel: Kernel, in_specs: tuple, out_specs: tuple):
        self.kernel = kernel
        self.fn = kernel.fn
        self.runtime = weakref.ref(rt)  # the runtime caches us: no cycle
        self.direct = False
        self.seen_kwargs = None
        # (kwargs, the kernel bound to them): one attribute, so another thread never sees half of a new pair
        self.binding = (None, None)
        self.exact = None  # outputs needed no reshaping on every grid run so far
        self.grid_args = (None, None)  # (the plan's device_args, as grid-shaped tensors)
        self.with_lead = (None, None)  # (the plan's kwargs, with ``lead``)
        self.in_specs = in_specs
        self.out_specs = out_specs
        mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh
        self.mesh = mesh
        self.nd = mesh.ndim
        self.grid_dev = rt.grid_device(mesh)
        self.grid = self.grid_dev is not None and all(s.is_even() for s in in_specs + out_specs)
        # uneven with idle devices (empty blocks): one run on the busy devices' box (runtime/box.py)
        self.box = box_plan(mesh, in_specs, out_specs, kernel.name) if not self.grid and self.grid_dev is not None \
            else None
        self.sums_over_devices = self.grid or self.box is not None
        # an element-wise kernel on two sum-Partial grids of one spec, which may come as their terms' sums
        # (SummedShards: gradients summed by torch): the add of two such is the add of the sums (``add_sums``)
        self.adds_sums = (self.grid and kernel.name == "pointwise" and len(in_specs) == 2 and len(out_specs) == 1
                          and in_specs[0] == in_specs[1] == out_specs[0]
                          and any(isinstance(p, Partial) and p.reduce_op == "sum" for p in in_specs[0].placements))
        self.wants_lead = "lead" in inspect.signature(kernel.fn).parameters
        self.coords = mesh.coordinates()
        self.in_reshape = None
        if self.grid and kernel.align:
            r = max((len(s.shape) for s in in_specs), default=0)
            self.in_reshape = [
                (tuple(s.grid_shape()) + (1,) * (r - len(s.shape)) + s.even_local_shape()) if len(s.shape) < r else None
                for s in in_specs
            ]
            if all(r is None for r in self.in_reshape):
                self.in_reshape = None
        # (box runs) outputs whose spec is even are stored as a grid, the others as blocks
        self.use_grid_out = [rt.use_grid(s) for s in out_specs]
        # each output's expected (grid shape, local shape)
        self.out_fix = [(s.grid_shape(), s.even_local_shape()) for s in out_specs] if self.grid else None

    def run(self, handles, kwargs, device_args=None):
        if self.adds_sums:
            out = add_sums(handles, kwargs)
            if out is not None:
                return out
        if self.direct and not device_args:
            xs = []
            for h in handles:
                g = h.grid
                if g is None:  # a blocks-form handle of an even spec: the general path stacks it
                    return self._run(handles, kwargs, device_args)
                xs.append(g)
            binding = self.binding
            if kwargs is binding[0]:  # (only ever set once direct)
                out = binding[1](*xs)
            else:
                out = self.fn(*xs, lead=self.nd, **kwargs) if self.wants_lead else self.fn(*xs, **kwargs)
                if kwargs is self.seen_kwargs:  # the same dict a second time in a row: a plan's own, bind it
                    self._bind(kwargs, type(out) is tuple)
                else:  # (calls with run-time values, scalars, bring a new dict every time: they stay generic)
                    self.seen_kwargs = kwargs
            if type(out) is tuple:
                return [Shards(y) for y in out]
            return [Shards(out)]
        return self._run(handles, kwargs, device_args)

    def _bind(self, kwargs, tuple_out: bool) -> None:
        lead = self.nd if self.wants_lead else 0
        out_shapes = tuple(tuple(g) + local for g, local in self.out_fix)
        f = self.kernel.bind(kwargs, lead, out_shapes) if self.kernel.bind is not None else None
        if f is None:
            f = functools.partial(self.fn, lead=lead, **kwargs) if self.wants_lead else functools.partial(self.fn, **kwargs)
        self.binding = (kwargs, f)
        self.tuple_out = tuple_out
        # the executable specialises itself: run is the bound call from now on (not where run looks at the
        # handles first: adds_sums)
        if self.in_specs and not self.adds_sums:
            self.run = _bound_run(self, f, kwargs, len(self.in_specs), tuple_out)

    def grid_call(self, kwargs, device_args):
        """``(f, several outputs, handle of a grid)``: the torch call this executable makes on the grids once bound
        to ``kwargs``, for a step replay to call directly, grids in and out (dtorch.compile), and how a grid
        becomes a handle again; None when it is not bound to them."""
        kw, f = self.binding
        if self.direct and not device_args and self.in_specs and kw is kwargs and f is not None and not self.adds_sums:
            return f, self.tuple_out, Shards
        return None

    def local_call(self, kwargs, device_args):
        """``(f, handle of a grid)``: ``f(*grids)`` is this executable's run on grids with ``kwargs``, a tensor or a
        tuple of them (for dtorch.compile's backend="inductor" to fuse it, bound to ``kwargs`` or not); None when
        a run is more than that one call."""
        if not self.direct or device_args or not self.in_specs:
            return None
        kw, f = self.binding
        if kw is not kwargs or f is None:
            f = functools.partial(self.fn, lead=self.nd, **kwargs) if self.wants_lead else \
                functools.partial(self.fn, **kwargs)
        return f, Shards

    def _grid_inputs(self, handles, kwargs, device_args, leaf=None):
        """The kernel's grid inputs and keyword arguments (per-device values as grid-shaped tensors);
        ``leaf(i, x)``: what input ``i``'s grid becomes before it is aligned (autograd leaves)."""
        rt = self.runtime()
        xs = [h.grid if h.grid is not None else rt.as_grid(h, s) for h, s in zip(handles, self.in_specs)]
        if leaf is not None:
            xs = [leaf(i, x) for i, x in enumerate(xs)]
        if self.in_reshape is not None:
            xs = [x if shp is None else x.reshape(shp) for x, shp in zip(xs, self.in_reshape)]
        if device_args:
            grid_args = self.grid_args
            if grid_args[0] is not device_args:  # plans keep their device_args: convert once
                grid_args = self.grid_args = (device_args, {
                    k: torch.as_tensor(v, device=self.grid_dev).reshape(self.mesh.shape) for k, v in device_args.items()})
            kwargs = dict(kwargs, **grid_args[1])
            return xs, dict(kwargs, lead=self.nd) if self.wants_lead else kwargs
        if not self.wants_lead:
            return xs, kwargs
        # plans keep their kwargs dict (and never change it): with ``lead`` added once per dict, which the
        # callers only unpack into the kernel's call
        with_lead = self.with_lead
        if with_lead[0] is not kwargs:
            with_lead = self.with_lead = (kwargs, dict(kwargs, lead=self.nd))
        return xs, with_lead[1]

    def _fit(self, y, g, local, what):
        """A grid result laid out as an output of grid shape ``g`` (replicated dims narrowed, broadcast
        dims expanded); (the grid, whether it needed a fix)."""
        if tuple(y.shape[self.nd:]) != local:
            raise RuntimeBackendError(f"kernel {what} produced local shape {tuple(y.shape[self.nd:])}, expected {local}")
        yg = y.shape[: self.nd]
        if tuple(yg) == g:
            return y, False
        for d in range(self.nd):
            if yg[d] != g[d] and g[d] == 1:
                y = y.narrow(d, 0, 1)
        if tuple(y.shape[: self.nd]) != g:
            y = y.expand(tuple(g) + tuple(y.shape[self.nd:]))
        return y, True

    def _run(self, handles, kwargs, device_args):
        rt = self.runtime()
        kernel = self.kernel
        if self.grid:
            xs, kwargs = self._grid_inputs(handles, kwargs, device_args)
            out = kernel.fn(*xs, **kwargs)
            outs = out if isinstance(out, tuple) else (out,)
            res = []
            exact = not device_args
            for y, (g, local) in zip(outs, self.out_fix):
                y, fixed = self._fit(y, g, local, kernel.name)
                exact = exact and not fixed
                res.append(Shards(grid=y))
            self.exact = exact if self.exact is None else (self.exact and exact)
            if self.exact and self.in_reshape is None and len(outs) == len(self.out_specs):
                self.direct = True
            return res
        if self.box is not None:
            return self._run_box(handles, kwargs, device_args)
        # one call per device
        blocks_in = [rt.local_blocks(h, s) for h, s in zip(handles, self.in_specs)]
        per_dev = [self._run_on_device(n, blocks_in, kwargs, device_args) for n in range(len(self.coords))]
        return [rt._make(s, blocks=[d[j] for d in per_dev]) for j, s in enumerate(self.out_specs)]

    def _run_on_device(self, n, blocks_in, kwargs, device_args):
        kw = kwargs
        if device_args:
            kw = dict(kw, **{k: np.asarray(v)[self.coords[n]].item() for k, v in device_args.items()})
        if self.wants_lead:
            kw = dict(kw, lead=0)
        out = self.kernel.fn(*[b[n] for b in blocks_in], **kw)
        return out if isinstance(out, tuple) else (out,)

    def _box_grid(self, h, spec, g=None):
        """Handle ``h`` (of ``spec``) as a grid of the box (its grid shape ``g``)."""
        box = self.box
        g = box.grid_shape(spec) if g is None else g
        if type(h) is BoxShards and h.key == box.key(g):
            return h.boxed
        if h.grid is not None:
            return box.narrow(h.grid, g)
        return box.stack(h.blocks, spec, g)

    def _box_align(self, i, x):
        """Input ``i``'s box grid as an aligned kernel takes it (local rank padded)."""
        if not self.kernel.align:
            return x
        r = max(len(s.shape) for s in self.in_specs)
        n = len(self.in_specs[i].shape)
        return x if n == r else x.reshape(tuple(x.shape[: self.nd]) + (1,) * (r - n) + tuple(x.shape[self.nd:]))

    def _box_inputs(self, handles, kwargs, device_args, leaf=None):
        box = self.box
        xs = [self._box_grid(h, s, g) for h, s, g in zip(handles, self.in_specs, box.in_grids)]
        if leaf is not None:
            xs = [leaf(i, x) for i, x in enumerate(xs)]
        xs = [self._box_align(i, x) for i, x in enumerate(xs)]
        if device_args:
            kwargs = dict(kwargs, **box.device_args(device_args, self.grid_dev))
        if self.wants_lead:
            kwargs = dict(kwargs, lead=self.nd)
        return xs, kwargs

    def _run_box(self, handles, kwargs, device_args):
        """One run on the busy devices' box; idle devices get their outputs by the box plan's rules."""
        xs, kw = self._box_inputs(handles, kwargs, device_args)
        out = self.kernel.fn(*xs, **kw)
        del xs
        return self._box_outputs(out if isinstance(out, tuple) else (out,), handles, kwargs, device_args)

    def _box_outputs(self, outs, handles, kwargs, device_args):
        rt = self.runtime()
        box = self.box
        n_fwd = len(kwargs["vjp"][0]) if box.vjp else None
        res = []
        ran, blocks_in = {}, None
        for j, (y, g, local) in enumerate(zip(outs, box.out_grids, box.local_out)):
            y = self._fit(y, g, local, self.kernel.name)[0]
            spec = self.out_specs[j]
            if self.use_grid_out[j] and box.whole(spec):
                res.append(Shards(grid=y))
                continue
            blocks = []
            made: dict = {}  # (replicas, and idle devices' empty blocks, share one tensor)
            for n, (kind, arg) in enumerate(box.out_layout(j, n_fwd)):
                if kind == "run":
                    if blocks_in is None:
                        blocks_in = [rt.local_blocks(h, s) for h, s in zip(handles, self.in_specs)]
                    if n not in ran:
                        ran[n] = self._run_on_device(n, blocks_in, kwargs, device_args)
                    blocks.append(ran[n][j])
                    continue
                b = made.get((kind, arg))
                if b is None:
                    b = y[arg] if kind == "view" else (y.new_empty if kind == "empty" else y.new_zeros)(arg)
                    if kind != "zeros":  # (zero terms are no replicas: each device's may be written on its own)
                        made[(kind, arg)] = b
                blocks.append(b)
            res.append(rt._make(spec, blocks=blocks) if self.use_grid_out[j] else BoxShards(blocks, box.key(g), y))
        return res


_new_shards = object.__new__
# The bound runs make their output handles without a call to Shards.__init__ (a measurable part of a tiny
# op), which is only right while a grid handle is exactly these slots; otherwise they call Shards().
_BARE_SHARDS = Shards.__slots__ == ("grid", "blocks", "__weakref__")


def _bound_run(ex: _Executable, f, bound_kwargs: dict, n_in: int, tuple_out: bool):
    """``ex.run`` once bound, for one or two inputs: ``f`` (the bound kernel, e.g. ``torch.add``) straight on
    the grids when the call brings the bound kwargs again; anything else goes to the generic run.
    ``tuple_out``: the kernel returns a tuple of outputs (split), else one tensor."""
    generic = _Executable.run

    def wrap(out):
        return [Shards(y) for y in out] if tuple_out else [Shards(out)]

    if n_in == 1 and not tuple_out and _BARE_SHARDS:  # the hot cases are spelled out: no call but f's
        def run(handles, kwargs, device_args=None):
            if kwargs is bound_kwargs and not device_args:
                g = handles[0].grid
                if g is not None:
                    h = _new_shards(Shards)
                    h.grid = f(g)
                    h.blocks = None
                    return [h]
            return generic(ex, handles, kwargs, device_args)
    elif n_in == 2 and not tuple_out and _BARE_SHARDS:
        def run(handles, kwargs, device_args=None):
            if kwargs is bound_kwargs and not device_args:
                a, b = handles
                a, b = a.grid, b.grid
                if a is not None and b is not None:
                    h = _new_shards(Shards)
                    h.grid = f(a, b)
                    h.blocks = None
                    return [h]
            return generic(ex, handles, kwargs, device_args)
    else:
        def run(handles, kwargs, device_args=None):
            if kwargs is bound_kwargs and not device_args:
                xs = [h.grid for h in handles]
                if all(x is not None for x in xs):
                    return wrap(f(*xs))
            return generic(ex, handles, kwargs, device_args)

    return run
