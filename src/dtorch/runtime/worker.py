"""A process-backend worker: one process per device, holding that device's blocks.

The controller streams batches of op records through its TCPStore (a queue per worker); the worker
runs them in order: kernels on its local blocks (the in-process backend's per-device path, ``lead=0``),
the redistribution primitives (one handler each: collectives over the process groups of mesh dims,
local cuts, point-to-point copies for moves between meshes and ring shifts), and uploads of blocks
the controller asked for. It never answers a record unless asked (``get``,
``sync``), so the controller does not wait on it. Nor do its peers: a move's sends are not waited on
and its receives only where the block is first read (``_Incoming``), so pipeline stages overlap.

Run by the controller (``--rank``), or on another node by ``dtorch worker --controller HOST:PORT
--ranks 0-3``, which starts one worker per rank and reports the ones that die.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import importlib
import inspect
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter

import torch
import torch.distributed as dist

from . import process_plan as pp
from . import shm_barrier
from .blocks import cut_shard, reduce_dim, reduce_list
from .cow import private_copy, writable
from .interface import read_file_block
from .kernels import get_kernel

_NATIVE_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                  "min": dist.ReduceOp.MIN}
# dtypes the native reductions take (bool and the rest: gather the terms and reduce them here)
_NATIVE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
_HALF = (torch.float16, torch.bfloat16)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NUMBERED = ("put", "zeros", "fread", "get", "k", "w", "s", "r", "mi")  # records whose second field is the op's number
SHM_COLLECTIVE_MAX = 32 << 20  # bytes per member up to which same-host all_reduce/all_gather go through /dev/shm


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class _Exit(Exception):
    pass


class _Incoming:
    """A move's receives, posted but not waited on: the block exists once they complete. A worker runs its
    queue on while its peers catch up (a pipeline stage works on the next micro-batch while the previous
    stage still computes the gradient it will receive), and waits only where the block is first read."""

    __slots__ = ("works", "recvs", "out", "dtype")

    def __init__(self, works, recvs, out, dtype):
        self.works, self.recvs, self.out, self.dtype = works, recvs, out, dtype

    def finish(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        out = self.out
        for buf, d_sl, shape in self.recvs:
            got = pp.from_bytes(buf, self.dtype, shape)
            if d_sl is None:
                out = got
            else:
                out[d_sl] = got
        return out


class _Blocks(dict):
    """Handle id -> local block. A block still arriving from another worker waits in ``pending`` (an
    ``_Incoming``) and is completed by its first read, so every reader (kernels, steps, uploads, aliases)
    sees an ordinary block without knowing. Only misses pay: present blocks are plain dict hits."""

    __slots__ = ("pending",)

    def __init__(self):
        super().__init__()
        self.pending: dict = {}

    def __missing__(self, hid):
        inc = self.pending.pop(hid, None)
        if inc is None:
            raise KeyError(hid)
        x = self[hid] = inc.finish()
        return x

    def get(self, hid, default=None):
        if hid in self or hid in self.pending:
            return self[hid]
        return default


class _Slots:
    """all_reduce and all_gather among workers of one host through shared memory. Gloo moves a 512 KiB
    all_reduce over loopback TCP in 0.6 ms between 2 processes and 6 ms among 4 (measured, docs/benchmarks.md);
    here each member copies its block into its slot of a file every member maps, one barrier, and reads
    the others' slots. Two sets of slots alternate, so the next exchange's barrier is what tells a member
    that every other has read this exchange's slots before it writes them again. The barrier is on words
    at the head of the same file (``shm_barrier``) where the platform allows, else gloo's."""

    __slots__ = ("pg", "path", "m", "j", "timeout", "cap", "limit", "buf", "n", "barrier")

    def __init__(self, pg, path: str, m: int, j: int, timeout: float):
        self.pg, self.path, self.m, self.j = pg, path, m, j  # j: this member's group rank (slot index)
        self.timeout = timeout
        self.cap, self.limit, self.buf, self.n, self.barrier = 0, SHM_COLLECTIVE_MAX, None, 0, None

    def exchange(self, b: torch.Tensor, top: int):
        """Every member's bytes as a [m, top] uint8 view (group rank order), ``b`` (at most ``top`` bytes, the
        members' largest) being this member's; valid until this group's exchange after next. None if the
        slots cannot grow to ``top`` (no room in /dev/shm): every member then uses torch.distributed."""
        if top > self.cap and not self.grow(top):
            return None
        slots = self.buf[self.n & 1]
        self.n += 1
        slots[self.j, : b.numel()] = b
        if self.barrier is not None:
            self.barrier.wait()
        else:
            dist.barrier(group=self.pg)
        return slots[:, :top]

    def grow(self, top: int) -> bool:
        cap = max(1 << 16, 1 << (top - 1).bit_length())
        if cap > self.limit:
            return False
        head = shm_barrier.header_bytes(self.m) if shm_barrier.AVAILABLE else 0
        path, size = f"{self.path}-{cap}", head + 2 * self.m * cap
        ok = 1
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # room now, not a SIGBUS at the first write past it
            finally:
                os.close(fd)
            whole = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            buf = whole[head:].view(2, self.m, cap)  # (the view keeps the mapping, the barrier's words too)
        except OSError:
            ok = 0
        flag = torch.tensor([ok])
        dist.all_reduce(flag, dist.ReduceOp.MIN, group=self.pg)  # also: every member has mapped the file
        if self.j == 0:
            with contextlib.suppress(OSError):
                os.unlink(path)  # the mappings keep the pages
        if not flag.item():
            self.limit = cap // 2
            return False
        self.buf, self.cap, self.n = buf, cap, 0
        if head:
            self.barrier = shm_barrier.Barrier(whole.data_ptr(), self.m, self.j, self.timeout)
        return True


