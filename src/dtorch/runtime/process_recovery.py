"""What ``dtorch.recovery`` asks of the process and ray backends' controller (``Recovery``, mixed into
``process.ProcessRuntime``): the workers' pids, faults injected at an op for tests, many values fetched in
one pass, and a snapshot's mirror: every worker writes its blocks into its own file in shared memory
(``mirror_many``), which outlives the worker, and the controller reads them back only when it restores."""
from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import glob
import os
import pickle
import struct
import threading

import torch

from ..errors import RuntimeBackendError
from . import process_plan as pp
from . import protocol as rec


WORKER_FAULTS = ("kill", "stop")  # the fault record's kinds: the worker sends itself SIGKILL or SIGSTOP


class Recovery:
    def worker_pids(self) -> dict:
        with self._lock:
            pool = self._pool
            return {} if pool is None else {r: pool.pid(r) for r in range(self._world)}

    def inject_fault(self, device: int, at_op: int, kind: str = "kill") -> None:
        """Lose worker ``device`` just before the ``at_op``-th op (kernel, step, put, get) issued from now: it
        SIGKILLs or SIGSTOPs itself at a fault record queued in order (``kind`` "kill", "stop"), or the transport
        kills it from here once it ran the ops before (``Transport.fault_kinds``: the ray backend's "ray_kill",
        ``ray.kill`` of its actor). Either way where it dies does not depend on timing."""
        kinds = WORKER_FAULTS + self.transport.fault_kinds
        if kind not in kinds or not (isinstance(at_op, int) and at_op >= 1) or \
                self._pool is None or not 0 <= device < self._world:
            raise ValueError(f"inject_fault(device={device}, at_op={at_op!r}, kind={kind!r}): kind is one of "
                             f"{', '.join(map(repr, kinds))} on the {self.transport.name} backend, at_op >= 1 (1: the "
                             f"next op), device a running worker's id (0..{self._world - 1})")
        fire = self.stats["ops"] + at_op
        note = type(self)._note.__get__(self)

        def armed(what):  # this runtime's _note until the fault is queued (no cost once it is)
            seq = note(what)
            if self.stats["ops"] == fire:
                del self._note
                if kind in WORKER_FAULTS:
                    self._buf.setdefault(device, []).append(rec.Fault(kind))
                else:  # the ops before this one go out; once the worker ran them, it is lost
                    self.flush()
                    self.transport.inflict(self._pool, device, kind)
            return seq

        self._note = armed

    def to_global_many(self, handles, specs) -> list:
        """The global values of many tensors: every request is queued first, then the answers are collected
        in order, so the workers write one block after another instead of waiting for a round trip each."""
        return self._collect_many(self._ask_many(handles, specs))

    def to_global_many_async(self, handles, specs) -> concurrent.futures.Future:
        """``to_global_many`` whose requests are queued now (the values are those after the work queued so far)
        and whose answers one thread collects while the caller goes on queueing work."""
        asked = self._ask_many(handles, specs)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def collect():
            try:
                fut.set_result(self._collect_many(asked))
            except BaseException as exc:  # noqa: BLE001  (delivered through the future)
                fut.set_exception(exc)

        threading.Thread(target=collect, name="dtorch-fetch-many", daemon=True).start()
        return fut

    def _ask_many(self, handles, specs) -> list:
        asked = []
        with self._lock:
            for h, spec in zip(handles, specs):
                coords = pp.grid_coords(spec)
                asked.append((self._request(h, spec, coords, whole=True), spec, coords))
        return asked

    def _collect_many(self, asked) -> list:
        return [self._fetch(req, ranks, pool, out, spec, coords) for (req, ranks, pool, out), spec, coords in asked]

    # -- the snapshot's mirror: blocks the workers keep in shared-memory files -------------------------------
    def mirror_many(self, handles, specs, name: str):
        """Each worker writes its blocks of these tensors (their values after the work queued so far) into its
        own file ``<name>-<rank>`` of this runtime's mirror directory in shared memory; returns the
        ``MirrorCopy`` that reads them back, or None where the workers do not all see this host's shared
        memory (other hosts, DTORCH_PROCESS_SHM=0, the ray backend): fetch the values instead. Raises an
        OSError (ENOSPC), queueing nothing, where shared memory has no room for the files."""
        with self._lock:
            pool = self._pool
            ranks = set(range(self._world))
            if pool is None or not getattr(self.transport, "shm", False) or \
                    not ranks <= getattr(self.transport, "shm_ranks", set()):
                return None
            if self._mirror_dir is None:
                self._mirror_dir = pp.shm_dir()  # outlives pools: a recovery reads what the lost workers wrote
                if self._mirror_dir is None:
                    return None
            items: dict = {r: [] for r in ranks}
            sizes = dict.fromkeys(ranks, 0)
            layout = []
            for n, (h, spec) in enumerate(zip(handles, specs)):
                hid = self._id(h)
                blocks = []
                for coord in _mirrored_coords(spec, n):
                    r = spec.mesh.device_id(coord)
                    shape = spec.local_shape(coord)
                    offset = sizes[r]
                    sizes[r] += -(-pp.nbytes(shape, spec.dtype) // _ALIGN) * _ALIGN  # (views of any dtype)
                    items[r].append((hid, offset))
                    blocks.append((r, offset, shape, spec.local_box(coord), coord))
                layout.append((spec.dtype, tuple(spec.shape), spec.partial_dims() != [], blocks, _layout_key(spec), n))
            paths = {r: os.path.join(self._mirror_dir[0], f"{name}-{r}") for r in ranks}
            _check_room(self._mirror_dir[0], paths, sizes)
            token = next(self._ids)
            self._note(("mirror", f"{len(layout)} tensors"))  # one op: a test's fault may hit the mirror's write
            for r in ranks:
                self._buf[r].append(rec.Mirror(paths[r], tuple(items[r]), sizes[r], token))
            self.flush()
            return MirrorCopy(pool, paths, sizes, token, layout)

    def mirror_place(self, copy, n: int, spec):
        """A handle of the ``n``-th tensor of ``copy`` (a ``MirrorCopy``) laid out as ``spec``, each worker reading
        its block straight from the mirror file that holds it (nothing passes through the controller); None when
        ``spec`` is not the layout the copy was written in (a shrink changed the mesh: place the global value)."""
        dtype, _, partial, blocks, key, k = copy.layout[n]
        if key != _layout_key(spec):
            return None
        mesh = spec.mesh
        self._ensure(mesh)
        with self._lock:
            ranks = tuple(mesh.device_ids)
            h = self._new(ranks)
            seq = self._note(("put", spec))
            where = {coord: (r, offset) for r, offset, _, _, coord in blocks}
            rep = [i for i, p in enumerate(spec.placements) if p.is_replicate()]
            for r, coord in zip(ranks, mesh.coordinates()):
                src = coord if partial else tuple(k % mesh.shape[i] if i in rep else x for i, x in enumerate(coord))
                holder, offset = where[src]
                self._buf[r].append(rec.MirrorRead(seq, h.id, dtype, spec.local_shape(coord), mesh.device_type,
                                                   copy.paths[holder], offset))
            self._counted(len(ranks))
        return h

    def mirror_drop(self, name: str) -> None:
        """Remove the mirror files ``name-*`` (a snapshot's, when it is dropped)."""
        where = self._mirror_dir
        if where is not None:
            for f in glob.glob(os.path.join(glob.escape(where[0]), f"{glob.escape(name)}-*")):
                with contextlib.suppress(OSError):
                    os.unlink(f)

    def _drop_mirror_dir(self) -> None:
        where, self._mirror_dir = self._mirror_dir, None
        pp.shm_drop(where)


_ALIGN = 64  # blocks start at multiples of this in a mirror file


def _layout_key(spec) -> tuple:
    """What a mirrored tensor's layout was (values, not the mesh object: a shrink changes meshes in place)."""
    mesh = spec.mesh
    return mesh.device_type, tuple(mesh.device_ids), tuple(mesh.shape), tuple(spec.placements), tuple(spec.shape), \
        spec.dtype
_TRAILER = struct.Struct("<q")  # after the blocks: the token of the write that completed them


def _check_room(where: str, paths: dict, sizes: dict) -> None:
    """Raise an OSError (ENOSPC) where the files ``paths`` (``sizes`` bytes of blocks each, then a token) do not
    fit in ``where``'s file system: its free bytes, and those of the older files they overwrite. (Known short
    before the write: this snapshot is fetched. Short only while the workers write: they answer the OSError.)"""
    need = sum(sizes[r] + _TRAILER.size for r in paths)
    reused = 0
    for path in paths.values():
        with contextlib.suppress(OSError):
            reused += os.stat(path).st_size
    free = pp.free_bytes(where)
    if need > free + reused:
        raise OSError(errno.ENOSPC, f"the snapshot's mirror files need {need / 2**20:.1f} MiB in {where} and its "
                      f"file system has {(free + reused) / 2**20:.1f} MiB for them")


def _mirrored_coords(spec, n: int) -> list:
    """The devices whose blocks a mirror keeps: one replica of each block (the ``n``-th tensor takes replica
    ``n`` mod the dim's size, so that the writing spreads over the workers), every device of a Partial tensor
    (its terms), in mesh order."""
    if spec.partial_dims():
        return list(spec.mesh.coordinates())
    rep = [i for i, p in enumerate(spec.placements) if p.is_replicate()]
    return [c for c in spec.mesh.coordinates() if all(c[i] == n % spec.mesh.shape[i] for i in rep)]


class MirrorCopy:
    """The blocks one ``mirror_many`` asked the workers to write, read back from their files: ``done`` once every
    worker's file ends with this write's token (a worker killed mid-write leaves an older one), ``values`` the
    host copies (``dtorch.recovery``'s ``("global", tensor)`` or, for Partial tensors, ``("blocks", [...])``)."""

    def __init__(self, pool, paths: dict, sizes: dict, token: int, layout: list):
        self.pool, self.paths, self.sizes, self.token, self.layout = pool, paths, sizes, token, layout
        self.nbytes = sum(pp.nbytes(block[2], entry[0]) for entry in layout for block in entry[3])
        self._failure = None

    def failure(self) -> str | None:
        """Why a worker could not write its file (an OSError: /dev/shm full), else None (written, or not yet):
        the workers' ``rec.MIRROR_FAILED`` answers, read once from the pool's store."""
        if self._failure is None and self.pool.store is not None:
            key, client = f"{rec.MIRROR_FAILED}/{self.token}", self.pool.client
            if client.check([f"{key}/all"]):
                why = [f"worker {r}: {pickle.loads(client.get(f'{key}/{r}'))}" for r in sorted(self.paths)
                       if client.check([f"{key}/{r}"])]
                for k in [key, f"{key}/all", *(f"{key}/{r}" for r in self.paths)]:
                    client.delete_key(k)
                self._failure = "; ".join(why)
        return self._failure

    def done(self) -> bool:
        for r, path in self.paths.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.sizes[r])
                    got = f.read(_TRAILER.size)
            except OSError:
                return False
            if len(got) != _TRAILER.size or _TRAILER.unpack(got)[0] != self.token:
                return False
        return True

    def wait(self) -> None:
        """Until every worker wrote its blocks (the pool's health checks and timeout apply)."""
        if not self.done():
            if self.pool.store is None:
                raise RuntimeBackendError("the workers writing this snapshot's mirror were stopped before they "
                                          "finished it")
            self.pool.wait(lambda: self.done() or self.failure() is not None,
                           "the workers to write the snapshot's blocks to shared memory")

    def values(self, only=None) -> list:
        """Each tensor's host copy (``only``: of the tensors at these indices)."""
        def block(r, offset, shape, dtype):
            buf = torch.empty(pp.nbytes(shape, dtype), dtype=torch.uint8)
            if buf.numel():  # (an empty shard: its worker's file may hold nothing at all)
                with open(self.paths[r], "rb") as f:
                    f.seek(offset)
                    f.readinto(memoryview(buf.numpy()))
            return pp.from_bytes(buf, dtype, shape)

        out = []
        for dtype, shape, partial, blocks, _, _ in (self.layout if only is None else [self.layout[i] for i in only]):
            if partial:
                out.append(("blocks", [block(r, o, s, dtype) for r, o, s, _, _ in blocks]))
                continue
            full = torch.empty(shape, dtype=dtype)
            for r, o, s, box, _ in blocks:
                full[tuple(slice(a, a + n) for a, n in box)] = block(r, o, s, dtype)
            out.append(("global", full))
        return out
