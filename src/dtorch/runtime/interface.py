"""The narrow interface every backend implements.

The front end hands the runtime specs (pure metadata) and opaque storage handles; the runtime owns
the per-device blocks. Nothing above this layer touches a device.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence

import torch

from ..spec import DTensorSpec
from .kernels import Kernel


class Runtime(ABC):
    name: str = "abstract"
    # True when the runtime must hear about every dead tensor (release()): the Graph then installs
    # a finalizer on dtorch.Tensor (it costs ~1 us per op, so the in-process backend does without).
    needs_release: bool = False
    # True when handles are plain torch tensors of this process that any runtime which also sets this
    # can read: tensors of two such Graphs may meet in one op (graph.check_one_graph).
    handles_in_process: bool = False

    @abstractmethod
    def from_global(self, full: torch.Tensor, spec: DTensorSpec) -> Any:
        """Place a global value: every device takes its block (a Partial's terms reduce to ``full``)."""

    @abstractmethod
    def from_blocks(self, blocks: Sequence[torch.Tensor], spec: DTensorSpec) -> Any:
        """Place one given block per device (mesh order); each has the shape ``spec.local_box`` gives.

        Replicas (devices that differ only on Replicate mesh dims) must get equal blocks.
        """

    @abstractmethod
    def to_global(self, handle, spec: DTensorSpec) -> torch.Tensor:
        """Fetch the global value (blocks gathered, partials reduced) as a new CPU-or-device tensor."""

    def to_global_async(self, handle, spec: DTensorSpec):
        from ..future import TensorFuture

        return TensorFuture.completed(self.to_global(handle, spec))

    @abstractmethod
    def run_local(self, kernel: Kernel, inputs: Sequence, in_specs: Sequence[DTensorSpec],
                  out_specs: Sequence[DTensorSpec], kwargs: dict, device_args: dict | None = None) -> list:
        """Run ``kernel`` on every device of the mesh on its blocks; returns one handle per output."""

    @abstractmethod
    def redistribute_step(self, step, handle, before: DTensorSpec, after: DTensorSpec):
        """Run one planned step (a collective, a local cut or a move between meshes)."""

    @abstractmethod
    def ring_shift(self, handle, spec: DTensorSpec, mesh_dim: int, shift: int = 1):
        """Every device sends its block to the device ``shift`` steps further along ``mesh_dim`` (cyclic).

        The result is an internal handle whose blocks no longer match ``spec``'s boxes (device j holds
        block j - shift); ring attention uses it for K/V blocks and never wraps it as a Tensor.
        """

    @abstractmethod
    def local_blocks(self, handle, spec: DTensorSpec) -> list[torch.Tensor]:
        """Every device's block, in mesh order (for tests, visualisation and debugging)."""

    def sync(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def release(self, handle) -> None:
        """The front-end tensor owning ``handle`` is gone (called only when ``needs_release``)."""

    def shutdown(self) -> None:
        pass
