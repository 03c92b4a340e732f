"""The ray backend: one Ray actor per device, torch.distributed between the actors.

The controller is the process backend's (``ProcessRuntime``: handles, op records, plans, batching); this
module gives it Ray's transport (``RayTransport``, the seam of ``transport.py``):

* workers are Ray actors (``ray_worker.DeviceActor``): CPU actors for "cpu" meshes, which reserve a
  fraction of a CPU each (a 4-device mesh runs on a 2-core machine), GPU actors through a placement group,
  one GPU each, for "cuda" meshes when the cluster has GPUs;
* batches of op records are actor calls, made without waiting (Ray keeps one caller's calls to an actor
  in order);
* data between controller and actors goes through Ray's object store: blocks to place are ``ray.put`` and
  passed as call arguments, fetched blocks come back as the call's result (no TCPStore, no pickled copy);
* faults come from Ray's supervision: a dead actor fails its calls (``ActorDiedError``), which the
  controller sees at the next op or wait, and names the device and the op; an op that raises on an actor
  comes back in the call's answers. Either way every actor is killed, the tensors on them are lost and the
  next operation starts new actors.

Ray: the program's own when it already called ``ray.init`` (``ray.is_initialized()``); else
``ray.init(address=...)`` with ``address=`` / ``RAY_ADDRESS`` (an existing cluster: "auto" or HOST:PORT);
else a local Ray that this backend starts, and stops when the last runtime on it shuts down.

Configuration (environment; the process backend's DTORCH_PROCESS_TIMEOUT, DTORCH_PROCESS_SYNC,
DTORCH_PROCESS_HEARTBEAT_TIMEOUT and DTORCH_PROCESS_MAX_WORKERS apply too):
  RAY_ADDRESS                the cluster to join when Ray is not initialized yet
  DTORCH_RAY_CPUS_PER_DEVICE Ray CPUs a "cpu" device actor reserves (default 0.01: scheduling only)
  DTORCH_RAY_THREADS         torch threads per actor (default: this machine's cores / devices)
"""
from __future__ import annotations

import atexit
import os
import pickle
import threading
import time
import warnings
import weakref

import torch

from ..errors import DeviceUnavailableError, RuntimeBackendError
from . import process_plan as pp
from . import protocol as rec
from .process import INLINE_BYTES, ProcessRuntime, _shutdown_all
from .process_pool import HEARTBEAT_TIMEOUT_S, Heartbeats, WorkerError
from .transport import Transport
from .worker import connect

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
except ImportError:  # pragma: no cover  (the message is the point)
    ray = None

__all__ = ["RayRuntime"]

CPUS_PER_DEVICE = 0.01
POLL_S = 0.002


def _need_ray():
    if ray is None:
        raise RuntimeBackendError("the ray backend needs Ray: pip install 'dtorch[ray]' (or pip install ray), "
                                  "or choose another backend (DTORCH_BACKEND=process runs one process per device "
                                  "without Ray)")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be a positive number")
    return value


class RayRuntime(ProcessRuntime):
    """The process backend's controller over Ray's transport (``RayTransport``): nothing else differs."""

    name = "ray"

    def __init__(self, *, address: str | None = None, workers: int | None = None, timeout: float | None = None,
                 max_workers: int | None = None, cpus_per_device: float | None = None,
                 heartbeat_timeout_s: float | None = None):
        _need_ray()
        transport = RayTransport(address, cpus_per_device or _env_float("DTORCH_RAY_CPUS_PER_DEVICE", CPUS_PER_DEVICE))
        super().__init__(workers=workers, timeout=timeout, max_workers=max_workers,
                         heartbeat_timeout_s=heartbeat_timeout_s, transport=transport)
        self.stats["bytes_object_store"] = 0


