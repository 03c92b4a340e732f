"""DeviceMesh: an n-dimensional array of device ids with optional axis names.

A mesh has *mesh dims* (axes such as "dp", "tp"); a tensor has *tensor dims*. The mesh is pure
metadata: it never touches devices. Which torch device an id maps to is the runtime's business.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np
import torch

from .errors import MeshError

_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")


def _to_id_array(mesh) -> np.ndarray:
    if isinstance(mesh, torch.Tensor):
        arr = mesh.detach().cpu().numpy()
    else:
        try:
            arr = np.asarray(mesh)
        except ValueError as exc:  # ragged nested lists
            raise MeshError(f"mesh must be a rectangular nested list of device ids: {exc}") from None
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        if arr.size and np.issubdtype(arr.dtype, np.floating) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise MeshError(
                f"mesh must hold integer device ids, got dtype {arr.dtype}; "
                "pass a nested list such as [[0, 1], [2, 3]]"
            )
    return arr.astype(np.int64)


class DeviceMesh:
    """A logical n-D arrangement of devices, e.g. ``DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])``."""

    __slots__ = ("device_type", "mesh", "_names", "_ids", "_key", "_hash", "_parent", "__weakref__")

    def __init__(self, device_type: str = "cpu", mesh=None, *, mesh_dim_names: Sequence[str] | None = None):
        if device_type not in _SUPPORTED_DEVICE_TYPES:
            raise MeshError(f"device_type must be one of {_SUPPORTED_DEVICE_TYPES}, got {device_type!r}")
        arr = np.array([0], dtype=np.int64) if mesh is None else _to_id_array(mesh)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.size == 0:
            raise MeshError("mesh must contain at least one device id")
        ids = arr.reshape(-1).tolist()
        if min(ids) < 0:
            raise MeshError(f"device ids must be non-negative, got {sorted(i for i in ids if i < 0)}")
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise MeshError(f"device ids must be unique within a mesh; repeated: {dup}")
        names = None
        if mesh_dim_names is not None:
            if isinstance(mesh_dim_names, str):  # list("tp") would silently become ["t", "p"]
                raise MeshError(f"mesh_dim_names must be a list of names, one per mesh dim; got the string "
                                f"{mesh_dim_names!r}: write [{mesh_dim_names!r}]")
            names = [str(n) for n in mesh_dim_names]
            if len(names) != arr.ndim:
                raise MeshError(
                    f"mesh_dim_names has {len(names)} names {names} but the mesh has {arr.ndim} dims "
                    f"(shape {tuple(arr.shape)}); give one name per mesh dim"
                )
            if len(set(names)) != len(names):
                raise MeshError(f"mesh_dim_names must be unique, got {names}")
        arr.setflags(write=False)
        self.device_type = device_type
        self.mesh = arr
        self._names = names
        self._ids = tuple(ids)
        self._key = (device_type, tuple(arr.shape), self._ids, tuple(names) if names else None)
        self._hash = hash(self._key)
        self._parent = None  # (parent mesh, mesh dim index) for meshes made by unbind

    # -- shape -------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.shape)

    @property
    def ndim(self) -> int:
        return self.mesh.ndim

    def size(self, dim: int | str | None = None) -> int:
        if dim is None:
            return self.mesh.size
        return self.mesh.shape[self.resolve_dim(dim)]

    @property
    def dim_names(self) -> list[str] | None:
        return list(self._names) if self._names is not None else None

    # the original docs call it mesh_dim_names
    mesh_dim_names = dim_names

    @property
    def device_ids(self) -> list[int]:
        return list(self._ids)

    def dim_name_index(self, name: str) -> int | None:
        if self._names is None:
            return None
        name = canonical_dim_name(name, self._names)
        return self._names.index(name) if name in self._names else None

    def resolve_dim(self, dim: int | str) -> int:
        """Mesh dim index for an index or a name; raises with the available names otherwise."""
        if isinstance(dim, str):
            idx = self.dim_name_index(dim)
            if idx is None:
                if self._names is None:
                    raise MeshError(f"mesh {self} has no dim names, so {dim!r} is unknown; use a mesh dim index "
                                    "or build the mesh with mesh_dim_names=[...]")
                raise MeshError(f"mesh has no dim named {dim!r}; its dims are {self._names}")
            return idx
        if not -self.ndim <= dim < self.ndim:
            raise MeshError(f"mesh dim {dim} out of range for a {self.ndim}-D mesh")
        return dim % self.ndim

    def dim_label(self, dim: int):
        """What logs and errors call a mesh dim: its name, else its index."""
        return self._names[dim] if self._names else dim

    def check_all_dim_names_in_set(self, names: Iterable[str]) -> None:
        allowed = set(names)
        bad = [n for n in (self._names or []) if n not in allowed]
        if bad:
            raise ValueError(
                f"mesh dims {bad} are not supported here; supported dim names are {sorted(allowed)}. "
                "Rename or remove those mesh dims."
            )

    # -- coordinates ---------------------------------------------------------------------------
    def coordinates(self) -> list[tuple[int, ...]]:
        """Every device coordinate, row-major (the order of ``device_ids``)."""
        return list(itertools.product(*[range(s) for s in self.shape]))

    def unbind(self, name) -> list["DeviceMesh"]:
        """One sub-mesh per index along dim ``name`` (removed; the other names kept); ``[self]`` when the
        mesh has no such dim. A list of names unbinds each in turn: one sub-mesh per index combination,
        the first name outermost."""
        if isinstance(name, (list, tuple)):
            out = [self]
            for n in name:
                out = [child for m in out for child in m.unbind(n)]
            return out
        idx = self.dim_name_index(name)
        if idx is None:
            return [self]
        names = [n for i, n in enumerate(self._names) if i != idx]
        out = []
        for k in range(self.mesh.shape[idx]):
            sub = np.take(self.mesh, k, axis=idx)
            if sub.ndim == 0:
                sub = sub.reshape(1)
            child = DeviceMesh(self.device_type, sub, mesh_dim_names=names or None)
            child._parent = (self, idx)
            out.append(child)
        return out

    def parent_dim_between(self, other: "DeviceMesh"):
        """If both meshes came from ``unbind`` of one parent, the parent's dim label (e.g. "pp")."""
        if self._parent and other._parent and self._parent[0] == other._parent[0] and self._parent[1] == other._parent[1]:
            parent, idx = self._parent
            return parent.dim_label(idx)
        return None

    # -- identity ----------------------------------------------------------------------------
    def __eq__(self, other):
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self):
        return self._hash

    def __repr__(self):
        names = f", mesh_dim_names={self._names}" if self._names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    def __str__(self):
        if self._names:
            dims = ", ".join(f"{n}={s}" for n, s in zip(self._names, self.shape))
        else:
            dims = "x".join(map(str, self.shape))
        return f"{self.device_type}[{dims}]"


