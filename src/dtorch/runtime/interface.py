"""The narrow interface every backend implements.

The front end hands the runtime specs (pure metadata) and opaque storage handles; the runtime owns
the per-device blocks. Nothing above ``runtime/`` reads a handle's storage. A backend implements:

* placement: ``from_global``, ``from_blocks``, ``from_files`` (blocks read from safetensors files where the
  device is: the default reads them here), ``to_global`` (+ async), ``local_blocks``;
* compute: ``executable(kernel, in_specs, out_specs)`` -> an ``Executable`` the runtime caches (bounded);
  ``Executable.run(handles, kwargs, device_args)`` runs the kernel on every device;
* in place: ``write`` runs an in-place kernel on a handle's own blocks, copying first when the storage is
  shared (copy-on-write);
* redistribution primitives, one mesh dim at a time: ``all_gather``, ``all_reduce``, ``reduce_scatter``,
  ``all_to_all``, ``local_slice``, ``to_partial``; ``move`` between meshes; ``ring_shift``; ``move_into``
  (many tensors written into other tensors' storage, each in its own layout: the weight sync). The source and
  target placements are ``before.placements[mesh_dim]`` and ``after.placements[mesh_dim]``. Backends do not
  record CommLog: the one redistribution executor (``dtorch.redistribute.executor``) does, once per step.

Memory accounting is an observer (``observe``): the Graph asks the runtime to report a handle's birth and
death, and the runtime ties that to the handle's own lifetime.
"""
from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..spec import DTensorSpec
from .kernels import Kernel, kernel


@dataclass(frozen=True)
class FileBlock:
    """Where one device's block lies in a safetensors file: ``key``'s region ``box`` (``(start, length)`` per
    dim). With ``rows``, dim 0 takes the saved rows ``box[0][0] + i`` for each ``i`` in ``rows``, in that
    order (a layout that repeats rows, e.g. kv heads replicated over tp). Plain data, so a backend can
    send it to the process that reads it; ``path`` must name the file there too."""
    path: str
    key: str
    box: tuple
    rows: tuple | None = None


def read_file_block(block: FileBlock, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """``block`` read with safetensors (only its own bytes), as a ``dtype`` tensor of ``shape``."""
    if any(n == 0 for n in shape):  # an empty shard (uneven split)
        return torch.empty(shape, dtype=dtype)
    from safetensors import safe_open

    with safe_open(block.path, framework="pt") as f:
        x = f.get_slice(block.key)[tuple(slice(o, o + n) for o, n in block.box)]
    if block.rows is not None:
        x = x[torch.tensor(block.rows, dtype=torch.long)]
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{block.path}: {block.key}{[list(b) for b in block.box]} read a {list(x.shape)} block where "
                         f"{list(shape)} was expected; the file changed since its shapes were checked")
    return x.to(dtype)


class Executable(ABC):
    """One kernel on one combination of input/output specs, prepared by a runtime (cached per plan)."""

    # True when one call computes every device's block together (stacked grids), so a gradient summed over
    # devices comes out summed (``kernels.vjp_kernel``'s ``summed``) instead of as per-device terms
    sums_over_devices: bool = False

    @abstractmethod
    def run(self, handles: Sequence, kwargs: dict, device_args: dict | None = None) -> list:
        """Run on every device of the mesh; returns one handle per output spec."""

    # Optional (autograd): a backend that can keep each device's local autograd graph from the forward
    # returns ``(output handles, tape)`` here and differentiates the tape in ``vjp_tracked``; None means
    # the backward recomputes the local forward (``kernels.vjp_kernel``), which every backend can run.
    # ``refetch``: input positions the caller lays out again for the backward (an fsdp-gathered weight): the
    # tape must not keep them; ``vjp_tracked`` then gets them as ``refetched`` ({position: handle}).
    def run_tracked(self, handles: Sequence, kwargs: dict, device_args: dict | None, diff: tuple, refetch=()):
        return None

    def vjp_tracked(self, tape, cotangents: Sequence, ct_specs, has_ct: tuple, grad_specs, refetched=None) -> list:
        """The gradient handles (laid out as ``grad_specs``) of the ``diff`` inputs of a ``run_tracked`` call."""
        raise NotImplementedError

    def tape_released(self, tape) -> tuple:
        """Input positions the tape does not hold (its graph did not save them): the caller need not keep them
        for the backward. Default: it holds every input."""
        return ()

    def tape_saved_outputs(self, tape) -> tuple:
        """Output positions whose values the tape saved (memory accounting: the caller keeps their handles
        counted while it keeps the tape)."""
        return ()

    def tape_bytes(self, tape):
        """Bytes per device (an int, or a vector in mesh order) the tape's saved tensors hold beyond the
        call's inputs and outputs (memory accounting: what no handle shows)."""
        return 0