class RayTransport(Transport):
    """Device actors (``RayPool``) for workers, actor calls for records, Ray's object store for data."""

    name = "ray"
    shm = False  # Ray's object store is the data plane (the actors' collectives still use /dev/shm)

    def __init__(self, address: str | None, cpus_per_device: float):
        super().__init__()
        self.address = address
        self.cpus_per_device = cpus_per_device
        self.pool_alive = False  # (``close``: is Ray still in use?)
        _connect(address)
        _USERS.add(self)
        self.gpus = int(ray.cluster_resources().get("GPU", 0))

    def remote_gpus(self, config) -> bool:
        # "cuda" meshes: one GPU actor per device when the cluster has GPUs, though this process may have none
        return self.gpus > 0 and not config.same_device

    def real_gpus(self, config) -> bool:
        return self.remote_gpus(config)

    def make_pool(self, timeout: float, world: int, heartbeat: float) -> "RayPool":
        _connect(self.address)  # again, if another runtime's shutdown stopped the Ray dtorch had started
        self.pool_alive = True
        return RayPool(timeout, max(60.0, 15.0 * world), self.cpus_per_device, heartbeat)

    def reset(self) -> None:
        self.pool_alive = False

    fault_kinds = ("ray_kill",)

    def inflict(self, pool: "RayPool", rank: int, kind: str) -> None:
        pool.kill(rank)

    def resize(self, pool: "RayPool", old: int, world: int, backend: str, cuda: bool) -> None:
        pool.resize(world, backend, cuda)

    def stage(self, pool: "RayPool", name: str, block: torch.Tensor, readers: list):
        data = pp.as_bytes(block.detach().cpu())
        if data.numel() <= INLINE_BYTES:
            return data.numpy().tobytes()
        ref = ray.put(data.numpy())  # one copy into the object store; every reader's node maps or pulls it
        self.stats["bytes_object_store"] += data.numel()
        for r in readers:
            pool.attach(r, name, ref)
        return ("ray", name)

    def pending(self, pool: "RayPool", ranks) -> list:
        return [pool.last[r] for r in ranks]  # the get is the last record of its call: the result holds the block

    def collect(self, pool: "RayPool", req: int, pending, spec, writable: bool) -> list:
        answers = pool.results(pending, f"the blocks of {spec}")
        out = []
        with warnings.catch_warnings():  # Ray maps results read-only; assembling copies, ``writable`` too
            warnings.simplefilter("ignore", UserWarning)
            for answer in answers:
                dtype, shape, data = answer[("get", req)]
                self.stats["bytes_object_store"] += data.nbytes
                block = pp.from_bytes(torch.from_numpy(data), dtype, shape)
                out.append(block.clone() if writable else block)
        return out

    def answers(self, pool: "RayPool", kind: str, req: int, world: int, what: str, values: bool) -> list | None:
        # an actor runs its calls in order: the last call's completion is the answer to everything before
        got = pool.results([pool.last[r] for r in range(world)], what)
        return [a[(kind, req)] for a in got] if values else None

    def close(self) -> None:
        """The Ray that dtorch started stops with the last runtime that has actors on it."""
        self.pool_alive = False
        _USERS.discard(self)
        if _STARTED["local"] and not any(t.pool_alive for t in list(_USERS)) and ray.is_initialized():
            _STARTED["local"] = False
            ray.shutdown()


_STARTED = {"local": False, "exit hook": False}  # local: did dtorch start this process's Ray (ray.init, no address)?
_USERS: "weakref.WeakSet[RayTransport]" = weakref.WeakSet()


def _connect(address: str | None) -> None:
    """The program's Ray if it has one; else join ``address`` / RAY_ADDRESS; else start a local one."""
    if not _STARTED["exit hook"]:
        # registered after Ray's own (at ``import ray``), so it runs first at exit: the actors get their exit
        # record and the heartbeat reader stops while Ray is still up (Ray's shutdown kills the actors)
        atexit.register(_shutdown_all)
        _STARTED["exit hook"] = True
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS") or None
    # quiet: Ray's logging handlers would hold on to this process's stderr
    ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False)
    _STARTED["local"] = address is None


