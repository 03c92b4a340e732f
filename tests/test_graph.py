"""Graph (API.md section 4), dtorch.testing helpers and the single-device simulation variables."""
from __future__ import annotations

import gc
import logging
import threading

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, DeviceUnavailableError, Graph, MeshError, Partial, Replicate, Shard, TensorFuture
from dtorch.runtime import devices

SAME = devices.SAME_DEVICE_VAR
NUM = devices.NUM_GPU_VAR


@pytest.fixture
def fresh_graph():
    """A new default Graph for this thread (reads the environment now); the old one comes back after."""
    old = Graph.default_graph()

    def make():
        g = Graph()
        Graph.set_default_graph(g)
        return g

    yield make
    Graph.set_default_graph(old)


def test_default_graph_is_per_thread():
    g = Graph.default_graph()
    assert dtorch.default_graph() is g and Graph.default_graph() is g
    seen = []

    def other():
        seen.append(Graph.default_graph())
        seen.append(Graph.default_graph())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen[0] is seen[1] and seen[0] is not g and isinstance(seen[0], Graph)


def test_guards_nest_and_restore():
    g = dtorch.default_graph()
    a = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    b = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    base_mesh, base_dtype = g.default_device_mesh, g.default_dtype
    assert base_mesh == DeviceMesh("cpu") and base_dtype == torch.get_default_dtype()
    with g.device_mesh_guard(a) as got:
        assert got is a and g.default_device_mesh is a and dtorch.ones(2).device_mesh is a
        with g.device_mesh_guard(b), g.dtype_guard(torch.float64):
            x = dtorch.zeros(3)
            assert x.device_mesh is b and x.placements == [Replicate(), Replicate()] and x.dtype == torch.float64
            with g.dtype_guard(torch.bfloat16):
                assert dtorch.rand(2).dtype == torch.bfloat16 and g.default_dtype == torch.bfloat16
            assert g.default_dtype == torch.float64
        assert g.default_device_mesh is a and g.default_dtype == base_dtype
        with pytest.raises(RuntimeError, match="boom"), g.device_mesh_guard(b):
            raise RuntimeError("boom")
        assert g.default_device_mesh is a
    assert g.default_device_mesh == base_mesh


def test_guards_in_one_thread_do_not_leak_into_another():
    mesh = dtorch.init_device_mesh("cpu", (3,))
    seen = []
    with dtorch.default_graph().device_mesh_guard(mesh):
        t = threading.Thread(target=lambda: seen.append(dtorch.ones(1).device_mesh))
        t.start()
        t.join()
    assert seen == [DeviceMesh("cpu")]


def test_guard_errors():
    g = dtorch.default_graph()
    with pytest.raises(MeshError, match="needs a DeviceMesh, got list"):
        with g.device_mesh_guard([0, 1]):
            pass
    with pytest.raises(TypeError, match="needs a torch.dtype, got 'float32'"):
        with g.dtype_guard("float32"):
            pass


def test_satisfy():
    g = dtorch.default_graph()
    assert g.satisfy(dtorch.init_device_mesh("cpu", 512))
    have = torch.cuda.device_count()
    assert g.satisfy(dtorch.init_device_mesh("cuda", have + 1)) is False
    assert dtorch.testing.is_graph_satisfy(g, dtorch.init_device_mesh("cpu", (4, 4)))
    assert dtorch.testing.is_graph_satisfy(g, DeviceMesh("cuda", [have])) is False


def test_sync_future_and_empty_cache():
    g = dtorch.default_graph()
    x = dtorch.Tensor(torch.arange(6.0), device_mesh=dtorch.init_device_mesh("cpu", 2), placements=[Shard(0)])
    assert g.sync() is None
    fut = g.sync_future()
    assert isinstance(fut, TensorFuture) and fut.is_ready() and fut.wait_for(0) and fut.get() is None
    g.empty_cache()
    assert torch.equal(x.to_torch(), torch.arange(6.0))  # tensors survive a cache flush