class Runtime(ABC):
    name: str = "abstract"
    # set by Graph.track_memory: executables note what their tapes hold (Executable.tape_bytes)
    measure_tapes: bool = False
    # True when handles are plain torch tensors of this process that any runtime which also sets this
    # can read: tensors of two such Graphs may meet in one op (graph.check_one_graph).
    handles_in_process: bool = False
    # False for a backend of shapes and dtypes only (the meta backend): values made on the controller to be
    # laid out (factories, random initialisation) are then made as torch meta tensors, never allocated
    holds_values: bool = True

    # -- placement -------------------------------------------------------------------------------
    @abstractmethod
    def from_global(self, full: torch.Tensor, spec: DTensorSpec) -> Any:
        """Place a global value: every device takes its block (a Partial's terms reduce to ``full``)."""

    @abstractmethod
    def from_blocks(self, blocks: Sequence[torch.Tensor], spec: DTensorSpec) -> Any:
        """Place one given block per device (mesh order); each has the shape ``spec.local_box`` gives.

        Replicas (devices that differ only on Replicate mesh dims) must get equal blocks.
        """

    def zeros(self, spec: DTensorSpec) -> Any:
        """Zeros laid out as ``spec`` (storage about to be filled, e.g. parameters a checkpoint loads). This
        default places a global zero tensor; a backend whose devices live elsewhere makes them there."""
        return self.from_global(torch.zeros(spec.shape, dtype=spec.dtype), spec)

    def from_files(self, reads: Sequence[FileBlock], spec: DTensorSpec) -> Any:
        """Place one block per device (mesh order) read from safetensors files (``FileBlock``); equal
        reads are one read. This default reads them in this process and places them with ``from_blocks``;
        a backend whose devices live elsewhere reads each block where its device is."""
        read: dict = {}
        blocks = []
        for coord, where in zip(spec.mesh.coordinates(), reads):
            if where not in read:
                read[where] = read_file_block(where, spec.local_shape(coord), spec.dtype)
            blocks.append(read[where])
        return self.from_blocks(blocks, spec)

    @abstractmethod
    def to_global(self, handle, spec: DTensorSpec) -> torch.Tensor:
        """The global value (blocks gathered, partials reduced) as a NEW tensor the caller owns."""

    def to_global_async(self, handle, spec: DTensorSpec):
        from ..future import TensorFuture

        return TensorFuture.completed(self.to_global(handle, spec))

    def to_global_many(self, handles: Sequence, specs: Sequence[DTensorSpec]) -> list[torch.Tensor]:
        """``to_global`` of many tensors (a backend may overlap them)."""
        return [self.to_global(h, s) for h, s in zip(handles, specs)]

    def to_global_many_async(self, handles: Sequence, specs: Sequence[DTensorSpec]):
        """A ``concurrent.futures.Future`` of ``to_global_many``: the values are those after the work issued so
        far, whatever is issued before the future completes (a backend may collect them meanwhile)."""
        import concurrent.futures

        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(self.to_global_many(handles, specs))
        return fut

    @abstractmethod
    def local_blocks(self, handle, spec: DTensorSpec) -> list[torch.Tensor]:
        """Every device's block, in mesh order (for tests, visualisation and debugging; do not write)."""

    # -- compute ---------------------------------------------------------------------------------
    @abstractmethod
    def executable(self, kernel: Kernel, in_specs: Sequence[DTensorSpec], out_specs: Sequence[DTensorSpec]) -> Executable:
        """The prepared form of ``kernel`` for these specs (the runtime caches it, bounded)."""

    def run_local(self, kernel: Kernel, inputs: Sequence, in_specs: Sequence[DTensorSpec],
                  out_specs: Sequence[DTensorSpec], kwargs: dict, device_args: dict | None = None) -> list:
        """Run ``kernel`` on every device of the mesh on its blocks; returns one handle per output."""
        return self.executable(kernel, in_specs, out_specs).run(inputs, kwargs, device_args)

    @abstractmethod
    def write(self, kernel: Kernel, target, target_spec: DTensorSpec, inputs: Sequence,
              in_specs: Sequence[DTensorSpec], kwargs: dict, device_args: dict | None = None):
        """Run the in-place kernel ``fn(target_block, *input_blocks, **kw)`` on every device.

        The kernel mutates ``target_block`` (same shape and dtype) and returns nothing. The input specs
        are laid out like ``target_spec`` requires (the caller redistributed them). When the target's
        storage is shared with another handle or a view, it is copied first (copy-on-write), so nobody
        else sees the change. Returns the handle now holding the result: ``target`` itself when it was
        written in place, else a new handle.
        """

    @abstractmethod
    def alias(self, handle, spec: DTensorSpec):
        """A second handle on the same blocks (``detach``, ``Tensor(t)``, parameters): no copy now; a
        later ``write`` to either copies first, so the other never sees it."""

    # -- redistribution primitives (one mesh dim each) --------------------------------------------
    @abstractmethod
    def all_gather(self, handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int):
        """S(k) -> R on ``mesh_dim``."""

    @abstractmethod
    def all_reduce(self, handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int):
        """P -> R on ``mesh_dim``."""

    @abstractmethod
    def reduce_scatter(self, handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int):
        """P -> S(k) on ``mesh_dim``."""

    @abstractmethod
    def all_to_all(self, handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int):
        """S(k) -> S(j) on ``mesh_dim``."""

    @abstractmethod
    def local_slice(self, handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int):
        """R -> S(k) on ``mesh_dim``: every device keeps its piece, no communication."""

    @abstractmethod
    def to_partial(self, handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int):
        """R -> P on ``mesh_dim``: sum keeps the value on index 0 and zeros elsewhere; avg/max/min keep it."""

    @abstractmethod
    def move(self, handle, before: DTensorSpec, after: DTensorSpec, same_layout: bool):
        """Hand a tensor from ``before.mesh`` to ``after.mesh`` (no partials unless ``same_layout``)."""

    def move_into(self, moves: Sequence[tuple]) -> list:
        """Write many tensors into other tensors' storage, each laid out as its target: ``moves`` holds
        ``(source handle, source spec, target handle, target spec)`` with one global shape per pair, the
        meshes the same, sharing devices or apart, no partials on either side; a source of another dtype is
        cast on arrival.

        Each destination device copies the regions it holds itself from its own blocks and receives each
        other region once, from one device holding it (``spec.move_transfers``): nothing passes through
        this process. A target block anyone else can see is replaced, not written (copy-on-write). The
        moves of one call may be in flight together, and a backend may complete a target only where it is
        first read. Returns, per move, the handle holding the target now (the target itself unless its
        storage was shared).

        This default moves each source and copies it in (``move`` then ``write``); backends write the
        regions straight into the targets' blocks.
        """
        out = []
        for src, before, target, after in moves:
            landed = DTensorSpec(after.mesh, after.placements, after.shape, before.dtype)
            moved = self.move(src, before, landed, False)
            out.append(self.write(_copy_into_kernel, target, after, [moved], [landed], {}))
        return out

    @abstractmethod
    def ring_shift(self, handle, spec: DTensorSpec, mesh_dim: int, shift: int = 1):
        """Every device sends its block to the device ``shift`` steps further along ``mesh_dim`` (cyclic).

        The result is an internal handle whose blocks no longer match ``spec``'s boxes (device j holds
        block j - shift); ring attention uses it for K/V blocks and never wraps it as a Tensor.
        """

    # -- lifetime ----------------------------------------------------------------------------------
    def observe(self, handle, on_free: Callable[[], None]) -> bool:
        """Call ``on_free`` once when ``handle``'s storage dies; False when the handle is already observed.

        Memory accounting uses it (the Graph counts bytes when a handle is born and calls back when it
        dies); it costs a finalizer per handle, so the Graph asks only while it tracks memory.
        """
        watched = self.__dict__.setdefault("_observed", weakref.WeakKeyDictionary())
        if handle in watched:
            return False
        watched[handle] = weakref.finalize(handle, on_free)
        return True

    def sync(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    # -- workers (backends with a process per device; dtorch.recovery) ----------------------------------
    def worker_pids(self) -> dict:
        """Device id -> the process id of its worker; {} where the devices live in this process."""
        return {}

    def mirror_many(self, handles: Sequence, specs: Sequence[DTensorSpec], name: str):
        """A snapshot's copy of these tensors kept by the workers themselves (``process_recovery.MirrorCopy``:
        ``done()``, ``wait()``, ``values()``, ``nbytes``), written under ``name`` (a later call with the same name
        overwrites it); None where the backend keeps none (the caller fetches the values instead)."""
        return None

    def mirror_place(self, copy, n: int, spec: DTensorSpec):
        """A handle of tensor ``n`` of a ``mirror_many`` copy, placed as ``spec`` from the copy itself; None where
        it cannot (the caller places the global value)."""
        return None

    def mirror_drop(self, name: str) -> None:
        """Remove the copy ``mirror_many`` wrote under ``name``."""

    def inject_fault(self, device: int, at_op: int, kind: str = "kill") -> None:
        """Tests of recovery: lose ``device``'s worker just before the ``at_op``-th op issued from now."""
        from ..errors import RuntimeBackendError

        raise RuntimeBackendError(f"the {self.name} backend has no worker processes to lose; faults are injected "
                                  "on the process backend (dtorch.Graph(backend='process'))")

    def shutdown(self) -> None:
        pass


@kernel("runtime.copy_into")
def _copy_into_kernel(target, src):
    target.copy_(src)
