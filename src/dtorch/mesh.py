"""DeviceMesh: an n-dimensional array of device ids with optional axis names.

A mesh has *mesh dims* (axes such as "dp", "tp"); a tensor has *tensor dims*. The mesh is pure
metadata: it never touches devices. Which torch device an id maps to is the runtime's business.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Sequence

import numpy as np
import torch

from ._lru import LRU
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


# sub-mesh key -> (parent mesh, its unbound dims, the sub-mesh's coordinate on them): the latest unbind that made it
# (bounded: a program that makes meshes in a loop must not grow it forever)
_UNBOUND = LRU("mesh.unbound", 4096)


class DeviceMesh:
    """A logical n-D arrangement of devices, e.g. ``DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])``."""

    # _array: the ids as a read-only numpy array (what the library reads); ``mesh`` gives torch's form
    __slots__ = ("device_type", "_array", "_names", "_ids", "_key", "_hash", "_parent", "__weakref__")

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
        self._array = arr
        self._names = names
        self._ids = tuple(ids)
        self._key = (device_type, tuple(arr.shape), self._ids, tuple(names) if names else None)
        self._hash = hash(self._key)
        self._parent = None  # (parent mesh, its unbound dims, this mesh's coordinate on them) after unbind

    # -- shape -------------------------------------------------------------------------------
    @property
    def mesh(self) -> torch.Tensor:
        """The device ids as an int64 torch tensor of the mesh's shape, as torch's DeviceMesh.mesh (a new
        tensor each time: writing into it never changes the mesh)."""
        return torch.from_numpy(self._array.copy())

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._array.shape)

    @property
    def ndim(self) -> int:
        return self._array.ndim

    def size(self, dim: int | str | None = None) -> int:
        if dim is None:
            return self._array.size
        return self._array.shape[self.resolve_dim(dim)]

    @property
    def dim_names(self) -> list[str] | None:
        return list(self._names) if self._names is not None else None

    # the original docs call it mesh_dim_names
    mesh_dim_names = dim_names

    @property
    def device_ids(self) -> list[int]:
        return list(self._ids)

    def device_id(self, coord) -> int:
        """The id of the device at mesh coordinate ``coord``."""
        return int(self._array[tuple(coord)])

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

    def unbind(self, dims) -> list["DeviceMesh"]:
        """The sub-meshes of every coordinate on mesh dims ``dims`` (a name, an index, or a list of them),
        those dims removed and the other names kept. The sub-meshes come in the row-major order of those
        coordinates, the dims taken in the mesh's order whatever their order in the list (as the ids lie in
        ``mesh``). Names the mesh lacks are skipped: ``[self]`` when none is left."""
        picked = set()
        for d in (dims if isinstance(dims, (list, tuple)) else [dims]):
            idx = self.dim_name_index(d) if isinstance(d, str) else self.resolve_dim(d)
            if idx is not None:
                picked.add(idx)
        if not picked:
            return [self]
        picked = tuple(sorted(picked))
        names = [n for i, n in enumerate(self._names) if i not in picked] if self._names else None
        out = []
        for coord in itertools.product(*[range(self.shape[i]) for i in picked]):
            index = [slice(None)] * self.ndim
            for i, c in zip(picked, coord):
                index[i] = c
            sub = self._array[tuple(index)]
            child = DeviceMesh(self.device_type, sub.reshape(1) if sub.ndim == 0 else sub,
                               mesh_dim_names=names or None)
            child._parent = (self, picked, coord)
            _UNBOUND[child._key] = child._parent
            out.append(child)
        return out

    def parent_dim_between(self, other: "DeviceMesh"):
        """If both meshes came from one ``unbind`` of a parent and sit at coordinates that differ on one of its
        unbound dims only, that dim's label (e.g. "pp")."""
        # (by key too: a mesh equal to a sub-mesh, e.g. in a spec a cached plan made earlier, stands for it)
        mine, theirs = self._parent or _UNBOUND.get(self._key), other._parent or _UNBOUND.get(other._key)
        if not (mine and theirs):
            return None
        (parent, dims, coord), (other_parent, other_dims, other_coord) = mine, theirs
        if parent != other_parent or dims != other_dims:
            return None
        differ = [d for d, a, b in zip(dims, coord, other_coord) if a != b]
        return parent.dim_label(differ[0]) if len(differ) == 1 else None

    # -- identity ----------------------------------------------------------------------------
    def __eq__(self, other):
        return isinstance(other, DeviceMesh) and self._key == other._key

    def __hash__(self):
        return self._hash

    def __repr__(self):
        names = f", mesh_dim_names={self._names}" if self._names else ""
        return f"DeviceMesh({self.device_type!r}, {self._array.tolist()}{names})"

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
