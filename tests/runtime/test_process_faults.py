"""Faults and lifetimes of the process backend: dead workers, failing ops, controllers that go away,
and workers launched separately (the several-node setup, on loopback).

Every subprocess runs under a timeout and every test ends with "no process left behind" checks.

    .venv/bin/pytest -q tests/runtime/test_process_faults.py
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Replicate, Shard
from dtorch.errors import OpError, RuntimeBackendError
from dtorch.runtime.kernels import get_kernel
from dtorch.runtime.process import WorkerError
from dtorch.runtime.process_pool import Pool

from . import process_kernels
from .conftest import process_graph, using

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# subprocesses import this checkout's dtorch (and tests.*), not whichever one the environment installed
PYTHONPATH = os.pathsep.join([os.path.join(REPO, "src"), REPO])
PAIR = DeviceMesh("cpu", [0, 1], mesh_dim_names=["a"])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 10.0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def worker_pids(graph) -> list[int]:
    return [p.pid for p in graph.runtime._pool.procs.values()]


def queue_sleeps(graph, x, n: int, seconds: float):
    for _ in range(n):
        x = process_kernels.run(graph, get_kernel("test_sleep"), x, seconds=seconds)
    return x


# -- in this process ----------------------------------------------------------------------------


def test_killed_worker_raises_quickly_and_stops_the_others():
    g = process_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(8.0), device_mesh=PAIR, placements=[Shard(0)])
            y = queue_sleeps(g, x, 10, 0.1).redistribute(PAIR, [Replicate()])  # the gather waits on worker 1
            g.runtime.flush()
            pids = worker_pids(g)
            time.sleep(0.3)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(WorkerError, match=rf"worker 1 \(device id 1, pid {pids[1]}\) died: killed by signal SIGKILL") as err:
                y.to_torch()
            assert time.monotonic() - t0 < 15
            assert "workers were stopped" in str(err.value)
            assert wait_gone(pids, 5) == []
            # the lost tensor says so; new work starts new workers
            with pytest.raises(RuntimeBackendError, match="blocks are gone"):
                x.to_torch()
            z = dtorch.Tensor(torch.arange(4.0), device_mesh=PAIR, placements=[Shard(0)])
            assert torch.equal((z * 2).to_torch(), torch.arange(4.0) * 2)
            assert set(worker_pids(g)).isdisjoint(pids)
    finally:
        g.runtime.shutdown()


def test_worker_killed_during_a_sync_is_named_and_the_next_sync_works():
    """``sync`` blocks on the store (``Pool.wait_key``); a worker that dies meanwhile never sets the key."""
    g = process_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(8.0), device_mesh=PAIR, placements=[Shard(0)])
            queue_sleeps(g, x, 20, 0.1)
            pids = worker_pids(g)
            killer = threading.Timer(0.5, os.kill, (pids[0], signal.SIGKILL))
            killer.start()
            t0 = time.monotonic()
            with pytest.raises(WorkerError, match=rf"worker 0 \(device id 0, pid {pids[0]}\) died"):
                g.sync()
            assert time.monotonic() - t0 < 5
            killer.join()
            assert wait_gone(pids, 5) == []
            z = dtorch.Tensor(torch.arange(4.0), device_mesh=PAIR, placements=[Shard(0)])
            y = z * 2
            g.sync()  # a new pool: its own waiter
            assert torch.equal(y.to_torch(), torch.arange(4.0) * 2)
    finally:
        g.runtime.shutdown()


def test_sync_sleeps_until_the_workers_finish(monkeypatch):
    """While the workers work, the controller wakes only for the health checks (every 50 ms): polling the
    store every 2 ms took cores from the workers (docs/benchmarks.md, "Process backend")."""
    g = process_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(8.0), device_mesh=PAIR, placements=[Shard(0)])
            x.to_torch()
            wakes = []
            check = Pool.check
            monkeypatch.setattr(Pool, "check", lambda self, *a, **k: (wakes.append(1), check(self, *a, **k))[1])
            y = queue_sleeps(g, x, 1, 1.0)
            t0 = time.monotonic()
            g.sync()
            took = time.monotonic() - t0
            assert took >= 0.9
            assert len(wakes) <= took / 0.05 * 1.5 + 3, f"{len(wakes)} wake-ups in {took:.2f} s"
            assert torch.equal(y.to_torch(), torch.arange(8.0))
    finally:
        g.runtime.shutdown()


def test_stopped_worker_is_named_within_the_heartbeat_timeout(monkeypatch):
    """A worker that stops answering (SIGSTOP) is named after the heartbeat timeout, not after the
    300 s wait timeout; the others are stopped too. Busy and idle workers are not mistaken for hung."""
    g = process_graph(workers=2, heartbeat_timeout_s=1.5)
    pids: list = []
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(8.0), device_mesh=PAIR, placements=[Shard(0)])
            pids = worker_pids(g)
            # worker 1 sleeps in a kernel for twice the timeout while worker 0 idles in its queue wait
            one = DeviceMesh("cpu", [1])
            slow = queue_sleeps(g, dtorch.Tensor(torch.arange(3.0), device_mesh=one), 1, 3.0)
            assert torch.equal(slow.to_torch(), torch.arange(3.0))
            y = x.redistribute(PAIR, [Replicate()])  # the gather needs worker 1
            os.kill(pids[1], signal.SIGSTOP)
            t0 = time.monotonic()
            hung = rf"worker 1 \(device id 1, pid {pids[1]}\) stopped answering: no heartbeat for 1.5 s"
            with pytest.raises(WorkerError, match=hung) as err:
                y.to_torch()
            assert time.monotonic() - t0 < 10
            assert "DTORCH_PROCESS_HEARTBEAT_TIMEOUT" in str(err.value) and "workers were stopped" in str(err.value)
            assert g.runtime._pool is None and wait_gone(pids, 5) == []
    finally:
        for pid in pids:  # the stopped worker, should the test fail before the backend killed it
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
        g.runtime.shutdown()
    monkeypatch.setenv("DTORCH_PROCESS_HEARTBEAT_TIMEOUT", "0.2")
    with pytest.raises(ValueError, match=r"DTORCH_PROCESS_HEARTBEAT_TIMEOUT='0.2' must be .* >= 1"):
        dtorch.Graph(backend="process")


def test_exception_in_a_worker_names_the_op():
    g = process_graph(workers=2)
    try:
        with using(g):
            ints = dtorch.Tensor(torch.arange(6), device_mesh=PAIR, placements=[Shard(0)])
            bad = ints // 0  # passes every check on the controller; fails on the workers' data
            pids = worker_pids(g)
            with pytest.raises(WorkerError, match=r"torch\.floor_divide") as err:
                bad.to_torch()
            assert "ZeroDivisionError" in str(err.value) and "kernel pointwise" in str(err.value)
            assert g.runtime._pool is None and wait_gone(pids, 5) == []

            x = dtorch.Tensor(torch.ones(4), device_mesh=PAIR, placements=[Shard(0)])
            y = process_kernels.run(g, get_kernel("test_raise"), x, message="bad shapes in my kernel")
            with pytest.raises(WorkerError, match=r"kernel test_raise\(message='bad shapes in my kernel'\)"):
                g.sync()
    finally:
        g.runtime.shutdown()
    # the in-process backend raises at the op itself, naming it too
    with pytest.raises(OpError, match="floor_divide"):
        dtorch.Tensor(torch.arange(6), device_mesh=PAIR, placements=[Shard(0)]) // 0


def test_sync_mode_raises_at_the_failing_op(monkeypatch):
    monkeypatch.setenv("DTORCH_PROCESS_SYNC", "1")
    g = process_graph(workers=2)
    try:
        with using(g):
            ints = dtorch.Tensor(torch.arange(6), device_mesh=PAIR, placements=[Shard(0)])
            with pytest.raises(WorkerError, match=r"torch\.floor_divide"):
                ints // 0
    finally:
        g.runtime.shutdown()


def test_unpicklable_kernel_arguments_are_named():
    g = process_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.ones(4), device_mesh=PAIR, placements=[Shard(0)])
            with pytest.raises(RuntimeBackendError, match=r"cannot send kernel test_sleep.*must be picklable"):
                process_kernels.run(g, get_kernel("test_sleep"), x, seconds=lambda: 0)
                g.sync()
    finally:
        g.runtime.shutdown()


# -- controllers in subprocesses ---------------------------------------------------------------------

CONTROLLER = """
import json, os, sys, time, torch, dtorch
from dtorch import DeviceMesh, Shard, Replicate
from dtorch.runtime.kernels import get_kernel
from tests.runtime import process_kernels
g = dtorch.default_graph()
assert g.backend == "process", g.backend
mesh = DeviceMesh("cpu", [0, 1])
x = dtorch.Tensor(torch.arange(6.0), device_mesh=mesh, placements=[Shard(0)])
assert torch.equal(x.redistribute(mesh, [Replicate()]).to_torch(), torch.arange(6.0))
zygote = g.runtime.transport.zygote  # (forks the workers: it must not outlive the controller either)
server = g.runtime._pool.server  # (the store server the zygote forked: nor this)
print(json.dumps([p.pid for p in g.runtime._pool.procs.values()] + ([zygote.pid] if zygote else [])
                 + ([server.pid] if server else [])), flush=True)
