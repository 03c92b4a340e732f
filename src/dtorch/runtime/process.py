"""The process backend (scale-out): one worker process per device, torch.distributed underneath.

The controller (this object, in the user's process) never touches data. It turns each runtime call
into an op record, buffers the records per worker and pushes them in batches through its TCPStore
(one queue per worker); it waits on workers only to fetch values (``to_global``), in ``sync`` and in
``TensorFuture.get``. Handles are integer ids the controller allocates, so outputs exist before any
worker has run anything. A mesh's device id is a worker's rank; what each worker does for a kernel
or a redistribution primitive is a pure function of the specs (``process_plan``), sent once per plan.

Transport: control records go through the store. Controller<->worker data: workers on this host get
large blocks as files in a shared-memory directory (``process_plan.shm_*``: the record carries the name);
workers elsewhere (and any block /dev/shm has no room for) through a gloo group of two per worker, the
controller and that worker (``_open_pairs``): torch.distributed send/recv, so the store carries control only;
worker<->worker data goes through torch.distributed collectives and send/recv (gloo on CPU, NCCL on
CUDA), except all_reduce and all_gather among workers of the controller's host, which exchange blocks
through shared-memory slots (met at a futex barrier, ``shm_barrier``) and reduce in mesh order with the
in-process backend's function, its bits (``worker._Slots``). Otherwise Partial terms reduce with torch.distributed's all_reduce / reduce_scatter (half floats in
float32, integer avg in int64). Where any order gives the same bits (two terms, max/min, integers) the
results equal the in-process backend's bit for bit; float sums/avgs over more than two terms add in
the collective's order, so they may differ from the in-process backend's mesh-order sums in the last
bits (docs/process-backend.md). Bools, and groups whose members torch.distributed ranks in different
orders (replicas must stay equal), gather the terms and reduce them in mesh order with the in-process
backend's function (``runtime/blocks.py``); to_global reduces fetched terms the same way.

Configuration (environment):
  DTORCH_PROCESS_LISTEN   HOST:PORT the store listens on (default 127.0.0.1:0: loopback, a free port)
  DTORCH_PROCESS_SPAWN    1 (default): start workers here; 0: wait for `dtorch worker` launches
  DTORCH_PROCESS_WORKERS  workers to start with (default: what the first mesh needs); with SPAWN=0,
                          how many will join
  DTORCH_PROCESS_TIMEOUT  seconds one wait may take (default 300); DTORCH_PROCESS_SYNC=1 waits after
                          every op, so a failing op raises where it was issued (debugging)
  DTORCH_PROCESS_SHM      1 (default): large blocks to and from workers on this host go through /dev/shm;
                          0: through torch.distributed (the path of workers on other hosts)
  DTORCH_PROCESS_HEARTBEAT_TIMEOUT  seconds a worker's heartbeat may stand still before it counts as
                          hung and the workers are stopped (default 15)
"""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import datetime
import functools
import itertools
import os
import pickle
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from ..errors import DeviceUnavailableError, RuntimeBackendError
from ..mesh import DeviceMesh
from ..placement import Replicate, Shard
from ..spec import DTensorSpec
from . import process_plan as pp
from .blocks import assemble, cut_global
from .process_plan import INLINE_BYTES
from .devices import mesh_problems, read_device_config, simulation_device
from .._lru import LRU
from .interface import Executable, Runtime
from .process_pool import Pool, WorkerError, heartbeat_timeout

__all__ = ["ProcessRuntime", "WorkerError"]

FLUSH_RECORDS = 64  # records buffered before a push
FLUSH_AFTER_S = 0.002  # ... or this long after the first one
_TAG_SPAN = 1 << 24
PLAN_IDS = 4096  # plan ids the workers hold at most (a decode loop makes new ones every step)

_LIVE: "weakref.WeakSet[ProcessRuntime]" = weakref.WeakSet()


class Handle:
    """A DTensor's storage on the workers. When the last reference goes, its blocks are freed."""

    __slots__ = ("id", "ranks", "epoch", "sink", "__weakref__")
    # code written for the in-process backend's storage probes these; here the data lives elsewhere
    grid = None
    blocks = None

    def __init__(self, hid: int, ranks: tuple, epoch: int, sink: list):
        self.id = hid
        self.ranks = ranks
        self.epoch = epoch
        self.sink = sink

    def __del__(self):
        try:
            self.sink.append((self.id, self.ranks, self.epoch))
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass

    def __repr__(self):
        return f"Handle({self.id} on ranks {list(self.ranks)})"


def _env_int(name: str, default):
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


