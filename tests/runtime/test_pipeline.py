"""dtorch.pipeline: 1F1B order, gradients equal to the full batch's, activation memory bounded by the stage
count; and on the process backend, stages that do not wait for each other (sends are not waited on,
receives are waited on where the block is first read).

    .venv/bin/pytest -q tests/runtime/test_pipeline.py
"""
from __future__ import annotations

import gc
import time

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.models.llama import LlamaForCausalLM
from dtorch.pipeline import issue_order, one_f_one_b, split_micro_batches, train_step
from dtorch.runtime.kernels import get_kernel
from tests.llama_models import hf_model

from . import process_kernels
from .conftest import using

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # kernels this small only contend over threads


def dtorch_model(hf, mesh) -> LlamaForCausalLM:
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    return model


def grads(model) -> dict:
    return {n: p.grad.to_torch() for n, p in model.named_parameters() if p.grad is not None}


def hf_grads(hf, ids, labels) -> tuple[float, dict]:
    hf.zero_grad()
    out = hf(ids, labels=labels)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in hf.named_parameters()}


# -- the order ---------------------------------------------------------------------------------------


def megatron_1f1b(p: int, m: int, s: int) -> list:
    """Stage s's own 1F1B order, written out independently of issue_order."""
    warm = min(p - 1 - s, m)
    out = [("F", i) for i in range(warm)]
    for k in range(m - warm):
        out += [("F", warm + k), ("B", k)]
    return out + [("B", i) for i in range(m - warm, m)]


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 4), (2, 8), (3, 5), (4, 2), (4, 9)])
def test_issue_order_projects_to_each_stages_1f1b(p, m):
    order = issue_order(p, m)
    done = set()
    for ev in order:
        if ev[0] == "B":
            _, i, s = ev
            assert ("F", i) in done and (s == p - 1 or ("B", i, s + 1) in done), ev
        done.add(ev)
    assert len(done) == len(order) == m + m * p
    for s in range(p):
        mine = [("F", ev[1]) if ev[0] == "F" else ("B", ev[1]) for ev in order if ev[0] == "F" or ev[2] == s]
        assert mine == megatron_1f1b(p, m, s)
        # micro-batches between forward and backward on this stage: at most p - s
        live = peak = 0
        for kind, _ in mine:
            live += 1 if kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(p - s, m)


def test_gpipe_order_is_all_forwards_then_all_backwards():
    order = issue_order(3, 4, "gpipe")
    assert order[:4] == [("F", i) for i in range(4)]
    assert sorted(order[4:]) == sorted(("B", i, s) for i in range(4) for s in range(3))


def test_the_helper_runs_the_issue_order(monkeypatch):
    import dtorch.pipeline as pipeline

    hf = hf_model("pipeline", torch.float64)
    ids = torch.randint(0, 97, (8, 5), generator=torch.Generator().manual_seed(1))
    g = dtorch.Graph(backend="inprocess")
    with g, g.dtype_guard(torch.float64):
        mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
        model = dtorch_model(hf, mesh)
        stages = model.model.stage_meshes
        seen = []
        real = pipeline.run_backward

        def spy(roots, grads_):
            seen.append(("B", stages.index(roots[0].device_mesh)))
            return real(roots, grads_)

        def loss_fn(model, mb):
            seen.append(("F", mb[2]))
            return model(mb[0], labels=mb[1]).loss

        monkeypatch.setattr(pipeline, "run_backward", spy)
        mbs = [(x, y, i) for i, (x, y) in enumerate(split_micro_batches(ids, ids, chunks=4))]
        train_step(model, mbs, loss_fn)
    want = [ev if ev[0] == "F" else ("B", ev[2]) for ev in issue_order(2, 4)]
    assert seen == want


# -- gradients ------------------------------------------------------------------------------------------

LAYOUTS = {
    "pp2": ((2,), ["pp"]),
    "pp3": ((3,), ["pp"]),
    "pp2 x dp2": ((2, 2), ["pp", "dp"]),  # 3 rows per micro-batch: uneven over dp
    "pp2 x tp2": ((2, 2), ["pp", "tp"]),
}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_equal_the_full_batch(layout, schedule):
    shape, names = LAYOUTS[layout]
    hf = hf_model("pipeline", torch.float64)
    ids = torch.randint(0, 97, (9, 7), generator=torch.Generator().manual_seed(2))
    want_loss, want = hf_grads(hf, ids, ids)
    g = dtorch.Graph(backend="inprocess")
    with g, g.dtype_guard(torch.float64):
        mesh = dtorch.init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = dtorch_model(hf, mesh)
        loss = train_step(model, split_micro_batches(ids, ids, chunks=3), schedule=schedule)
        got = grads(model)
        # the same model's single full-batch backward
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        full = grads(model)
    assert isinstance(loss, dtorch.Tensor) and not loss.requires_grad
    assert abs(loss.item() - want_loss) < 1e-5
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5, msg=n)
        torch.testing.assert_close(got[n], full[n], rtol=1e-10, atol=1e-12, msg=n)