class Worker:
    def __init__(self, store: dist.TCPStore, rank: int, device_index: int, parent_pid: int | None):
        self.store = store
        self.rank = rank
        self.device_index = device_index
        self.parent_pid = parent_pid
        self.t = _Blocks()  # handle id -> local block (or a block still arriving: t.pending)
        # sends posted and not yet known complete: a sender runs on without waiting for its receiver, so
        # a stage is not held up until the next stage reaches the matching receive. The posted views keep
        # their blocks' storage shared, so an in-place write meanwhile copies first (cow.writable)
        self.sends: list = []
        self.defs: dict = {}  # plan id -> what this rank does for it (until a forget record drops it)
        self.groups: dict = {}  # sorted ranks -> process group
        self.calls: Counter = Counter()  # torch.distributed calls by kind (worker_stats(collectives=True))
        self.failed = False
        self.stopping = False  # the controller is shutting down: skip to the exit record
        self.leaving = False  # got the exit record: the controller closing its store now is no fault
        self.cfg: dict = {}
        self.shm = None  # the controller's shared-memory directory, when this worker sees it (same host)
        self.pair = None  # a gloo group of two with the controller: blocks that do not go through self.shm
        self.slots: dict = {}  # sorted ranks -> (process group, its _Slots or None: not all on this host)

    # -- setup -------------------------------------------------------------------------------
    def join(self) -> None:
        """(Re-)join the current process group generation the controller published."""
        cfg = pickle.loads(self.store.get("cfg"))
        self.shm = pp.shm_reachable(cfg.get("shm"))
        # who this worker is, for the controller's fault messages (a hung worker is named by these)
        self.store.set(f"info/{self.rank}", pickle.dumps(dict(self.identity(cfg), shm=self.shm is not None)))
        # the process groups get their own store connection: sharing ours with gloo's rendezvous
        # corrupted it (crashes in gloo's address parsing when groups were made under load)
        self.form(cfg, dist.PrefixStore(f"g{cfg['gen']}/", self.store.clone()))
        self.store.set(f"ready/{cfg['gen']}/{self.rank}", str(os.getpid()))

    def identity(self, cfg) -> dict:
        where = f"cuda:{self.device_index}" if cfg["cuda"] else "cpu"
        return {"pid": os.getpid(), "host": socket.gethostname(), "device": where}

    def form(self, cfg, pg_store) -> None:
        """Join process-group generation ``cfg["gen"]`` (leaving the previous one) through ``pg_store``."""
        self.cfg = cfg
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

    # -- main loop -----------------------------------------------------------------------------
    def loop(self) -> None:
        key = f"q/{self.rank}"
        while True:
            try:
                blob = self.store.queue_pop(key)
            except dist.DistNetworkError:  # the controller is gone
                if not self.leaving:
                    _orphaned(self)
                os._exit(1)
            except dist.DistStoreError:
                continue  # idle past the store timeout
            self.run(pickle.loads(blob))

    def run(self, records) -> None:
        for rec in records:
            if self.failed or (self.stopping and rec[0] != "exit"):
                if rec[0] == "exit" and self.failed:
                    os._exit(0)
                continue
            try:
                getattr(self, "op_" + rec[0])(*rec[1:])
            except _Exit:
                self.leave()
            except BaseException as exc:  # noqa: BLE001  (report everything, then wait to be stopped)
                self.report(rec, exc)

    def report(self, rec, exc: BaseException) -> None:
        self.failed = True
        self.store.set(f"err/{self.rank}", pickle.dumps(failure(rec, exc)))
        self.store.add("nfault", 1)

    def leave(self) -> None:
        # A barrier before exiting: a gloo process that exits while a peer still talks to it can abort
        # at interpreter exit; os._exit skips the teardown that aborts.
        self.leaving = True
        try:
            if not self.stopping:  # (skipped work posted nothing its peers wait for)
                self.settle()
            dist.barrier()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.store.set(f"bye/{self.rank}", "")
        finally:
            os._exit(0)

    # -- records ------------------------------------------------------------------------------
    def op_exit(self):
        raise _Exit

    def settle(self) -> None:
        """Complete every posted send and receive (before a sync answers, statistics, a re-form)."""
        for hid in list(self.t.pending):
            self.t[hid]
        for w in self.sends:
            w.wait()
        self.sends.clear()

    def op_reform(self):
        self.settle()
        self.join()

    def op_groups(self, groups):
        # every worker creates every group, in the controller's order (new_group is collective)
        for ranks in groups:
            key = tuple(sorted(ranks))
            if key not in self.groups:
                self.groups[key] = dist.new_group(list(key))

    def op_free(self, ids):
        for i in ids:
            if self.t.pop(i, None) is None and i in self.t.pending:
                self.sends += self.t.pending.pop(i).works  # never read: still completed before a sync answers

    def op_forget(self, pids):
        """The controller's plan table dropped these ids; no later record uses them (new ids replace them)."""
        for pid in pids:
            self.defs.pop(pid, None)

    def op_empty_cache(self):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def statistics(self, collectives: bool) -> dict:
        """What ``worker_stats`` reports, after the posted transfers completed."""
        self.settle()
        stats = {"blocks": len(self.t), "bytes": sum(x.numel() * x.element_size() for x in self.t.values()),
                 "defs": len(self.defs), **memory_usage()}
        if collectives:
            stats["collectives"] = dict(self.calls)
        return stats

    def op_stats(self, req, collectives, world):
        self.store.set(f"st/{req}/{self.rank}", pickle.dumps(self.statistics(collectives)))
        self.counted(f"st/{req}", world)

    def op_sync(self, tok, world):
        self.settle()
        self.counted(f"s/{tok}", world)

    def counted(self, key: str, world: int) -> None:
        """One more of the ``world`` workers answered under ``key``; the last one wakes the controller
        (``Pool.wait_key``)."""
        if self.store.add(key, 1) == world:
            self.store.set(f"{key}/all", b"")

    def op_pair(self, gen):
        """Join the controller's gloo group of two for this worker (``ProcessRuntime._open_pairs``)."""
        store = dist.PrefixStore(f"pair/{gen}/{self.rank}/", self.store.clone())
        self.pair = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=self.cfg["timeout"]))

    def op_put(self, seq, hid, dtype, shape, device_type, data):
        if isinstance(data, tuple) and data[0] == "shm":  # a file in the shared-memory directory
            _, path, size, name = data
            block = pp.shm_take(path, size, dtype, shape, unlink=False)  # mapped before anyone unlinks
            if self.store.add(f"{name}/left", -1) == 0:  # the last reader unlinks it
                os.unlink(path)
                self.store.delete_key(f"{name}/left")
            self.t[hid] = block.to(self.device(device_type))
            return
        if isinstance(data, tuple):  # a large block the controller sent through our pair
            _, size, tag = data
            buf = torch.empty(size, dtype=torch.uint8)
            self.pair.recv([buf], 0, tag).wait()
            self.t[hid] = pp.from_bytes(buf, dtype, shape).to(self.device(device_type))
            return
        self.t[hid] = pp.from_blob(data, dtype, shape).to(self.device(device_type))

    def op_fread(self, seq, hid, dtype, shape, device_type, where):
        self.t[hid] = read_file_block(where, shape, dtype).to(self.device(device_type))

    def op_zeros(self, seq, hid, dtype, shape, device_type):
        self.t[hid] = torch.zeros(shape, dtype=dtype, device=self.device(device_type))

    def op_get(self, seq, hid, req, shm=False, tag=0):
        """Our block of a fetch: into shared memory when the controller asked and there is room, else
        inline (small) or through our pair (the header in the store says which)."""
        x = self.t[hid]
        key = f"g/{req}/{self.rank}"
        head = (x.dtype, tuple(x.shape))
        sent = None
        try:
            if isinstance(shm, tuple):  # into the controller's file of the global value, at our block's offset
                path, offset = shm
                pp.shm_write_at(path, offset, x)
                sent = head + ("direct",)
            elif shm and self.shm:  # a file of its own: the controller maps it and unlinks it
                path = os.path.join(self.shm, f"g-{req}-{self.rank}")
                try:
                    sent = head + ("shm", path, pp.shm_write(path, x))
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    raise
        except OSError:  # /dev/shm is full (a container's is often 64 MB): the pair carries it
            pass
        data = None
        if sent is None:
            data = pp.as_bytes(x.detach().cpu())
            sent = head + (("inline", data.numpy().tobytes()) if data.numel() <= pp.INLINE_BYTES else ("pg", tag))
        self.store.set(key, pickle.dumps(sent))
        self.store.add(f"g/{req}", 1)
        if sent[2] == "pg":  # the controller receives once every block's header is in
            self.pair.send([data], 0, tag).wait()

    def op_batch(self, name, size):  # a batch too large for one queue message
        self.run(pickle.loads(pp.store_take(self.store, name, size)))

    # -- kernels ------------------------------------------------------------------------------
    def op_defk(self, pid, name, module, in_specs, out_specs):
        try:
            k = get_kernel(name)
        except KeyError:
            importlib.import_module(module)  # kernels registered outside dtorch's own op modules
            k = get_kernel(name)
        mesh = out_specs[0].mesh if out_specs else in_specs[0].mesh
        coord = pp.rank_coords(mesh)[self.rank]
        lead = "lead" in inspect.signature(k.fn).parameters
        self.defs[pid] = (k, lead, tuple(s.local_shape(coord) for s in out_specs))

    def op_k(self, seq, pid, in_ids, out_ids, kwargs, dev_kw):
        k, lead, shapes = self.defs[pid]
        kw = dict(kwargs, **dev_kw) if dev_kw else kwargs
        if lead:
            kw = dict(kw, lead=0)
        out = k.fn(*[self.t[i] for i in in_ids], **kw)
        outs = out if isinstance(out, tuple) else (out,)
        for i, y, shape in zip(out_ids, outs, shapes):
            if tuple(y.shape) != shape:
                raise RuntimeError(f"kernel {k.name} produced local shape {tuple(y.shape)}, expected {shape}")
            self.t[i] = y

    def op_w(self, seq, pid, tid, in_ids, kwargs, dev_kw):
        """In place into block ``tid``; copy-on-write when another id holds the same tensor or storage."""
        k, lead, _ = self.defs[pid]
        kw = dict(kwargs, **dev_kw) if dev_kw else kwargs
        if lead:
            kw = dict(kw, lead=0)
        if not writable(self.t[tid]):
            self.t[tid] = private_copy(self.t[tid])
        k.fn(self.t[tid], *[self.t[i] for i in in_ids], **kw)

    def op_alias(self, hid, new_id):
        self.t[new_id] = self.t[hid]

    # -- redistribution primitives: one handler each ------------------------------------------------
    def op_defp(self, pid, primitive, before, after, arg):
        self.defs[pid] = (getattr(self, "p_" + primitive), before, after, arg)

    def op_s(self, seq, pid, in_id, out_id, tag):
        fn, before, after, arg = self.defs[pid]
        out = fn(self.t.get(in_id), before, after, arg, tag)
        if isinstance(out, _Incoming):
            self.t.pending[out_id] = out
        elif out is not None:  # a move leaves nothing on a rank outside the target mesh
            self.t[out_id] = out

    def along(self, mesh, i):
        """(this rank's coordinate, the ranks along mesh dim i through it in mesh order, m, its index)."""
        coord = pp.rank_coords(mesh)[self.rank]
        ranks = pp.members(mesh, coord, i)
        return coord, ranks, len(ranks), coord[i]

    def p_local_slice(self, x, before, after, i, tag):
        _, _, m, j = self.along(before.mesh, i)
        return cut_shard(x, after.placements[i].dim, m, j)

    def p_to_partial(self, x, before, after, i, tag):
        _, _, m, j = self.along(before.mesh, i)
        return x if j == 0 or after.placements[i].reduce_op != "sum" else torch.zeros_like(x)

    def p_all_gather(self, x, before, after, i, tag):
        coord, ranks, m, j = self.along(before.mesh, i)
        return torch.cat(self.all_gather(x, pp.member_shapes(before, coord, i), ranks), dim=before.placements[i].dim)

    def p_all_to_all(self, x, before, after, i, tag):
        coord, ranks, m, j = self.along(before.mesh, i)
        d = after.placements[i].dim
        shapes = [pp.cut_shape(s, d, m, j) for s in pp.member_shapes(before, coord, i)]
        got = self.all_to_all([cut_shard(x, d, m, jj) for jj in range(m)], shapes, ranks)
        return torch.cat(got, dim=before.placements[i].dim)

    def native(self, dtype, op: str, m: int, mesh, i: int) -> bool:
        """May torch.distributed reduce these terms itself?

        Integers, max/min and two terms give the same bits in any order; float sums over more terms do
        not (they differ from the in-process backend's mesh-order sum in the last bits, within a
        tolerance), but replicas along other mesh dims must stay equal, so every group along the mesh
        dim must order its members alike (``same_rank_order``)."""
        if dtype not in _NATIVE or (dtype.is_complex and op in ("max", "min")):
            return False
        if m <= 2 or op in ("max", "min") or not (dtype.is_floating_point or dtype.is_complex):
            return True
        return pp.same_rank_order(mesh, i)

    @staticmethod
    def acc_dtype(dtype, op: str):
        """The dtype a native reduction runs in: half floats sum in float32 (one rounding at the end, as
        torch's own sum of half terms does); integer avg sums in int64 (its floor mean, as in-process)."""
        if op in ("max", "min"):
            return dtype
        if dtype in _HALF:
            return torch.float32
        if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
            return torch.int64
        return dtype

    @staticmethod
    def finish(y, op: str, m: int, dtype):
        if op == "avg":
            y = y / m if (y.is_floating_point() or y.is_complex()) else y.div(m, rounding_mode="floor")
        return y.to(dtype)

    def p_all_reduce(self, x, before, after, i, tag):
        coord, ranks, m, j = self.along(before.mesh, i)
        if m == 1:
            return x
        op = before.placements[i].reduce_op
        n = x.numel() * x.element_size()
        sh = self.shared(ranks, x, n)
        got = sh.exchange(pp.as_bytes(x), n) if sh is not None else None
        if got is not None:
            # the terms in mesh order, reduced by the in-process backend's function: its bits, any dtype
            order = sorted(ranks)
            if list(ranks) != order:
                got = got[[order.index(r) for r in ranks]]
            self.calls["all_reduce"] += 1
            self.calls["shm"] += 1  # (of which through shared memory)
            return reduce_dim(op, got.view(x.dtype).reshape(m, *x.shape), 0).squeeze(0)
        if not self.native(x.dtype, op, m, before.mesh, i):
            return reduce_list(op, self.all_gather(x, [tuple(x.shape)] * m, ranks))
        y = x.to(self.acc_dtype(x.dtype, op), memory_format=torch.contiguous_format, copy=True)
        self.calls["all_reduce"] += 1
        dist.all_reduce(y, _NATIVE_REDUCE[op], group=self.group(ranks))
        return self.finish(y, op, m, x.dtype)

    def p_reduce_scatter(self, x, before, after, i, tag):
        coord, ranks, m, j = self.along(before.mesh, i)
        op, d = before.placements[i].reduce_op, after.placements[i].dim
        pieces = [cut_shard(x, d, m, jj) for jj in range(m)]
        if m == 1:
            return pieces[0]
        if not self.native(x.dtype, op, m, before.mesh, i):
            # every member sends piece jj to member jj, which reduces the m pieces in mesh order
            got = self.all_to_all(pieces, [tuple(pieces[j].shape)] * m, ranks)
            return reduce_list(op, got)
        top = max(p.numel() for p in pieces)  # uneven pieces: pad each to the largest (trimmed after)
        if top == 0:
            return pieces[j].clone()
        acc = self.acc_dtype(x.dtype, op)
        inp = torch.zeros(m * top, dtype=acc, device=x.device)
        for g, n in enumerate(sorted(range(m), key=ranks.__getitem__)):  # chunk g goes to group rank g
            inp[g * top: g * top + pieces[n].numel()] = pieces[n].reshape(-1)
        out = inp.new_empty(top)
        self.calls["reduce_scatter"] += 1
        _reduce_scatter(out, inp, op=_NATIVE_REDUCE[op], group=self.group(ranks))
        mine = out[: pieces[j].numel()].reshape(pieces[j].shape)
        return self.finish(mine, op, m, x.dtype)

    def p_move(self, x, before, after, same_layout, tag):
        return self.move(pp.move_transfers(before, after, same_layout), after, x, tag)

    def op_defmi(self, pid, pairs):
        self.defs[pid] = tuple((before, after, pp.move_transfers(before, after)) for before, after in pairs)

    def op_mi(self, seq, pid, ids, tag):
        """Write each source into its target's own block (``Runtime.move_into``): regions held here are
        copied, the others received (straight into the block where the region is contiguous) from the one
        rank ``move_transfers`` names, and what other ranks need from here is sent. Every send and receive
        of the batch is posted at once; each target waits in ``t.pending`` until it is first read."""
        me = self.rank
        ops, landing = [], []  # landing: (target id, block, [receive op index], [(buffer, dst slices, shape)])
        k = tag
        for (before, after, transfers), (src_id, tgt_id) in zip(self.defs[pid], ids):
            x = self.t.get(src_id)  # None where this rank holds no block of the source
            block = None
            if any(t[1] == me for t in transfers):
                if not writable(self.t[tgt_id]):  # shared: fresh storage (every element is written)
                    self.t[tgt_id] = torch.empty_like(self.t[tgt_id], memory_format=torch.contiguous_format)
                block = self.t[tgt_id]
                landing.append((tgt_id, block, [], [], before.dtype))
            for src, dst, s_sl, d_sl, shape in transfers:
                if src == dst == me:
                    block[d_sl].copy_(x[s_sl])
                elif dst == me:
                    region = block[d_sl]
                    if region.is_contiguous() and region.dtype == before.dtype:
                        buf = pp.as_bytes(region)  # a view: the bytes land in the block itself
                    else:
                        buf = torch.empty(pp.nbytes(shape, before.dtype), dtype=torch.uint8, device=block.device)
                        landing[-1][3].append((buf, d_sl, shape))
                    if buf.numel():
                        landing[-1][2].append(len(ops))
                        ops.append(dist.P2POp(dist.irecv, buf, src, tag=k))
                elif src == me:
                    piece = pp.as_bytes(x[s_sl])
                    if piece.numel():
                        ops.append(dist.P2POp(dist.isend, piece, dst, tag=k))
                k += 1
        works, per_op = [], True
        if ops:
            self.sends = [w for w in self.sends if not w.is_completed()]
            works = dist.batch_isend_irecv(ops)
            per_op = len(works) == len(ops)  # one work per op (gloo); else coalesced (NCCL): wait for all
            self.sends += [w for op, w in zip(ops, works) if op.op is dist.isend] if per_op else works
        for tgt_id, block, recv_ops, copies, dtype in landing:
            waits = [works[i] for i in recv_ops] if per_op else works if recv_ops else []
            if waits:
                del self.t[tgt_id]
                self.t.pending[tgt_id] = _Incoming(waits, copies, block, dtype)

    def group(self, ranks):
        return self.groups[tuple(sorted(ranks))]

    def shared(self, ranks, x, nbytes: int):
        """The group's shared-memory slots, or None: torch.distributed moves it (a block on a GPU, an
        empty or very large one, or a member on another host). What decides is the same on every member
        (``nbytes`` is the members' largest); whether all members see this host's shared-memory
        directory is agreed once per group, by its first such call."""
        if x.device.type != "cpu" or not 0 < nbytes <= SHM_COLLECTIVE_MAX:
            return None
        key = tuple(sorted(ranks))
        pg = self.groups[key]
        hit = self.slots.get(key)
        if hit is None or hit[0] is not pg:  # new, or the groups were re-formed since
            on = self.shm is not None and os.environ.get("DTORCH_PROCESS_SHM", "1") not in ("0", "false")
            flag = torch.tensor([int(on)])
            dist.all_reduce(flag, dist.ReduceOp.MIN, group=pg)
            slots = None
            if flag.item():
                path = os.path.join(self.shm, f"coll-{self.cfg.get('gen', 0)}-{'-'.join(map(str, key))}")
                slots = _Slots(pg, path, len(key), key.index(self.rank), self.cfg.get("timeout", 1800))
            hit = self.slots[key] = (pg, slots)
        return hit[1]

    def all_gather(self, x, shapes, ranks) -> list:
        """Every member's block, in mesh order (gloo gathers equal sizes: pad to the largest, trim)."""
        if len(ranks) == 1:
            return [x]
        sizes = [pp.nbytes(s, x.dtype) for s in shapes]
        top = max(sizes)
        if top == 0:
            return [x.new_empty(s) for s in shapes]
        buf = pp.as_bytes(x)
        sh = self.shared(ranks, x, top)
        got = sh.exchange(buf, top) if sh is not None else None
        if got is not None:  # views of the slots: the callers copy out (cat, reduce) right away
            self.calls["all_gather"] += 1
            self.calls["shm"] += 1
            pos = {r: n for n, r in enumerate(sorted(ranks))}
            return [pp.from_bytes(got[pos[r], :n], x.dtype, s) for r, n, s in zip(ranks, sizes, shapes)]
        if buf.numel() < top:
            buf = torch.cat([buf, buf.new_zeros(top - buf.numel())])
        outs = [buf.new_empty(top) for _ in ranks]
        self.calls["all_gather"] += 1
        dist.all_gather(outs, buf, group=self.group(ranks))
        pos = {r: n for n, r in enumerate(sorted(ranks))}
        return [pp.from_bytes(outs[pos[r]][:n], x.dtype, s) for r, n, s in zip(ranks, sizes, shapes)]

    def all_to_all(self, pieces, shapes, ranks) -> list:
        """Send ``pieces[j]`` to member j; returns what each member sent here (shapes known), mesh order."""
        if len(ranks) == 1:
            return [pieces[0]]
        dtype = pieces[0].dtype
        order = sorted(range(len(ranks)), key=lambda n: ranks[n])  # group rank order
        send = [pp.as_bytes(pieces[n]) for n in order]
        recv_sizes = [pp.nbytes(shapes[n], dtype) for n in order]
        inp = torch.cat(send) if send else pieces[0].new_empty(0, dtype=torch.uint8)
        out = inp.new_empty(sum(recv_sizes))
        # every member calls, even with nothing to send or receive: skipping would strand the others
        self.calls["all_to_all"] += 1
        dist.all_to_all_single(out, inp, recv_sizes, [s.numel() for s in send], group=self.group(ranks))
        parts = dict(zip(order, out.split(recv_sizes)))
        return [pp.from_bytes(parts[n], dtype, shapes[n]) for n in range(len(ranks))]

    def op_defr(self, pid, spec, mesh_dim, shift):
        self.defs[pid] = (spec, mesh_dim, shift)

    def op_r(self, seq, pid, in_id, out_id, tag):
        spec, i, shift = self.defs[pid]
        mesh = spec.mesh
        coord = pp.rank_coords(mesh)[self.rank]
        ranks = pp.members(mesh, coord, i)
        m, j = len(ranks), coord[i]
        x = self.t[in_id]
        if shift % m == 0:
            self.t[out_id] = x
            return
        src = list(coord)
        src[i] = (j - shift) % m
        shape = spec.local_shape(tuple(src))
        buf = torch.empty(pp.nbytes(shape, x.dtype), dtype=torch.uint8, device=x.device)
        ops = []
        if buf.numel():
            ops.append(dist.P2POp(dist.irecv, buf, ranks[(j - shift) % m], tag=tag))
        if x.numel():
            ops.append(dist.P2POp(dist.isend, pp.as_bytes(x), ranks[(j + shift) % m], tag=tag))
        _run_p2p(ops)
        self.t[out_id] = pp.from_bytes(buf, x.dtype, shape)

    def move(self, transfers, after, x, tag):
        """Post this rank's part of a move; returns its destination block (None if it has none), or an
        ``_Incoming`` when parts of it are still to arrive. Sends are not waited on here (``self.sends``)."""
        me = self.rank
        coords = pp.rank_coords(after.mesh)
        device = self.device(after.mesh.device_type)
        out = None
        if me in coords and not any(t[1] == me and t[2] is None for t in transfers):
            # regions land in a fresh block (a same-layout move hands over the whole block instead)
            out = torch.empty(after.local_shape(coords[me]), dtype=after.dtype, device=device)
        recvs, ops = [], []
        for n, (src, dst, s_sl, d_sl, shape) in enumerate(transfers):
            if src == dst == me:
                piece = x if s_sl is None else x[s_sl]
                if d_sl is None:
                    out = piece.to(device)
                else:
                    out[d_sl] = piece
            elif dst == me:
                buf = torch.empty(pp.nbytes(shape, after.dtype), dtype=torch.uint8, device=device)
                if buf.numel():
                    ops.append(dist.P2POp(dist.irecv, buf, src, tag=tag + n))
                recvs.append((buf, d_sl, shape))
            elif src == me:
                piece = x if s_sl is None else x[s_sl]
                if piece.numel():
                    ops.append(dist.P2POp(dist.isend, pp.as_bytes(piece), dst, tag=tag + n))
        waits = []
        if ops:
            self.sends = [w for w in self.sends if not w.is_completed()]
            works = dist.batch_isend_irecv(ops)
            if len(works) == len(ops):  # one per op (gloo)
                for op, w in zip(ops, works):
                    (self.sends if op.op is dist.isend else waits).append(w)
            else:  # coalesced (NCCL): the block waits for the whole batch
                (waits if any(op.op is dist.irecv for op in ops) else self.sends).extend(works)
        incoming = _Incoming(waits, recvs, out, after.dtype)
        return incoming if waits else incoming.finish()


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


