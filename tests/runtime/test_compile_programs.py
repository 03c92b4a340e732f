"""Compiled steps as worker programs on the process backend (compile/program.py, runtime/process_program.py): a
step run as one program per worker gives the call-by-call replay's bits (``DTORCH_COMPILE_PROGRAMS=0``), also
after its trace was evicted (the program is dropped on the workers and made again) and after a worker was lost
and replaced (the program is recorded again on the new workers; the fault fires at its op)."""
from __future__ import annotations

import gc

import torch

import dtorch
from dtorch.models.llama import LlamaForCausalLM
from tests.compile.test_compile_llama import train_step
from tests.llama_models import hf_model

from .conftest import process_graph, using


def _model(mesh):
    hf = hf_model()
    m = LlamaForCausalLM(hf.config, mesh)
    m.load_state_dict(hf.state_dict())
    return m, dtorch.optim.AdamW(m.parameters(), lr=1e-2), hf.config.vocab_size


class Twin:
    """A model and its compiled step, with worker programs on or off (the environment while it replays)."""

    def __init__(self, mesh, programs: bool, max_traces: int = 8):
        self.model, self.opt, self.vocab = _model(mesh)
        self.step = dtorch.compile(train_step, max_traces=max_traces)
        self.programs = programs

    def __call__(self, ids, monkeypatch):
        monkeypatch.setenv("DTORCH_COMPILE_PROGRAMS", "1" if self.programs else "0")
        return self.step(self.model, self.opt, ids).to_torch()

    def state(self) -> dict:
        """The weights and optimizer states, on the host."""
        out = {}
        for name, p in self.model.named_parameters():
            s = self.opt.state[p]
            out[name] = (p.to_torch(), s["exp_avg"].to_torch(), s["exp_avg_sq"].to_torch(), float(s["step"]))
        return out


def _same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, (w, m, v, step) in a.items():
        w2, m2, v2, step2 = b[name]
        assert torch.equal(w, w2) and torch.equal(m, m2) and torch.equal(v, v2) and step == step2, name


def _batches(vocab, shapes):
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, shape, generator=gen) for shape in shapes]


def _programs_on_workers(rt, devices: int = 4) -> set:
    """The program counts of the mesh's workers (a shared pool that an earlier test grew holds more, with none)."""
    return {s["programs"] for rank, s in rt.worker_stats().items() if rank < devices}


def test_program_steps_equal_the_call_by_call_replay_also_after_an_eviction(process_pool, monkeypatch):
    rt = process_pool.runtime
    with using(process_pool):
        mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
        on, off = Twin(mesh, True, max_traces=2), Twin(mesh, False, max_traces=2)
        base = _programs_on_workers(rt)
        (n0,) = base
        # 5 steps of [3, 5] (2 traces, 3 replays: the second recorded, the third a program run), then [2, 5] and
        # [3, 4] (traced: the [3, 5] trace is evicted, its program dropped), then [3, 5] again (traced afresh)
        shapes = [(3, 5)] * 5 + [(2, 5)] * 4 + [(3, 4)] * 2 + [(3, 5)] * 5
        runs = rt.stats["program_runs"]
        for n, ids in enumerate(_batches(on.vocab, shapes)):
            l1, l2 = on(ids, monkeypatch), off(ids, monkeypatch)
            assert torch.equal(l1, l2), f"step {n} {tuple(ids.shape)}: {l1} vs {l2}"
            if n == 4:  # the [3, 5] trace: 2 traced calls (a warm-up), 1 replayed call by call, 1 recorded, 1 run
                assert rt.stats["program_runs"] == runs + 1 and _programs_on_workers(rt) == {n0 + 1}
            if n == 8:  # [2, 5]: traced, replayed call by call, recorded, run
                assert rt.stats["program_runs"] == runs + 2 and _programs_on_workers(rt) == {n0 + 2}
            if n == 9:  # [3, 4] traced: the [3, 5] trace is evicted, its program dropped on the workers
                assert _programs_on_workers(rt) == {n0 + 1}
        # the new [3, 5] trace: recorded at its third call, run at its fourth and fifth ([2, 5]'s trace evicted)
        assert rt.stats["program_runs"] == runs + 4 and _programs_on_workers(rt) == {n0 + 1}
        assert on.step.stats == off.step.stats
        _same_state(on.state(), off.state())
    del on
    gc.collect()
    assert _programs_on_workers(rt) == {n0}  # dropped with their traces


def test_a_lost_worker_mid_program_is_replaced_and_the_program_made_again(monkeypatch):
    g = process_graph(workers=4, heartbeat_timeout_s=2)
    try:
        with using(g):
            mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
            ref = Twin(mesh, False)
            batches = _batches(ref.vocab, [(3, 5)] * 10)
            want = [ref(ids, monkeypatch) for ids in batches]
            want_state = ref.state()
            del ref
            on = Twin(mesh, True)
            snap = dtorch.recovery.snapshot(on.model, on.opt, every=1)
            monkeypatch.setenv("DTORCH_COMPILE_PROGRAMS", "1")
            got, runs = [], []
            for n, ids in enumerate(batches):
                if n == 5:  # the step before ran as a program: lose worker 2 midway through this one
                    assert g.runtime.stats["program_runs"] == 1
                    dtorch.recovery.inject_fault(2, at_op=150, kind="kill")
                got.append(snap.run_step(lambda x: on.step(on.model, on.opt, x).to_torch(), ids))
                runs.append(g.runtime.stats["program_runs"])
            (event,) = snap.events
            assert event.devices == (2,)
            for n, (a, b) in enumerate(zip(got, want)):
                assert torch.equal(a, b), f"step {n}: {a} vs {b}"
            # step 5 ran call by call (the fault was armed); re-run after the recovery it is traced again (the
            # snapshot put new optimizer state dicts in place), then replayed call by call, recorded on the new
            # workers and run as a program
            assert runs[4:] == [1, 1, 1, 1, 2, 3]
            _same_state(on.state(), want_state)
    finally:
        g.runtime.shutdown()
