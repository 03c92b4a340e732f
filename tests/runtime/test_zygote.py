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