def test_memory_stats_grow_and_shrink(fresh_graph):
    g = fresh_graph()
    mesh = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "tp"])
    keys = [("cpu", i) for i in range(6)]
    assert g.get_memory_stats(mesh) == {k: {"allocated": 0, "peak": 0} for k in keys}
    x = dtorch.zeros(6, 9, device_mesh=mesh, placements=[Shard(0), Shard(1)])  # 3x3 float32 per device
    assert {k: v["allocated"] for k, v in g.get_memory_stats(mesh).items()} == {k: 36 for k in keys}
    y = dtorch.zeros(5, 7, dtype=torch.float64, device_mesh=mesh, placements=[Replicate(), Shard(1)])
    per_dev = [5 * n * 8 for n in (3, 3, 1)] * 2  # columns 7 over 3: 3, 3, 1
    stats = g.get_memory_stats()
    assert [stats[k]["allocated"] for k in keys] == [36 + b for b in per_dev]
    other = DeviceMesh("cpu", [10])
    z = dtorch.ones(4, device_mesh=other)
    assert g.get_memory_stats(other) == {("cpu", 10): {"allocated": 16, "peak": 16}}
    assert ("cpu", 10) in g.get_memory_stats() and ("cpu", 10) not in g.get_memory_stats(mesh)
    del x
    gc.collect()
    assert [g.get_memory_stats(mesh)[k]["allocated"] for k in keys] == per_dev
    del y, z
    gc.collect()
    assert all(v["allocated"] == 0 for v in g.get_memory_stats(mesh).values())
    assert g.get_memory_stats(other)[("cpu", 10)]["allocated"] == 0


def test_tracked_peak_memory(fresh_graph):
    g = fresh_graph()
    g.track_memory()
    mesh = dtorch.init_device_mesh("cpu", 2)
    x = dtorch.zeros(8, device_mesh=mesh, placements=[Shard(0)])
    y = dtorch.zeros(8, device_mesh=mesh, placements=[Shard(0)])
    del y
    gc.collect()
    stats = g.get_memory_stats(mesh)
    assert stats[("cpu", 0)] == {"allocated": 16, "peak": 32}
    del x


def test_memory_tracking_observes_storage_handles(fresh_graph):
    """Accounting is an observer of storage handles (Runtime.observe): no Tensor.__del__ patch, a storage
    shared by several tensors counts once, and tensors born before track_memory() leave the stats when they die."""
    g = fresh_graph()
    mesh = dtorch.init_device_mesh("cpu", 2)
    early = dtorch.zeros(8, device_mesh=mesh, placements=[Shard(0)])  # 4 float32 per device, born untracked
    g.track_memory()
    assert "__del__" not in vars(dtorch.Tensor) and not hasattr(dtorch.Tensor, "_finalize")

    def allocated():
        return g.get_memory_stats(mesh)[("cpu", 0)]["allocated"]

    assert allocated() == 16
    shared = dtorch.Tensor._make(early.spec, early._h, g)  # a second tensor object on the same handle
    assert allocated() == 16
    y = dtorch.zeros(8, device_mesh=mesh, placements=[Shard(0)])
    assert allocated() == 32
    del early
    gc.collect()
    assert allocated() == 32  # `shared` still holds that handle
    del shared
    gc.collect()
    assert allocated() == 16
    p = dtorch.nn.Parameter(dtorch.zeros(4, device_mesh=mesh, placements=[Shard(0)]))
    assert allocated() == 16 + 8
    p._set(dtorch.zeros(2, device_mesh=mesh, placements=[Shard(0)]))  # the old storage's last holder lets go
    gc.collect()
    assert allocated() == 16 + 4
    del p, y
    gc.collect()
    assert g.get_memory_stats(mesh)[("cpu", 0)] == {"allocated": 0, "peak": 32}


def test_memory_tracking_off_and_on_again(fresh_graph):
    g = fresh_graph()
    mesh = dtorch.init_device_mesh("cpu", 3)
    g.track_memory()
    a = dtorch.zeros(3, device_mesh=mesh, placements=[Shard(0)])  # observed while tracking
    g.track_memory(False)
    b = dtorch.zeros(3, device_mesh=mesh, placements=[Shard(0)])  # not observed now
    assert g.get_memory_stats(mesh)[("cpu", 1)]["allocated"] == 8  # untracked stats scan the live tensors
    g.track_memory()
    assert g.get_memory_stats(mesh)[("cpu", 1)] == {"allocated": 8, "peak": 8}
    del a, b
    gc.collect()
    assert g.get_memory_stats(mesh)[("cpu", 1)] == {"allocated": 0, "peak": 8}


