"""Fixtures for the process-backend tests: one pool of workers per module, references, a hang guard."""
from __future__ import annotations

import contextlib
import faulthandler

import pytest

import dtorch
from dtorch.runtime.inprocess import InProcessRuntime
from dtorch.runtime.process import ProcessRuntime

TEST_TIMEOUT_S = 240  # a hung test dumps every thread's stack and ends the run instead of hanging CI


@pytest.fixture(autouse=True)
def no_hang():
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


class BlocksRuntime(InProcessRuntime):
    """The in-process backend forced onto its per-device path: the path a worker takes (one block, lead=0)."""

    def grid_device(self, mesh):
        return None


def process_graph(**kwargs) -> dtorch.Graph:
    g = dtorch.Graph(backend="process")
    g.runtime = ProcessRuntime(**{"timeout": 60, **kwargs})
    return g


@contextlib.contextmanager
def using(graph: dtorch.Graph):
    old = dtorch.Graph.default_graph()
    dtorch.Graph.set_default_graph(graph)
    try:
        yield graph
    finally:
        dtorch.Graph.set_default_graph(old)


@pytest.fixture(scope="session")
def process_pool():
    """One process-backend Graph with 4 workers for the whole session (a mesh of more devices grows it):
    starting workers is the slow part of a backend test. Tests that break, stop or count workers make
    their own Graph."""
    g = process_graph(workers=4)
    yield g
    g.runtime.shutdown()


@pytest.fixture(scope="session")
def ray_pool(ray_cluster):
    """The ray backend's session Graph: 4 device actors."""
    g = ray_graph(workers=4)
    yield g
    g.runtime.shutdown()


@pytest.fixture(scope="module")
def proc(request):
    """The Graph the backend tests run on: the process backend's session pool, or the ray backend's in a
    module that sets ``PROC_BACKEND = "ray"`` (test_ray_backend.py runs the process backend's tests on Ray)."""
    backend = getattr(request.module, "PROC_BACKEND", "process")
    return request.getfixturevalue({"process": "process_pool", "ray": "ray_pool"}[backend])


@pytest.fixture(scope="module")
def ref():
    return dtorch.Graph(backend="inprocess")


@pytest.fixture(scope="module")
def blocks_ref():
    g = dtorch.Graph(backend="inprocess")
    g.runtime = BlocksRuntime()
    return g


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance for the ray-backend tests (2 CPUs, as in CI); skipped, saying why, only where
    Ray is not installed or cannot start."""
    ray = pytest.importorskip("ray", reason="the ray backend's tests need Ray: pip install 'dtorch[ray]'")
    if ray.is_initialized():
        yield ray
        return
    try:
        # a Ray of our own even where a cluster runs on this machine (`ray start`), which ray.init would join
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"Ray cannot start on this machine: {exc}")
    yield ray
    ray.shutdown()


def ray_graph(**kwargs) -> dtorch.Graph:
    from dtorch.runtime.ray_backend import RayRuntime

    g = dtorch.Graph(backend="ray")
    g.runtime = RayRuntime(**{"timeout": 60, **kwargs})
    return g
