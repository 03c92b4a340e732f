"""``shrink`` recovery: go on without the lost device, on a mesh whose data-parallel dim is one smaller.

The backend has stopped every worker when a device is lost (as for ``replace``). ``shrink`` then drops, from
the widest mesh holding the lost device, its slice on the "dp" dim (dp4 -> dp3; on dp4 x tp2, the lost
device's tp pair: 8 -> 6 devices), renumbers the surviving device ids 0..n-1 in their order (so the new pool
has n workers: no worker is started for a device that is gone), and re-points every mesh *object* in place:
the meshes of the snapshot's tensors, the meshes the model's modules hold as attributes, and the thread's
default mesh, so that a mesh the user holds describes the smaller mesh afterwards and a step function that
makes its batch with ``Shard(0)`` on "dp" splits it over the devices left. Each snapshot tensor gets a fresh
spec on its (re-pointed) mesh with the same placements; ``Snapshot.restore`` then places the global values.

Why in place, not new mesh objects: tensors, modules and the user's code hold the mesh object itself; only
an in-place change reaches all of them. A mesh's hash changes with it, so every process-global cache
(``_lru.all_caches``: plans, executables, memos, keyed by meshes and specs) is cleared (other Graphs recompute
theirs), and every spec the snapshot covers is made afresh (a spec caches its hash).
"""
from __future__ import annotations

import numpy as np

from .. import context
from .._lru import all_caches
from ..mesh import _UNBOUND, DeviceMesh
from ..placement import Partial
from ..spec import DTensorSpec
from .config import RecoveryError

SHRINKABLE_DIMS = ("dp",)  # data parallel (also HSDP's replicate dim): its loss is absorbed by re-splitting the batch


def _meshes(snap, tensors) -> list:
    """Every mesh object a shrink must re-point, each once: the tensors' meshes, the meshes the model's modules
    keep as attributes (alone or in a list/tuple: pp's stage meshes), the thread's default mesh, and the parents
    of any of them that came from an ``unbind``."""
    found: dict = {}

    def add(m):
        while isinstance(m, DeviceMesh) and id(m) not in found:
            found[id(m)] = m
            m = m._parent[0] if m._parent else None

    for t in tensors:
        add(t._spec.mesh)
    for module in snap.model.modules():
        for v in vars(module).values():
            for m in (v if isinstance(v, (list, tuple)) else (v,)):
                add(m)
    default = context.default_device_mesh()
    keys = {m._key for m in found.values()}
    if default._key in keys:  # an equal object the user made the default: it describes the same devices
        add(default)
    return list(found.values())


def _dropped(root: DeviceMesh, lost: list) -> tuple:
    """(the "dp" dim of ``root``, the ids of ``root``'s slices on it that hold a lost device)."""
    names = root.dim_names or []
    dims = [names.index(n) for n in SHRINKABLE_DIMS if n in names]
    use = ("; configure('replace') starts a new worker for the lost device instead (dtorch.recovery.configure)")
    if not dims:
        raise RecoveryError(f"recovery mode 'shrink': device {', '.join(map(str, lost))} of mesh {root!r} was lost, "
                            f"and the mesh has no data-parallel dim to shrink (one named {' or '.join(SHRINKABLE_DIMS)}"
                            f": only a dp dim's loss is absorbed by re-splitting the batch){use}")
    k = dims[0]
    slices = sorted({int(np.argwhere(root._array == d)[0][k]) for d in lost if d in root.device_ids})
    if root.shape[k] - len(slices) < 1:
        raise RecoveryError(f"recovery mode 'shrink': device {', '.join(map(str, lost))} was lost, but mesh {root!r} "
                            f"has {root.shape[k]} device{'s' if root.shape[k] > 1 else ''} on "
                            f"'{names[k]}': shrinking it would leave fewer than 1{use}")
    return k, {int(i) for s in slices for i in np.take(root._array, s, axis=k).reshape(-1)}


def _new_array(m: DeviceMesh, gone: set) -> np.ndarray:
    """``m``'s ids with the slices of its dp dim that hold ``gone`` removed, renumbered past ``gone``."""
    arr = m._array
    hit = gone.intersection(m.device_ids)
    if hit:
        names = m.dim_names or []
        for k in [names.index(n) for n in SHRINKABLE_DIMS if n in names]:
            idx = sorted({int(np.argwhere(arr == d)[0][k]) for d in hit})
            cut = {int(i) for s in idx for i in np.take(arr, s, axis=k).reshape(-1)}
            if cut == hit and len(idx) < arr.shape[k]:
                arr = np.delete(arr, idx, axis=k)
                break
        else:
            raise RecoveryError(f"recovery mode 'shrink': mesh {m!r} holds devices {sorted(hit)} of the dropped "
                                f"dp slice, but not as whole slices of a dp dim, so it cannot shrink with the rest; "
                                "use configure('replace') (a new worker for the lost device)")
    gone_sorted = np.array(sorted(gone), dtype=np.int64)
    return arr - np.searchsorted(gone_sorted, arr)  # each id moves down by the gone ids below it


def layouts(meshes, lost) -> tuple:
    """(the widest mesh holding a lost device or None, the device ids that go, {id(mesh): its new id array}) for
    ``meshes`` after losing ``lost``; raises a RecoveryError where one cannot shrink. Changes nothing."""
    holding = [m for m in meshes if set(lost) & set(m.device_ids)]
    if not holding:  # no tensor lives on the lost device: nothing shrinks (the new pool is just smaller)
        root, gone = None, set(lost)
    else:
        root = max(holding, key=lambda m: m.size())
        _, gone = _dropped(root, list(lost))
        gone |= set(lost)  # (a lost id no mesh holds goes too)
    return root, gone, {id(m): _new_array(m, gone) for m in meshes}


def shrink(snap, lost) -> str:
    """Re-point the meshes of the tensors ``snap`` restores (``Snapshot.tensors``) onto the devices left after
    losing ``lost`` (device ids), before ``snap.restore`` places the values. Checks everything before it changes
    anything. Returns the new mesh, as events print it."""
    tensors = snap.tensors()
    partial = [t for t in tensors if any(isinstance(p, Partial) for p in t.placements)]
    if partial:
        raise RecoveryError(f"recovery mode 'shrink': {len(partial)} snapshot tensor(s) are Partial (e.g. "
                            f"{partial[0]._spec}); their per-device terms cannot be re-split over fewer devices; "
                            "use configure('replace')")
    meshes = _meshes(snap, tensors)
    root, gone, new = layouts(meshes, lost)
    # nothing raised: change the meshes, the specs, the caches
    for m in meshes:
        arr = new[id(m)]
        arr.setflags(write=False)
        m._array, m._ids = arr, tuple(arr.reshape(-1).tolist())
        m._key = (m.device_type, tuple(arr.shape), m._ids, m._key[3])
        m._hash = hash(m._key)
    for cache in all_caches():  # keyed by the old meshes' hashes: stale (unreachable, but held)
        if cache.on_evict is None:  # (one with on_evict stands for state held elsewhere: a live backend's plan
            cache.clear()  # ids on its workers; ours was reset when the workers stopped, stale keys just age out)
    for m in meshes:
        if m._parent:
            _UNBOUND[m._key] = m._parent
    for t in tensors:
        s = t._spec
        t._spec = DTensorSpec(s.mesh, s.placements, s.shape, s.dtype)
    rt = snap.graph.runtime
    if getattr(rt, "min_workers", None):  # the pool the backend starts next: without the lost devices
        rt.min_workers = max(1, rt.min_workers - sum(1 for d in gone if d < rt.min_workers))
    return str(root) if root is not None else "unchanged"
