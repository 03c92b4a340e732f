"""The process backend (scale-out): one worker process per device, torch.distributed underneath.

The controller (this object, in the user's process) never touches data. It turns each runtime call
into an op record (``protocol``), buffers the records per worker and pushes them in batches through its
transport (the store transport: a TCPStore queue per worker); it waits on workers only to fetch values (``to_global``), in ``sync`` and in
``TensorFuture.get``. Handles are integer ids the controller allocates, so outputs exist before any
worker has run anything. A mesh's device id is a worker's rank; what each worker does for a kernel
or a redistribution primitive is a pure function of the specs (``process_plan``), sent once per plan.

Transport (``transport.py``): records and data move through a ``Transport``, the one seam between this
controller and its workers: the store transport here, Ray's in ``ray_backend``. Worker<->worker data goes
through torch.distributed collectives and send/recv (gloo on CPU, NCCL on CUDA), except all_reduce and
all_gather among workers of the controller's host, which exchange blocks through shared-memory slots and
reduce in mesh order with the in-process backend's function, its bits (``worker_comm._Slots``).
Otherwise Partial terms reduce with torch.distributed's all_reduce / reduce_scatter (half floats in
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
  DTORCH_PROCESS_ZYGOTE   1 (default): workers on this host are forks of one pre-imported process
                          (``zygote.py``); 0: each starts as its own Python process
"""
from __future__ import annotations

import atexit
import concurrent.futures
import functools
import itertools
import os
import pickle
import threading
import time
import weakref

import torch

from ..errors import DeviceUnavailableError, RuntimeBackendError
from ..mesh import DeviceMesh
from ..placement import Replicate
from ..spec import DTensorSpec
from . import process_plan as pp
from . import protocol as rec
from .blocks import assemble, cut_global
from .process_plan import INLINE_BYTES  # noqa: F401  (re-exported: tests and the ray backend size blocks by it)
from .devices import mesh_problems, read_device_config, simulation_device
from .._lru import LRU
from .interface import Runtime
from .process_ops import Handle, Operations
from .process_program import ProgramControl
from .process_recovery import Recovery
from .process_pool import Pool, WorkerError, heartbeat_timeout
from .transport import StoreTransport, Transport, _TAG_SPAN

__all__ = ["ProcessRuntime", "WorkerError"]

FLUSH_RECORDS = 64  # records buffered before a push
FLUSH_AFTER_S = 0.002  # ... or this long after the first one
FLUSH_CHECK_S = 0.25  # a push checks the workers' health at most this often (every wait checks too: process_pool.Pool.wait)
PLAN_IDS = 4096  # plan ids the workers hold at most (a decode loop makes new ones every step)

_LIVE: "weakref.WeakSet[ProcessRuntime]" = weakref.WeakSet()


def _env_int(name: str, default):
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


