"""The ray backend (one Ray actor per device, gloo between them) against the in-process backend and torch.

The process backend's suite runs here unchanged on Ray (its tests take the ``proc`` fixture, which this
module binds to a ray-backend Graph): every redistribution transition bit for bit, partial reductions,
dtypes, empty tensors, moves between meshes, ring shifts, CommLog, ops against torch, attention, copy-on-write.
Then what is Ray's own: the object-store data plane, the Llama layouts, faults, shutdown, Ray's lifetime.
All against a local Ray (``ray.init(num_cpus=2)``, the ``ray_cluster`` fixture), as in CI.

    .venv/bin/pytest -q tests/runtime/test_ray_backend.py
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

import dtorch
from dtorch import CommLog, DeviceMesh, Replicate, Shard
from dtorch.errors import OpError, RuntimeBackendError
from dtorch.runtime.kernels import get_kernel
from tests.models.test_llama import ATOL, LAYOUTS, RTOL, Layout, run_layout

from . import process_kernels
from .conftest import ray_graph, using
from .test_process_backend import (  # noqa: F401  (collected here: the process backend's suite on Ray)
    MESH_2D, assert_identical, test_3d_mesh_with_a_size_one_dim, test_an_empty_strided_block_is_fetched,
    test_blocks_are_freed_when_tensors_die, test_commlog_matches_inprocess, test_context_parallel_attention,
    test_device_args_reach_each_device, test_dtypes, test_every_transition_is_bit_identical,
    test_float_sums_over_four_devices_are_native_collectives, test_in_place_writes_and_copy_on_write_on_the_workers,
    test_large_values_and_large_batches, test_moves_between_meshes, test_one_commlog_record_per_step_like_inprocess,
    test_ops_match_inprocess_and_torch, test_partial_reduce_ops, test_pipeline_hand_off_is_one_send_recv_on_pp,
    test_placement_sweep_on_the_process_backend, test_ring_shift, test_scalars_and_empty_tensors, test_to_torch_async,
    value)
from .test_process_faults import alive, wait_gone

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIR = DeviceMesh("cpu", [0, 1], mesh_dim_names=["a"])


PROC_BACKEND = "ray"  # the ``proc`` fixture (conftest.py) is the ray backend's session Graph


def actor_pids(graph) -> list[int]:
    return [info["pid"] for info in graph.runtime._pool.info.values()]


# -- the data plane: Ray's object store --------------------------------------------------------------


def test_large_blocks_travel_through_the_object_store(proc):
    rt = proc.runtime
    full = value((700, 500))  # 1.4 MB: above the inline limit
    before = dict(rt.stats)
    with using(proc):
        x = dtorch.Tensor(full, device_mesh=MESH_2D, placements=[Shard(0), Replicate()])
        assert_identical(x.to_torch(), full, "placed and fetched through the object store")
        blocks = x.local_blocks()
    placed = rt.stats["bytes_object_store"] - before["bytes_object_store"]
    # placed once per distinct block (replicas share one object), fetched once per grid block
    assert placed >= 2 * full.numel() * 4
    assert rt.stats["bytes_put"] == before["bytes_put"] and rt.stats["bytes_fetched"] == before["bytes_fetched"]
    blocks[0].add_(1)  # local_blocks are the caller's copies: writable, and the tensor is unchanged
    assert_identical(x.to_torch(), full, "after writing a fetched block")


def test_blocks_placed_once_are_private_to_each_replica(proc):
    """Replicas on one node read one object; an in-place write on one device must not reach the others."""
    full = value((600, 300))
    with using(proc):
        x = dtorch.Tensor(full, device_mesh=MESH_2D, placements=[Replicate(), Replicate()])
        x.mul_(2)
        assert_identical(x.to_torch(), full * 2, "replicated block after an in-place write")
        y = dtorch.Tensor(full, device_mesh=MESH_2D, placements=[Replicate(), Replicate()])
        assert_identical(y.to_torch(), full, "a new placement of the same value")


def test_records_go_as_batched_actor_calls_without_waiting(proc):
    rt = proc.runtime
    with using(proc):
        x = dtorch.Tensor(value((6, 4)), device_mesh=PAIR, placements=[Shard(0)])
        rt.sync()
        before = dict(rt.stats)
        y = x
        for _ in range(50):
            y = y * 1.01 + 0.5
        t_issue = rt.stats["ops"] - before["ops"]
        assert t_issue == 100
        assert rt.stats["flushes"] - before["flushes"] < 20  # batches, not one call per op
        want = value((6, 4))
        for _ in range(50):
            want = want * 1.01 + 0.5
        torch.testing.assert_close(y.to_torch(), want)


def test_pool_grows_and_keeps_blocks(ray_cluster):
    g = ray_graph()
    try:
        with using(g):
            x = dtorch.Tensor(value((5, 3)), device_mesh=PAIR, placements=[Shard(0)])
            assert g.runtime._world == 2
            mesh3 = DeviceMesh("cpu", [0, 2, 1])
            y = x.redistribute(mesh3, [Shard(1)])  # needs device 2: a third actor joins
            assert g.runtime._world == 3
            assert_identical(x.to_torch(), value((5, 3)), "block kept across the re-formed group")
            assert_identical(y.to_torch(), value((5, 3)), "moved onto the grown pool")
    finally:
        g.runtime.shutdown()


# -- the Llama layout matrix ---------------------------------------------------------------------------

RAY_LAYOUTS = [lay for lay in LAYOUTS if lay.name in ("dp2", "tp2", "pp2", "ulysses2", "ring2", "ring2 uneven sequence")]
RAY_LAYOUTS.append(Layout("dp2 x tp2 x pp2", (("dp", 2), ("tp", 2), ("pp", 2)), batch=4, seq=5))


@pytest.mark.parametrize("layout", RAY_LAYOUTS, ids=lambda lay: lay.name)
def test_llama_layout_matches_inprocess_and_hugging_face(proc, ref, layout):
    runs = []
    for g in (ref, proc):
        with using(g), CommLog() as log:
            got, expected = run_layout(layout)
        runs.append((got, log.counts(), log.bytes()))
    (want, counts, nbytes), (got, r_counts, r_bytes) = runs
    assert (r_counts, r_bytes) == (counts, nbytes)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_llama_train_step_matches_inprocess(proc, ref):
    """A training step (backward recomputes the local forward on the actors) gives the in-process gradients."""
    from tests.llama_models import hf_model

    from dtorch.models.llama import LlamaForCausalLM

    hf = hf_model()
    ids = torch.randint(0, hf.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    grads = []
    for g in (ref, proc):
        with using(g):
            mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
            model = LlamaForCausalLM(hf.config, mesh)
            model.load_state_dict(hf.state_dict())
            model(ids, labels=ids).loss.backward()
            grads.append({n: p.grad.to_torch() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


# -- faults ----------------------------------------------------------------------------------------------


def test_killed_actor_is_named_quickly_and_a_new_graph_goes_on(ray_cluster):
    g = ray_graph(workers=2)
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(8.0), device_mesh=PAIR, placements=[Shard(0)])
            y = x
            for _ in range(10):
                y = process_kernels.run(g, get_kernel("test_sleep"), y, seconds=0.1)
            y = y.redistribute(PAIR, [Replicate()])  # the gather waits on actor 1
            g.runtime.flush()
            pids = actor_pids(g)
            time.sleep(0.3)
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RuntimeBackendError, match=r"device actor 1 \(device id 1, pid \d+.*\) died while "
                                                          r"running the ops queued up to #\d+ \((kernel|redistribute)"):
                y.to_torch()
            assert time.monotonic() - t0 < 5
            assert wait_gone(pids, 10) == []  # the other actor, blocked in a collective, was killed too
            with pytest.raises(RuntimeBackendError, match="blocks are gone.*Recreate the tensor"):
                x + 1
            z = dtorch.Tensor(torch.arange(6.0), device_mesh=PAIR, placements=[Shard(0)])  # new actors
            assert_identical((z * 2).to_torch(), torch.arange(6.0) * 2, "after the fault")
    finally:
        g.runtime.shutdown()


# actor 0 also hosts the store the heartbeats tick in (-m slow, CI: ~20 s each on 2 shared cores)
@pytest.mark.parametrize("rank", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_hung_actor_is_named_after_the_heartbeat_timeout(ray_cluster, rank):
    """An actor that stops answering (SIGSTOP) is not dead to Ray; its heartbeat stands still, and the
    controller names it after DTORCH_PROCESS_HEARTBEAT_TIMEOUT, stops every actor, and goes on."""
    g = ray_graph(workers=2, heartbeat_timeout_s=1.5)
    pids: list = []
    try:
        with using(g):
            x = dtorch.Tensor(torch.arange(8.0), device_mesh=PAIR, placements=[Shard(0)])
            slow = process_kernels.run(g, get_kernel("test_sleep"), x, seconds=3.0)  # busy is not hung
            assert torch.equal(slow.to_torch(), torch.arange(8.0))
            pids = actor_pids(g)
            y = x.redistribute(PAIR, [Replicate()])  # the gather needs both actors
            os.kill(pids[rank], signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(RuntimeBackendError, match=rf"device actor {rank} \(device id {rank}, pid {pids[rank]}"
                                                          r".*\) stopped answering: no heartbeat for 1.5 s"):
                y.to_torch()
            assert time.monotonic() - t0 < 10
            assert wait_gone(pids, 10) == []
            z = dtorch.Tensor(torch.arange(6.0), device_mesh=PAIR, placements=[Shard(0)])  # new actors
            assert_identical((z * 2).to_torch(), torch.arange(6.0) * 2, "after the fault")
    finally:
        for pid in pids:  # should the test fail before the backend killed it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        g.runtime.shutdown()


def test_large_transfer_interrupted_by_a_killed_actor(ray_cluster):
    """SIGKILL during a 256 MB fetch: the error comes in under 5 s and nothing is left behind."""
    g = ray_graph(workers=2)
    try:
        with using(g):
            big = dtorch.Tensor(torch.ones(64 << 20), device_mesh=PAIR, placements=[Shard(0)])
            g.sync()
            pids = actor_pids(g)
            fut = big.to_torch_async() if hasattr(big, "to_torch_async") else None
            os.kill(pids[0], signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(RuntimeBackendError, match=r"device actor 0 .*died"):
                fut.get() if fut is not None else big.to_torch()
                g.sync()
            assert time.monotonic() - t0 < 5
            assert wait_gone(pids, 10) == []
    finally:
        g.runtime.shutdown()


def test_exception_on_an_actor_names_the_op(ray_cluster):
    g = ray_graph(workers=2)
    try:
        with using(g):
            ints = dtorch.Tensor(torch.arange(6), device_mesh=PAIR, placements=[Shard(0)])
            bad = ints // 0  # passes every check on the controller; fails on the actors' data
            pids = actor_pids(g)
            with pytest.raises(RuntimeBackendError, match=r"device actor \d .*failed running kernel pointwise.*"
                                                          r"torch\.floor_divide") as err:
                bad.to_torch()
            assert "ZeroDivisionError" in str(err.value)
            assert g.runtime._pool is None and wait_gone(pids, 5) == []
            x = dtorch.Tensor(torch.ones(4), device_mesh=PAIR, placements=[Shard(0)])
            process_kernels.run(g, get_kernel("test_raise"), x, message="bad shapes in my kernel")
            with pytest.raises(RuntimeBackendError, match=r"kernel test_raise\(message='bad shapes in my kernel'\)"):
                g.sync()
    finally:
        g.runtime.shutdown()
    with pytest.raises(OpError, match="floor_divide"):  # the in-process backend raises at the op itself
        dtorch.Tensor(torch.arange(6), device_mesh=PAIR, placements=[Shard(0)]) // 0


def test_shutdown_leaves_no_actors(ray_cluster):
    from ray._private.state import actors  # the GCS's table (ray.util.state needs the dashboard)

    g = ray_graph(workers=3)
    with using(g):
        x = dtorch.Tensor(torch.arange(9.0), device_mesh=DeviceMesh("cpu", [0, 1, 2]), placements=[Shard(0)])
        assert_identical(x.to_torch(), torch.arange(9.0), "before shutdown")
        pids = actor_pids(g)
        ids = [a._actor_id.hex() for a in g.runtime._pool.actors.values()]
    g.runtime.shutdown()
    assert wait_gone(pids, 10) == []

    def states():
        table = actors()
        return [table[i]["State"] for i in ids]

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and states() != ["DEAD"] * 3:
        time.sleep(0.1)
    assert states() == ["DEAD"] * 3


def without_ray(script: str) -> dict:
    """Run ``script`` in a fresh interpreter where Ray is not started (so dtorch starts it); the JSON object
    its last line prints."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    # Ray's own directory, short (Ray's sockets live there): ray.init must not find a cluster that runs on
    # this machine (it would join it), and what this Ray leaves is this test's to remove
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="dtr", dir="/tmp")
    try:
        run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=180)
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # starts a Ray of its own in a fresh interpreter: ~40 s on 2 shared cores
def test_ray_that_dtorch_started_is_stopped_at_shutdown():
    """Without ray.init by the program, the backend starts a local Ray and stops it again: no Ray processes
    that dtorch started are left (run in a fresh interpreter: this one's Ray is the tests')."""
    script = textwrap.dedent("""
        import json, os, time, torch, ray, dtorch
        from dtorch import DeviceMesh, Shard

        def mine():  # this process's descendants, alive (not zombies)
            parent = {}
            for d in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                if fields[0] != "Z":
                    parent[int(d)] = int(fields[1])
            out, frontier = set(), {os.getpid()}
            while frontier:
                frontier = {p for p, pp in parent.items() if pp in frontier} - out
                out |= frontier
            return sorted(out)
        g = dtorch.Graph(backend="ray")
        with g:
            x = dtorch.Tensor(torch.arange(4.0), device_mesh=DeviceMesh("cpu", [0, 1]), placements=[Shard(0)])
            ok = bool(torch.equal((x * 2).to_torch(), torch.arange(4.0) * 2))
        started = mine()
        g.runtime.shutdown()
        deadline = time.time() + 20
        while mine() and time.time() < deadline:
            time.sleep(0.2)
        print(json.dumps({"ok": ok, "initialized": ray.is_initialized(), "started": len(started), "left": mine()}))
    """)
    out = without_ray(script)
    assert out["ok"] and out["started"] > 0
    assert not out["initialized"] and out["left"] == [], out