class ProcessRuntime(Runtime):
    name = "process"

    def __init__(self, *, workers: int | None = None, listen: str | None = None, spawn: bool | None = None,
                 timeout: float | None = None, max_workers: int | None = None,
                 heartbeat_timeout_s: float | None = None):
        self.config = read_device_config()
        self.min_workers = workers if workers is not None else _env_int("DTORCH_PROCESS_WORKERS", None)
        self.listen = listen or os.environ.get("DTORCH_PROCESS_LISTEN") or "127.0.0.1:0"
        self.spawn = spawn if spawn is not None else os.environ.get("DTORCH_PROCESS_SPAWN", "1") not in ("0", "false")
        self.timeout = float(timeout if timeout is not None else _env_int("DTORCH_PROCESS_TIMEOUT", 300))
        self.max_workers = max_workers or _env_int("DTORCH_PROCESS_MAX_WORKERS", 64)
        self.heartbeat_timeout = heartbeat_timeout(heartbeat_timeout_s)
        self.sync_every_op = os.environ.get("DTORCH_PROCESS_SYNC", "0") in ("1", "true")
        self.shm = os.environ.get("DTORCH_PROCESS_SHM", "1") not in ("0", "false")
        # the workers' GPUs, when this controller's machine has none (several nodes)
        self.force_cuda = os.environ.get("DTORCH_PROCESS_CUDA", "0") in ("1", "true")
        if not self.spawn and not self.min_workers:
            raise ValueError("DTORCH_PROCESS_SPAWN=0 needs DTORCH_PROCESS_WORKERS=N: how many workers will join")
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._pool: Pool | None = None
        self._epoch = 0
        self._lost = None  # why the previous epoch's tensors are gone
        # bytes_pushed: op records (inline blocks included); bytes_put: larger blocks placed through torch.distributed
        # bytes_shm: blocks moved through shared memory (both ways); bytes_fetched: fetched through torch.distributed
        self.stats = {"ops": 0, "records": 0, "flushes": 0, "bytes_pushed": 0, "bytes_put": 0, "bytes_shm": 0,
                      "bytes_fetched": 0}
        self._sink: list = []  # (id, ranks, epoch) of dead handles, appended by Handle.__del__
        self._executables = LRU("process.executables", 4096)  # (kernel, in specs, out specs) -> _Executable
        self._pid_seq = itertools.count(1)  # plan ids are never reused (a worker may still hold a forgotten one)
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        """State of one pool of workers."""
        self._buf: dict[int, list] = {}
        self._nrec = 0
        self._t_first = 0.0
        self._ready: set = set()  # meshes whose workers run
        # plan key -> (plan id, the ranks its definition went to). Bounded: the ids it drops are
        # forgotten by those ranks (``_forget``: queued after every record that used them)
        self._plans = LRU("process.plan_ids", PLAN_IDS, on_evict=functools.partial(self._forget, self._buf))
        self._groups: set = set()  # (mesh, dim) whose process groups exist
        self._dev_args: dict = {}
        self._ops: dict = {}  # seq -> what it was, for error messages
        self._tag = 0
        self._world = 0
        self._cuda = False
        self._shm_ranks: set = set()  # workers that see the pool's shared-memory directory
        # rank -> a two-member gloo group (controller 0, worker 1): large blocks to and from workers that do
        # not see the shared-memory directory (other hosts, DTORCH_PROCESS_SHM=0, a full /dev/shm)
        self._pairs: dict = {}
        self._posted: list = []  # (send work, its bytes) of blocks placed through a pair, until complete
        self._pair_tag = 0

    # -- devices ---------------------------------------------------------------------------------
    def devices(self, mesh) -> tuple:
        if mesh.device_type == "cpu":
            return (torch.device("cpu"),) * mesh.size()
        return tuple(torch.device("cuda", i) for i in mesh.device_ids)

    def _ensure(self, mesh: DeviceMesh) -> None:
        if mesh in self._ready:
            return
        with self._lock:
            problem = None if mesh.device_type == "cuda" and self.force_cuda else mesh_problems(mesh, self.config)
            if problem:
                raise DeviceUnavailableError(problem)
            if mesh.device_type == "cuda" and not self._real_gpus():
                simulation_device()  # says once that simulated GPUs run on the CPU, as in-process does
            need = max(mesh.device_ids) + 1
            if need > self.max_workers:
                raise DeviceUnavailableError(
                    f"mesh {mesh} needs {need} worker processes (one per device id 0..{need - 1}) but the process "
                    f"backend allows {self.max_workers}; use a smaller mesh, the in-process backend, or raise "
                    "DTORCH_PROCESS_MAX_WORKERS")
            cuda = self._cuda or (mesh.device_type == "cuda" and self._real_gpus())
            world = max(need, self._world, self.min_workers or 0)
            if self._pool is None:
                self._start(world, cuda)
            elif world > self._world or cuda != self._cuda:
                if not self.spawn:
                    raise DeviceUnavailableError(
                        f"mesh {mesh} needs device ids up to {need - 1} but {self._world} workers joined "
                        "(DTORCH_PROCESS_WORKERS); start workers for the missing ranks and raise "
                        "DTORCH_PROCESS_WORKERS")
                self._grow(world, cuda)
            self._ready.add(mesh)

    def _real_gpus(self) -> bool:
        """Do "cuda" meshes run on GPUs (NCCL), or simulated on the workers' CPUs?"""
        return self.force_cuda or (torch.cuda.is_available() and not self.config.same_device)

    def _make_pool(self, world: int):
        return Pool(self.listen, self.spawn, self.timeout, max(60.0, 15.0 * world), self.heartbeat_timeout)

    def _start(self, world: int, cuda: bool) -> None:
        pool = self._make_pool(world)
        pool.describe = self._describe
        self._pool = pool
        try:
            self._resize(world, cuda)
        except BaseException as exc:
            self._teardown(f"the workers did not start: {exc}")
            raise

    def _grow(self, world: int, cuda: bool) -> None:
        """More workers (or NCCL): every worker re-joins a new process-group generation; blocks stay."""
        self.sync()
        try:
            self._resize(world, cuda)
        except WorkerError as exc:
            self._teardown(str(exc))
            raise

    def _resize(self, world: int, cuda: bool) -> None:
        old = self._world

        def reform():
            for r in range(old):
                self._pool.push(r, pickle.dumps([("reform",)]))

        self._pool.resize(world, "cpu:gloo,cuda:nccl" if cuda else "gloo", cuda, reform)
        self._world, self._cuda = world, cuda
        self._shm_ranks = self._pool.shm_ranks() if self._pool.shm else set()
        for r in range(world):
            self._buf.setdefault(r, [])
        self._open_pairs(range(old, world))
        # the plans stay defined: running workers keep theirs across a re-form, and no plan names a new rank
        self._groups.clear()

    def _open_pairs(self, ranks) -> None:
        """A gloo group of two (this controller, the worker) per new worker: the data plane wherever shared
        memory is not (the store then carries control only). Each side's constructor waits for the other."""
        pool = self._pool
        for r in ranks:
            pool.push(r, pickle.dumps([("pair", pool.gen)]))
            store = dist.PrefixStore(f"pair/{pool.gen}/{r}/", pool.client.clone())
            self._pairs[r] = watched(
                pool, lambda: dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=self.timeout)),
                f"{pool.who(r)} to open its data connection", pool.start_timeout)

    def _next_pair_tag(self) -> int:
        self._pair_tag = (self._pair_tag + 1) % _TAG_SPAN
        return self._pair_tag

    # -- records ---------------------------------------------------------------------------------
    def _new(self, ranks: tuple) -> Handle:
        return Handle(next(self._ids), ranks, self._epoch, self._sink)

    def _id(self, h) -> int:
        if not isinstance(h, Handle) or h.epoch != self._epoch:
            raise RuntimeBackendError(
                f"this tensor's blocks are gone: the process backend's workers were stopped ({self._lost}). "
                "Recreate the tensor (and reload module parameters).")
        return h.id

    def _note(self, what: tuple) -> int:
        seq = next(self._seq)
        ops = self._ops
        ops[seq] = what
        if len(ops) > 20000:
            for k in list(itertools.islice(ops, 10000)):
                del ops[k]
        self.stats["ops"] += 1
        return seq

    def _emit(self, ranks, rec) -> None:
        buf = self._buf
        for r in ranks:
            buf[r].append(rec)
        self._counted(len(ranks))

    def _counted(self, n: int) -> None:
        if not self._nrec:
            self._t_first = time.perf_counter()
        self._nrec += n
        if self._nrec >= FLUSH_RECORDS or time.perf_counter() - self._t_first > FLUSH_AFTER_S:
            self.flush()

    def _define(self, key, rec: tuple, ranks) -> int:
        """The plan id of ``key``; its definition is queued for ``ranks`` the first time (and again, under
        a fresh id, if the id was dropped from the table since)."""
        hit = self._plans.fast_get(key)  # the common case: one dict lookup
        if hit is None:
            hit = self._plans.get(key)
            if hit is None:
                hit = (next(self._pid_seq), ranks)
                self._plans[key] = hit  # may drop old ids: their forget records go before this definition
                full = (rec[0], hit[0]) + rec[1:]
                for r in ranks:
                    self._buf[r].append(full)
        return hit[0]

    @staticmethod
    def _forget(buf: dict, dropped: dict) -> None:
        """The plan table dropped these ids: the ranks that got their definitions drop them too. Every
        record that used one is already queued (a record is queued right after its id is looked up), and
        records run in order per worker. (``buf``, not ``self``: the table must not keep the runtime alive.)"""
        per: dict = {}
        for pid, ranks in dropped.values():
            for r in ranks:
                per.setdefault(r, []).append(pid)
        for r, pids in per.items():
            buf[r].append(("forget", pids))

    def _make_groups(self, mesh: DeviceMesh, dim: int) -> None:
        """new_group is collective over all workers: every worker creates every group, in our order."""
        if (mesh, dim) in self._groups or mesh.shape[dim] == 1:
            return
        rec = ("groups", pp.dim_groups(mesh, dim))
        for r in range(self._world):
            self._buf[r].append(rec)
        self._groups.add((mesh, dim))

    def _tags(self, n: int) -> int:
        if self._tag + n >= _TAG_SPAN:
            self._tag = 0
        base = self._tag
        self._tag += max(n, 1)
        return base

    def _queue_frees(self) -> None:
        """Free records for the handles that died (after every record that used them: they are queued)."""
        sink = self._sink
        n = len(sink)
        if n:
            frees: dict = {}
            for hid, ranks, epoch in sink[:n]:
                if epoch != self._epoch:
                    continue  # its workers are gone
                for r in ranks:
                    frees.setdefault(r, []).append(hid)
            del sink[:n]
            for r, ids in frees.items():
                self._buf[r].append(("free", ids))

    def flush(self) -> None:
        """Push every buffered record to its worker (one store message per worker)."""
        with self._lock:
            pool = self._pool
            if pool is None:
                return
            self._queue_frees()
            for r, recs in self._buf.items():
                if not recs:
                    continue
                try:
                    blob = pickle.dumps(recs, protocol=5)
                except Exception as exc:  # noqa: BLE001  (the queued work can no longer run in order)
                    msg = self._unpicklable(recs, exc)
                    self._teardown(msg)
                    raise RuntimeBackendError(msg) from exc
                self.stats["bytes_pushed"] += pool.push(r, blob)
                self._buf[r] = []
            self.stats["flushes"] += 1
            self.stats["records"] += self._nrec
            if self._posted:  # blocks placed through a pair: their bytes are ours until sent
                self._posted = [p for p in self._posted if not p[0].is_completed()]
            self._nrec = 0
            try:
                pool.check()  # a dead worker surfaces at the next op, not only at the next wait
            except WorkerError as exc:
                self._teardown(str(exc))
                raise

    # -- placement of global values ---------------------------------------------------------------
    def from_global(self, full: torch.Tensor, spec: DTensorSpec) -> Handle:
        # None: a sum Partial's zeros (the worker makes them); replicas share one view: uploaded once
        return self.from_blocks(cut_global(full.detach().cpu(), spec), spec)

    def from_blocks(self, blocks, spec: DTensorSpec) -> Handle:
        """One block per device in mesh order (None: zeros); the same tensor object is uploaded once."""
        mesh = spec.mesh
        self._ensure(mesh)
        ranks = tuple(mesh.device_ids)
        h = self._new(ranks)
        seq = self._note(("put", spec))
        data: dict = {}
        readers: dict = {}
        plan = []
        for r, coord, block in zip(ranks, mesh.coordinates(), blocks):
            shape = spec.local_shape(coord)
            if block is None:
                plan.append((r, ("zeros", seq, h.id, spec.dtype, shape, mesh.device_type)))
                continue
            key = id(block)
            if key not in data:
                data[key] = block
                readers[key] = []
            readers[key].append(r)
            plan.append((r, ("put", seq, h.id, spec.dtype, shape, mesh.device_type, key)))
        payload = {key: self._stage(f"{h.id}-{n}", block, readers[key]) for n, (key, block) in enumerate(data.items())}
        for r, rec in plan:
            if rec[0] == "put":
                rec = rec[:-1] + (payload[rec[-1]],)
            self._buf[r].append(rec)
        self._counted(len(plan))
        return h

    def _stage(self, name: str, block: torch.Tensor, readers: list):
        """What a put record carries for ``block``, which the workers ``readers`` read: small blocks inline;
        larger ones a file in shared memory (workers on this host), else a gloo send to each reader."""
        size = pp.nbytes(tuple(block.shape), block.dtype)
        if size > INLINE_BYTES and self.shm and self._shm_ranks.issuperset(readers):
            path = os.path.join(self._pool.shm[0], f"p-{name}")
            try:
                pp.shm_write(path, block)
            except OSError:  # /dev/shm full (a container's is often 64 MB): this block takes the store
                with contextlib.suppress(OSError):
                    os.unlink(path)
            else:
                self.stats["bytes_shm"] += size
                self._pool.client.add(f"p/{name}/left", len(readers))
                return ("shm", path, size, f"p/{name}")
        data = pp.as_bytes(block.detach().cpu())
        if size <= INLINE_BYTES:
            return data.numpy().tobytes()
        tag = self._next_pair_tag()
        for r in readers:  # posted now, received when the worker reaches the record
            self._posted.append((self._pairs[r].send([data], 1, tag), data))
            self.stats["bytes_put"] += size
        return ("pg", size, tag)

    def zeros(self, spec: DTensorSpec) -> Handle:
        return self.from_blocks([None] * spec.mesh.size(), spec)  # each worker makes its own

    def from_files(self, reads, spec: DTensorSpec) -> Handle:
        """Each worker reads its own block from the files (``FileBlock``): only the read instructions
        leave the controller, no weight bytes."""
        mesh = spec.mesh
        self._ensure(mesh)
        ranks = tuple(mesh.device_ids)
        h = self._new(ranks)
        seq = self._note(("read", spec))
        for r, coord, where in zip(ranks, mesh.coordinates(), reads):
            self._buf[r].append(("fread", seq, h.id, spec.dtype, spec.local_shape(coord), mesh.device_type, where))
        self._counted(len(ranks))
        return h

    # -- fetching values -------------------------------------------------------------------------
    def _request(self, h: Handle, spec: DTensorSpec, coords, whole: bool = False) -> tuple:
        """Ask the workers holding ``coords`` for their blocks; returns what ``_collect`` needs.

        ``whole`` (the global value is wanted): where every block is one contiguous run of it and every
        worker is on this host, the workers write their blocks straight into one shared-memory file of
        the global value (its path is returned last), which the controller then maps: no assembly copy."""
        self._ensure(spec.mesh)
        hid = self._id(h)
        req = next(self._ids)
        seq = self._note(("get", spec))
        ranks = [spec.mesh.device_id(c) for c in coords]
        shm = self.shm and pp.nbytes(spec.local_shape(coords[0]), spec.dtype) > INLINE_BYTES
        out = None
        if shm and whole and self._shm_ranks.issuperset(ranks) and all(
                isinstance(p, (Replicate, Shard)) for p in spec.placements):
            offsets = [pp.contiguous_offset(spec, c) for c in coords]
            if None not in offsets:
                out = os.path.join(self._pool.shm[0], f"o-{req}")
                with open(out, "wb") as f:
                    f.truncate(pp.nbytes(spec.shape, spec.dtype))
        tag = self._next_pair_tag()
        for n, r in enumerate(ranks):
            how = (out, offsets[n]) if out else shm and r in self._shm_ranks
            self._buf[r].append(("get", seq, hid, req, how, tag))
        self._counted(len(ranks))
        self.flush()
        return req, ranks, self._pool, out

    def _fetch(self, req: int, ranks, pool: Pool, out, spec: DTensorSpec, coords) -> torch.Tensor:
        """The global value: mapped from the file the workers wrote into, else assembled from blocks."""
        blocks = self._collect(req, ranks, pool, spec)
        if out is None:
            return self._assemble(spec, coords, blocks)
        size = pp.nbytes(spec.shape, spec.dtype)
        self.stats["bytes_shm"] += size
        full = pp.shm_take(out, size, spec.dtype, spec.shape)
        flat = pp.as_bytes(full)  # (the mapping is private: these writes stay here)
        for coord, block in zip(coords, blocks):
            if block is not None:  # a worker that could not write into the file (/dev/shm full) sent it
                offset = pp.contiguous_offset(spec, coord)
                flat[offset: offset + block.numel() * block.element_size()] = pp.as_bytes(block)
        return full

    def _collect(self, req: int, ranks, pool: Pool, spec: DTensorSpec) -> list:
        key = f"g/{req}"
        store = pool.client
        try:
            pool.wait(lambda: int(store.add(key, 0)) >= len(ranks), f"the blocks of {spec}")
        except WorkerError as exc:
            with self._lock:
                if pool is self._pool:
                    self._teardown(str(exc))
            raise
        store.delete_key(key)
        heads = store.multi_get([f"{key}/{r}" for r in ranks])
        out, recvs = [], []
        for r, head in zip(ranks, heads):
            dtype, shape, how, *where = pickle.loads(head)
            if how == "direct":  # written into the global value's file (``_request``)
                out.append(None)
            elif how == "shm":  # a file in the shared-memory directory
                path, size = where
                out.append(pp.shm_take(path, size, dtype, shape))
                self.stats["bytes_shm"] += size
            elif how == "inline":
                out.append(pp.from_blob(where[0], dtype, shape))
            else:  # sent through our gloo pair: every receive is posted before any is waited on
                buf = torch.empty(pp.nbytes(shape, dtype), dtype=torch.uint8)
                recvs.append((r, self._pairs[r].recv([buf], 1, where[0])))
                out.append(pp.from_bytes(buf, dtype, shape))
                self.stats["bytes_fetched"] += buf.numel()
            store.delete_key(f"{key}/{r}")
        for r, work in recvs:
            self._pair_wait(pool, r, work, spec)
        return out

    def _pair_wait(self, pool: Pool, r: int, work, spec) -> None:
        """Wait for worker ``r``'s block, watching the workers as in every wait (``watched``)."""
        try:
            watched(pool, work.wait, f"the blocks of {spec} from {pool.who(r)}")
        except WorkerError as err:
            with self._lock:
                if pool is self._pool:
                    self._teardown(str(err))
            raise

    def _assemble(self, spec: DTensorSpec, coords, blocks) -> torch.Tensor:
        """The global value from the (CPU) blocks of ``coords``: partial terms reduce in the one documented
        order with the in-process backend's function (``blocks.assemble``)."""
        got = dict(zip(coords, blocks))
        # replicas were not fetched: every device takes the block of its index-0 replica
        flat = [got[tuple(0 if isinstance(p, Replicate) else x for x, p in zip(c, spec.placements))]
                for c in spec.mesh.coordinates()]
        return assemble(flat, spec, torch.device("cpu"), out=pp.empty_result(spec.shape, spec.dtype))

    def to_global(self, h: Handle, spec: DTensorSpec) -> torch.Tensor:
        coords = pp.grid_coords(spec)
        with self._lock:
            req, ranks, pool, out = self._request(h, spec, coords, whole=True)
        return self._fetch(req, ranks, pool, out, spec, coords)

    def to_global_async(self, h: Handle, spec: DTensorSpec):
        from ..future import TensorFuture

        coords = pp.grid_coords(spec)
        with self._lock:
            req, ranks, pool, out = self._request(h, spec, coords, whole=True)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def finish():
            try:
                fut.set_result(self._fetch(req, ranks, pool, out, spec, coords))
            except BaseException as exc:  # noqa: BLE001  (delivered through the future)
                fut.set_exception(exc)

        threading.Thread(target=finish, name="dtorch-fetch", daemon=True).start()
        return TensorFuture(fut, describe=f"to_torch_async() of {spec}")

    def local_blocks(self, h: Handle, spec: DTensorSpec) -> list[torch.Tensor]:
        coords = spec.mesh.coordinates()
        with self._lock:
            req, ranks, pool, _ = self._request(h, spec, coords)
        return self._collect(req, ranks, pool, spec)

    # -- local kernels ---------------------------------------------------------------------------
    def executable(self, kernel, in_specs, out_specs) -> "_Executable":
        key = (kernel.name, tuple(in_specs), tuple(out_specs))
        ex = self._executables.get(key)
        if ex is None:
            ex = self._executables[key] = _Executable(self, kernel, key[1], key[2])
        return ex

    def write(self, kernel, target: Handle, target_spec: DTensorSpec, inputs, in_specs, kwargs, device_args=None):
        """Each worker runs the in-place kernel on its block of ``target`` under the same id; a block that
        another id shares (an alias, an identity kernel's output) is copied first on the worker."""
        mesh = target_spec.mesh
        self._ensure(mesh)
        specs = (target_spec,) + tuple(in_specs)
        ranks = tuple(mesh.device_ids)
        pid = self._define(("k", kernel.name, specs, ()), ("defk", kernel.name, kernel.fn.__module__, specs, ()), ranks)
        tid = self._id(target)
        in_ids = tuple(self._id(h) for h in inputs)
        seq = self._note(("kernel", kernel.name, kwargs, specs))
        per = self._per_rank(mesh, device_args) if device_args else None
        for r in ranks:
            self._buf[r].append(("w", seq, pid, tid, in_ids, kwargs, per[r] if per else None))
        self._counted(len(ranks))
        if self.sync_every_op:
            self.sync()
        return target

    def alias(self, h: Handle, spec: DTensorSpec) -> Handle:
        self._ensure(spec.mesh)
        hid = self._id(h)
        out = self._new(h.ranks)
        self._emit(h.ranks, ("alias", hid, out.id))
        return out

    def _per_rank(self, mesh, device_args: dict) -> dict:
        """rank -> {name: python number} (cached per device_args object: plans reuse theirs)."""
        hit = self._dev_args.get(id(device_args))
        if hit is not None and hit[0] is device_args and hit[1] == mesh:
            return hit[2]
        arrays = {k: np.asarray(v) for k, v in device_args.items()}
        per = {r: {k: a[c].item() for k, a in arrays.items()} for r, c in zip(mesh.device_ids, mesh.coordinates())}
        if len(self._dev_args) > 4096:
            self._dev_args.clear()
        self._dev_args[id(device_args)] = (device_args, mesh, per)
        return per

    # -- redistribution primitives: one mesh dim each (CommLog is the executor's, not ours) ------------
    def _primitive(self, name: str, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int,
                   collective: bool = True) -> Handle:
        """Queue primitive ``name`` on mesh dim ``mesh_dim`` for every worker of the mesh (``Worker.p_<name>``)."""
        mesh = before.mesh
        self._ensure(mesh)
        if collective:
            self._make_groups(mesh, mesh_dim)
        ranks = tuple(mesh.device_ids)
        pid = self._define(("p", name, before, after, mesh_dim), ("defp", name, before, after, mesh_dim), ranks)
        hid = self._id(h)
        out = self._new(ranks)
        what = f"{before.placements[mesh_dim]}->{after.placements[mesh_dim]} {name} on {mesh.dim_label(mesh_dim)}"
        seq = self._note(("step", what, before))
        self._emit(ranks, ("s", seq, pid, hid, out.id, 0))
        if self.sync_every_op:
            self.sync()
        return out

    def all_gather(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("all_gather", h, before, after, mesh_dim)

    def all_reduce(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("all_reduce", h, before, after, mesh_dim)

    def reduce_scatter(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("reduce_scatter", h, before, after, mesh_dim)

    def all_to_all(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("all_to_all", h, before, after, mesh_dim)

    def local_slice(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("local_slice", h, before, after, mesh_dim, collective=False)

    def to_partial(self, h: Handle, before: DTensorSpec, after: DTensorSpec, mesh_dim: int) -> Handle:
        return self._primitive("to_partial", h, before, after, mesh_dim, collective=False)

    def move(self, h: Handle, before: DTensorSpec, after: DTensorSpec, same_layout: bool) -> Handle:
        self._ensure(before.mesh)
        self._ensure(after.mesh)
        ranks = tuple(dict.fromkeys(before.mesh.device_ids + after.mesh.device_ids))
        pid = self._define(("p", "move", before, after, same_layout), ("defp", "move", before, after, same_layout),
                           ranks)
        hid = self._id(h)
        out = self._new(tuple(after.mesh.device_ids))
        tag = self._tags(len(pp.move_transfers(before, after, same_layout)))
        how = "block to block" if same_layout else "regions"
        seq = self._note(("step", f"move {before.mesh} -> {after.mesh} ({how})", before))
        self._emit(ranks, ("s", seq, pid, hid, out.id, tag))
        if self.sync_every_op:
            self.sync()
        return out

    def move_into(self, moves) -> list:
        """One record for the whole batch: every worker of the meshes posts its sends and receives of every
        move at once (``Worker.op_mi``) and runs on; a target completes where it is first read. The targets
        keep their ids (a worker whose block is shared gives it fresh storage under the same id, as ``write``)."""
        pairs = tuple((before, after) for _, before, _, after in moves)
        ranks = set()
        for before, after in pairs:
            self._ensure(before.mesh)
            self._ensure(after.mesh)
            ranks.update(before.mesh.device_ids + after.mesh.device_ids)
        ranks = tuple(sorted(ranks))
        pid = self._define(("mi", pairs), ("defmi", pairs), ranks)
        ids = tuple((self._id(src), self._id(target)) for src, _, target, _ in moves)
        tag = self._tags(sum(len(pp.move_transfers(before, after)) for before, after in pairs))
        seq = self._note(("step", f"move_into of {len(moves)} tensors", pairs[0][0]))
        self._emit(ranks, ("mi", seq, pid, ids, tag))
        if self.sync_every_op:
            self.sync()
        return [target for _, _, target, _ in moves]

    def ring_shift(self, h: Handle, spec: DTensorSpec, mesh_dim: int, shift: int = 1) -> Handle:
        mesh = spec.mesh
        self._ensure(mesh)
        ranks = tuple(mesh.device_ids)
        pid = self._define(("r", spec, mesh_dim, shift), ("defr", spec, mesh_dim, shift), ranks)
        hid = self._id(h)
        out = self._new(ranks)
        seq = self._note(("ring_shift", mesh_dim, spec))
        self._emit(ranks, ("r", seq, pid, hid, out.id, self._tags(1)))
        if self.sync_every_op:
            self.sync()
        return out

    # -- waiting, errors, lifetime -----------------------------------------------------------------
    def sync(self) -> None:
        with self._lock:
            pool = self._pool
            if pool is None:
                return
            tok = next(self._ids)
            self._queue_frees()
            for r in range(self._world):
                self._buf[r].append(("sync", tok, self._world))
            self.flush()
            key = f"s/{tok}"
            try:
                pool.wait_key(f"{key}/all", "the workers to finish their queued work")
            except WorkerError as exc:
                self._teardown(str(exc))
                raise
            pool.client.delete_key(key)
            pool.client.delete_key(f"{key}/all")

    def empty_cache(self) -> None:
        with self._lock:
            if self._pool is not None:
                for r in range(self._world):
                    self._buf[r].append(("empty_cache",))
                self.flush()

    def worker_stats(self, collectives: bool = False) -> dict:
        """rank -> {"blocks": live blocks, "bytes": their bytes, "defs": plan definitions held, "rss": the
        worker's resident bytes, "peak_rss": its most since the previous call (Linux)}, after the queued work
        (for tests, debugging and memory checks).

        ``collectives=True`` adds "collectives": {kind: torch.distributed calls this worker made so far}."""
        with self._lock:
            pool = self._pool
            if pool is None:
                return {}
            req = next(self._ids)
            self._queue_frees()
            for r in range(self._world):
                self._buf[r].append(("stats", req, collectives, self._world))
            self.flush()
            key = f"st/{req}"
            try:
                pool.wait_key(f"{key}/all", "worker statistics")
            except WorkerError as exc:
                self._teardown(str(exc))
                raise
            out = {r: pickle.loads(pool.client.get(f"{key}/{r}")) for r in range(self._world)}
            for r in range(self._world):
                pool.client.delete_key(f"{key}/{r}")
            pool.client.delete_key(key)
            pool.client.delete_key(f"{key}/all")
            return out

    def _describe(self, seq, kind) -> str:
        what = self._ops.get(seq)
        if what is None:
            return f"record {kind}"
        if what[0] == "kernel":
            _, name, kwargs, in_specs = what
            kw = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
            kw = kw if len(kw) < 160 else kw[:157] + "..."
            ins = "; ".join(f"#{n}: {s}" for n, s in enumerate(in_specs))
            return f"kernel {name}({kw}) on inputs {ins}"
        if what[0] == "step":
            return f"redistribute step '{what[1]}' of {what[2]}"
        if what[0] == "ring_shift":
            return f"ring_shift on mesh dim {what[1]} of {what[2]}"
        return {"put": "placing", "get": "fetching", "read": "reading from files"}[what[0]] + f" {what[1]}"

    def _unpicklable(self, recs, exc) -> str:
        for rec in recs:
            try:
                pickle.dumps(rec)
            except Exception:  # noqa: BLE001
                what = self._describe(rec[1], rec[0]) if rec[0] in ("k", "w", "s", "r", "put") else f"record {rec[0]}"
                return (f"dtorch process backend: cannot send {what} to the workers: {exc}. Kernel arguments "
                        "must be picklable (numbers, strings, tuples, dtypes, torch tensors).")
        return f"dtorch process backend: cannot send records to the workers: {exc}"

    def _teardown(self, reason: str) -> None:
        """After a fault: stop every worker; tensors of this epoch are gone; the next op starts afresh."""
        with self._lock:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.stop(clean=False)
            self._lost = reason.splitlines()[0] if reason else "shut down"
            self._epoch += 1
            self._reset()

    def shutdown(self) -> None:
        with self._lock:
            pool = self._pool
            if pool is None:
                return
            try:
                self._farewell(pool)
                clean = True
            except Exception:  # noqa: BLE001
                clean = False
            self._pool = None
            pool.stop(clean=clean)
            self._lost = "the backend was shut down"
            self._epoch += 1
            self._reset()

    def _farewell(self, pool) -> None:
        """Tell every worker to exit once it reaches the end of its queue."""
        pool.client.set("stop", "1")  # queued work can no longer be observed: workers skip it
        for r in range(self._world):
            self._buf[r].append(("exit",))
        self.flush()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass



class _Executable(Executable):
    """One kernel on one combination of specs: each run queues one kernel record per worker (the plan,
    the handles' ids, the call's kwargs, each rank's per-device values); the workers run it on their
    blocks."""

    def __init__(self, rt: ProcessRuntime, kernel, in_specs: tuple, out_specs: tuple):
        self.runtime = weakref.ref(rt)  # the runtime caches us: no cycle (its __del__ stops the workers)
        self.kernel = kernel
        self.in_specs, self.out_specs = in_specs, out_specs
        self.mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh
        self.ranks = tuple(self.mesh.device_ids)
        self.plan_key = ("k", kernel.name, in_specs, out_specs)
        self.plan_rec = ("defk", kernel.name, kernel.fn.__module__, in_specs, out_specs)

    def run(self, handles, kwargs, device_args=None):
        rt = self.runtime()
        mesh, ranks = self.mesh, self.ranks
        rt._ensure(mesh)
        pid = rt._define(self.plan_key, self.plan_rec, ranks)  # per pool of workers: defined once each
        in_ids = tuple(rt._id(h) for h in handles)
        outs = [rt._new(ranks) for _ in self.out_specs]
        out_ids = tuple(h.id for h in outs)
        seq = rt._note(("kernel", self.kernel.name, kwargs, self.in_specs))
        if device_args:
            per = rt._per_rank(mesh, device_args)
            for r in ranks:
                rt._buf[r].append(("k", seq, pid, in_ids, out_ids, kwargs, per[r]))
            rt._counted(len(ranks))
        else:
            rt._emit(ranks, ("k", seq, pid, in_ids, out_ids, kwargs, None))
        if rt.sync_every_op:
            rt.sync()
        return outs

def watched(pool: Pool, fn, what: str, timeout: float | None = None):
    """``fn()`` (a blocking gloo call) in a thread while this one watches the workers, as every wait does:
    gloo may not notice a peer that died mid-transfer until its own timeout, and a gloo work's
    is_completed() does not move until someone waits on it. Its result; a dead or hung worker, a timeout
    or what ``fn`` raised is a WorkerError."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def call():
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001  (delivered below)
            done.set_exception(exc)

    threading.Thread(target=call, name="dtorch-gloo-wait", daemon=True).start()
    pool.wait(done.done, what, timeout, lambda s: concurrent.futures.wait([done], s))
    try:
        return done.result()
    except Exception as exc:  # noqa: BLE001  (gloo: RuntimeError on a closed connection)
        pool.check(force=True)  # a dead worker is the news, when there is one
        raise WorkerError(f"dtorch process backend: waiting for {what} failed: {exc}") from None


@atexit.register
def _shutdown_all() -> None:
    for rt in list(_LIVE):
        try:
            rt.shutdown()
        except Exception:  # noqa: BLE001
            pass