def failure(rec, exc: BaseException) -> tuple:
    """(op number or None, record kind, the exception in one line, its traceback): what the controller
    needs to name the op a record belonged to (it knows what op #seq was)."""
    seq = rec[1] if rec[0] in _NUMBERED else None
    kind = rec[0] if seq is not None or len(rec) < 3 else f"{rec[0]} {rec[2]!r}"
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return seq, kind, text, traceback.format_exc()


def _run_p2p(ops) -> None:
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _watch(store: dist.TCPStore, worker: Worker, parent_pid: int | None) -> None:
    """Exit when the controller (its store or its process) goes away, even mid-collective."""
    s = store.clone()
    while True:
        try:
            s.add(f"hb/{worker.rank}", 1)
            if s.check(["abort"]):
                os._exit(1)
            if not worker.stopping and s.check(["stop"]):
                worker.stopping = True
        except Exception:  # noqa: BLE001
            # the store is gone: after the exit record that is the controller finishing (exit quietly,
            # so a launcher has nothing to report), before it the controller died
            if not worker.leaving:
                _orphaned(worker)
            os._exit(0 if worker.leaving else 1)
        if parent_pid and os.getppid() != parent_pid:
            _orphaned(worker)
            os._exit(1)
        time.sleep(0.5)


def _orphaned(worker: Worker) -> None:
    """The controller died (killed: it could not clean up): remove its shared-memory directory."""
    if worker.shm:
        shutil.rmtree(worker.shm, ignore_errors=True)


