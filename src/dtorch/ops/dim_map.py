"""The dim map: how the data of a single-input shape op (view/reshape, permute, expand, repeat, indexing,
split) moves, and how placements follow it.

Each op is described by one entry per output dim saying where its data comes from, in a small vocabulary
(InputDim, Flatten, Split, Singleton, NewDim, Broadcast, Slice, Repeat, Interleave). Placements then follow
the data, per mesh dim:

    S(d), d kept 1:1 (transpose, unsqueeze, ...)  -> S(out)  the block holds the same data
    S(d), d outermost in a flatten / split        -> S(out)  when every block boundary of d is a block
                                                             boundary of out (the sizes divide); else R
    S(d), d inner in a flatten, sliced, indexed,
          broadcast or repeated                   -> R       gathered first, on that mesh dim only
    P                                             -> P       views move elements, never combine them
    R                                             -> R
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..placement import Replicate, Shard
from ..spec import DTensorSpec, chunk_size, shard_range
from .dispatch import OpPlan
from .rules import spec_like


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def _first_big(sizes):
    """Index of the first size other than 1: the only piece of a merge or split that can hold a shard."""
    return next((k for k, s in enumerate(sizes) if s != 1), None)


# ------------------------------------------------------------------------------------------------
# the dim map vocabulary
#
# ``size(shape)``: the output dim's size given the input's shape, global or one device's block (so
# kernels derive their local output shape from their local input). ``carries(shape)``: (input dim d,
# rin, rout) when the output dim walks input dim d in order: element i of d covers [i*rin, (i+1)*rin)
# of a common flat range, element j of the output dim covers [j*rout, (j+1)*rout); else None.


class DimSpec:
    def carries(self, shape):
        return None


@dataclass(frozen=True)
class InputDim(DimSpec):
    dim: int

    def size(self, shape):
        return shape[self.dim]

    def carries(self, shape):
        return (self.dim, 1, 1)


@dataclass(frozen=True)
class Singleton(DimSpec):
    def size(self, shape):
        return 1


@dataclass(frozen=True)
class NewDim(DimSpec):
    """A new dim of a fixed size (the leading dims expand and repeat add)."""
    n: int

    def size(self, shape):
        return self.n


@dataclass(frozen=True)
class Broadcast(DimSpec):
    """A size-1 input dim expanded to n."""
    src: DimSpec
    n: int

    def size(self, shape):
        return self.n


@dataclass(frozen=True)
class Slice(DimSpec):
    """n elements picked out of an input dim (slicing, narrow, chunk)."""
    src: DimSpec
    n: int

    def size(self, shape):
        return self.n


@dataclass(frozen=True)
class Repeat(DimSpec):
    """An input dim tiled r times: [x, x, ...]."""
    src: DimSpec
    r: int

    def size(self, shape):
        return self.src.size(shape) * self.r


@dataclass(frozen=True)
class Interleave(DimSpec):
    """Each element of an input dim repeated r times in place: [x0, x0, x1, x1, ...]."""
    src: InputDim
    r: int

    def size(self, shape):
        return self.src.size(shape) * self.r

    def carries(self, shape):
        return (self.src.dim, self.r, 1)


@dataclass(frozen=True)
class Flatten(DimSpec):
    """Several input dims merged, outer first."""
    parts: tuple

    def size(self, shape):
        return _prod(p.size(shape) for p in self.parts)

    def carries(self, shape):
        sizes = [p.size(shape) for p in self.parts]
        k = _first_big(sizes)
        if k is None or not isinstance(self.parts[k], InputDim):
            return None
        return (self.parts[k].dim, _prod(sizes[k + 1:]), 1)


@dataclass(frozen=True)
class Split(DimSpec):
    """Piece ``idx`` of one (maybe flattened) input dim cut into ``pieces``, outer first."""
    src: DimSpec
    pieces: tuple
    idx: int

    def size(self, shape):
        if self.idx != _first_big(self.pieces):
            return self.pieces[self.idx]
        # the one piece that may be sharded: whatever the source block leaves after the other pieces
        return self.src.size(shape) // _prod(p for k, p in enumerate(self.pieces) if k != self.idx)

    def carries(self, shape):
        c = self.src.carries(shape) if self.idx == _first_big(self.pieces) else None
        return None if c is None else (c[0], c[1], c[2] * _prod(self.pieces[self.idx + 1:]))


def view_map(src: tuple, dst: tuple) -> tuple:
    """Dim map of reshaping ``src`` into ``dst`` (same numel): runs of input dims and runs of output dims
    whose sizes multiply to the same number form a group, which is flattened then split."""
    if _prod(src) == 0:
        return tuple(NewDim(n) for n in dst)  # an empty tensor has no data to follow
    out, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        f = src[i] if i < len(src) else None
        t = dst[j] if j < len(dst) else None
        if t is None or (f == 1 and t != 1):  # a size-1 input dim goes away
            i += 1
            continue
        if f is None or (t == 1 and f != 1):  # a size-1 output dim appears
            out.append(Singleton())
            j += 1
            continue
        dims, pieces = [i], [t]
        i, j = i + 1, j + 1
        while f != t:
            if f < t:
                f *= src[i]
                dims.append(i)
                i += 1
            else:
                t *= dst[j]
                pieces.append(dst[j])
                j += 1
        group = InputDim(dims[0]) if len(dims) == 1 else Flatten(tuple(InputDim(d) for d in dims))
        out += [group] if len(pieces) == 1 else [Split(group, tuple(pieces), k) for k in range(len(pieces))]
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# placements follow the data


@lru_cache(maxsize=4096)
def _levels_kept(n_in: int, rin: int, rout: int, mesh_sizes: tuple) -> int:
    """How many nested shard levels (outer mesh dim first) of an input dim of ``n_in`` elements stay a
    shard of the output dim carrying it: at each level, torch.chunk of the input dim and torch.chunk
    of the output dim must cut the common flat range at the same places."""
    pieces = {n_in * rin}
    for t, m in enumerate(mesh_sizes):
        nxt = set()
        for e in pieces:
            c = chunk_size(e // rin, m) * rin
            if c != chunk_size(e // rout, m) * rout:
                return t
            nxt.update(shard_range(e // rin, m, k)[1] * rin for k in range(m))
        pieces = nxt
    return len(mesh_sizes)


def follow(spec: DTensorSpec, dim_map) -> tuple[tuple, tuple]:
    """(input placements the op needs, output placements) for a single-input op with ``dim_map``."""
    carried = {}
    for o, ds in enumerate(dim_map):
        c = ds.carries(spec.shape)
        if c is not None:
            carried[c[0]] = (o, c[1], c[2])
    in_pl, out_pl = list(spec.placements), list(spec.placements)  # P and R pass: views are linear
    for d in range(spec.ndim):
        levels = spec.shard_mesh_dims(d)
        if not levels:
            continue
        o, rin, rout = carried.get(d, (None, 1, 1))
        keep = 0 if o is None else _levels_kept(spec.shape[d], rin, rout, tuple(spec.mesh.shape[i] for i in levels))
        for t, i in enumerate(levels):
            if t < keep:
                out_pl[i] = Shard(o)
            else:  # inner levels too: their blocks would nest under a gathered outer level
                in_pl[i] = out_pl[i] = Replicate()
    return tuple(in_pl), tuple(out_pl)


def map_plan(spec: DTensorSpec, dmap, kern, **kwargs) -> OpPlan:
    """The plan of a single-input op with dim map ``dmap``: its input laid out as ``follow`` asks, one output."""
    in_pl, out_pl = follow(spec, dmap)
    out = DTensorSpec(spec.mesh, out_pl, tuple(ds.size(spec.shape) for ds in dmap), spec.dtype)
    return OpPlan((spec_like(spec, placements=in_pl),), (out,), kern, kwargs)