def test_guards_are_per_thread_and_shared_by_the_threads_graphs():
    """The default mesh/dtype live in dtorch.context (per thread); every Graph of the thread reads them."""
    from dtorch import context

    mesh = dtorch.init_device_mesh("cpu", (2,))
    g, other = dtorch.default_graph(), Graph()
    with g.device_mesh_guard(mesh), other.dtype_guard(torch.float64):
        assert other.default_device_mesh is mesh and g.default_dtype == torch.float64
        assert context.get_default_device_mesh() is mesh and dtorch.get_default_device_mesh() is mesh
        assert dtorch.distributed_spec.get_default_device_mesh() is mesh
    assert context.default_device_mesh() == DeviceMesh("cpu") and context.default_dtype() == torch.get_default_dtype()


def test_backend_registry(monkeypatch):
    from dtorch.runtime import registry
    from dtorch.runtime.inprocess import InProcessRuntime

    with pytest.raises(ValueError) as err:
        Graph(backend="nccl")
    msg = str(err.value)
    assert "unknown dtorch backend 'nccl'" in msg and "DTORCH_BACKEND" in msg
    assert all(repr(name) in msg for name in registry.backend_names())
    monkeypatch.setenv("DTORCH_BACKEND", "nccl")
    with pytest.raises(ValueError, match="unknown dtorch backend 'nccl'"):
        Graph()
    # adding a backend is one entry: name -> "module:Class"
    monkeypatch.setitem(registry.BACKENDS, "inprocess2", "dtorch.runtime.inprocess:InProcessRuntime")
    g = Graph(backend="inprocess2")
    assert type(g.runtime) is InProcessRuntime and g.backend == "inprocess2"
    with g:
        x = dtorch.Tensor(torch.arange(4.0), device_mesh=dtorch.init_device_mesh("cpu", 2), placements=[Shard(0)])
    assert torch.equal((x * 2).to_torch(), torch.arange(4.0) * 2)
    # a backend's command-line entry (`dtorch worker`) goes through the registry too
    with pytest.raises(SystemExit) as exit_:
        registry.run_command("worker", ["--help"])
    assert exit_.value.code == 0


def test_assert_close_takes_torch_and_dtorch():
    mesh = dtorch.init_device_mesh("cpu", (2,))
    full = torch.randn(5, 3)
    d = dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(0)])
    p = dtorch.Tensor(full, device_mesh=mesh, placements=[Partial()])
    dtorch.testing.assert_close(d, full)
    dtorch.testing.assert_close(full, d)
    dtorch.testing.assert_close(d, p)
    dtorch.testing.assert_close(full + 1e-3, d, rtol=0, atol=1e-2)
    with pytest.raises(AssertionError, match="not close"):
        dtorch.testing.assert_close(d, full + 1)
    with pytest.raises(AssertionError):
        dtorch.testing.assert_close(d, full.double())  # dtypes must match, as in torch


# -- single-device simulation ---------------------------------------------------------------------------
def test_simulated_cuda_mesh(monkeypatch, fresh_graph, caplog):
    monkeypatch.setenv(SAME, "1")
    monkeypatch.setenv(NUM, "4")
    monkeypatch.setattr(devices, "_warned_cpu_fallback", False)
    g = fresh_graph()
    cuda = dtorch.init_device_mesh("cuda", (2, 2), mesh_dim_names=["dp", "tp"])
    assert g.satisfy(cuda) and not g.satisfy(dtorch.init_device_mesh("cuda", 5))
    full = torch.randn(5, 6)
    with caplog.at_level(logging.WARNING, logger="dtorch"):
        x = dtorch.Tensor(full, device_mesh=cuda, placements=[Shard(0), Partial()])
        y = (x.redistribute(cuda, [Replicate(), Shard(1)]) * 2).redistribute(cuda, [Shard(1), Shard(0)])
        torch.testing.assert_close(y.to_torch().cpu(), full * 2)
        torch.testing.assert_close(x.to_torch().cpu(), full)
    expected = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert {b.device for b in y.local_blocks()} == {expected}
    cpu_lines = [r for r in caplog.records if "run on the CPU" in r.getMessage()]
    assert len(cpu_lines) == (0 if torch.cuda.is_available() else 1)
    if cpu_lines:
        assert SAME in cpu_lines[0].getMessage() and "no GPU" in cpu_lines[0].getMessage()


