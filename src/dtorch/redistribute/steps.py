"""Typed redistribution steps: one frozen class per kind, each changing one mesh dim (or the mesh).

The planner emits them; the executor (``executor.py``) records CommLog for the ones that communicate
and calls ``step.run``, which calls the one runtime primitive of its kind. Steps are pure metadata
(this module imports only placements, meshes and specs), printable without running anything:

    S(0)->R all_gather on tp        (the mesh dim's name, else its index)

    kind            runtime primitive   CommLog kind
    AllGather       all_gather          all_gather
    AllReduce       all_reduce          all_reduce
    ReduceScatter   reduce_scatter      reduce_scatter
    AllToAll        all_to_all          all_to_all
    LocalSlice      local_slice         - (no communication)
    ToPartial       to_partial          - (no communication)
    Move            move                send_recv (between meshes)

The source and target placements are ``before.placements[mesh_dim]`` and
``after.placements[mesh_dim]``; a step also carries them (``src``, ``dst``) for printing and tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..placement import Placement
from ..spec import DTensorSpec, moved_bytes


class Step:
    """A redistribution step (base class). ``kind``: what CommLog (or the plan's printout) calls it."""

    kind: ClassVar[str] = "step"
    is_collective: ClassVar[bool] = False  # a collective over the devices along one mesh dim
    communicates: ClassVar[bool] = False  # the executor records a CommLog record for it

    def run(self, rt, handle, before: DTensorSpec, after: DTensorSpec):
        raise NotImplementedError

    def wire_bytes(self, before: DTensorSpec, after: DTensorSpec) -> int:
        """CommLog bytes: the input blocks of every device in the groups (the spec before the step)."""
        return before.total_bytes()

    def devices(self, before: DTensorSpec, after: DTensorSpec) -> tuple:
        return tuple(before.mesh.device_ids)


@dataclass(frozen=True)
class _OnMeshDim(Step):
    mesh_dim: int
    src: Placement
    dst: Placement
    label: object = None  # the mesh dim's name, else its index (what CommLog records)

    def __post_init__(self):
        if self.label is None:
            object.__setattr__(self, "label", self.mesh_dim)

    def __str__(self):
        return f"{self.src}->{self.dst} {self.kind} on {self.label}"


class _Collective(_OnMeshDim):
    is_collective = True
    communicates = True


@dataclass(frozen=True)
class AllGather(_Collective):
    """S(k) -> R: every device gets the whole (current) block along the mesh dim."""

    kind = "all_gather"

    def run(self, rt, handle, before, after):
        return rt.all_gather(handle, before, after, self.mesh_dim)


@dataclass(frozen=True)
class AllReduce(_Collective):
    """P -> R: every device gets the reduction of the terms along the mesh dim."""

    kind = "all_reduce"

    def run(self, rt, handle, before, after):
        return rt.all_reduce(handle, before, after, self.mesh_dim)


@dataclass(frozen=True)
class ReduceScatter(_Collective):
    """P -> S(k): every device gets its shard of the reduction."""

    kind = "reduce_scatter"

    def run(self, rt, handle, before, after):
        return rt.reduce_scatter(handle, before, after, self.mesh_dim)


@dataclass(frozen=True)
class AllToAll(_Collective):
    """S(k) -> S(j): every device swaps pieces with the others along the mesh dim."""

    kind = "all_to_all"

    def run(self, rt, handle, before, after):
        return rt.all_to_all(handle, before, after, self.mesh_dim)


@dataclass(frozen=True)
class LocalSlice(_OnMeshDim):
    """R -> S(k): every device keeps its piece; no communication."""

    kind = "local_slice"

    def run(self, rt, handle, before, after):
        return rt.local_slice(handle, before, after, self.mesh_dim)


@dataclass(frozen=True)
class ToPartial(_OnMeshDim):
    """R -> P: sum keeps the value on index 0 and zeros elsewhere; avg/max/min keep it everywhere."""

    kind = "to_partial"

    def run(self, rt, handle, before, after):
        return rt.to_partial(handle, before, after, self.mesh_dim)


@dataclass(frozen=True)
class Move(Step):
    """Hand a tensor from one mesh to another (pipeline stages, other device types).

    ``same_layout``: both meshes have the same shape and placements, so device k of the source sends
    its block to device k of the destination; otherwise regions move (no partials: the planner reduces
    them on the source first and re-creates them on the target).
    """

    src_spec: DTensorSpec
    dst_spec: DTensorSpec
    same_layout: bool
    label: object = None  # the parent mesh's dim name when both meshes come from one unbind, else None

    kind: ClassVar[str] = "send_recv"
    communicates: ClassVar[bool] = True
    mesh_dim: ClassVar[None] = None

    def run(self, rt, handle, before, after):
        return rt.move(handle, before, after, self.same_layout)

    def wire_bytes(self, before, after) -> int:
        # what crosses devices: each target region once, from one source replica, none that its destination
        # device holds already (meshes may share devices)
        return moved_bytes(before, after, self.same_layout)

    def devices(self, before, after) -> tuple:
        return tuple(before.mesh.device_ids) + tuple(after.mesh.device_ids)

    def __str__(self):
        how = "block to block" if self.same_layout else "regions"
        on = "" if self.label is None else f" on {self.label}"
        return f"move {self.src_spec.mesh} -> {self.dst_spec.mesh} ({how}) send_recv{on}"


# the planner's step names -> classes
BY_KIND = {cls.kind: cls for cls in (AllGather, AllReduce, ReduceScatter, AllToAll, LocalSlice, ToPartial)}