def test_missing_ray_gives_the_install_command(monkeypatch):
    from dtorch.runtime import ray_backend

    monkeypatch.setattr(ray_backend, "ray", None)
    with pytest.raises(RuntimeBackendError, match=r"pip install 'dtorch\[ray\]'.*DTORCH_BACKEND=process"):
        ray_backend.RayRuntime()


def test_backend_is_registered_and_bad_settings_are_named(ray_cluster, monkeypatch):
    from dtorch.runtime.registry import backend_names

    assert "ray" in backend_names()
    monkeypatch.setenv("DTORCH_RAY_CPUS_PER_DEVICE", "none")
    with pytest.raises(ValueError, match="DTORCH_RAY_CPUS_PER_DEVICE='none' must be a positive number"):
        ray_graph()


@pytest.mark.slow
def test_operator_suites_on_the_ray_backend(ray_cluster):
    """The operator, nn, tensor and graph test files, unchanged, with DTORCH_BACKEND=ray on this Ray instance.

    (tests/test_redistribute.py is left out, as on the process backend: its hypothesis meshes name device ids
    up to about 70, one actor each; the transition sweeps imported above cover its transitions.)
    """
    import faulthandler

    files = [f"tests/ops/{n}" for n in ("test_pointwise.py", "test_view.py", "test_reduce.py", "test_matrix.py",
                                        "test_nn_ops.py", "test_attention.py")] + ["tests/nn", "tests/test_tensor.py",
                                                                                   "tests/test_graph.py"]
    env = dict(os.environ, DTORCH_BACKEND="ray", DTORCH_PROCESS_WORKERS="4", DTORCH_PROCESS_TIMEOUT="60",
               RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    faulthandler.dump_traceback_later(1500, exit=True)  # longer than the per-test guard; the run has its own
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *files], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=1400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


@pytest.mark.slow  # starts a Ray of its own in a fresh interpreter: ~50 s on 2 shared cores
def test_ray_that_dtorch_started_stays_while_another_graph_uses_it():
    """Two ray Graphs on the Ray dtorch started: shutting one down leaves the other's actors running; Ray
    stops with the last one."""
    script = textwrap.dedent("""
        import json, torch, ray, dtorch
        from dtorch import DeviceMesh, Shard
        mesh = DeviceMesh("cpu", [0, 1])
        a, b = dtorch.Graph(backend="ray"), dtorch.Graph(backend="ray")
        with a:
            x = dtorch.Tensor(torch.arange(4.0), device_mesh=mesh, placements=[Shard(0)])
        with b:
            y = dtorch.Tensor(torch.arange(4.0), device_mesh=mesh, placements=[Shard(0)])
        a.runtime.shutdown()
        up = ray.is_initialized()
        ok = bool(torch.equal((y * 2).to_torch(), torch.arange(4.0) * 2))
        b.runtime.shutdown()
        print(json.dumps({"up_after_first": up, "second_works": ok, "down_after_last": not ray.is_initialized()}))
    """)
    assert without_ray(script) == {"up_after_first": True, "second_works": True,
                                                                "down_after_last": True}
