"""``fully_shard``: FSDP2's entry point for dtorch modules.

A parameter on a mesh with a dim named ``"fsdp"`` is sharded along it already (``autograd/fsdp.py``), and
each module gathers its own parameters for its forward. ``fully_shard(module)`` makes ``module`` one FSDP
unit, as in torch: the parameters of its subtree (those of nested units excepted) are gathered together
when its forward starts, cast to the mixed-precision policy's ``param_dtype``, and let go when it returns
(``reshard_after_forward=True``; False keeps them for the backward, ZeRO-2). Apply it to submodules first,
then to their parents, as FSDP2 asks::

    policy = dtorch.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        dtorch.nn.fully_shard(block, mp_policy=policy)
    dtorch.nn.fully_shard(model, mp_policy=policy)
"""
from __future__ import annotations

import itertools
import weakref

import torch

from ..autograd.fsdp import FSDP_DIM, FSDPUnit, MixedPrecisionPolicy, fsdp_placements
from ..errors import MeshError
from ..mesh import DeviceMesh
from ..placement import Replicate
from .module import Module

_GENERATION = itertools.count(1)  # bumped by every fully_shard: a unit's parameter list is rebuilt after one


class _ModuleUnit(FSDPUnit):
    """The unit of one module; its parameters are the module's subtree's, nested units' excepted (read again
    after any later ``fully_shard`` call, so the order in which units are made does not matter)."""

    __slots__ = ("module", "generation")

    def __init__(self, module: Module, mp, reshard_after_forward: bool):
        super().__init__((), mp, reshard_after_forward)
        self.module = weakref.ref(module)
        self.generation = 0

    def gather(self) -> dict:
        current = _generation[0]
        if self.generation != current:
            self.params = _managed(self.module())
            self.generation = current
        return super().gather()


_generation = [next(_GENERATION)]


def _managed(root: Module | None) -> list:
    """(owner, name) of every parameter under ``root`` that no nested unit owns."""
    out, seen = [], set()
    if root is None:
        return out
    stack = [root]
    while stack:
        mod = stack.pop()
        if mod is not root and mod.__dict__.get("_fsdp_unit") is not None:
            continue
        if id(mod) in seen:
            continue
        seen.add(id(mod))
        out += [(mod, name) for name, p in mod._parameters.items() if p is not None]
        stack += [m for m in reversed(list(mod._modules.values())) if m is not None]
    return out


def fully_shard(module: Module, *, mesh: DeviceMesh | None = None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy | None = None) -> Module:
    """Make ``module`` one FSDP unit (module docstring); returns ``module``.

    ``mesh``: a mesh with a dim named "fsdp"; parameters (and buffers) living elsewhere are moved onto it,
    sharded on "fsdp" and keeping their placements on the dims both meshes name. None: the parameters stay
    where they are (a mesh without "fsdp" then only casts them, by ``mp_policy``)."""
    if not isinstance(module, Module):
        raise TypeError(f"fully_shard takes a dtorch.nn.Module, got {type(module).__name__}; build the model from "
                        "dtorch.nn modules (a list of modules is not one unit here: call fully_shard on each)")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a dtorch.MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if mesh is not None:
        _move_to(module, mesh)
    module.__dict__["_fsdp_unit"] = _ModuleUnit(module, mp_policy, reshard_after_forward)
    _generation[0] = next(_GENERATION)
    return module


def fully_shard_modules(root: Module, *, reshard_after_forward: bool = True,
                        mp_policy: MixedPrecisionPolicy | None = None) -> Module:
    """``fully_shard`` every module under ``root`` that has parameters of its own: the finest units (one
    projection's weight gathered at a time, the next one prefetched), each with this policy."""
    for mod in list(root.modules()):
        if any(p is not None for p in mod._parameters.values()):
            fully_shard(mod, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    return root


def _move_to(module: Module, mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"fully_shard(mesh=...) takes a DeviceMesh, got {type(mesh).__name__}")
    if mesh.dim_name_index(FSDP_DIM) is None:
        raise MeshError(f"fully_shard(mesh=...) needs a mesh with a dim named {FSDP_DIM!r} to shard on; got dims "
                        f"{mesh.dim_names}. Build it with init_device_mesh(..., mesh_dim_names=[..., 'fsdp'])")
    with torch.no_grad():
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None and p.device_mesh != mesh:
                    places = fsdp_placements(mesh, _by_name(p, mesh), p.ndim)
                    p._set(p.redistribute(mesh, places))
            for name, b in list(mod._buffers.items()):
                if b is not None and b.device_mesh != mesh:
                    mod._buffers[name] = b.redistribute(mesh, _by_name(b, mesh))


def _by_name(t, mesh: DeviceMesh) -> list:
    """``t``'s placements on the dims of ``mesh`` that its own mesh names too, Replicate elsewhere."""
    own = dict(zip(t.device_mesh.dim_names or (), t.placements))
    return [own.get(name, Replicate()) for name in mesh.dim_names]


__all__ = ["fully_shard", "fully_shard_modules", "MixedPrecisionPolicy"]
