"""How the process backend's controller reaches its workers: one seam, two implementations.

The controller (``process.ProcessRuntime``: handles, records, plans, batching) is the same for every
backend that runs one worker per device; a ``Transport`` is what differs:

* ``make_pool`` / ``resize``: the workers (processes this controller or ``dtorch worker`` starts, or Ray
  actors), and joining them to a process-group generation;
* ``push``: a batch of records to one worker;
* ``stage``: what a ``Put`` record carries for a block too large to ride in it;
* ``fetch_plan`` / ``pending`` / ``collect``: how each worker sends a block back, and receiving them;
* ``answers``: waiting until every worker answered a ``Sync`` or ``Stats`` record.

``StoreTransport`` (the process backend): control records through the controller's TCPStore (a queue per
worker); data with workers on this host as files in a shared-memory directory (``process_plan.shm_*``:
the record carries the name), with workers elsewhere (and any block /dev/shm has no room for) through a
gloo group of two per worker, the controller and that worker (``Pair``). ``ray_backend.RayTransport``:
actor calls, and Ray's object store for data. Every wait watches the workers and has a timeout.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import os
import pickle
import threading

import torch
import torch.distributed as dist

from ..placement import Replicate, Shard
from . import process_plan as pp
from . import protocol as rec
from .process_plan import INLINE_BYTES
from .process_pool import Pool, WorkerError, sleeper
from .worker import worker_env
from .zygote import Zygote, zygote_enabled

_TAG_SPAN = 1 << 24


class Transport:
    """The seam between the controller and its workers (see the module docstring). ``stats`` is the
    controller's counters dict, which the transport adds its bytes to."""

    name = "transport"
    shm = False  # may blocks to and from workers go through this host's shared memory?
    spawn = True  # does the controller start its workers? (else they join: the pool cannot grow)

    def __init__(self):
        self.stats: dict = {}

    def real_gpus(self, config) -> bool:
        """Do "cuda" meshes run on GPUs (NCCL), or simulated on the workers' CPUs?"""
        raise NotImplementedError

    def remote_gpus(self, config) -> bool:
        """Are "cuda" meshes the workers' GPUs, whatever this machine has (its devices are not checked)?"""
        return False

    def make_pool(self, timeout: float, world: int, heartbeat: float):
        raise NotImplementedError

    def resize(self, pool, old: int, world: int, backend: str, cuda: bool) -> None:
        """Make ``world`` workers (``old`` of them running) join the next process-group generation."""
        raise NotImplementedError

    def reset(self) -> None:
        """The pool is gone (a fault or a shutdown): forget what belonged to it."""

    # faults the controller itself inflicts on a worker (``inject_fault``; "kill" and "stop" are the worker's own)
    fault_kinds: tuple = ()

    def inflict(self, pool, rank: int, kind: str) -> None:
        """Lose worker ``rank`` by ``kind`` (one of ``fault_kinds``), once it ran every record pushed to it."""
        raise NotImplementedError

    def stage(self, pool, name: str, block: torch.Tensor, readers: list):
        """What a ``Put`` record carries for ``block``, which the workers ``readers`` read."""
        raise NotImplementedError

    def fetch_plan(self, pool, spec, coords, ranks, req: int, whole: bool) -> tuple:
        """(each rank's ``Get.how``, its ``Get.tag``, a shared-memory file of the global value or None)."""
        return [False] * len(ranks), 0, None

    def pending(self, pool, ranks) -> list:
        """Right after the Get records were pushed: what ``collect`` waits on, per rank."""
        return list(ranks)

    def collect(self, pool, req: int, pending, spec, writable: bool) -> list:
        """Each rank's block (None: written into the global value's file); ``writable``: blocks the caller
        keeps (not read-only mappings)."""
        raise NotImplementedError

    def answers(self, pool, kind: str, req: int, world: int, what: str, values: bool) -> list | None:
        """After a ``Sync`` (kind "s") or ``Stats`` ("st") record went to every worker: wait for every
        answer; their values (when ``values``)."""
        raise NotImplementedError

    def farewell(self, pool) -> None:
        """Before the exit records: workers may skip their queued work."""

    def close(self) -> None:
        """The controller shut down."""