"""


def run_controller(tmp_path, body: str, env=None):
    script = tmp_path / "controller.py"
    script.write_text(textwrap.dedent(CONTROLLER) + textwrap.dedent(body))
    # TMPDIR: a controller killed outright cannot remove its workers' log directory
    full_env = dict(os.environ, DTORCH_BACKEND="process", PYTHONPATH=PYTHONPATH, TMPDIR=str(tmp_path), **(env or {}))
    return subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def read_pids(proc) -> list[int]:
    line = proc.stdout.readline()
    assert line, f"controller printed nothing; stderr:\n{proc.stderr.read()}"
    return json.loads(line)


def test_normal_exit_stops_workers_cleanly(tmp_path):
    ctl = run_controller(tmp_path, "y = x * 3  # left queued: exit must not wait for it to matter\n")
    try:
        pids = read_pids(ctl)
        out, err = ctl.communicate(timeout=60)
    finally:
        ctl.kill()
    assert ctl.returncode == 0, err
    assert "terminate called" not in err and "Traceback" not in err, err
    assert wait_gone(pids, 5) == []


# (a controller and its workers in fresh interpreters: ~10-20 s each on 2 shared cores; the default run keeps
# SIGKILL, -m slow (CI) adds Ctrl-C)
@pytest.mark.parametrize("how", [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGKILL", "Ctrl-C"])
def test_workers_do_not_survive_the_controller(tmp_path, how):
    body = """
    y = x
    for _ in range(100):
        y = process_kernels.run(g, get_kernel("test_sleep"), y, seconds=0.2)
    print("waiting", flush=True)
    y.to_torch()  # 20 s of work: interrupted
    """
    ctl = run_controller(tmp_path, body)
    try:
        pids = read_pids(ctl)
        assert ctl.stdout.readline().strip() == "waiting"
        time.sleep(0.5)
        ctl.send_signal(how)
        ctl.wait(timeout=30)
        assert wait_gone(pids, 10) == []
    finally:
        ctl.kill()
        ctl.communicate()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_node(address: str, ranks: str):
    return subprocess.Popen([sys.executable, "-m", "dtorch.cli", "worker", "--controller", address, "--ranks", ranks,
                             "--connect-timeout", "60"], cwd=REPO, env=dict(os.environ, PYTHONPATH=PYTHONPATH),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def external_pids(address: str, world: int) -> list[int]:
    host, port = address.split(":")
    store = torch.distributed.TCPStore(host, int(port), is_master=False)
    return [int(store.get(f"ready/0/{r}")) for r in range(world)]


SEPARATE = """
import torch, dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard
mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
full = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
ref = dtorch.Graph(backend="inprocess")
def run():
    x = dtorch.Tensor(full, device_mesh=mesh, placements=[Partial(), Shard(1)])
    y = (x.redistribute(mesh, [Shard(0), Replicate()]) * 2).redistribute(DeviceMesh("cpu", [3, 1]), [Shard(1)])
    return y.to_torch(), [b.clone() for b in y.local_blocks()]
