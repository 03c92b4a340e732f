"""A worker of the process and ray backends: one per device, holding that device's blocks.

The worker runs the controller's records (``protocol``) in order, dispatching on each record's type
(``HANDLERS``): kernels on its local blocks (the in-process backend's per-device path, ``lead=0``), the
redistribution primitives (``worker_comm.Collectives``), placements, and uploads of blocks the controller
asked for. It never answers a record unless asked (``Get``, ``Sync``, ``Stats``), so the controller does
not wait on it.

How records arrive and answers leave is its link's business (``Link``): the process backend's store and
gloo pair (``worker.StoreLink``), or a Ray actor's call and result (``ray_worker.RayLink``).
"""
from __future__ import annotations

import contextlib
import datetime
import importlib
import inspect
import os
import signal
from collections import Counter

import torch
import torch.distributed as dist

from . import process_plan as pp
from . import protocol as rec
from .cow import private_copy, writable
from .interface import read_file_block
from .kernels import get_kernel
from .process_program import ProgramWorker
from .protocol import handler_table, handles
from .worker_comm import Collectives, _Blocks


class Link:
    """How a worker talks to its controller: joining process groups, the answers it sends, the blocks
    that do not ride in a record, and how it leaves."""

    def join(self, worker: "Worker", cfg) -> None:
        """Join process-group generation ``cfg`` (None: the link knows where to read it)."""
        raise NotImplementedError

    def answer(self, worker: "Worker", kind: str, req: int, value, world: int) -> None:
        """Answer request ``req`` of ``kind`` ("s": sync, "st": statistics) with ``value``."""
        raise NotImplementedError

    def receive(self, worker: "Worker", r: rec.Put) -> torch.Tensor:
        """A placed block the controller staged (``Transport.stage``), on the CPU."""
        raise NotImplementedError

    def send(self, worker: "Worker", r: rec.Get, x: torch.Tensor) -> None:
        """Block ``x`` to the controller, for its fetch ``r``."""
        raise NotImplementedError

    def open_pair(self, worker: "Worker", gen: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no data pair with the controller")

    def batch(self, worker: "Worker", r: rec.Batch) -> list:
        raise NotImplementedError(f"{type(self).__name__} gets no batches by name")

    def report(self, worker: "Worker", r, exc: BaseException) -> None:
        raise NotImplementedError

    def leave(self, worker: "Worker") -> None:
        raise NotImplementedError

    def identity(self, worker: "Worker", cfg) -> dict:
        raise NotImplementedError


class Exiting(Exception):
    """The exit record: the link leaves."""


class Worker(Collectives, ProgramWorker):
    HANDLERS: dict = {}  # record type -> handler (filled below, from the @handles marks)

    def __init__(self, link: Link, rank: int, device_index: int):
        self.link = link
        self.rank = rank
        self.device_index = device_index
        self.t = _Blocks()  # handle id -> local block (or a block still arriving: t.pending)
        # sends posted and not yet known complete: a sender runs on without waiting for its receiver, so
        # a stage is not held up until the next stage reaches the matching receive. The posted views keep
        # their blocks' storage shared, so an in-place write meanwhile copies first (cow.writable)
        self.sends: list = []
        self.defs: dict = {}  # plan id -> what this rank does for it (until a forget record drops it)
        self.programs: dict = {}  # program id -> (its records, the plans they use): compiled steps (process_program)
        self.groups: dict = {}  # sorted ranks -> process group
        self.calls: Counter = Counter()  # torch.distributed calls by kind (worker_stats(collectives=True))
        self.kernels_run = 0  # kernel records run (a posted collective notes whether kernels ran behind it)
        self.failed = False
        self.stopping = False  # the controller is shutting down: skip to the exit record
        self.leaving = False  # got the exit record: the controller closing its store now is no fault
        self.cfg: dict = {}
        self.shm = None  # the controller's shared-memory directory, when this worker sees it (same host)
        self.slots: dict = {}  # sorted ranks -> (process group, its _Slots or None: not all on this host)

    # -- setup -------------------------------------------------------------------------------
    def form(self, cfg, pg_store) -> None:
        """Join process-group generation ``cfg["gen"]`` (leaving the previous one) through ``pg_store``."""
        self.cfg = cfg
        self.shm = pp.shm_reachable(cfg.get("shm"))
        if dist.is_initialized():
            dist.destroy_process_group()
        self.groups.clear()
        if cfg["cuda"]:
            torch.cuda.set_device(self.device_index)  # NCCL works on the current device
        dist.init_process_group(cfg["backend"], store=pg_store, rank=self.rank, world_size=cfg["world"],
                                timeout=datetime.timedelta(seconds=cfg["timeout"]))

    def device(self, device_type: str) -> torch.device:
        # "cuda" meshes run on the CPU when the controller simulates GPUs (no GPU, or same-device mode)
        if device_type == "cuda" and self.cfg.get("cuda"):
            return torch.device("cuda", self.device_index)
        return torch.device("cpu")

    # -- running records ---------------------------------------------------------------------------
    def run(self, records) -> None:
        handlers = self.HANDLERS
        for r in records:
            if self.failed or (self.stopping and r[0] is not rec.Exit):
                if r[0] is rec.Exit and self.failed:
                    os._exit(0)
                continue
            try:
                handlers[r[0]](self, r)
            except Exiting:
                self.link.leave(self)
            except BaseException as exc:  # noqa: BLE001  (report everything, then wait to be stopped)
                self.failed = True
                self.link.report(self, r, exc)

    def settle(self) -> None:
        """Complete every posted send and receive (before a sync answers, statistics, a re-form)."""
        for hid in list(self.t.pending):
            self.t[hid]
        for w in self.sends:
            w.wait()
        self.sends.clear()

    def statistics(self, collectives: bool) -> dict:
        """What ``worker_stats`` reports, after the posted transfers completed."""
        self.settle()
        stats = {"blocks": len(self.t), "bytes": sum(x.numel() * x.element_size() for x in self.t.values()),
                 "defs": len(self.defs), "programs": len(self.programs), **memory_usage()}
        if collectives:
            stats["collectives"] = dict(self.calls)
        return stats

    # -- membership and lifetime records ------------------------------------------------------------
    @handles(rec.Exit)
    def on_exit(self, r):
        raise Exiting

    @handles(rec.Reform)
    def on_reform(self, r: rec.Reform):
        self.settle()
        self.link.join(self, r[1])

    @handles(rec.Pair)
    def on_pair(self, r: rec.Pair):
        self.link.open_pair(self, r[1])

    @handles(rec.Fault)
    def on_fault(self, r: rec.Fault):
        os.kill(os.getpid(), signal.SIGKILL if r[1] == "kill" else signal.SIGSTOP)

    @handles(rec.Batch)
    def on_batch(self, r: rec.Batch):
        self.run(self.link.batch(self, r))

    @handles(rec.Groups)
    def on_groups(self, r: rec.Groups):
        # every worker creates every group, in the controller's order (new_group is collective)
        for ranks in r[1]:
            key = tuple(sorted(ranks))
            if key not in self.groups:
                self.groups[key] = dist.new_group(list(key))

    @handles(rec.Free)
    def on_free(self, r: rec.Free):
        for i in r[1]:
            if self.t.pop(i, None) is None and i in self.t.pending:
                self.sends += self.t.pending.pop(i).works  # never read: still completed before a sync answers

    @handles(rec.Forget)
    def on_forget(self, r: rec.Forget):
        """The controller's plan table dropped these ids; no later record uses them (new ids replace them)."""
        for pid in r[1]:
            self.defs.pop(pid, None)

    @handles(rec.EmptyCache)
    def on_empty_cache(self, r):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @handles(rec.Stats)
    def on_stats(self, r: rec.Stats):
        _, req, collectives, world = r
        self.link.answer(self, "st", req, self.statistics(collectives), world)

    @handles(rec.MirrorRead)
    def on_mirror_read(self, r: rec.MirrorRead):
        _, seq, hid, dtype, shape, device_type, path, offset = r
        buf = torch.empty(pp.nbytes(shape, dtype), dtype=torch.uint8)
        with open(path, "rb") as f:
            f.seek(offset)
            if f.readinto(memoryview(buf.numpy())) != buf.numel():
                raise OSError(f"{path}: the snapshot's mirror file ends before byte {offset + buf.numel()}")
        self.t[hid] = pp.from_bytes(buf, dtype, shape).to(self.device(device_type))

    @handles(rec.Mirror)
    def on_mirror(self, r: rec.Mirror):
        _, path, items, size, token = r
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != size + 8:
                    os.ftruncate(fd, size + 8)
                for hid, offset in items:
                    pp.write_at(fd, offset, self.t[hid])
                os.pwrite(fd, token.to_bytes(8, "little", signed=True), size)  # last: the copy is whole
            finally:
                os.close(fd)
        except OSError as exc:
            # (/dev/shm full: ENOSPC) no fault of the step: the partial file goes, its space with it, and the
            # controller hears why (``MirrorCopy.failure``): it fetches the snapshot's values instead
            with contextlib.suppress(OSError):
                os.unlink(path)
            self.link.answer(self, rec.MIRROR_FAILED, token, f"{type(exc).__name__}: {exc}", 1)

    @handles(rec.Sync)
    def on_sync(self, r: rec.Sync):
        self.settle()
        _, tok, world = r
        self.link.answer(self, "s", tok, None, world)

    # -- placement ----------------------------------------------------------------------------------
    @handles(rec.Put)
    def on_put(self, r: rec.Put):
        # small blocks ride in the record; the link fetches what the controller staged
        _, seq, hid, dtype, shape, device_type, data = r
        block = pp.from_blob(data, dtype, shape) if isinstance(data, bytes) else self.link.receive(self, r)
        self.t[hid] = block.to(self.device(device_type))

    @handles(rec.FileRead)
    def on_file_read(self, r: rec.FileRead):
        _, seq, hid, dtype, shape, device_type, where = r
        self.t[hid] = read_file_block(where, shape, dtype).to(self.device(device_type))

    @handles(rec.Zeros)
    def on_zeros(self, r: rec.Zeros):
        _, seq, hid, dtype, shape, device_type = r
        self.t[hid] = torch.zeros(shape, dtype=dtype, device=self.device(device_type))

    @handles(rec.Get)
    def on_get(self, r: rec.Get):
        self.link.send(self, r, self.t[r[2]])

    @handles(rec.Alias)
    def on_alias(self, r: rec.Alias):
        _, hid, new_id = r
        self.t[new_id] = self.t[hid]

    # -- kernels ------------------------------------------------------------------------------------
    @handles(rec.DefineKernel)
    def on_define_kernel(self, r: rec.DefineKernel):
        _, pid, name, module, in_specs, out_specs = r
        try:
            k = get_kernel(name)
        except KeyError:
            importlib.import_module(module)  # kernels registered outside dtorch's own op modules
            k = get_kernel(name)
        mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh
        coord = pp.rank_coords(mesh)[self.rank]
        lead = "lead" in inspect.signature(k.fn).parameters
        self.defs[pid] = (k, lead, tuple(s.local_shape(coord) for s in out_specs))

    @handles(rec.Kernel)
    def on_kernel(self, r: rec.Kernel):
        _, seq, pid, in_ids, out_ids, kwargs, dev_kw = r
        k, lead, shapes = self.defs[pid]
        kw = _call_kwargs(kwargs, dev_kw, lead)
        t = self.t
        out = k.fn(*[t[i] for i in in_ids], **kw)
        self.kernels_run += 1
        outs = out if isinstance(out, tuple) else (out,)
        for i, y, shape in zip(out_ids, outs, shapes):
            if tuple(y.shape) != shape:
                raise RuntimeError(f"kernel {k.name} produced local shape {tuple(y.shape)}, expected {shape}")
            t[i] = y

    @handles(rec.Write)
    def on_write(self, r: rec.Write):
        """In place into block ``tid``; copy-on-write when another id holds the same tensor or storage."""
        _, seq, pid, tid, in_ids, kwargs, dev_kw = r
        k, lead, _ = self.defs[pid]
        kw = _call_kwargs(kwargs, dev_kw, lead)
        if not writable(self.t[tid]):
            self.t[tid] = private_copy(self.t[tid])
        k.fn(self.t[tid], *[self.t[i] for i in in_ids], **kw)


Worker.HANDLERS = handler_table(Worker)


def memory_usage() -> dict:
    """{"rss": resident bytes now, "peak_rss": the most since the previous call} of this process, where
    /proc tells (Linux); {} elsewhere. Each call restarts the peak (``clear_refs``), so a caller brackets a
    step with two calls. Memory the allocator holds free is handed back first (``malloc_trim``), so "rss" is
    what lives."""
    out = {}
    trim_allocator()
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out["rss" if key == "VmRSS" else "peak_rss"] = int(value.split()[0]) * 1024
    except OSError:
        return {}
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return out


def trim_allocator() -> None:
    """Return the C allocator's free memory to the system (glibc's ``malloc_trim``; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _call_kwargs(kwargs: dict, dev_kw, lead: bool) -> dict:
    """A kernel's keywords on this worker: the record's, this device's own, and ``lead=0`` for kernels that
    take the leading grid dims (a worker holds one block: none)."""
    kw = dict(kwargs, **dev_kw) if dev_kw else kwargs
    return dict(kw, lead=0) if lead else kw