class StoreTransport(Transport):
    name = "process"

    def __init__(self, listen: str, spawn: bool, timeout: float, shm: bool, force_cuda: bool):
        super().__init__()
        self.listen, self.spawn, self.timeout = listen, spawn, timeout
        self.shm = shm
        self.force_cuda = force_cuda  # the workers' GPUs, when this controller's machine has none
        # forks the workers this controller starts (``zygote.py``); it outlives pools: a recovery's new workers
        # are forks too. Started with the first pool (None: not yet, or DTORCH_PROCESS_ZYGOTE=0).
        self.zygote: Zygote | None = None
        self.reset()

    def reset(self) -> None:
        self.shm_ranks: set = set()  # workers that see the pool's shared-memory directory
        # rank -> a two-member gloo group (controller 0, worker 1): large blocks to and from workers that do
        # not see the shared-memory directory (other hosts, DTORCH_PROCESS_SHM=0, a full /dev/shm)
        self.pairs: dict = {}
        self.posted: list = []  # (send work, its bytes) of blocks placed through a pair, until complete
        self.pair_device = None  # the gloo device (network loop) every pair of this pool uses
        self.pair_tag = 0

    def remote_gpus(self, config) -> bool:
        return self.force_cuda

    def real_gpus(self, config) -> bool:
        return self.force_cuda or (torch.cuda.is_available() and not config.same_device)

    def make_pool(self, timeout: float, world: int, heartbeat: float) -> Pool:
        start_timeout = max(60.0, 15.0 * world)
        zygote = None
        if self.spawn and zygote_enabled():
            if self.zygote is not None and not self.zygote.alive():
                self.zygote.close()
                self.zygote = None
            if self.zygote is None:
                self.zygote = Zygote(worker_env(1), start_timeout)
            zygote = self.zygote
        return Pool(self.listen, self.spawn, timeout, start_timeout, heartbeat, zygote)

    def resize(self, pool: Pool, old: int, world: int, backend: str, cuda: bool) -> None:
        def reform():
            for r in range(old):
                pool.push(r, pickle.dumps([rec.Reform()]))

        pool.resize(world, backend, cuda, reform)
        self.shm_ranks = pool.shm_ranks() if self.shm else set()
        # a gloo group of two (this controller, the worker) per new worker that does not see our shared memory:
        # its data plane (the store then carries control only). Workers that see it open theirs only when a
        # block first needs one (/dev/shm full, DTORCH_PROCESS_SHM turned off): the pairs' gloo device is a
        # network loop thread that wakes ~100 times a second even when idle, ~2 ms of the controller's CPU per
        # second (0.13 ms of a 65 ms training step).
        for r in range(old, world):
            if r not in self.shm_ranks:
                pool.push(r, pickle.dumps([rec.Pair(pool.gen)]))
                self._open_pair(pool, r, pool.start_timeout)

    def _open_pair(self, pool: Pool, r: int, timeout: float | None = None):
        """Our side of worker ``r``'s pair; the worker opens its own side (a ``Pair`` record, or its ``send``
        falling back): each side's constructor waits for the other."""
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=self.timeout)
        if self.pair_device is None:  # one device for every pair (a device is a loop thread)
            self.pair_device = dist.ProcessGroupGloo.create_default_device()
        options._devices = [self.pair_device]
        store = dist.PrefixStore(f"pair/{pool.gen}/{r}/", pool.client.clone())
        self.pairs[r] = watched(pool, lambda: dist.ProcessGroupGloo(store, 0, 2, options),
                                f"{pool.who(r)} to open its data connection", timeout)
        return self.pairs[r]

    def _pair_to(self, pool: Pool, r: int):
        """Worker ``r``'s pair, opened now if it has none: a ``Pair`` record ahead of its queued records (every
        record pushed to it needs only records pushed to its peers: flushes push to all), and we wait until it
        reaches it."""
        pair = self.pairs.get(r)
        if pair is None:
            pool.push(r, pickle.dumps([rec.Pair(pool.gen)]))
            pair = self._open_pair(pool, r)
        return pair

    def _next_tag(self) -> int:
        self.pair_tag = (self.pair_tag + 1) % _TAG_SPAN
        return self.pair_tag

    def stage(self, pool: Pool, name: str, block: torch.Tensor, readers: list):
        """Small blocks inline; larger ones a file in shared memory (workers on this host), else a gloo send
        to each reader, posted now and received when the worker reaches the record."""
        if self.posted:  # blocks placed through a pair: their bytes are ours until sent
            self.posted = [p for p in self.posted if not p[0].is_completed()]
        size = pp.nbytes(tuple(block.shape), block.dtype)
        if size > INLINE_BYTES and self.shm and self.shm_ranks.issuperset(readers):
            path = os.path.join(pool.shm[0], f"p-{name}")
            try:
                pp.shm_write(path, block)
            except OSError:  # /dev/shm full (a container's is often 64 MB): this block takes the store
                with contextlib.suppress(OSError):
                    os.unlink(path)
            else:
                self.stats["bytes_shm"] += size
                pool.client.add(f"p/{name}/left", len(readers))
                return ("shm", path, size, f"p/{name}")
        if size <= INLINE_BYTES:
            return pp.to_blob(block)
        data = pp.as_bytes(block.detach().cpu())
        tag = self._next_tag()
        for r in readers:
            self.posted.append((self._pair_to(pool, r).send([data], 1, tag), data))
            self.stats["bytes_put"] += size
        return ("pg", size, tag)

    def fetch_plan(self, pool: Pool, spec, coords, ranks, req: int, whole: bool) -> tuple:
        """``whole`` (the global value is wanted): where every block is one contiguous run of it and every
        worker is on this host, the workers write their blocks straight into one shared-memory file of the
        global value, which the controller then maps: no assembly copy."""
        # the workers count their blocks up from minus their number: the last one sets g/<req>/all, which
        # ``collect`` blocks on (polling the count took a wake-up every 2 ms)
        pool.client.add(f"g/{req}", -len(ranks))
        shm = self.shm and pp.nbytes(spec.local_shape(coords[0]), spec.dtype) > INLINE_BYTES
        out = None
        if shm and whole and self.shm_ranks.issuperset(ranks) and all(
                isinstance(p, (Replicate, Shard)) for p in spec.placements):
            offsets = [pp.contiguous_offset(spec, c) for c in coords]
            if None not in offsets:
                out = os.path.join(pool.shm[0], f"o-{req}")
                with open(out, "wb") as f:
                    f.truncate(pp.nbytes(spec.shape, spec.dtype))
                return [(out, o) for o in offsets], self._next_tag(), out
        return [shm and r in self.shm_ranks for r in ranks], self._next_tag(), None

    def collect(self, pool: Pool, req: int, ranks, spec, writable: bool) -> list:
        key = f"g/{req}"
        store = pool.client
        pool.wait_key(f"{key}/all", f"the blocks of {spec}")
        store.delete_key(key)
        store.delete_key(f"{key}/all")
        heads = store.multi_get([f"{key}/{r}" for r in ranks])
        out, recvs = [], []
        for r, head in zip(ranks, heads):
            dtype, shape, how, *where = pickle.loads(head)
            if how == "direct":  # written into the global value's file (``fetch_plan``)
                out.append(None)
            elif how == "shm":  # a file in the shared-memory directory
                path, size = where
                out.append(pp.shm_take(path, size, dtype, shape))
                self.stats["bytes_shm"] += size
            elif how == "inline":
                out.append(pp.from_blob(where[0], dtype, shape))
            else:  # sent through our gloo pair: every receive is posted before any is waited on
                buf = torch.empty(pp.nbytes(shape, dtype), dtype=torch.uint8)
                pair = self.pairs.get(r)
                if pair is None:  # (the worker opens its side to send)
                    pair = self._open_pair(pool, r)
                recvs.append((r, pair.recv([buf], 1, where[0])))
                out.append(pp.from_bytes(buf, dtype, shape))
                self.stats["bytes_fetched"] += buf.numel()
            store.delete_key(f"{key}/{r}")
        for r, work in recvs:
            watched(pool, work.wait, f"the blocks of {spec} from {pool.who(r)}")
        return out

    def answers(self, pool: Pool, kind: str, req: int, world: int, what: str, values: bool) -> list | None:
        key = f"{kind}/{req}"
        pool.wait_key(f"{key}/all", what)
        out = None
        if values:
            out = [pickle.loads(v) for v in pool.client.multi_get([f"{key}/{r}" for r in range(world)])]
            for r in range(world):
                pool.client.delete_key(f"{key}/{r}")
        pool.client.delete_key(key)
        pool.client.delete_key(f"{key}/all")
        return out

    def farewell(self, pool: Pool) -> None:
        pool.client.set("stop", "1")  # queued work can no longer be observed: workers skip it

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None


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
    pool.wait(done.done, what, timeout, sleeper(done))
    try:
        return done.result()
    except Exception as exc:  # noqa: BLE001  (gloo: RuntimeError on a closed connection)
        pool.check(force=True)  # a dead worker is the news, when there is one
        raise WorkerError(f"dtorch process backend: waiting for {what} failed: {exc}") from None
