"""The process backend's data plane: large blocks to and from workers on this host travel as files in a
shared-memory directory; to workers elsewhere (``DTORCH_PROCESS_SHM=0`` here) and where /dev/shm has no
room, through a gloo group of two per worker (torch.distributed send/recv); the store carries only control
records. Values equal torch's (uneven shapes, shards and replicas), nothing is left in /dev/shm after use,
shutdown or a worker killed in the middle of a 256 MB transfer.

    .venv/bin/pytest -q tests/runtime/test_process_dataplane.py
"""
from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Replicate, Shard
from dtorch.runtime import process_plan as pp
from dtorch.runtime.process import INLINE_BYTES, WorkerError

from .conftest import process_graph, using
from .test_process_faults import read_pids, run_controller, wait_gone, worker_pids

TRIO = DeviceMesh("cpu", [0, 1, 2], mesh_dim_names=["a"])
PAIR = DeviceMesh("cpu", [0, 1], mesh_dim_names=["a"])


def shm_files() -> list:
    """Everything this controller left in /dev/shm (its pools' directories and their files)."""
    return glob.glob(os.path.join(pp.SHM_ROOT, f"dtorch-{os.getpid()}-*"))


pytestmark = pytest.mark.skipif(not os.path.isdir(pp.SHM_ROOT),
                                reason="no /dev/shm on this machine: the store path is the only one")