class RayPool:
    """The device actors of one ray-backend runtime: start, grow, call, watch, stop.

    Every call's ObjectRef stays ``outstanding`` until its result was looked at: a failed call (the actor
    died) or an answer carrying an error is a fault. ``last[rank]`` is the latest call to that actor; since
    an actor runs its calls in order, waiting for it waits for everything queued before."""

    def __init__(self, timeout: float, start_timeout: float, cpus_per_device: float,
                 heartbeat: float = HEARTBEAT_TIMEOUT_S):
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.cpus_per_device = cpus_per_device
        self.last_op = lambda: None  # the number of the latest op issued (the controller's)
        self.actors: dict = {}
        self.groups: list = []  # placement groups of GPU actors
        self.info: dict = {}  # rank -> what the actor said about itself
        self.outstanding: dict = {}  # ObjectRef -> (rank, the last op queued before it)
        self.last: dict = {}
        self.arriving: dict = {}  # rank -> [(key, ObjectRef)] of blocks its next call places
        self.rendezvous = None
        self.world = 0
        self.gen = -1
        self.cuda = False
        self.describe = lambda seq, kind: f"{kind} #{seq}"
        self._next_check = 0.0
        # Ray names an actor that died, not one that hangs (stopped, frozen, its node unreachable): every
        # actor ticks ``hb/<rank>`` in the rendezvous store, as process-backend workers do in theirs
        self.beats = Heartbeats(heartbeat)
        self._beat_values = None  # (when, {rank: counter}) as ``_read_beats`` last read them
        self._beat_reader = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # ``outstanding``: a to_torch_async thread waits while the caller runs on
        # a directory in /dev/shm: device actors on this node run all_reduce/all_gather through files in it
        # (the process backend's shared-memory collectives); data to and from the controller stays Ray's
        self.shm = pp.shm_dir()

    # -- membership ----------------------------------------------------------------------------------
    def resize(self, world: int, backend: str, cuda: bool) -> None:
        """``world`` actors join process-group generation gen+1 (the running ones keep their blocks)."""
        if self.world and cuda != self.cuda:
            raise DeviceUnavailableError(
                "the ray backend cannot move running CPU device actors onto GPUs: use a new dtorch.Graph for "
                "the cuda mesh (or put the cuda mesh first)")
        self.cuda = cuda
        actor_cls = _actor_class()
        new = range(self.world, world)
        if cuda and len(new):
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = placement_group([{"GPU": 1, "CPU": self.cpus_per_device}] * len(new), strategy="PACK")
            self.groups.append(group)
            self._wait_ready([group.ready()], f"a placement group of {len(new)} GPUs "
                             f"(the cluster has {int(ray.cluster_resources().get('GPU', 0))})", self.start_timeout)
            for n, r in enumerate(new):
                strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=n)
                self.actors[r] = actor_cls.options(num_gpus=1, num_cpus=self.cpus_per_device,
                                                   scheduling_strategy=strategy).remote(r)
        else:
            for r in new:
                self.actors[r] = actor_cls.options(num_cpus=self.cpus_per_device).remote(r)
        self.world = world
        if self.rendezvous is None:
            self.rendezvous = self._wait_ready([self.actors[0].host_rendezvous.remote(self.timeout)],
                                               "the first device actor to start", self.start_timeout)[0]
        gen = self.gen + 1
        threads = int(os.environ.get("DTORCH_RAY_THREADS") or max(1, (os.cpu_count() or 1) // world))
        cfg = {"gen": gen, "world": world, "backend": backend, "cuda": cuda, "timeout": self.timeout,
               "rendezvous": self.rendezvous, "threads": threads, "shm": self.shm}
        blob = pickle.dumps([rec.Reform(cfg)])
        refs = [self.call(r, blob) for r in range(world)]
        for r, answer in enumerate(self.results(refs, f"{world} device actors to join (generation {gen})",
                                                self.start_timeout)):
            self.info[r] = answer["info"]
        self.gen = gen

    def _wait_ready(self, refs, what: str, timeout: float) -> list:
        try:
            return ray.get(refs, timeout=timeout)
        except GetTimeoutError:
            raise WorkerError(f"dtorch ray backend: timed out after {timeout:.0f} s waiting for {what}; is the Ray "
                              "cluster short of resources? (`ray status` shows them)") from None
        except RayActorError as exc:
            raise WorkerError(f"dtorch ray backend: a device actor died while starting: {_first_line(exc)}") from None

    # -- calls -----------------------------------------------------------------------------------------
    def attach(self, rank: int, key: str, ref) -> None:
        """The next call to ``rank`` carries ``ref`` (a block a put record names by ``key``)."""
        self.arriving.setdefault(rank, []).append((key, ref))

    def call(self, rank: int, blob: bytes):
        arriving = self.arriving.pop(rank, ())
        keys = tuple(k for k, _ in arriving)
        ref = self.actors[rank].run.remote(blob, keys, *(v for _, v in arriving))
        with self._lock:
            self.outstanding[ref] = (rank, self.last_op())
        self.last[rank] = ref
        return ref

    def push(self, rank: int, blob: bytes) -> int:
        self.call(rank, blob)  # Ray moves a large batch through its object store itself
        return len(blob)

    # -- waiting and health ----------------------------------------------------------------------------
    def results(self, refs, what: str, timeout: float | None = None) -> list:
        """The answers of these calls; watches every actor meanwhile; never longer than ``timeout``."""
        timeout = self.timeout if timeout is None else timeout
        start = time.perf_counter()
        pending = list(refs)
        delay = POLL_S
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=delay)
            self.check(force=True)
            if time.perf_counter() - start > timeout:
                raise WorkerError(f"dtorch ray backend: timed out after {timeout:.0f} s waiting for {what}. "
                                  "Raise DTORCH_PROCESS_TIMEOUT if the work is just long.")
            delay = min(0.05, delay * 2)
        answers = ray.get(list(refs))  # all ready and looked at by check(): no failure is left in them
        return [a or {} for a in answers]

    def check(self, now: float | None = None, force: bool = False) -> None:
        """Raise WorkerError when an actor died or an op failed on one (seen in the calls that finished)."""
        now = time.perf_counter() if now is None else now
        if not force and now < self._next_check:
            return
        self._next_check = now + 0.05
        faults = self._finished_faults()
        if faults:
            time.sleep(0.3)  # let the peers' calls fail or report too: the root cause leads the message
            faults += self._finished_faults()
        else:
            faults = [(2, r, self.beats.message(self.who(r))) for r in self._silent(now)]
        if faults:
            err = WorkerError(self._fault_report(faults))
            err.lost_devices = tuple(sorted({r for kind, r, _ in faults if kind != 1}))  # dead or silent actors
            raise err

    def _silent(self, now: float) -> list:
        """Actors whose heartbeat stood still; actor 0 when the store that counts them (its own) has not
        answered for the heartbeat timeout."""
        if self.rendezvous is None or not self.world or self._beat_reader is False:
            return []
        if self._beat_reader is None:
            try:
                store = connect(self.rendezvous, self.start_timeout)
            except Exception as exc:  # noqa: BLE001  (the work can go on without)
                warnings.warn(f"dtorch ray backend: cannot reach the device actors' store at {self.rendezvous} "
                              f"({_first_line(exc)}): an actor that hangs will not be named, only one that dies",
                              stacklevel=2)
                self._beat_reader = False
                return []
            self._beat_values = (now, {})
            self._beat_reader = threading.Thread(target=self._read_beats, args=(store,), name="dtorch-heartbeats",
                                                 daemon=True)
            self._beat_reader.start()
        when, values = self._beat_values
        if now - when > self.beats.timeout:
            return [0]
        if now - when > 2 * self._beat_interval():
            return []  # the store is late to answer: stale counters would make every actor look silent
        return self.beats.silent(now, list(values), values.__getitem__)

    def _beat_interval(self) -> float:
        return min(1.0, self.beats.timeout / 4)

    def _read_beats(self, store) -> None:
        """Read the counters into ``_beat_values`` beside the caller's waits: a store whose host is stopped
        blocks a read for good (no timeout applies to it), which only this thread then sits out."""
        while not self._stopping.is_set():
            try:
                values = {r: int(store.add(f"hb/{r}", 0)) for r in range(self.world)}
            except Exception:  # noqa: BLE001  (actor 0 is gone: the pool is being stopped)
                return
            self._beat_values = (time.perf_counter(), values)
            self._stopping.wait(self._beat_interval())

    def _finished_faults(self) -> list:
        with self._lock:
            calls = list(self.outstanding)
        if not calls:
            return []
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=0, fetch_local=False)
        with self._lock:
            return self._faults(done)

    def _faults(self, done) -> list:
        """(kind, rank, text) of each fault among the finished calls ``done``: 0 a dead actor, 1 a failed op
        (2, from ``check``: an actor that stopped answering)."""
        done = set(done)
        faults = []
        dead = set()
        for ref in [ref for ref in self.outstanding if ref in done]:  # in call order
            rank, last = self.outstanding.pop(ref)
            try:
                answer = ray.get(ref)
            except RayActorError as exc:
                if rank not in dead:  # its first failed call holds the op it was running
                    dead.add(rank)
                    op = "" if last is None else f" while running the ops queued up to #{last} ({self.describe(last, 'op')})"
                    faults.append((0, rank, f"{self.who(rank)} died{op}: {_first_line(exc)}"))
                continue
            if answer and "err" in answer:
                seq, kind, text, _tb = answer["err"]
                faults.append((1, rank, f"{self.who(rank)} failed running {self.describe(seq, kind)}:\n    {text}"))
        return faults

    def _fault_report(self, faults) -> str:
        # a dead actor makes its peers' collectives fail too: the death is the news, their errors follow
        lines, dead = [], set()
        for kind, rank, text in sorted(faults, key=lambda f: f[:2]):  # stable: a rank's first death stays first
            if kind == 0 and rank in dead:
                continue
            dead.add(rank) if kind == 0 else None
            lines.append(text)
        return ("dtorch ray backend: " + "\n".join(dict.fromkeys(lines)) +
                "\nThe backend's device actors were stopped; tensors on them are lost (the next operation starts "
                "new actors).")

    def pid(self, r: int) -> int | None:
        return self.info.get(r, {}).get("pid")

    def who(self, r: int) -> str:
        info = self.info.get(r, {})
        parts = [f"device id {r}"] + [f"{k} {info[k]}" for k in ("pid", "host") if k in info]
        if info.get("device", "cpu") != "cpu":
            parts.append(info["device"])
        return f"device actor {r} ({', '.join(parts)})"

    def shm_ranks(self) -> set:
        return set()  # the controller's blocks go through Ray's object store, never through self.shm

    def kill(self, rank: int) -> None:
        """Tests of recovery: ``ray.kill`` actor ``rank`` once it ran every call made to it (its peers' calls
        went out too, so that its collectives complete): it is lost between two ops, as Ray loses an actor whose
        node or process goes. Its next call fails, which ``check`` reports as for any actor that died."""
        if rank in self.last:
            self.results([self.last[rank]], f"device actor {rank} to run its ops before the injected ray.kill")
        ray.kill(self.actors[rank], no_restart=True)

    # -- stopping --------------------------------------------------------------------------------------
    def stop(self, clean: bool, grace: float = 5.0) -> None:
        """Clean: the actors got an exit record; give them ``grace`` to finish it. Then kill every actor."""
        if clean and self.last:
            ray.wait(list(self.last.values()), num_returns=len(self.last), timeout=grace, fetch_local=False)
        self._stopping.set()
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001  (already gone)
                pass
        if self._beat_reader:
            # gone before the interpreter finalizes: a thread that comes back from a torch.distributed call
            # then can crash the process (SIGSEGV at exit, seen once). A read blocked on a stopped actor 0
            # ends when the kill above closes its store.
            self._beat_reader.join(timeout=10)
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            try:
                remove_placement_group(group)
            except Exception:  # noqa: BLE001
                pass
        pp.shm_drop(self.shm)
        self.actors.clear()
        self.groups.clear()
        self.outstanding.clear()
        self.last.clear()
        self.arriving.clear()


_ACTOR = None


def _actor_class():
    global _ACTOR
    if _ACTOR is None:
        from .ray_worker import DeviceActor

        _ACTOR = ray.remote(DeviceActor)
    return _ACTOR


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
