"""Many tensors written into other tensors' storage, each laid out as its target, in batched moves.

``copy_tensors_(targets, sources)`` is ``t.copy_(s)`` for every pair without the gather a cross-mesh
``copy_`` makes: each target keeps its mesh, placements, dtype and storage, and each destination device
receives only the regions of its own blocks that it does not hold already, from one device that holds
them (``spec.move_transfers``). Nothing passes through the controller. The pairs go in buckets of about
``bucket_bytes``; a bucket is one runtime call (``Runtime.move_into``) and one CommLog record, and on the
process and ray backends every transfer of a bucket is posted at once, while the workers run on to the
next bucket (a target completes where it is first read), so buckets overlap.

Weight sync between a trainer and a rollout model (``nn.utils.copy_parameters_``) and ``load_state_dict``
with dtorch tensors take this path.
"""
from __future__ import annotations

from ..autograd.mode import no_grad
from ..errors import PlacementError
from ..graph import check_one_graph
from ..placement import Partial, Replicate
from ..spec import moved_bytes
from ..redistribute import relayout
from ..redistribute.executor import move_into

BUCKET_BYTES = 32 << 20  # bytes landed per bucket (every destination block counted)


def copy_tensors_(targets, sources, *, bucket_bytes: int = BUCKET_BYTES, label=None) -> int:
    """Write ``sources[i]`` into ``targets[i]``'s own storage laid out as ``targets[i]`` (cast to its dtype),
    for every ``i`` in order (a pair reading an earlier pair's target sees the written value); returns the
    bytes that changed device (what CommLog records).

    Shapes must match pair by pair; sources may be on any mesh of the targets' Graph, with any placements
    (Partial ones are reduced on their own mesh first). No autograd history is recorded, as for a copy under
    ``no_grad`` (``load_state_dict``); a target that an autograd graph saved fails that graph's backward
    (its version moved). ``label``: the CommLog records' mesh dim (None: between meshes)."""
    targets, sources = list(targets), list(sources)
    if len(targets) != len(sources):
        raise ValueError(f"copy_tensors_: {len(targets)} targets but {len(sources)} sources")
    pairs, problems = [], []
    for n, (t, s) in enumerate(zip(targets, sources)):
        if tuple(t.shape) != tuple(s.shape):
            problems.append(f"pair {n}: source of shape {list(s.shape)} for a target of shape {list(t.shape)}")
        elif any(isinstance(p, Partial) for p in t.placements):
            problems.append(f"pair {n}: the target {t._spec} is Partial; its storage holds terms, not the value")
        elif s is not t and not (s._h is t._h and s._spec == t._spec):  # (a tensor into itself: nothing to do)
            pairs.append((t, s))
    if problems:
        raise PlacementError("copy_tensors_: " + "; ".join(problems))
    if not pairs:
        return 0
    check_one_graph("copy_tensors_", [x for pair in pairs for x in pair])
    rt = pairs[0][0]._graph.runtime
    moved = 0
    # the bucket being filled: its pairs, the bytes they land, its targets' and its sources' handles
    bucket, size, written, read = [], 0, set(), set()
    for t, s in pairs:
        if getattr(t, "_vroot", None) is not None:  # a view (ops/views.py) writes through its root: copy_ does
            _run(rt, bucket, label)
            bucket, size, written, read = [], 0, set(), set()
            with no_grad():
                t.copy_(s)
            continue
        if id(t._h) in written or id(t._h) in read or id(s._h) in written:
            # a pair that touches what this bucket writes, or writes what it reads, goes after it (a bucket's
            # moves run together, its writes arriving while the others read): pairs take effect in order
            _run(rt, bucket, label)
            bucket, size, written, read = [], 0, set(), set()
        if any(isinstance(p, Partial) for p in s.placements):  # the sums are reduced where they are, then moved
            s = relayout(s, s._spec.with_placements(tuple(Replicate() if isinstance(p, Partial) else p
                                                          for p in s.placements)))
        bucket.append((t, s))
        written.add(id(t._h))
        read.add(id(s._h))
        moved += moved_bytes(s._spec, t._spec)
        size += t._spec.total_bytes()
        if size >= bucket_bytes:
            _run(rt, bucket, label)
            bucket, size, written, read = [], 0, set(), set()
    if bucket:
        _run(rt, bucket, label)
    return moved


def _run(rt, bucket: list, label) -> None:
    if not bucket:
        return
    handles = move_into(rt, [(s._h, s._spec, t._h, t._spec) for t, s in bucket], label)
    for (t, _), h in zip(bucket, handles):
        t._written(h)