def test_gradients_accumulate_like_backward_and_mesh_without_stages():
    # no pipeline stage (one mesh): plain gradient accumulation, added to what .grad already holds
    torch.manual_seed(3)
    w0 = torch.randn(5, 3, dtype=torch.float64)
    xs = torch.randn(6, 5, dtype=torch.float64)
    ys = torch.randn(6, 3, dtype=torch.float64)
    w_t = w0.clone().requires_grad_()
    ((xs @ w_t - ys) ** 2).mean().backward()
    ((xs[:2] @ w_t) ** 2).sum().backward()  # an earlier gradient the step adds to
    g = dtorch.Graph(backend="inprocess")
    with g:
        mesh = dtorch.init_device_mesh("cpu", (2,))
        w = dtorch.nn.Parameter(dtorch.Tensor(w0, device_mesh=mesh, placements=[Shard(1)]))
        x = dtorch.Tensor(xs[:2], device_mesh=mesh, placements=[Replicate()])
        ((x @ w) ** 2).sum().backward()

        def loss_fn(_, mb):
            xb = dtorch.Tensor(mb[0], device_mesh=mesh, placements=[Shard(0)])
            yb = dtorch.Tensor(mb[1], device_mesh=mesh, placements=[Shard(0)])
            return ((xb @ w - yb) ** 2).mean()

        loss = one_f_one_b(None, split_micro_batches(xs, ys, chunks=3), loss_fn)
    torch.testing.assert_close(w.grad.to_torch(), w_t.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(loss.to_torch(), ((xs @ w0 - ys) ** 2).mean(), rtol=1e-12, atol=1e-12)


def test_any_model_whose_stages_hand_on_by_redistribute():
    # a hand-written two-stage MLP, micro-batches of 3, 2 and 2 rows (3 rows split unevenly over dp=2),
    # a sum loss: the step's gradient is the mean of the micro-batch gradients
    torch.manual_seed(6)
    w0_t = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    w1_t = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(7, 4, dtype=torch.float64)
    cuts = [xs[:3], xs[3:5], xs[5:]]
    (sum((torch.tanh(x @ w0_t) @ w1_t).pow(2).sum() for x in cuts) / 3).backward()
    g = dtorch.Graph(backend="inprocess")
    with g:
        s0, s1 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "dp"]).unbind("pp")
        w0 = dtorch.nn.Parameter(dtorch.Tensor(w0_t.detach(), device_mesh=s0, placements=[Replicate()]))
        w1 = dtorch.nn.Parameter(dtorch.Tensor(w1_t.detach(), device_mesh=s1, placements=[Shard(1)]))

        def loss_fn(_, x):
            h = dtorch.tanh(dtorch.Tensor(x, device_mesh=s0, placements=[Shard(0)]) @ w0)
            return (h.redistribute(s1, h.placements) @ w1).pow(2).sum()

        train_step(None, cuts, loss_fn)
        torch.testing.assert_close(w0.grad.to_torch(), w0_t.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(w1.grad.to_torch(), w1_t.grad, rtol=1e-12, atol=1e-12)

        def wandering(_, x):  # micro-batch 1 skips the second stage
            h = dtorch.tanh(dtorch.Tensor(x, device_mesh=s0) @ w0)
            if x.shape[0] == 2:
                return h.sum()
            return (h.redistribute(s1, h.placements) @ w1).sum()

        with pytest.raises(RuntimeError, match="same pipeline stages"):
            train_step(None, cuts, wandering)

        def back_again(_, x):  # the loss on the first stage's mesh, which also hands on: not a chain
            h = dtorch.tanh(dtorch.Tensor(x, device_mesh=s0) @ w0)
            y = h.redistribute(s1, h.placements) @ w1
            return y.redistribute(s0, y.placements).sum()

        with pytest.raises(NotImplementedError, match="chain"):
            train_step(None, cuts, back_again)


# -- memory ---------------------------------------------------------------------------------------


def test_activation_memory_is_bounded_by_the_stage_count():
    hf = hf_model("pipeline")
    g = dtorch.Graph(backend="inprocess")
    peaks = {}
    with g:
        mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
        model = dtorch_model(hf, mesh)
        ids = torch.randint(0, 97, (16, 16), generator=torch.Generator().manual_seed(4))
        train_step(model, split_micro_batches(ids, ids, chunks=2))  # .grad exists from here on
        g.track_memory()
        for m, schedule in ((2, "1f1b"), (8, "1f1b"), (8, "gpipe")):
            gc.collect()
            base = g.get_memory_stats(mesh)
            g.reset_peak_memory_stats()
            train_step(model, split_micro_batches(ids[: 2 * m], ids[: 2 * m], chunks=m), schedule=schedule)
            stats = g.get_memory_stats(mesh)
            peaks[m, schedule] = [stats[k]["peak"] - base[k]["allocated"] for k in sorted(stats)]
    for dev in range(2):
        one_f_one_b_2, one_f_one_b_8, gpipe_8 = (peaks[k][dev] for k in ((2, "1f1b"), (8, "1f1b"), (8, "gpipe")))
        assert one_f_one_b_8 <= 1.05 * one_f_one_b_2, peaks
        assert gpipe_8 >= 2.5 * one_f_one_b_8, peaks


# -- bad input ------------------------------------------------------------------------------------------


def test_bad_input_says_what_to_change():
    with pytest.raises(ValueError, match="equal micro-batches"):
        split_micro_batches(torch.zeros(7, 2), chunks=2)
    with pytest.raises(ValueError, match="same batch size"):
        split_micro_batches(torch.zeros(4, 2), torch.zeros(6), chunks=2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        train_step(None, [1], schedule="zb")
    with pytest.raises(ValueError, match="at least one micro-batch"):
        train_step(None, [])
    mesh = dtorch.init_device_mesh("cpu", (2,))
    w = dtorch.nn.Parameter(dtorch.ones(3, device_mesh=mesh))
    with pytest.raises(TypeError, match="one element"):
        train_step(None, [0], lambda _, mb: w * 2)
    with pytest.raises(RuntimeError, match="does not require grad"):
        train_step(None, [0], lambda _, mb: w.detach().sum())
    with pytest.raises(TypeError, match="loss_fn"):
        train_step(None, [torch.zeros(2)])


# -- the process backend ------------------------------------------------------------------------------


def test_process_backend_pipeline_step_matches_inprocess(proc):
    hf = hf_model("pipeline")
    ids = torch.randint(0, 97, (6, 9), generator=torch.Generator().manual_seed(5))
    out = {}
    for name, graph in (("ref", dtorch.Graph(backend="inprocess")), ("proc", proc)):
        with using(graph):
            mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
            model = dtorch_model(hf, mesh)
            loss = train_step(model, split_micro_batches(ids, ids, chunks=3))
            out[name] = (loss.item(), grads(model))
    assert abs(out["proc"][0] - out["ref"][0]) < 1e-5
    for n, want in out["ref"][1].items():
        torch.testing.assert_close(out["proc"][1][n], want, rtol=1e-5, atol=1e-5, msg=n)


def _sleep(graph, t, seconds):
    return process_kernels.run(graph, get_kernel("test_sleep"), t, seconds=seconds)


def test_a_stage_does_not_wait_for_the_next_to_receive(proc):
    # stage 1 is busy; stage 0 hands it a block and goes on: its next result is ready long before stage 1
    # gets to the receive (a send waited on until then held stage 0 for the whole sleep)
    with using(proc):
        s0, s1 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"]).unbind("pp")
        a = dtorch.Tensor(torch.arange(6.0), device_mesh=s0)
        busy = _sleep(proc, dtorch.Tensor(torch.zeros(3), device_mesh=s1), 3.0)
        moved = a.redistribute(s1, [Replicate()])
        with torch.no_grad():
            a.add_(100)  # written while the send may still be in flight: the receiver gets the old value
        t0 = time.perf_counter()
        after = (a * 2).to_torch()
        took = time.perf_counter() - t0
        assert took < 1.5, f"stage 0 waited {took:.2f} s for stage 1"
        torch.testing.assert_close(after, (torch.arange(6.0) + 100) * 2)
        torch.testing.assert_close(moved.to_torch(), torch.arange(6.0))
        busy.to_torch()


def test_a_stage_waits_for_a_received_block_only_where_it_reads_it(proc):
    # stage 0 is busy before it sends; stage 1 posts the receive and runs its own work meanwhile
    with using(proc):
        s0, s1 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"]).unbind("pp")
        a = _sleep(proc, dtorch.Tensor(torch.arange(4.0), device_mesh=s0), 3.0)
        moved = a.redistribute(s1, [Shard(0)])  # regions: each half lands in a fresh block
        b = dtorch.Tensor(torch.ones(5), device_mesh=s1)
        t0 = time.perf_counter()
        independent = (b + 1).to_torch()
        took = time.perf_counter() - t0
        assert took < 1.5, f"stage 1 waited {took:.2f} s for a block it did not read"
        torch.testing.assert_close(independent, torch.full((5,), 2.0))
        torch.testing.assert_close((moved * 3).to_torch(), torch.arange(4.0) * 3)
        st = proc.runtime.worker_stats()  # settles every posted receive and send first
        assert {0, 1} <= set(st)  # both stages (the shared pool may hold more workers)