got = run()
dtorch.Graph.set_default_graph(ref)
want = run()
assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
print("OK", flush=True)
"""


@pytest.mark.slow  # a controller and two launchers in fresh interpreters: ~30 s on 2 shared cores
def test_workers_launched_separately_join_the_controller(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    script = tmp_path / "separate.py"
    script.write_text(SEPARATE)
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, DTORCH_BACKEND="process", DTORCH_PROCESS_SPAWN="0",
               DTORCH_PROCESS_WORKERS="4", DTORCH_PROCESS_LISTEN=address)
    ctl = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    nodes = [launch_node(address, "0-1"), launch_node(address, "2-3")]
    try:
        out, err = ctl.communicate(timeout=120)
        assert ctl.returncode == 0 and out.strip() == "OK", err
        for n in nodes:
            n.wait(timeout=30)
            assert n.returncode == 0, n.stderr.read()
    finally:
        for p in [ctl] + nodes:
            p.kill()


@pytest.mark.slow  # a controller and a launcher in fresh interpreters: ~20 s on 2 shared cores
def test_launcher_reports_a_dead_worker(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    body = """
    import time
    from dtorch.runtime.process import WorkerError
    y = x
    for _ in range(100):
        y = process_kernels.run(g, get_kernel("test_sleep"), y, seconds=0.2)
    y = y.redistribute(mesh, [Replicate()])
    print("waiting", flush=True)
    t0 = time.monotonic()
    try:
        y.to_torch()
    except WorkerError as exc:
        print(json.dumps([time.monotonic() - t0, str(exc)]), flush=True)
    """
    # this controller spawns nothing: its pid list is empty, the launchers own the workers
    ctl = run_controller(tmp_path, body, env=dict(DTORCH_PROCESS_SPAWN="0", DTORCH_PROCESS_WORKERS="2",
                                                  DTORCH_PROCESS_LISTEN=address))
    node = launch_node(address, "0-1")
    try:
        assert read_pids(ctl) == []
        assert ctl.stdout.readline().strip() == "waiting"
        pids = external_pids(address, 2)
        os.kill(pids[1], signal.SIGKILL)
        elapsed, message = json.loads(ctl.stdout.readline())
        assert elapsed < 15 and f"worker 1 (device id 1, pid {pids[1]}) died: exit code -9" in message, message
        ctl.wait(timeout=30)
        node.wait(timeout=30)
        assert wait_gone(pids, 5) == []
    finally:
        for p in (ctl, node):
            p.kill()
            p.communicate()


def test_a_worker_failure_outside_any_numbered_op_is_described_by_its_record():
    """A worker's error on a record that carries no op number (seq None: a data connection it opened, its
    set-up) is named by the record's kind; it used to raise a TypeError while the fault message was built,
    hiding the worker's own error (the controller's op table holds a program run, as after a compiled step)."""
    from types import SimpleNamespace
    from dtorch.runtime.process import ProcessRuntime

    rt = SimpleNamespace(_ops={3: ("program", {0: ("kernel", "pointwise", {}, ())}, 4)})
    rt._program_what = lambda seq: ProcessRuntime._program_what(rt, seq)
    assert ProcessRuntime._describe(rt, None, "Pair") == "record Pair"
    assert ProcessRuntime._describe(rt, 9, "Run") == "record Run"  # (an op number the table no longer has)
