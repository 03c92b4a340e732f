"""The process backend's operations: what the controller queues for a kernel, an in-place write, and each
redistribution primitive (``Operations``, mixed into ``process.ProcessRuntime``, which provides the
records' plumbing: ``_ensure``, ``_define``, ``_note``, ``_emit``, ``_new``, ``_id``, ``_tags``), and the
kernel executables it caches; ``Handle``, what they take and give."""
from __future__ import annotations

import weakref
import numpy as np

from ..spec import DTensorSpec
from . import process_plan as pp
from . import protocol as rec
from .interface import Executable
from .protocol import Kernel

class Handle:
    """A DTensor's storage on the workers. When the last reference goes, its blocks are freed."""

    __slots__ = ("id", "ranks", "epoch", "sink", "__weakref__")
    # code written for the in-process backend's storage probes these; here the data lives elsewhere
    grid = None
    blocks = None

    def __init__(self, hid: int, ranks: tuple, epoch: int, sink: list):
        self.id = hid
        self.ranks = ranks
        self.epoch = epoch
        self.sink = sink

    def __del__(self):
        try:
            self.sink.append((self.id, self.ranks, self.epoch))
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def __repr__(self):
        return f"Handle({self.id} on ranks {list(self.ranks)})"


class Operations:
    # -- local kernels ---------------------------------------------------------------------------
    def executable(self, kernel, in_specs, out_specs) -> "_Executable":
        key = (kernel.name, tuple(in_specs), tuple(out_specs))
        ex = self._executables.get(key)
        if ex is None:
            ex = self._executables[key] = _Executable(self, kernel, key[1], key[2])
        return ex

    def write(self, kernel, target: Handle, target_spec: DTensorSpec, inputs, in_specs, kwargs, device_args=None):
        """Each worker runs the in-place kernel on its block of ``target`` under the same id; a block that
        another id shares (an alias, an identity kernel's output) is copied first on the worker."""
        mesh = target_spec.mesh
        self._ensure(mesh)
        specs = (target_spec,) + tuple(in_specs)
        ranks = tuple(mesh.device_ids)
        pid = self._define(("k", kernel.name, specs, ()), rec.DefineKernel, (kernel.name, kernel.fn.__module__, specs, ()),
                           ranks)
        tid = self._id(target)
        in_ids = tuple(self._id(h) for h in inputs)
        seq = self._note(("kernel", kernel.name, kwargs, specs))
        per = self._per_rank(mesh, device_args) if device_args else None
        for r in ranks:
            self._buf[r].append(rec.Write(seq, pid, tid, in_ids, kwargs, per[r] if per else None))
        self._counted(len(ranks))
        if self.sync_every_op:
            self.sync()
        return target

    def alias(self, h: Handle, spec: DTensorSpec) -> Handle:
        self._ensure(spec.mesh)
        hid = self._id(h)
        out = self._new(h.ranks)
        self._emit(h.ranks, rec.Alias(hid, out.id))
        return out

    def _per_rank(self, mesh, device_args: dict) -> dict:
        """rank -> {name: python number} (cached per device_args object: plans reuse theirs)."""
        hit = self._dev_args.get(id(device_args))
        if hit is not None and hit[0] is device_args and hit[1] == mesh:
            return hit[2]
        arrays = {k: np.asarray(v) for k, v in device_args.items()}
        per = {r: {k: a[c].item() for k, a in arrays.items()} for r, c in zip(mesh.device_ids, mesh.coordinates())}
        if len(self._dev_args) > 4096:
            self._dev_args.clear()
        self._dev_args[id(device_args)] = (device_args, mesh, per)
        return per

    # -- redistribution primitives: one mesh dim each (CommLog is the executor's, not ours) ------------
    def _primitive(self, name: str, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int,
                   collective: bool = True) -> Handle:
        """Queue primitive ``name`` on mesh dim ``mesh_dim`` for every worker of the mesh (``worker_comm.Collectives.p_<name>``)."""
        mesh = before.mesh
        self._ensure(mesh)
        if collective:
            self._make_groups(mesh, mesh_dim)
        ranks = tuple(mesh.device_ids)
        pid = self._define(("p", name, before, after, mesh_dim), rec.DefineStep, (name, before, after, mesh_dim), ranks)
        hid = self._id(h)
        out = self._new(ranks)
        what = f"{before.placements[mesh_dim]}->{after.placements[mesh_dim]} {name} on {mesh.dim_label(mesh_dim)}"
        seq = self._note(("step", what, before))
        self._emit(ranks, rec.Step(seq, pid, hid, out.id, 0))
        if self.sync_every_op:
            self.sync()
        return out

    def all_gather(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("all_gather", h, before, after, mesh_dim)

    def all_reduce(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("all_reduce", h, before, after, mesh_dim)

    def reduce_scatter(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("reduce_scatter", h, before, after, mesh_dim)

    def all_to_all(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("all_to_all", h, before, after, mesh_dim)

    def local_slice(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("local_slice", h, before, after, mesh_dim, collective=False)

    def to_partial(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("to_partial", h, before, after, mesh_dim, collective=False)

    def move(self, h: Handle, before: DTensorSpec, after: DTensorSpec, same_layout: bool) -> Handle:
        self._ensure(before.mesh)
        self._ensure(after.mesh)
        ranks = tuple(dict.fromkeys(before.mesh.device_ids + after.mesh.device_ids))
        pid = self._define(("p", "move", before, after, same_layout), rec.DefineStep,
                           ("move", before, after, same_layout), ranks)
        hid = self._id(h)
        out = self._new(tuple(after.mesh.device_ids))
        tag = self._tags(len(pp.move_transfers(before, after, same_layout)))
        how = "block to block" if same_layout else "regions"
        seq = self._note(("step", f"move {before.mesh} -> {after.mesh} ({how})", before))
        self._emit(ranks, rec.Step(seq, pid, hid, out.id, tag))
        if self.sync_every_op:
            self.sync()
        return out

    def move_into(self, moves) -> list:
        """One record for the whole batch: every worker of the meshes posts its sends and receives of every
        move at once (``Worker.on_move_into``) and runs on; a target completes where it is first read. The targets
        keep their ids (a worker whose block is shared gives it fresh storage under the same id, as ``write``)."""
        pairs = tuple((before, after) for _, before, _, after in moves)
        ranks = set()
        for before, after in pairs:
            self._ensure(before.mesh)
            self._ensure(after.mesh)
            ranks.update(before.mesh.device_ids + after.mesh.device_ids)
        ranks = tuple(sorted(ranks))
        pid = self._define(("mi", pairs), rec.DefineMoveInto, (pairs,), ranks)
        ids = tuple((self._id(src), self._id(target)) for src, _, target, _ in moves)
        tag = self._tags(sum(len(pp.move_transfers(before, after)) for before, after in pairs))
        seq = self._note(("step", f"move_into of {len(moves)} tensors", pairs[0][0]))
        self._emit(ranks, rec.MoveInto(seq, pid, ids, tag))
        if self.sync_every_op:
            self.sync()
        return [target for _, _, target, _ in moves]

    def ring_shift(self, h: Handle, spec: DTensorSpec, mesh_dim: int, shift: int = 1) -> Handle:
        mesh = spec.mesh
        self._ensure(mesh)
        ranks = tuple(mesh.device_ids)
        pid = self._define(("r", spec, mesh_dim, shift), rec.DefineRingShift, (spec, mesh_dim, shift), ranks)
        hid = self._id(h)
        out = self._new(ranks)
        seq = self._note(("ring_shift", mesh_dim, spec))
        self._emit(ranks, rec.RingShift(seq, pid, hid, out.id, self._tags(1)))
        if self.sync_every_op:
            self.sync()
        return out


class _Executable(Executable):
    """One kernel on one combination of specs: each run queues one kernel record per worker (the plan,
    the handles' ids, the call's kwargs, each rank's per-device values); the workers run it on their
    blocks."""

    def __init__(self, rt, kernel, in_specs: tuple, out_specs: tuple):
        self.runtime = weakref.ref(rt)  # the runtime caches us: no cycle (its __del__ stops the workers)
        self.kernel = kernel
        self.in_specs, self.out_specs = in_specs, out_specs
        self.mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh
        self.ranks = tuple(self.mesh.device_ids)
        self.plan_key = ("k", kernel.name, in_specs, out_specs)
        self.plan_args = (kernel.name, kernel.fn.__module__, in_specs, out_specs)

    def run(self, handles, kwargs, device_args=None):
        rt = self.runtime()
        mesh, ranks = self.mesh, self.ranks
        rt._ensure(mesh)
        pid = rt._define(self.plan_key, rec.DefineKernel, self.plan_args, ranks)  # per pool of workers: defined once each
        in_ids = tuple(rt._id(h) for h in handles)
        outs = [rt._new(ranks) for _ in self.out_specs]
        out_ids = tuple(h.id for h in outs)
        seq = rt._note(("kernel", self.kernel.name, kwargs, self.in_specs))
        if device_args:
            per = rt._per_rank(mesh, device_args)
            for r in ranks:
                rt._buf[r].append((Kernel, seq, pid, in_ids, out_ids, kwargs, per[r]))
            rt._counted(len(ranks))
        else:
            # the record as its tuple: the hottest record skips its constructor's call (``Kernel(...)``, the same
            # tuple, 0.3 us more per op; tests/runtime/test_protocol.py checks the two agree)
            rt._emit(ranks, (Kernel, seq, pid, in_ids, out_ids, kwargs, None))
        if rt.sync_every_op:
            rt.sync()
        return outs