class ProcessRuntime(Operations, Recovery, ProgramControl, Runtime):
    """The controller of one worker per device; ``transport`` reaches the workers (default: the process
    backend's store transport, configured by the arguments and the environment above)."""

    name = "process"

    def __init__(self, *, workers: int | None = None, listen: str | None = None, spawn: bool | None = None,
                 timeout: float | None = None, max_workers: int | None = None,
                 heartbeat_timeout_s: float | None = None, transport: Transport | None = None):
        self.config = read_device_config()
        self.min_workers = workers if workers is not None else _env_int("DTORCH_PROCESS_WORKERS", None)
        self.timeout = float(timeout if timeout is not None else _env_int("DTORCH_PROCESS_TIMEOUT", 300))
        self.max_workers = max_workers or _env_int("DTORCH_PROCESS_MAX_WORKERS", 64)
        self.heartbeat_timeout = heartbeat_timeout(heartbeat_timeout_s)
        self.sync_every_op = os.environ.get("DTORCH_PROCESS_SYNC", "0") in ("1", "true")
        if transport is None:
            spawn = spawn if spawn is not None else os.environ.get("DTORCH_PROCESS_SPAWN", "1") not in ("0", "false")
            if not spawn and not self.min_workers:
                raise ValueError("DTORCH_PROCESS_SPAWN=0 needs DTORCH_PROCESS_WORKERS=N: how many workers will join")
            transport = StoreTransport(
                listen or os.environ.get("DTORCH_PROCESS_LISTEN") or "127.0.0.1:0", spawn, self.timeout, shm=os.environ.get("DTORCH_PROCESS_SHM", "1") not in ("0", "false"),
                # the workers' GPUs, when this controller's machine has none (several nodes)
                force_cuda=os.environ.get("DTORCH_PROCESS_CUDA", "0") in ("1", "true"))
        self.transport = transport
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._pool: Pool | None = None
        self._epoch = 0
        self._lost = None  # why the previous epoch's tensors are gone
        # bytes_pushed: op records (inline blocks included); bytes_put: larger blocks placed through torch.distributed
        # bytes_shm: blocks moved through shared memory (both ways); bytes_fetched: fetched through torch.distributed
        self.stats = {"ops": 0, "records": 0, "flushes": 0, "bytes_pushed": 0, "bytes_put": 0, "bytes_shm": 0,
                      "bytes_fetched": 0, "program_runs": 0}
        transport.stats = self.stats
        self._sink: list = []  # (id, ranks, epoch) of dead handles, appended by Handle.__del__
        self._executables = LRU("process.executables", 4096)  # (kernel, in specs, out specs) -> _Executable
        self._pid_seq = itertools.count(1)  # plan ids are never reused (a worker may still hold a forgotten one)
        self._tap = None  # while a compiled step is recorded as a program: rank -> the records pushed to it
        self._dropped_programs: list = []  # (program id, epoch, ranks) of dropped programs (process_program)
        self._mirror_dir = None  # snapshots' mirror files (``Recovery.mirror_many``): outlives pools, not shutdown
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        """State of one pool of workers."""
        self._buf: dict[int, list] = {}
        self._nrec = 0
        self._t_first = 0.0
        self._next_flush_check = 0.0
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
        self.transport.reset()

    # -- devices ---------------------------------------------------------------------------------
    def devices(self, mesh) -> tuple:
        if mesh.device_type == "cpu":
            return (torch.device("cpu"),) * mesh.size()
        return tuple(torch.device("cuda", i) for i in mesh.device_ids)

    def _ensure(self, mesh: DeviceMesh) -> None:
        if mesh in self._ready:
            return
        with self._lock:
            remote = mesh.device_type == "cuda" and self.transport.remote_gpus(self.config)
            problem = None if remote else mesh_problems(mesh, self.config)
            if problem:
                raise DeviceUnavailableError(problem)
            if mesh.device_type == "cuda" and not self.transport.real_gpus(self.config):
                simulation_device()  # says once that simulated GPUs run on the CPU, as in-process does
            need = max(mesh.device_ids) + 1
            if need > self.max_workers:
                raise DeviceUnavailableError(
                    f"mesh {mesh} needs {need} worker processes (one per device id 0..{need - 1}) but the process "
                    f"backend allows {self.max_workers}; use a smaller mesh, the in-process backend, or raise "
                    "DTORCH_PROCESS_MAX_WORKERS")
            cuda = self._cuda or (mesh.device_type == "cuda" and self.transport.real_gpus(self.config))
            world = max(need, self._world, self.min_workers or 0)
            if self._pool is None:
                self._start(world, cuda)
            elif world > self._world or cuda != self._cuda:
                if not self.transport.spawn:
                    raise DeviceUnavailableError(
                        f"mesh {mesh} needs device ids up to {need - 1} but {self._world} workers joined "
                        "(DTORCH_PROCESS_WORKERS); start workers for the missing ranks and raise "
                        "DTORCH_PROCESS_WORKERS")
                self._grow(world, cuda)
            self._ready.add(mesh)

    def _start(self, world: int, cuda: bool) -> None:
        pool = self.transport.make_pool(self.timeout, world, self.heartbeat_timeout)
        pool.describe = self._describe
        pool.last_op = self._last_op
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
        self.transport.resize(self._pool, old, world, "cpu:gloo,cuda:nccl" if cuda else "gloo", cuda)
        self._world, self._cuda = world, cuda
        for r in range(world):
            self._buf.setdefault(r, [])
        # the plans stay defined: running workers keep theirs across a re-form, and no plan names a new rank
        self._groups.clear()

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

    def _define(self, key, define, args: tuple, ranks) -> int:
        """The plan id of ``key``; its definition is queued for ``ranks`` the first time (and again, under
        a fresh id, if the id was dropped from the table since)."""
        hit = self._plans.fast_get(key)  # the common case: one dict lookup
        if hit is None:
            hit = self._plans.get(key)
            if hit is None:
                hit = (next(self._pid_seq), ranks)
                self._plans[key] = hit  # may drop old ids: their forget records go before this definition
                full = define(hit[0], *args)
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
            buf[r].append(rec.Forget(tuple(pids)))

    def _make_groups(self, mesh: DeviceMesh, dim: int) -> None:
        """new_group is collective over all workers: every worker creates every group, in our order."""
        if (mesh, dim) in self._groups or mesh.shape[dim] == 1:
            return
        groups = rec.Groups(pp.dim_groups(mesh, dim))
        for r in range(self._world):
            self._buf[r].append(groups)
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
                self._buf[r].append(rec.Free(tuple(ids)))
        if self._dropped_programs:
            self._queue_drops()

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
                if self._tap is not None:
                    self._tap.setdefault(r, []).extend(recs)
                try:
                    blob = pickle.dumps(recs, protocol=5)
                except Exception as exc:  # noqa: BLE001  (the queued work can no longer run in order)
                    msg = self._unpicklable(recs, exc)
                    self._teardown(msg)
                    raise RuntimeBackendError(msg) from exc
                try:
                    self.stats["bytes_pushed"] += pool.push(r, blob)
                except WorkerError as exc:
                    self._teardown(str(exc))
                    raise
                self._buf[r] = []
            self.stats["flushes"] += 1
            self.stats["records"] += self._nrec
            self._nrec = 0
            now = time.perf_counter()
            if now < self._next_flush_check:  # (each check is a store round trip or more: not every step's)
                return
            self._next_flush_check = now + FLUSH_CHECK_S
            try:
                pool.check(now)  # a dead worker surfaces at a later op, not only at the next wait
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
        for r, shape, block in zip(ranks, spec.local_shapes(), blocks):
            if block is None:
                plan.append((r, rec.Zeros(seq, h.id, spec.dtype, shape, mesh.device_type)))
                continue
            key = id(block)
            if key not in data:
                data[key] = block
                readers[key] = []
            readers[key].append(r)
            plan.append((r, rec.Put(seq, h.id, spec.dtype, shape, mesh.device_type, key)))
        stage = self.transport.stage
        payload = {key: stage(self._pool, f"{h.id}-{n}", block, readers[key]) for n, (key, block) in enumerate(data.items())}
        for r, record in plan:
            if record[0] is rec.Put:
                record = record[:-1] + (payload[record[-1]],)
            self._buf[r].append(record)
        self._counted(len(plan))
        return h

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
            self._buf[r].append(rec.FileRead(seq, h.id, spec.dtype, spec.local_shape(coord), mesh.device_type, where))
        self._counted(len(ranks))
        return h

    # -- fetching values -------------------------------------------------------------------------
    def _request(self, h: Handle, spec: DTensorSpec, coords, whole: bool = False) -> tuple:
        """Ask the workers holding ``coords`` for their blocks (``whole``: the global value is wanted);
        returns what ``_collect`` needs, and the shared-memory file of the global value the workers write
        into, or None (``Transport.fetch_plan``)."""
        self._ensure(spec.mesh)
        hid = self._id(h)
        req = next(self._ids)
        seq = self._note(("get", spec))
        ranks = [spec.mesh.device_id(c) for c in coords]
        pool = self._pool
        hows, tag, out = self.transport.fetch_plan(pool, spec, coords, ranks, req, whole)
        for r, how in zip(ranks, hows):
            self._buf[r].append(rec.Get(seq, hid, req, how, tag))
        self._counted(len(ranks))
        self.flush()  # the gets end their batches (the ray transport's answer is the batch's call)
        return req, self.transport.pending(pool, ranks), pool, out

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

    def _collect(self, req: int, pending, pool: Pool, spec: DTensorSpec, writable: bool = False) -> list:
        try:
            return self.transport.collect(pool, req, pending, spec, writable)
        except WorkerError as exc:
            with self._lock:
                if pool is self._pool:
                    self._teardown(str(exc))
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
        return self._collect(req, ranks, pool, spec, writable=True)

    # -- waiting, errors, lifetime -----------------------------------------------------------------
    def _ask_everyone(self, make, kind: str, what: str, values: bool = False):
        """Queue ``make(req, world)`` for every worker, push, and wait until all answered (``Transport.answers``);
        their answers' values when ``values``. None when no worker runs."""
        with self._lock:
            pool = self._pool
            if pool is None:
                return None
            req = next(self._ids)
            self._queue_frees()
            record = make(req, self._world)
            for r in range(self._world):
                self._buf[r].append(record)
            self.flush()
            try:
                return self.transport.answers(pool, kind, req, self._world, what, values)
            except WorkerError as exc:
                if pool is self._pool:
                    self._teardown(str(exc))
                raise

    def sync(self) -> None:
        self._ask_everyone(rec.Sync, "s", "the workers to finish their queued work")

    def empty_cache(self) -> None:
        with self._lock:
            if self._pool is not None:
                for r in range(self._world):
                    self._buf[r].append(rec.EmptyCache())
                self.flush()

    def worker_stats(self, collectives: bool = False) -> dict:
        """rank -> {"blocks": live blocks, "bytes": their bytes, "defs": plan definitions held, "rss": the
        worker's resident bytes, "peak_rss": its most since the previous call (Linux)}, after the queued work
        (for tests, debugging and memory checks).

        ``collectives=True`` adds "collectives": {kind: torch.distributed calls this worker made so far}."""
        got = self._ask_everyone(lambda req, world: rec.Stats(req, collectives, world), "st", "worker statistics",
                                 values=True)
        return {} if got is None else dict(enumerate(got))

    def _last_op(self):
        """The number of the latest op issued (a dead Ray actor's message names the ops it had)."""
        return next(reversed(self._ops), None)

    def _describe(self, seq, kind) -> str:
        if seq is None:  # (a failure outside any op: a worker's set-up or a data connection it opened)
            return f"record {kind}"
        what = self._ops.get(seq) or self._program_what(seq)
        if what is None or what[0] == "program":
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
        return {"put": "placing", "get": "fetching", "read": "reading from files",
                "mirror": "writing the snapshot's blocks of"}[what[0]] + f" {what[1]}"

    def _unpicklable(self, recs, exc) -> str:
        for record in recs:
            try:
                pickle.dumps(record)
            except Exception:  # noqa: BLE001
                kind = record[0]
                what = (self._describe(record[1 + kind.fields.index("seq")], kind.__name__) if kind in rec.NUMBERED
                        else f"record {kind.__name__}")
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
            if pool is not None:
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
            self._drop_mirror_dir()
        self.transport.close()  # (also after a fault stopped the workers: the ray transport may stop Ray)

    def _farewell(self, pool) -> None:
        """Tell every worker to exit once it reaches the end of its queue."""
        self.transport.farewell(pool)
        for r in range(self._world):
            self._buf[r].append(rec.Exit())
        self.flush()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass



@atexit.register
def _shutdown_all() -> None:
    for rt in list(_LIVE):
        try:
            rt.shutdown()
        except Exception:  # noqa: BLE001
            pass
