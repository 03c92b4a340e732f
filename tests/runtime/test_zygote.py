"""The zygote (runtime/zygote.py): workers on the controller's host are forks of one pre-imported process,
which a recovery reuses and which never outlives the controller (test_process_faults checks the latter with
the controller killed outright: its pid list includes the zygote's)."""
from __future__ import annotations

import os
import signal

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Replicate, Shard
from dtorch.runtime.kernels import get_kernel
from dtorch.runtime.process import WorkerError
from dtorch.runtime.zygote import zygote_enabled

from . import process_kernels
from .conftest import process_graph, using
from .test_process_faults import wait_gone

PAIR = DeviceMesh("cpu", [0, 1])


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[-1].split()[1])


def listener(port: int) -> str | None:
    """The inode of the socket listening on ``port`` (IPv4 or IPv6), from /proc/net."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rpartition(":")[2], 16) == port:  # (state 0A: LISTEN)
                    return cols[9]
    return None


def open_files(pid: int) -> set:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # (closed meanwhile: the listing's own descriptor)
            pass
    return out


def test_workers_are_forks_of_one_zygote_that_a_restart_reuses_and_shutdown_ends():
    g = process_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(6.0), device_mesh=PAIR, placements=[Shard(0)])
            assert torch.equal(x.redistribute(PAIR, [Replicate()]).to_torch(), torch.arange(6.0))
            zygote = g.runtime.transport.zygote.pid
            pids = list(g.runtime.worker_pids().values())
            assert [parent(p) for p in pids] == [zygote, zygote]
            os.kill(pids[1], signal.SIGKILL)  # its exit status reaches the controller through the zygote
            with pytest.raises(WorkerError, match=rf"pid {pids[1]}\) died: killed by signal SIGKILL"):
                (x * 2).to_torch()
            assert wait_gone(pids) == []
            y = dtorch.Tensor(torch.arange(4.0), device_mesh=PAIR, placements=[Shard(0)])  # new workers
            assert torch.equal((y * 2).to_torch(), torch.arange(4.0) * 2)
            again = list(g.runtime.worker_pids().values())
            assert g.runtime.transport.zygote.pid == zygote and [parent(p) for p in again] == [zygote, zygote]
    finally:
        g.runtime.shutdown()
    assert wait_gone(again + [zygote]) == []


def test_the_store_is_served_by_a_fork_of_the_zygote_not_by_the_controller():
    g = process_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(6.0), device_mesh=PAIR, placements=[Shard(0)])
            assert torch.equal((x + 1).to_torch(), torch.arange(6.0) + 1)
            pool = g.runtime._pool
            server, zygote = pool.server.pid, g.runtime.transport.zygote.pid
            assert parent(server) == zygote
            port = int(pool.address.rpartition(":")[2])
            inode = listener(port)
            assert inode is not None, f"nothing listens on port {port}"
            mine, his = open_files(os.getpid()), open_files(server)
            assert f"socket:[{inode}]" in his and f"socket:[{inode}]" not in mine  # the listener is the server's
            # a recovery (the workers replaced) gets a new pool and a new server; the old one is gone
            os.kill(g.runtime.worker_pids()[1], signal.SIGKILL)
            with pytest.raises(WorkerError):
                (x * 2).to_torch()
            assert wait_gone([server]) == []
            y = dtorch.Tensor(torch.arange(4.0), device_mesh=PAIR, placements=[Shard(0)])
            assert torch.equal((y * 2).to_torch(), torch.arange(4.0) * 2)
            again = g.runtime._pool.server.pid
            assert again != server and parent(again) == zygote
    finally:
        g.runtime.shutdown()
    assert wait_gone([again, zygote]) == []


def test_a_dead_store_server_is_a_worker_fault_naming_it():
    g = process_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(6.0), device_mesh=PAIR, placements=[Shard(0)])
            (x + 1).to_torch()
            server = g.runtime._pool.server.pid
            workers = list(g.runtime.worker_pids().values())
            os.kill(server, signal.SIGKILL)
            assert wait_gone([server]) == []
            with pytest.raises(WorkerError, match=rf"store server \(pid {server}\) exited"):
                g.runtime.sync()
            assert wait_gone(workers) == []
            y = dtorch.Tensor(torch.arange(4.0), device_mesh=PAIR, placements=[Shard(0)])  # a fresh pool
            assert torch.equal((y * 2).to_torch(), torch.arange(4.0) * 2)
    finally:
        g.runtime.shutdown()


def test_a_forked_worker_sets_its_own_thread_count():
    # the zygote loaded OpenMP with one thread; a worker alone on this host gets every core (as a spawned one)
    g = process_graph(workers=1)
    one = DeviceMesh("cpu", [0])
    try:
        with using(g):
            x = dtorch.Tensor(torch.zeros(3), device_mesh=one, placements=[Replicate()])
            got = process_kernels.run(g, get_kernel("test_num_threads"), x).to_torch()
    finally:
        g.runtime.shutdown()
    want = int(os.environ.get("OMP_NUM_THREADS") or max(1, os.cpu_count() or 1))
    assert got.tolist() == [want] * 3


def test_zygote_off_spawns_each_worker(monkeypatch):
    monkeypatch.setenv("DTORCH_PROCESS_ZYGOTE", "0")
    g = process_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(6.0), device_mesh=PAIR, placements=[Shard(0)])
            assert torch.equal((x + 1).to_torch(), torch.arange(6.0) + 1)
            assert g.runtime.transport.zygote is None
            assert [parent(p) for p in g.runtime.worker_pids().values()] == [os.getpid()] * 2
    finally:
        g.runtime.shutdown()


def test_a_bad_setting_says_what_to_write(monkeypatch):
    monkeypatch.setenv("DTORCH_PROCESS_ZYGOTE", "maybe")
    with pytest.raises(ValueError, match="DTORCH_PROCESS_ZYGOTE='maybe' must be 1 .* or 0"):
        zygote_enabled()