@pytest.fixture(scope="module")
def trio():
    g = process_graph(workers=3)
    yield g
    g.runtime.shutdown()


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]])
def test_large_blocks_go_through_shared_memory_and_equal_torch(trio, placements):
    # 7 rows over 3 workers: uneven shards, each block well over the inline limit
    x = torch.randn(7, 3 * INLINE_BYTES // 4 + 13)
    with using(trio):
        rt = trio.runtime
        before = dict(rt.stats)
        d = dtorch.Tensor(x, device_mesh=TRIO, placements=placements)
        y = (d * 2).to_torch()
        assert torch.equal(y, x * 2)
        assert torch.equal(d.to_torch(), x)
        moved = rt.stats["bytes_shm"] - before["bytes_shm"]
        assert moved >= 3 * x.numel() * 4  # placed once, fetched twice
        # the store carried control only
        assert rt.stats["bytes_put"] == before["bytes_put"]
        assert rt.stats["bytes_fetched"] == before["bytes_fetched"]
        assert rt.stats["bytes_pushed"] - before["bytes_pushed"] < 64 << 10
        rt.sync()
        # every file was taken and unlinked: only the pool's directory and its token remain
        assert sorted(os.listdir(rt._pool.shm[0])) == ["lock", "token"]


def test_in_place_writes_stay_private(trio):
    """A replicated block is one file mapped by every worker: an in-place write must not reach another
    tensor placed from the same values (the mappings are private)."""
    x = torch.randn(5, INLINE_BYTES // 4 + 3)
    with using(trio):
        d = dtorch.Tensor(x, device_mesh=TRIO, placements=[Replicate()])
        s = dtorch.Tensor(x, device_mesh=TRIO, placements=[Replicate()])
        s.add_(1.0)
        assert torch.equal(s.to_torch(), x + 1)
        assert torch.equal(d.to_torch(), x)
        part = dtorch.Tensor(x, device_mesh=TRIO, placements=[Replicate()]).redistribute(TRIO, [Shard(0)])
        assert torch.equal(part.to_torch(), x)


@pytest.mark.parametrize("placements", [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Replicate(), Shard(0)],
                                        [Shard(0), Shard(0)], [Shard(1), Replicate()]])
def test_contiguous_offsets_locate_the_blocks(placements):
    """A fetch writes straight into the global value's file where a block is one contiguous run of it:
    the offset must be where torch has the block's values (2x3 mesh, 7x5 and 1x11 values: uneven)."""
    from dtorch.runtime.blocks import cut_global
    from dtorch.spec import DTensorSpec

    mesh = DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]])
    for shape in ((7, 5), (1, 11), (7,)):
        if len(shape) == 1 and any(p.is_shard() and p.dim == 1 for p in placements):
            continue
        x = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
        spec = DTensorSpec(mesh, tuple(placements), shape, x.dtype)
        flat = x.reshape(-1)
        rows_only = all(not p.is_shard() or p.dim == 0 for p in placements) or shape[0] == 1
        for coord, block in zip(mesh.coordinates(), cut_global(x, spec)):
            off = pp.contiguous_offset(spec, coord)
            if off is None:  # a block of several rows cut along columns: fetched as a block and assembled
                assert not rows_only, (shape, placements, coord)
                continue
            n = block.numel()
            assert torch.equal(flat[off // 4: off // 4 + n], block.reshape(-1)), (shape, placements, coord)


def test_torch_distributed_path_gives_the_same_values(trio):
    """The path of workers on other hosts: blocks through each worker's gloo pair with the controller."""
    x = torch.randn(7, INLINE_BYTES // 4 + 5, dtype=torch.float64)
    with using(trio):
        rt = trio.runtime
        rt.transport.shm = False
        try:
            before = dict(rt.stats)
            d = dtorch.Tensor(x, device_mesh=TRIO, placements=[Shard(0)])
            assert torch.equal((d + 1).to_torch(), x + 1)
            assert rt.stats["bytes_shm"] == before["bytes_shm"]
            assert rt.stats["bytes_put"] > before["bytes_put"] and rt.stats["bytes_fetched"] > before["bytes_fetched"]
        finally:
            rt.transport.shm = True


def test_workers_that_see_dev_shm_open_their_pair_when_a_block_first_needs_it():
    """No gloo pair (nor the gloo loop thread that wakes 100 times a second) while /dev/shm carries the blocks;
    a fetch through torch.distributed opens one from the worker's side, a placement from the controller's."""
    g = process_graph(workers=2)
    try:
        with using(g):
            rt = g.runtime
            x = torch.randn(5, INLINE_BYTES // 4 + 7)
            d = dtorch.Tensor(x, device_mesh=PAIR, placements=[Shard(0)])
            on0 = dtorch.Tensor(x, device_mesh=DeviceMesh("cpu", [0]), placements=[Replicate()])
            assert torch.equal(d.to_torch(), x)
            assert rt.transport.pairs == {} and rt.transport.pair_device is None
            rt.transport.shm = False
            before = dict(rt.stats)
            assert torch.equal(on0.to_torch(), x)  # worker 0 opens its pair to send
            assert sorted(rt.transport.pairs) == [0]
            assert rt.stats["bytes_fetched"] - before["bytes_fetched"] == x.numel() * 4
            on1 = dtorch.Tensor(x + 1, device_mesh=DeviceMesh("cpu", [1]), placements=[Replicate()])  # we open 1's
            assert sorted(rt.transport.pairs) == [0, 1]
            assert rt.stats["bytes_put"] - before["bytes_put"] == x.numel() * 4
            assert torch.equal(on1.to_torch(), x + 1)
            assert torch.equal((d * 2).to_torch(), x * 2)
            assert rt.stats["bytes_shm"] == before["bytes_shm"]
    finally:
        g.runtime.shutdown()


def test_a_full_dev_shm_falls_back_to_torch_distributed(trio, monkeypatch):
    """A block that does not fit in /dev/shm (a container's is often 64 MB) is placed through the pair."""
    def full(path, t):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pp, "shm_write", full)
    x = torch.randn(7, INLINE_BYTES // 4 + 9)
    with using(trio):
        rt = trio.runtime
        before = dict(rt.stats)
        d = dtorch.Tensor(x, device_mesh=TRIO, placements=[Shard(0)])
        assert torch.equal((d - 1).to_torch(), x - 1)
        assert rt.stats["bytes_put"] > before["bytes_put"]
        rt.sync()
        assert sorted(os.listdir(rt._pool.shm[0])) == ["lock", "token"]  # the partial file is gone


def test_shutdown_removes_the_shared_memory_directory():
    g = process_graph(workers=2)
    try:
        with using(g):
            d = dtorch.Tensor(torch.randn(3, INLINE_BYTES), device_mesh=PAIR, placements=[Shard(0)])
            d.to_torch()
            path = g.runtime._pool.shm[0]
            assert os.path.isdir(path)
    finally:
        g.runtime.shutdown()
    assert not os.path.exists(path)


OWNER = textwrap.dedent("""
    import sys, time
    from dtorch.runtime import process_plan as pp
    path, _ = pp.shm_dir()
    open(path + "/o-1", "wb").write(bytes(1 << 20))  # a block in flight
    print(path, flush=True)
    time.sleep(120)
""")


def test_a_directory_whose_owner_was_killed_is_swept_by_the_next_pool(tmp_path):
    """A controller killed outright (SIGKILL, the OOM killer) with its workers or Ray actors cannot remove
    its directory; the next pool on the host does, and leaves the directories of live owners alone."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owners = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        dead, live = (p.stdout.readline().strip() for p in owners)
        assert os.path.isfile(os.path.join(dead, "o-1")) and os.path.isdir(live)
        owners[0].kill()
        owners[0].wait(timeout=30)
        assert os.path.isdir(dead)  # nobody removed it
        mine = pp.shm_dir()
        try:
            assert not os.path.exists(dead)
            assert os.path.isdir(live)
            assert pp.shm_sweep() == []  # nor are a live pool's own directories swept
            assert os.path.isdir(mine[0])
        finally:
            pp.shm_drop(mine)
        assert not os.path.exists(mine[0])
    finally:
        for p in owners:
            p.kill()
            p.wait(timeout=30)
    pp.shm_sweep()
    assert not os.path.exists(live)


def writing(shm: str) -> bool:
    """Has a worker started writing its block into the file of a fetched value?"""
    for n in os.listdir(shm):
        try:
            if n.startswith("o-") and os.stat(os.path.join(shm, n)).st_blocks:
                return True
        except FileNotFoundError:
            pass
    return False


def signal_mid_fetch(path: str, shm: str, pid: int, sig) -> None:
    """Send ``sig`` to worker ``pid`` once the workers write the value being fetched (into its file in
    ``shm``; or, on the torch.distributed path, shortly after the fetch began: a send to the controller)."""
    if path == "shm":
        deadline = time.monotonic() + 20
        while not writing(shm) and time.monotonic() < deadline:
            time.sleep(0.001)
    else:
        time.sleep(0.05)
    os.kill(pid, sig)


@contextlib.contextmanager
def fetch_under_way(path: str, **graph_kw):
    """A Graph of 2 workers on data path ``path`` ("shm" or "torch.distributed": the workers' gloo pairs, the
    path of workers on other hosts) with a fetch of 256 MB just begun: yields (graph, future, worker pids,
    its /dev/shm directory, the other pools' /dev/shm directories). Afterwards the graph is shut down and
    none of its /dev/shm files is left."""
    others = set(shm_files())  # other tests' pools, still running
    g = process_graph(workers=2, **graph_kw)
    g.runtime.transport.shm = path == "shm"
    pids: list = []
    try:
        with using(g):
            d = dtorch.Tensor(torch.randn(64 << 20), device_mesh=PAIR, placements=[Shard(0)])  # 256 MB float32
            g.runtime.sync()
            pids = worker_pids(g)
            yield g, d.to_torch_async(), pids, g.runtime._pool.shm[0], others
    finally:
        for pid in pids:  # a stopped worker, should the test fail before the backend killed it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        g.runtime.shutdown()
    assert set(shm_files()) == others


# the default run takes the shared-memory path of each 256 MB fault; -m slow (CI) adds the gloo path
GLOO_SLOW = ["shm", pytest.param("torch.distributed", marks=pytest.mark.slow)]


@pytest.mark.parametrize("path", GLOO_SLOW)
def test_worker_killed_during_a_256mb_transfer(path):
    """Fetch and place of 256 MB with a worker SIGKILLed mid-way, through shared memory or through the
    workers' gloo pairs: the dead worker is named within 5 s, no worker process and no /dev/shm file is
    left, and the next tensor works on new workers."""
    with fetch_under_way(path) as (g, fut, pids, shm, others):
        signal_mid_fetch(path, shm, pids[1], signal.SIGKILL)  # once the workers write their 128 MB
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"worker 1 \(device id 1, pid {pids[1]}\) died: killed by signal SIGKILL"):
            fut.get()
        assert time.monotonic() - t0 < 5
        assert wait_gone(pids, 5) == [] and set(shm_files()) == others

        # place: kill worker 0 while the workers take the 256 MB just written (or sent)
        d = dtorch.Tensor(torch.randn(64 << 20), device_mesh=PAIR, placements=[Replicate()])
        pids = worker_pids(g)
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"worker 0 \(device id 0, pid {pids[0]}\) died"):
            g.runtime.sync()
        assert time.monotonic() - t0 < 5
        assert wait_gone(pids, 5) == [] and set(shm_files()) == others

        z = dtorch.Tensor(torch.arange(7.0), device_mesh=PAIR, placements=[Shard(0)])
        assert torch.equal((z * 3).to_torch(), torch.arange(7.0) * 3)
        assert set(worker_pids(g)).isdisjoint(pids)


@pytest.mark.parametrize("path", GLOO_SLOW)
def test_worker_hung_during_a_256mb_fetch(path):
    """A worker that stops answering (SIGSTOP) in the middle of a 256 MB fetch is named after the heartbeat
    timeout, through shared memory or through the gloo pairs (where the controller is blocked in a
    receive); every worker is stopped, the hung one too, no /dev/shm file is left, new tensors work."""
    with fetch_under_way(path, heartbeat_timeout_s=1.5) as (g, fut, pids, shm, others):
        signal_mid_fetch(path, shm, pids[1], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=rf"worker 1 \(device id 1, pid {pids[1]}\) stopped answering"):
            fut.get()
        assert time.monotonic() - t0 < 10
        assert wait_gone(pids, 5) == [] and set(shm_files()) == others
        z = dtorch.Tensor(torch.arange(7.0), device_mesh=PAIR, placements=[Shard(0)])
        assert torch.equal((z * 3).to_torch(), torch.arange(7.0) * 3)


def test_workers_remove_the_directory_of_a_killed_controller(tmp_path):
    """A controller killed by SIGKILL cannot clean up: its workers remove its /dev/shm directory."""
    body = """
    print(g.runtime._pool.shm[0], flush=True)
    time.sleep(60)
    """
    ctl = run_controller(tmp_path, body)
    try:
        pids = read_pids(ctl)
        path = ctl.stdout.readline().strip()
        assert os.path.isdir(path), path
        ctl.kill()
        ctl.wait(timeout=30)
        assert wait_gone(pids, 10) == []
        assert not os.path.exists(path)
    finally:
        ctl.kill()
        ctl.communicate()


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)]], ids=["into the global file", "a file per block"])
def test_a_fetch_that_does_not_fit_in_dev_shm_comes_through_torch_distributed(placements):
    """Workers whose /dev/shm writes fail send their blocks through their pair instead (both fetch forms:
    straight into the global value's file, a file per block); the values are torch's."""
    from dtorch.runtime.kernels import get_kernel

    from . import process_kernels

    g = process_graph(workers=2)
    try:
        with using(g):
            rt = g.runtime
            x = torch.randn(5, INLINE_BYTES // 4 + 7)
            d = dtorch.Tensor(x, device_mesh=PAIR, placements=placements)
            d = process_kernels.run(g, get_kernel("test_no_room_in_dev_shm"), d)
            before = dict(rt.stats)
            assert torch.equal((d * 3).to_torch(), x * 3)
            assert rt.stats["bytes_fetched"] - before["bytes_fetched"] == x.numel() * 4
            assert [b.shape for b in d.local_blocks()] == [b.shape for b in dtorch.Tensor(
                x, device_mesh=PAIR, placements=placements).local_blocks()]
            rt.sync()
            assert sorted(os.listdir(rt._pool.shm[0])) == ["lock", "token"]  # no partial files left
    finally:
        g.runtime.shutdown()

