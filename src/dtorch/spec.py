"""DTensorSpec (metadata only) and the shard arithmetic every layer shares.

Sharding is defined by one pure function: for a device coordinate, the index range of the global
tensor it holds (``local_box``). Sizes follow torch.chunk: chunk = ceil(size / n), later shards may be
smaller or empty. When several mesh dims shard one tensor dim, they split it outer (lower mesh dim)
to inner.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ._lru import LRU
from .mesh import DeviceMesh
from .placement import Partial, Placement, Replicate, Shard, fmt_placements


def chunk_size(size: int, n: int) -> int:
    return -(-size // n) if size else 0


def shard_range(size: int, n: int, idx: int) -> tuple[int, int]:
    """(offset, length) of shard ``idx`` of ``n`` along a dim of ``size`` elements (torch.chunk rules)."""
    c = chunk_size(size, n)
    start = min(idx * c, size)
    return start, min(c, size - start)


@dataclass(frozen=True, eq=False)
class DTensorSpec:
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    # specs key every plan cache: hash once, compare by identity first
    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.mesh, self.placements, self.shape, self.dtype)))

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return self is other or (
            isinstance(other, DTensorSpec) and self._hash == other._hash and self.shape == other.shape
            and self.placements == other.placements and self.dtype == other.dtype and self.mesh == other.mesh
        )

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def with_placements(self, placements) -> "DTensorSpec":
        return DTensorSpec(self.mesh, tuple(placements), self.shape, self.dtype)

    def shard_mesh_dims(self, tensor_dim: int) -> list[int]:
        """Mesh dims that shard ``tensor_dim``, outer to inner."""
        return [i for i, p in enumerate(self.placements) if isinstance(p, Shard) and p.dim == tensor_dim]

    def partial_dims(self) -> list[int]:
        return [i for i, p in enumerate(self.placements) if isinstance(p, Partial)]

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def local_box(self, coord: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return _local_box(self.mesh.shape, self.placements, self.shape, tuple(coord))

    def local_shape(self, coord) -> tuple[int, ...]:
        return tuple(n for _, n in self.local_box(coord))

    def local_shapes(self) -> tuple:
        """Every device's block shape, in mesh order; cached on the spec (a replayed step places host data
        with the same spec object every time)."""
        try:
            return self.__dict__["_local_shapes"]
        except KeyError:
            pass
        out = tuple(self.local_shape(c) for c in self.mesh.coordinates())
        object.__setattr__(self, "_local_shapes", out)
        return out

    def is_even(self) -> bool:
        """Every device holds a block of the same shape (so blocks stack into one grid tensor)."""
        return _is_even(self.mesh.shape, self.placements, self.shape)

    def even_local_shape(self) -> tuple[int, ...]:
        return self.local_shape((0,) * self.mesh.ndim)

    def device_bytes(self):
        """Bytes each device holds (a read-only int64 numpy array, mesh order); cached on the spec."""
        try:
            return self.__dict__["_nbytes_per_device"]
        except KeyError:
            pass
        import numpy as np

        item = self.dtype.itemsize
        if self.is_even():
            vec = np.full(self.mesh.size(), _prod(self.even_local_shape()) * item, dtype=np.int64)
        else:
            vec = np.array([_prod(self.local_shape(c)) * item for c in self.mesh.coordinates()], dtype=np.int64)
        vec.flags.writeable = False  # shared by every caller
        object.__setattr__(self, "_nbytes_per_device", vec)
        return vec

    def total_bytes(self) -> int:
        """Sum over devices of their block sizes in bytes (replicas each count); cached on the spec."""
        try:
            return self.__dict__["_nbytes_total"]
        except KeyError:
            pass
        if self.is_even():
            n = _prod(self.even_local_shape()) * self.dtype.itemsize * self.mesh.size()
        else:
            n = int(self.device_bytes().sum())
        object.__setattr__(self, "_nbytes_total", n)
        return n

    def grid_shape(self) -> tuple[int, ...]:
        """Leading dims of the stacked storage: mesh size where devices differ (Shard, Partial), 1 where they agree."""
        return tuple(1 if isinstance(p, Replicate) else s for p, s in zip(self.placements, self.mesh.shape))

    def __str__(self):
        return f"{list(self.shape)} {str(self.dtype).replace('torch.', '')} on {self.mesh} {fmt_placements(self.placements)}"


# spec -> the first equal spec seen (``interned``). Bounded (identity sharing is only a speed-up)
_INTERNED = LRU("spec.interned", 256)  # (a model has tens of distinct specs; inserted on plan misses)
_interned_get = _INTERNED.fast_get


def interned(spec: DTensorSpec) -> DTensorSpec:
    """One object for equal specs (of the same mesh object): the plans a rule makes again each time it runs
    (another op's plan, a backward layout) then hand out the spec objects the caches keyed by specs already
    hold, found by identity (``dispatch``'s last plan per op, tuple keys) instead of compared field by field."""
    got = _interned_get(spec) or _INTERNED.get(spec)
    if got is not None and got.mesh is spec.mesh:
        return got
    _INTERNED[spec] = spec
    return spec


@lru_cache(maxsize=65536)
def _local_box(mesh_shape, placements, shape, coord):
    box = [(0, s) for s in shape]
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            off, size = box[p.dim]
            o, n = shard_range(size, mesh_shape[i], coord[i])
            box[p.dim] = (off + o, n)
    return tuple(box)


@lru_cache(maxsize=65536)
def _is_even(mesh_shape, placements, shape):
    sizes = list(shape)
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            if sizes[p.dim] % mesh_shape[i]:
                return False
            sizes[p.dim] //= mesh_shape[i]
    return True


def block_offsets(spec: DTensorSpec, dim: int, coord_map=None):
    """Per device (an array of the mesh's shape): the global offset of its block along tensor dim ``dim``.

    ``coord_map`` reads another device's block (ring attention: the K/V block a device holds now)."""
    import numpy as np

    out = np.zeros(spec.mesh.shape, dtype=np.int64)
    for c in spec.mesh.coordinates():
        out[c] = spec.local_box(coord_map(c) if coord_map else c)[dim][0]
    return out


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def local_nbytes(spec: DTensorSpec, coord) -> int:
    return _prod(spec.local_shape(coord)) * spec.dtype.itemsize


# -- moves between meshes ------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def move_transfers(before: DTensorSpec, after: DTensorSpec, same_layout: bool = False) -> tuple:
    """Every copy a move from ``before`` to ``after`` needs (any two meshes, the same devices or others):
    ``(src device id, dst device id, src slices, dst slices, shape)``, in destination-device order.

    Same layout: device k of the source hands its block to device k of the destination (slices None).
    Otherwise, for each destination block, the regions where it overlaps the source blocks (no partials:
    reduce them first), each from one replica, preferring a replica the destination device holds itself,
    so a region only crosses devices when the destination does not hold it already.
    """
    src_ids, dst_ids = before.mesh.device_ids, after.mesh.device_ids
    if same_layout:
        return tuple((s, d, None, None, before.local_shape(c))
                     for s, d, c in zip(src_ids, dst_ids, before.mesh.coordinates()))
    holders: dict = {}  # distinct source boxes -> the device ids holding each (replicas)
    for r, c in zip(src_ids, before.mesh.coordinates()):
        holders.setdefault(before.local_box(c), []).append(r)
    out = []
    for n, (d, c) in enumerate(zip(dst_ids, after.mesh.coordinates())):
        dbox = after.local_box(c)
        for sbox, ranks in holders.items():
            lo = [max(a[0], b[0]) for a, b in zip(sbox, dbox)]
            hi = [min(a[0] + a[1], b[0] + b[1]) for a, b in zip(sbox, dbox)]
            if any(h <= l for l, h in zip(lo, hi)) and len(lo):  # (a 0-d tensor always overlaps)
                continue
            shape = tuple(h - l for l, h in zip(lo, hi))
            src = d if d in ranks else ranks[n % len(ranks)]
            s_sl = tuple(slice(l - b[0], h - b[0]) for l, h, b in zip(lo, hi, sbox))
            d_sl = tuple(slice(l - b[0], h - b[0]) for l, h, b in zip(lo, hi, dbox))
            out.append((src, d, s_sl, d_sl, shape))
    return tuple(out)


def moved_bytes(before: DTensorSpec, after: DTensorSpec, same_layout: bool = False) -> int:
    """The bytes a move puts on the wire: the regions whose destination device does not hold them already
    (in the source's dtype; a destination of another dtype casts on arrival)."""
    size = before.dtype.itemsize
    return sum(_prod(shape) * size for s, d, _, _, shape in move_transfers(before, after, same_layout) if s != d)
