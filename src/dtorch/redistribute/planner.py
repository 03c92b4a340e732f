"""Redistribute planning: (src spec, dst spec) -> typed, frozen, printable steps (``steps.py``). Pure
and cached.

Each step changes the placement of one mesh dim and is valid on its own:

    S(k) -> R      AllGather       (the mesh dim must be the innermost one sharding k)
    P    -> R      AllReduce
    P    -> S(k)   ReduceScatter   (afterwards the mesh dim is the innermost one sharding k)
    S(k) -> S(j)   AllToAll        (both conditions above)
    R    -> S(k)   LocalSlice      (no communication)
    R    -> P      ToPartial       (sum: the value on index 0, zeros elsewhere; avg/max/min: the value)

Between meshes: Move (after reducing partials on the source), then steps on the target mesh.

When several mesh dims shard one tensor dim, the outer (lower) mesh dim splits first. Shards that
sit in the right nesting order are kept; the others are gathered innermost first, partial sums are
reduced while the data is still small, and slices are cut outer first.

Several Partial mesh dims mean: reduce the terms over mesh dim 0 first, then mesh dim 1, ... With
mixed ops the order changes the value (sum then max != max then sum), so a mesh dim is only reduced
while an outer mesh dim is still partial if the two reductions commute (``reductions_commute``);
otherwise the outer one is all-reduced first (and made partial again at the end if the target wants
it). Reducing the outermost partial dim, and making new partials, is always valid.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..placement import Partial, Replicate, Shard
from ..spec import DTensorSpec
from .steps import BY_KIND, Move, Step


@dataclass(frozen=True)
class Plan:
    src: DTensorSpec
    dst: DTensorSpec
    steps: tuple  # of Step, applied in order
    specs: tuple  # spec after each step (the spec before step n is specs[n - 1], or src)

    def __str__(self):
        if not self.steps:
            return "no-op"
        return "; ".join(str(s) for s in self.steps)


def plan_redistribute(src: DTensorSpec, dst: DTensorSpec) -> Plan:
    return _plan(src, dst)


@lru_cache(maxsize=16384)
def _plan(src: DTensorSpec, dst: DTensorSpec) -> Plan:
    if src.mesh == dst.mesh:
        mesh = src.mesh
        steps = plan_same_mesh(src.placements, dst.placements, mesh.ndim, mesh_shape=mesh.shape,
                               linear_avg=src.dtype.is_floating_point or src.dtype.is_complex,
                               labels=tuple(mesh.dim_label(i) for i in range(mesh.ndim)))
        specs, cur = [], src
        for st in steps:
            cur = cur.with_placements(_replace(cur.placements, st.mesh_dim, st.dst))
            specs.append(cur)
        return Plan(src, dst, tuple(steps), tuple(specs))
    return _plan_cross_mesh(src, dst)


def _plan_cross_mesh(src: DTensorSpec, dst: DTensorSpec) -> Plan:
    same_layout = src.mesh.shape == dst.mesh.shape and src.placements == dst.placements
    if same_layout:
        return Plan(src, dst, (Move(src, dst, True, src.mesh.parent_dim_between(dst.mesh)),), (dst,))
    # Reduce partial sums on the source (less to move), move regions, then re-create partials.
    steps, specs = [], []
    before = src.with_placements(tuple(Replicate() if p.is_partial() else p for p in src.placements))
    if before != src:
        sub = _plan(src, before)
        steps += sub.steps
        specs += sub.specs
    landed = dst.with_placements(tuple(Replicate() if p.is_partial() else p for p in dst.placements))
    steps.append(Move(before, landed, False, src.mesh.parent_dim_between(dst.mesh)))
    specs.append(landed)
    if landed != dst:
        sub = _plan(landed, dst)
        steps += sub.steps
        specs += sub.specs
    return Plan(src, dst, tuple(steps), tuple(specs))


def _replace(placements, i, p):
    out = list(placements)
    out[i] = p
    return tuple(out)


def _sharders(placements, k) -> list[int]:
    return [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == k]


def reductions_commute(a: str, b: str, linear_avg: bool = True) -> bool:
    """Do reductions ``a`` and ``b`` over two mesh dims give the same value in either order?

    Equal ops do (sum, max, min), and sum/avg are both linear. Integer avg is a floored mean, which is
    not linear, so it is taken to commute with nothing (``linear_avg=False``).
    """
    if "avg" in (a, b) and not linear_avg:
        return False
    return a == b or {a, b} <= {"sum", "avg"}


def plan_same_mesh(src, dst, ndim, *, mesh_shape=None, linear_avg: bool = True, labels=None) -> list[Step]:
    """Steps from placements ``src`` to ``dst``; ``mesh_shape`` (optional) lets size-1 partial mesh
    dims (one term: nothing to reduce, so any order) skip the reduction-order rule; ``labels``: what
    the steps call each mesh dim (its name; default its index)."""
    cur = list(src)
    dst = list(dst)
    steps: list[Step] = []
    deferred: list[int] = []

    def apply(kind, i, new):
        steps.append(BY_KIND[kind](i, cur[i], new, i if labels is None else labels[i]))
        cur[i] = new

    def must_precede(j, i) -> bool:
        """Must outer mesh dim j be reduced before partial mesh dim i may be?"""
        p = cur[j]
        if not isinstance(p, Partial) or (mesh_shape is not None and 1 in (mesh_shape[i], mesh_shape[j])):
            return False  # a size-1 mesh dim holds one term: nothing to reduce, any order is right
        return not reductions_commute(p.reduce_op, cur[i].reduce_op, linear_avg)

    def reduce(kind, i, new):
        """all_reduce / reduce_scatter mesh dim i, after the outer partial dims it must not overtake."""
        for j in range(i):
            if must_precede(j, i):
                keep[j] = False  # a partial the target keeps is made again by step 3
                if j in deferred:
                    deferred.remove(j)
                reduce("all_reduce", j, Replicate())
        apply(kind, i, new)

    # Which current shards are already where the target wants them: for each tensor dim, the
    # common prefix (in mesh order) of the current and target mesh dims sharding it.
    keep = [False] * ndim
    for i in range(ndim):
        if cur[i] == dst[i] and not isinstance(cur[i], Shard):
            keep[i] = True
    for k in {p.dim for p in cur if isinstance(p, Shard)}:
        for a, b in zip(_sharders(cur, k), _sharders(dst, k)):
            if a != b:
                break
            keep[a] = True

    def can_become_shard(i, k) -> bool:
        """Can mesh dim i start sharding tensor dim k now, as the innermost sharder in its final nesting?"""
        if any(isinstance(cur[m], Shard) and cur[m].dim == k for m in range(i + 1, ndim)):
            return False
        before_cur = [m for m in range(i) if isinstance(cur[m], Shard) and cur[m].dim == k]
        before_dst = [m for m in range(i) if isinstance(dst[m], Shard) and dst[m].dim == k]
        return before_cur == before_dst and all(keep[m] for m in before_cur)

    # 1. Partial sums: reduce while the data is still sharded (smallest).
    for i in range(ndim):
        if isinstance(cur[i], Partial) and not keep[i]:
            if isinstance(dst[i], Shard):
                if can_become_shard(i, dst[i].dim):
                    reduce("reduce_scatter", i, dst[i])
                    keep[i] = True
                else:
                    deferred.append(i)
            else:
                reduce("all_reduce", i, Replicate())

    # 2. Shards in the wrong place: innermost first, all_to_all when the target shard can be cut
    #    in place, else gather.
    for i in reversed(range(ndim)):
        if isinstance(cur[i], Shard) and not keep[i]:
            tgt = dst[i]
            if isinstance(tgt, Shard) and tgt.dim != cur[i].dim and can_become_shard(i, tgt.dim):
                apply("all_to_all", i, tgt)
                keep[i] = True
            else:
                apply("all_gather", i, Replicate())

    while deferred:
        i = deferred.pop(0)  # reduce() may take later entries out of the list
        if can_become_shard(i, dst[i].dim):
            reduce("reduce_scatter", i, dst[i])
            keep[i] = True
        else:
            reduce("all_reduce", i, Replicate())

    # 3. Local cuts, outer first so nested shards split in the right order; then new partials.
    for i in range(ndim):
        if cur[i] != dst[i]:
            assert isinstance(cur[i], Replicate), (src, dst, cur)
            if isinstance(dst[i], Shard):
                apply("local_slice", i, dst[i])
            else:
                apply("to_partial", i, dst[i])
    return steps