# "ulysess_cp" is the original spelling; "ulysses_cp" is accepted as its alias.
_DIM_NAME_ALIASES = {"ulysses_cp": "ulysess_cp", "ulysess_cp": "ulysses_cp"}


def canonical_dim_name(name: str, names: Sequence[str]) -> str:
    if name in names:
        return name
    alias = _DIM_NAME_ALIASES.get(name)
    return alias if alias is not None and alias in names else name


def init_device_mesh(device_type: str, mesh_shape, *, mesh_dim_names: Sequence[str] | None = None) -> DeviceMesh:
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    if any((not isinstance(s, (int, np.integer))) or s < 1 for s in shape):
        raise MeshError(f"mesh_shape must be positive ints, got {mesh_shape!r}")
    ids = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    return DeviceMesh(device_type, ids, mesh_dim_names=mesh_dim_names)


def assign_layers_to_stages(num_layers: int, num_stages: int) -> list[int]:
    """Even split of layers over pipeline stages; earlier stages take the extra layers."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot place {num_layers} layers on {num_stages} pipeline stages: every stage needs a layer; "
            "use fewer pipeline stages"
        )
    base, extra = divmod(num_layers, num_stages)
    out = []
    for stage in range(num_stages):
        out.extend([stage] * (base + (1 if stage < extra else 0)))
    return out