def run_worker(address: str, rank: int, device_index: int, parent_pid: int | None, connect_timeout: float) -> None:
    faulthandler.enable()  # a crash in native code leaves its Python stack in the worker's log
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the controller, which stops us
    store = connect(address, connect_timeout)
    w = Worker(store, rank, device_index, parent_pid)
    threading.Thread(target=_watch, args=(store, w, parent_pid), daemon=True).start()
    w.join()
    store.set_timeout(datetime.timedelta(seconds=30))
    w.loop()


# -- launcher: the workers of one node ----------------------------------------------------------------


def parse_ranks(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise ValueError(f"--ranks {text!r} must name distinct non-negative ranks, e.g. 0-3 or 0,2,4")
    return out


def worker_command(address: str, rank: int, device_index: int, parent_pid: int, connect_timeout: float) -> list[str]:
    return [sys.executable, "-m", "dtorch.runtime.worker", "--controller", address, "--rank", str(rank),
            "--device-index", str(device_index), "--parent-pid", str(parent_pid),
            "--connect-timeout", str(connect_timeout)]


def worker_env(threads: int) -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # idle queue waits time out; that is not news
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def launch(address: str, ranks: list[int], devices: list[int] | None, connect_timeout: float) -> int:
    """Start one worker per rank on this node; report the ones that die; return when all have exited."""
    devices = devices or list(range(len(ranks)))
    env = worker_env(max(1, (os.cpu_count() or 1) // len(ranks)))
    procs = {r: subprocess.Popen(worker_command(address, r, d, os.getpid(), connect_timeout), env=env)
             for r, d in zip(ranks, devices)}

    def stop(*_):
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        sys.exit(130)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    store = None
    worst = 0
    live = dict(procs)
    while live:
        time.sleep(0.2)
        for r, p in list(live.items()):
            rc = p.poll()
            if rc is None:
                continue
            del live[r]
            if rc != 0:
                worst = worst or rc
                if not _listening(address):
                    continue  # the controller is gone: nobody to tell (and c10d would print a stack trying)
                try:
                    store = store or connect(address, 5)
                    if not store.check([f"bye/{r}"]):
                        store.set(f"dead/{r}", f"exit code {rc}")
                        store.add("nfault", 1)
                except Exception:  # noqa: BLE001  (the controller is gone: nobody to tell)
                    pass
    return 0 if worst == 0 else 1


def torchrun_identity(env, controller: str | None) -> tuple[str, int, int, int]:
    """(controller address, rank, local rank, world size) from torchrun's environment."""
    missing = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise ValueError(f"--torchrun needs torchrun's {', '.join(missing)} in the environment; start it as "
                         "`torchrun ... -m dtorch.runtime.worker --torchrun`, or use --ranks without torchrun")
    try:
        rank, local, world = (int(env[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    except ValueError:
        raise ValueError("RANK, LOCAL_RANK and WORLD_SIZE must be integers (as torchrun sets them)") from None
    if controller is None:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ValueError("give --controller HOST:PORT (MASTER_ADDR/MASTER_PORT are not set to derive it from)")
        # torchrun's own store holds MASTER_PORT on the first node: the controller listens next to it
        controller = f"{env['MASTER_ADDR']}:{int(env['MASTER_PORT']) + 1}"
    return controller, rank, local, world


def run_torchrun_worker(address: str, rank: int, local: int, world: int, connect_timeout: float) -> int:
    """One worker torchrun started: its rank is the device id, LOCAL_RANK its CUDA device. The world
    torchrun made must be the one the controller waits for, else no process group could form."""
    store = connect(address, connect_timeout)
    cfg = pickle.loads(store.get("cfg"))
    if cfg["world"] != world:
        msg = (f"torchrun started WORLD_SIZE={world} workers but the controller at {address} waits for "
               f"{cfg['world']}; set DTORCH_PROCESS_WORKERS={world} for the controller (or change --nnodes/"
               "--nproc-per-node)")
        print(f"dtorch worker (rank {rank}): {msg}", file=sys.stderr, flush=True)
        if rank == 0:  # one report is enough: the controller raises it instead of waiting for its timeout
            store.set("dead/0", msg)
            store.add("nfault", 1)
        return 2
    del store
    # torchrun's agent is the parent: a worker whose agent is gone exits (as under `dtorch worker`)
    run_worker(address, rank, local, os.getppid(), connect_timeout)
    return 0


def _listening(address: str) -> bool:
    """Does anything accept connections at HOST:PORT? (a plain socket: no c10d retries or logs)"""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dtorch worker",
                                 description="start process-backend workers and join a controller")
    ap.add_argument("--controller", help="HOST:PORT of the controller's store (DTORCH_PROCESS_LISTEN); under "
                    "--torchrun the default is MASTER_ADDR:MASTER_PORT+1")
    ap.add_argument("--torchrun", action="store_true",
                    help="this process is one worker started by torchrun: rank RANK, CUDA device LOCAL_RANK")
    ap.add_argument("--ranks", help="the ranks (device ids) this node runs, e.g. 0-3 or 4,5")
    ap.add_argument("--devices", help="local CUDA device index of each rank (default: 0, 1, ... in --ranks order)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--device-index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to wait for the controller")
    args = ap.parse_args(argv)
    if args.torchrun:
        try:
            address, rank, local, world = torchrun_identity(os.environ, args.controller)
        except ValueError as exc:
            ap.error(str(exc))
        return run_torchrun_worker(address, rank, local, world, args.connect_timeout)
    if not args.controller:
        ap.error("give --controller HOST:PORT (where the controller listens: DTORCH_PROCESS_LISTEN)")
    if args.rank is not None:
        run_worker(args.controller, args.rank, args.device_index, args.parent_pid, args.connect_timeout)
        return 0
    if not args.ranks:
        ap.error("give --ranks (e.g. --ranks 0-3)")
    ranks = parse_ranks(args.ranks)
    devices = parse_ranks(args.devices) if args.devices else None
    if devices is not None and len(devices) != len(ranks):
        ap.error(f"--devices names {len(devices)} devices for {len(ranks)} ranks; give one per rank")
    return launch(args.controller, ranks, devices, args.connect_timeout)


if __name__ == "__main__":
    sys.exit(main())
