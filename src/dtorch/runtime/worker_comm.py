"""A worker's redistribution: the primitives (one handler each), moves between meshes, ring shifts, and
the collectives under them.

Collectives run over the process groups of mesh dims (gloo on CPU, NCCL on CUDA), except all_reduce and
all_gather among the workers of one host, which exchange blocks through shared-memory slots (``_Slots``)
and reduce in mesh order with the in-process backend's function (its bits). A move's sends are not waited
on and its receives only where the block is first read (``_Incoming`` in ``_Blocks``), so pipeline stages
overlap.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from . import process_plan as pp
from . import protocol as rec
from . import shm_barrier
from .blocks import cut_shard, reduce_dim, reduce_list
from .cow import writable
from .protocol import handles

_NATIVE_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                  "min": dist.ReduceOp.MIN}
# dtypes the native reductions take (bool and the rest: gather the terms and reduce them here)
_NATIVE = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
           torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8}
_HALF = (torch.float16, torch.bfloat16)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
SHM_COLLECTIVE_MAX = 32 << 20  # bytes per member up to which same-host all_reduce/all_gather go through /dev/shm


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


class _Posted:
    """A collective posted with ``async_op``: its block is ``then(blocks())`` once the work completed, where
    it is first read (``_Blocks``). ``overlapped`` counts the posts that kernels ran behind (statistics)."""

    __slots__ = ("worker", "works", "blocks", "then", "kernels")

    def __init__(self, worker, work, blocks):
        self.worker, self.works, self.blocks, self.then = worker, [work], blocks, None
        self.kernels = worker.kernels_run

    def finish(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        if self.worker.kernels_run > self.kernels:
            self.worker.calls["overlapped"] += 1  # kernels ran while it moved
        return self.then(self.blocks())


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



class Collectives:
    """The redistribution records and the collectives under them; mixed into ``Worker`` (which holds
    ``t``, ``defs``, ``groups``, ``slots``, ``sends``, ``calls``, ``rank``, ``shm`` and ``cfg``)."""

    @handles(rec.DefineStep)
    def on_define_step(self, r: rec.DefineStep):
        _, pid, primitive, before, after, arg = r
        self.defs[pid] = (getattr(self, "p_" + primitive), before, after, arg)

    @handles(rec.Step)
    def on_step(self, r: rec.Step):
        _, seq, pid, in_id, out_id, tag = r
        fn, before, after, arg = self.defs[pid]
        out = fn(self.t.get(in_id), before, after, arg, tag)
        if isinstance(out, (_Incoming, _Posted)):
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
        """Posted, not waited on, where torch.distributed moves it: the block completes where it is first
        read, so a gather issued ahead (FSDP's prefetch of the next layer) moves while the kernels queued
        before that read compute. (Shared-memory slots exchange at once: a copy, no wire to wait on.)"""
        coord, ranks, m, j = self.along(before.mesh, i)
        d = before.placements[i].dim
        return self.all_gather(x, pp.member_shapes(before, coord, i), ranks, then=lambda got: torch.cat(got, dim=d))

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

    @handles(rec.DefineMoveInto)
    def on_define_move_into(self, r: rec.DefineMoveInto):
        _, pid, pairs = r
        self.defs[pid] = tuple((before, after, pp.move_transfers(before, after)) for before, after in pairs)

    @handles(rec.MoveInto)
    def on_move_into(self, r: rec.MoveInto):
        """Write each source into its target's own block (``Runtime.move_into``): regions held here are
        copied, the others received (straight into the block where the region is contiguous) from the one
        rank ``move_transfers`` names, and what other ranks need from here is sent. Every send and receive
        of the batch is posted at once; each target waits in ``t.pending`` until it is first read."""
        _, seq, pid, ids, tag = r
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

    def all_gather(self, x, shapes, ranks, then=None):
        """Every member's block, in mesh order (gloo gathers equal sizes: pad to the largest, trim).

        ``then`` (a function of that list): its result, or a ``_Posted`` that computes it once the
        torch.distributed gather completes (waited where the block is first read)."""
        got = self._all_gather(x, shapes, ranks, then is not None)
        if isinstance(got, _Posted):
            got.then = then
            return got
        return got if then is None else then(got)

    def _all_gather(self, x, shapes, ranks, post: bool):
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
        work = dist.all_gather(outs, buf, group=self.group(ranks), async_op=post)
        pos = {r: n for n, r in enumerate(sorted(ranks))}

        def blocks():
            return [pp.from_bytes(outs[pos[r]][:n], x.dtype, s) for r, n, s in zip(ranks, sizes, shapes)]

        return _Posted(self, work, blocks) if post else blocks()

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

    @handles(rec.DefineRingShift)
    def on_define_ring_shift(self, r: rec.DefineRingShift):
        _, pid, spec, mesh_dim, shift = r
        self.defs[pid] = (spec, mesh_dim, shift)

    @handles(rec.RingShift)
    def on_ring_shift(self, r: rec.RingShift):
        _, seq, pid, in_id, out_id, tag = r
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



def _run_p2p(ops) -> None:
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()