@pytest.mark.parametrize("flag", ["1", "true", "TRUE"])
def test_simulation_flag_spellings(monkeypatch, fresh_graph, flag):
    monkeypatch.setenv(SAME, flag)
    monkeypatch.delenv(NUM, raising=False)
    g = fresh_graph()
    assert g.satisfy(dtorch.init_device_mesh("cuda", 8))  # default: 8 simulated GPUs
    assert not g.satisfy(dtorch.init_device_mesh("cuda", 9))


def test_cpu_mesh_into_simulated_cuda_mesh_and_back(monkeypatch, fresh_graph):
    """How inputs enter a model: a 1-device cpu tensor redistributed onto a cuda mesh."""
    monkeypatch.setenv(SAME, "1")
    monkeypatch.setenv(NUM, "4")
    fresh_graph()
    full = torch.arange(20.0).reshape(5, 4)
    x = dtorch.Tensor(full, device_mesh=DeviceMesh("cpu"))
    cuda = dtorch.init_device_mesh("cuda", (2, 2), mesh_dim_names=["dp", "tp"])
    with dtorch.CommLog() as log:
        y = x.redistribute(cuda, [Shard(0), Shard(1)])
    assert log.counts() == {("send_recv", None): 1}
    assert y.device_mesh == cuda and torch.equal(y.to_torch().cpu(), full)
    back = y.redistribute(DeviceMesh("cpu"), [Replicate()])
    assert torch.equal(back.to_torch(), full) and torch.equal(x.to_torch(), full)
    z = dtorch.zeros(3, device="cuda:3")
    assert z.device_mesh == DeviceMesh("cuda", [3])


def test_simulated_mesh_larger_than_the_count(monkeypatch, fresh_graph):
    monkeypatch.setenv(SAME, "1")
    monkeypatch.setenv(NUM, "4")
    fresh_graph()
    with pytest.raises(DeviceUnavailableError) as err:
        dtorch.zeros(3, device_mesh=dtorch.init_device_mesh("cuda", (2, 4)))
    msg = str(err.value)
    assert "cuda device id 7" in msg and f"{NUM}=4" in msg and "at least 8" in msg
    with pytest.raises(DeviceUnavailableError, match="at least 6"):
        dtorch.zeros(3, device="cuda:5")


def test_cuda_mesh_larger_than_the_machine(monkeypatch, fresh_graph):
    monkeypatch.delenv(SAME, raising=False)
    fresh_graph()
    have = torch.cuda.device_count()
    with pytest.raises(DeviceUnavailableError) as err:
        dtorch.Tensor(torch.ones(2), device_mesh=dtorch.init_device_mesh("cuda", have + 1))
    msg = str(err.value)
    assert f"cuda device id {have}" in msg and f"this machine has {have} GPU(s)" in msg
    assert "'cpu' mesh" in msg and f"{SAME}=1" in msg


@pytest.mark.parametrize("same,num,words", [
    ("maybe", "8", [f"{SAME}='maybe' is not understood", "1/true or 0/false"]),
    ("1", "eight", [f"{NUM}='eight' is not an integer", "number of GPUs to simulate"]),
    ("1", "0", [f"{NUM}=0 must be at least 1"]),
])
def test_unparsable_simulation_variables(monkeypatch, fresh_graph, same, num, words):
    monkeypatch.setenv(SAME, same)
    monkeypatch.setenv(NUM, num)
    with pytest.raises(MeshError) as err:
        fresh_graph()
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_simulation_off_by_default(monkeypatch, fresh_graph):
    for v in ("0", "false", ""):
        monkeypatch.setenv(SAME, v)
        g = fresh_graph()
        assert g.runtime.config.same_device is False
        assert g.satisfy(DeviceMesh("cuda", [0])) == (torch.cuda.device_count() > 0)
