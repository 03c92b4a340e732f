"""dtorch.recovery on the process backend: a worker SIGKILLed or SIGSTOPped mid-step (forward, backward,
optimizer step) is replaced, the snapshot written back into the same tensor objects, and the step re-run:
losses and final weights equal the uninterrupted run bit for bit; nothing is left behind.

The default runs use a dp2 x tp2 mesh (4 workers); ``-m slow`` adds the dp2 x fsdp2 x tp2 sweep (8 workers).
"""
from __future__ import annotations

import os
import random
import warnings

import pytest
import torch

import dtorch
from dtorch.recovery import RecoveryError
from dtorch.runtime.process import WorkerError
from tests.llama_models import hf_model

from .conftest import process_graph, using
from .test_process_faults import alive, wait_gone

HEARTBEAT_S = 2  # a stopped worker is named after this long (the fixture's Graphs)
STEPS = 3


def _shm_dirs() -> set:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"dtorch-{os.getpid()}-")}


class Trainer:
    """A small Llama trained with AdamW for STEPS steps under a snapshot; ``phases`` is the op count at the
    end of forward, backward and optimizer step of one step (measured on the uninterrupted run)."""

    def __init__(self, graph, dims=(("dp", 2), ("tp", 2)), every=1):
        from dtorch.models.llama import LlamaForCausalLM

        self.graph = graph
        hf = hf_model()
        names, sizes = zip(*dims)
        with using(graph):
            mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
            self.model = LlamaForCausalLM(hf.config, mesh)
            self.model.load_state_dict(hf.state_dict())
            self.opt = dtorch.optim.AdamW(self.model.parameters(), lr=1e-2)
            self.snap = dtorch.recovery.snapshot(self.model, self.opt, every=every)
        gen = torch.Generator().manual_seed(5)
        self.batches = [torch.randint(0, hf.config.vocab_size, (4, 6), generator=gen) for _ in range(STEPS)]
        self.phases: list = []

    def step(self, ids):
        ops = self.first_op = self.graph.runtime.stats["ops"]
        self.opt.zero_grad()
        loss = self.model(ids, labels=ids).loss
        marks = [self.graph.runtime.stats["ops"] - ops]
        loss.backward()
        marks.append(self.graph.runtime.stats["ops"] - ops)
        self.opt.step()
        marks.append(self.graph.runtime.stats["ops"] - ops)
        self.phases = marks
        return loss.item()

    def kinds(self) -> list:
        """What each op of the latest step was ("kernel", "step" (a redistribution step), "put", "get", ...)."""
        ops = self.graph.runtime._ops
        return [ops[seq][0] for seq in range(self.first_op + 1, self.first_op + self.phases[-1] + 1)]

    def run(self, fault=None):
        """(losses, {name: final weight}); ``fault``: (step index, device, op within the step, kind)."""
        losses = []
        with using(self.graph):
            for i, ids in enumerate(self.batches):
                if fault is not None and fault[0] == i:
                    dtorch.recovery.inject_fault(fault[1], at_op=fault[2], kind=fault[3])
                losses.append(self.snap.run_step(self.step, ids))
            return losses, {n: p.to_torch() for n, p in self.model.named_parameters()}


@pytest.fixture(scope="module")
def graph():
    g = process_graph(workers=4, heartbeat_timeout_s=HEARTBEAT_S)
    yield g
    g.runtime.shutdown()


@pytest.fixture(scope="module")
def reference(graph):
    """The uninterrupted run: (losses, weights, op count at the end of forward / backward / optimizer step)."""
    t = Trainer(graph)
    losses, weights = t.run()
    return losses, weights, t.phases


def _same(got, reference):
    losses, weights = got
    assert losses == reference[0]
    for name, w in reference[1].items():
        assert torch.equal(weights[name], w), name


def test_worker_pids_name_the_live_workers(graph, reference):
    pids = graph.worker_pids()
    assert sorted(pids) == [0, 1, 2, 3] and all(alive(p) for p in pids.values())
    assert dtorch.Graph(backend="inprocess").worker_pids() == {}


@pytest.mark.parametrize("phase", [pytest.param("forward", marks=pytest.mark.slow), "backward",
                                   pytest.param("optimizer", marks=pytest.mark.slow)])
def test_a_killed_worker_is_replaced_and_the_step_rerun_bit_for_bit(graph, reference, phase):
    ends = reference[2]
    start = {"forward": 0, "backward": ends[0], "optimizer": ends[1]}[phase]
    end = {"forward": ends[0], "backward": ends[1], "optimizer": ends[2]}[phase]
    t = Trainer(graph)
    old = graph.worker_pids()
    shm_before = _shm_dirs()
    got = t.run(fault=(1, 1, (start + end) // 2, "kill"))
    _same(got, reference)
    (event,) = t.snap.events
    assert event.step == 2 and event.devices == (1,) and event.rebuilt > 0
    # nothing left behind: the old workers are gone (all of them: the group restarted), their /dev/shm too
    assert wait_gone(list(old.values())) == []
    new = graph.worker_pids()
    assert sorted(new) == [0, 1, 2, 3] and not set(new.values()) & set(old.values())
    assert len(_shm_dirs()) == len(shm_before) and _shm_dirs() != shm_before


def test_a_stopped_worker_is_replaced_after_the_heartbeat_timeout(graph, reference):
    t = Trainer(graph)
    old = graph.worker_pids()
    got = t.run(fault=(2, 3, reference[2][1] + 5, "stop"))  # in the optimizer step of the last step
    _same(got, reference)
    (event,) = t.snap.events
    assert event.devices == (3,) and "stopped answering" in event.reason
    assert event.seconds < 60
    assert wait_gone(list(old.values())) == []  # the stopped one too


def test_user_held_tensors_stay_valid_and_every_two_steps_replays_the_step_before(graph, reference):
    """every=2: a fault in step 2 re-runs step 1 from the snapshot of step 0, then step 2. A parameter the user
    holds, an optimizer state and a dtorch tensor passed to the step are the same objects afterwards, readable."""
    t = Trainer(graph, every=2)
    weight = t.model.model.embed_tokens.weight
    held = []

    def step(ids, scale):
        held.append(scale)
        return t.step(ids) * scale.to_torch().item()

    with using(graph):
        scale = dtorch.Tensor(torch.tensor([1.0]), device_mesh=weight.device_mesh)
        losses = [t.snap.run_step(step, t.batches[0], scale)]
        dtorch.recovery.inject_fault(2, at_op=reference[2][0] // 2, kind="kill")
        losses += [t.snap.run_step(step, ids, scale) for ids in t.batches[1:]]
        weights = {n: p.to_torch() for n, p in t.model.named_parameters()}
        assert t.model.model.embed_tokens.weight is weight and torch.equal(weight.to_torch(), weights["model.embed_tokens.weight"])
        assert scale.to_torch().item() == 1.0 and all(s is scale for s in held)
        state = t.opt.state[weight]["exp_avg"]
        assert state.to_torch().shape == weight.shape
    _same((losses, weights), reference)
    (event,) = t.snap.events
    assert event.step == 2 and len(held) == STEPS + 2  # steps 1 and 2 ran again


def test_two_faults_in_one_step_are_a_clear_error(graph, reference):
    t = Trainer(graph)
    first = reference[2][0] // 2

    def step(ids):
        if not t.snap.events:  # the second run of the step loses another device
            return t.step(ids)
        dtorch.recovery.inject_fault(0, at_op=first, kind="kill")
        return t.step(ids)

    with using(graph):
        dtorch.recovery.inject_fault(1, at_op=first, kind="kill")
        with pytest.raises(RecoveryError, match=r"(?s)step 1: 2 device losses in one step \(device ids 1, 0\).*worker 1.*worker 0"):
            t.snap.run_step(step, t.batches[0])
        # never a wrong value: the lost tensors say so; a restore brings back the snapshot, a step runs again
        with pytest.raises(dtorch.RuntimeBackendError, match="blocks are gone"):
            t.model.model.norm.weight.to_torch()
        t.snap.restore()
        assert t.snap.run_step(t.step, t.batches[0]) == reference[0][0]


def test_a_worker_lost_while_it_writes_the_snapshot_re_runs_from_the_one_before(graph, reference):
    """Worker 1 dies just before it writes step 2's snapshot into its mirror file (the op after the step's ops and
    its loss.item()): step 2's snapshot never counts, so the snapshot of step 1 is restored and the steps since
    it run again (step 2, and step 3 when the fault is noticed there)."""
    t = Trainer(graph)
    ends = reference[2]
    calls = []
    real = t.step
    t.step = lambda ids: calls.append(1) or real(ids)
    got = t.run(fault=(1, 1, ends[-1] + 2, "kill"))
    _same(got, reference)
    (event,) = t.snap.events
    assert event.devices == (1,) and event.step in (2, 3) and "worker 1 " in event.reason
    assert len(calls) == STEPS + event.step - 1  # restored from step 1: steps 2..event.step ran twice
    t.snap.wait()  # the last step's snapshot, written meanwhile
    assert t.snap.taken_at == STEPS


def test_the_workers_keep_the_snapshot_in_files_that_close_removes(graph, reference):
    t = Trainer(graph)
    _same(t.run(), reference)
    t.snap.wait()
    kept = t.snap.global_values()
    assert len(kept) == len(t.snap.tensors()) and t.snap.nbytes == sum(v.numel() * v.element_size()
                                                                        for _, (_, v) in kept)
    with using(graph):
        for tensor, (how, value) in kept:
            assert how == "global" and torch.equal(value, tensor.to_torch())
    where = graph.runtime._mirror_dir[0]
    mine = lambda: [f for f in os.listdir(where) if f.startswith(t.snap._mirror.name + "-")]  # noqa: E731
    assert len(mine()) == 2 * 4  # two slots, a file per worker
    t.snap.close()
    assert mine() == []


def test_the_mirror_gives_back_uneven_shards_replicas_and_partial_terms_bit_for_bit(graph):
    from dtorch import Partial, Replicate, Shard

    with using(graph):
        mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
        full = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
        tensors = [dtorch.Tensor(full, device_mesh=mesh, placements=p) for p in
                   ([Replicate(), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()])]
        tensors.append(dtorch.Tensor(full[:1], device_mesh=mesh, placements=[Shard(0), Shard(0)]))  # empty blocks
        tensors.append(dtorch.Tensor(full, device_mesh=mesh, placements=[Replicate(), Replicate()])
                       .redistribute(mesh, [Partial(), Replicate()]))  # terms: not a global value
        copy = graph.runtime.mirror_many([t._h for t in tensors], [t._spec for t in tensors], "test-mirror")
        try:
            copy.wait()
            got = copy.values()
            for t, (how, value) in zip(tensors[:-1], got):
                assert how == "global" and torch.equal(value, t.to_torch()), t.placements
            how, blocks = got[-1]
            assert how == "blocks" and all(torch.equal(a, b) for a, b in zip(blocks, tensors[-1].local_blocks()))
            assert copy.nbytes == 3 * full.numel() * 4 + 5 * 4 + 4 * full.numel() * 4  # the terms: 4 blocks
        finally:
            graph.runtime.mirror_drop("test-mirror")
        assert not [f for f in os.listdir(graph.runtime._mirror_dir[0]) if f.startswith("test-mirror")]


@pytest.mark.parametrize("fault_step", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_a_mirror_file_that_cannot_be_written_falls_back_to_fetched_snapshots(graph, reference, fault_step):
    """Worker 1 cannot write its file of step 1's snapshot (made a link to /dev/full: the write fails with an
    OSError, as on a full /dev/shm). Training goes on; that snapshot does not count and the later ones are fetched
    to the controller, said in one warning. A worker killed in step 2 (re-run from step 0's snapshot) or in step 3
    (from step 2's fetched one) is recovered bit for bit; no mirror file is left."""
    from dtorch.recovery.snapshot import Fetch

    t = Trainer(graph)
    where = graph.runtime._mirror_dir[0]
    full = os.path.join(where, f"{t.snap._mirror.name}-1-1")  # slot 1 (step 1's snapshot), worker 1's file
    os.symlink("/dev/full", full)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = t.run(fault=(fault_step, 2, reference[2][0] // 2, "kill"))
    _same(got, reference)
    (event,) = t.snap.events
    assert (event.step, event.devices) == (fault_step + 1, (2,))
    said = [str(w.message) for w in caught if "could not be kept in shared memory" in str(w.message)]
    if fault_step == 2:  # (a fault in step 2 may come before the controller read why: the snapshot then just fails)
        assert len(said) == 1 and "snapshot of step 1" in said[0] and "worker 1: " in said[0], said
        assert "/dev/shm" in said[0] and "--shm-size" in said[0]
    t.snap.wait()
    assert t.snap.taken_at == STEPS and isinstance(t.snap._kept, Fetch) == bool(said)
    assert not os.path.islink(full)  # (the worker removed it; a later snapshot in slot 1 may have written the file)
    assert bool(said) == (not [f for f in os.listdir(where) if f.startswith(t.snap._mirror.name + "-")])


def test_no_room_in_dev_shm_for_a_snapshot_fetches_that_snapshot(graph, reference, monkeypatch):
    """/dev/shm has no room for step 1's mirror files, known before they are written: that snapshot is fetched to
    the controller, and so are the later ones, said in one warning; a worker killed in step 2 is recovered from
    the fetched snapshot bit for bit, and the older mirror files are gone."""
    from dtorch.recovery.snapshot import Fetch
    from dtorch.runtime import process_plan

    t = Trainer(graph)
    real, calls = t.step, []

    def step(ids):
        calls.append(1)
        if len(calls) == 1:  # (step 0's snapshot is in the mirror files; slot 1 has none yet to overwrite)
            monkeypatch.setattr(process_plan, "free_bytes", lambda path: 0)
        if len(calls) == 2:
            t.snap.wait()  # step 1's fetched snapshot counts before the fault (else step 0's would be restored)
        return real(ids)

    t.step = step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = t.run(fault=(1, 1, (reference[2][0] + reference[2][1]) // 2, "kill"))
    _same(got, reference)
    assert [(e.step, e.devices) for e in t.snap.events] == [(2, (1,))]
    assert len(calls) == STEPS + 1  # only step 2 ran again: step 1's fetched snapshot counted
    (said,) = [str(w.message) for w in caught if "could not be kept in shared memory" in str(w.message)]
    assert "snapshot of step 1" in said and "[Errno 28]" in said and "fetched to the controller instead" in said
    t.snap.wait()
    assert isinstance(t.snap._kept, Fetch) and t.snap.taken_at == STEPS
    where = graph.runtime._mirror_dir[0]
    assert not [f for f in os.listdir(where) if f.startswith(t.snap._mirror.name + "-")]


def test_off_and_op_errors_raise_as_without_recovery(graph, reference):
    t = Trainer(graph)
    try:
        dtorch.recovery.configure("off")
        with using(graph):
            dtorch.recovery.inject_fault(1, at_op=3, kind="kill")
            with pytest.raises(WorkerError, match="worker 1 .* died: killed by signal SIGKILL"):
                t.snap.run_step(t.step, t.batches[0])
    finally:
        dtorch.recovery.configure("replace")
    assert t.snap.events == [] and t.snap.steps == 0
    # an op that raises on a worker loses no device: it would raise again, so it is not re-run
    with using(graph):
        t.snap.restore()
        mesh = t.model.model.norm.weight.device_mesh

        def bad_step():
            ints = dtorch.Tensor(torch.arange(8), device_mesh=mesh)
            return (ints // 0).to_torch()

        with pytest.raises(WorkerError, match="ZeroDivisionError") as err:
            t.snap.run_step(bad_step)
        assert err.value.lost_devices == () and t.snap.events == []


def test_inject_fault_names_the_kinds_its_backend_has(graph, reference):
    with using(graph), pytest.raises(ValueError, match=r"kind is one of 'kill', 'stop' on the process backend"):
        dtorch.recovery.inject_fault(0, at_op=1, kind="ray_kill")  # (ray.kill: the ray backend's)


def lose_device_at_second_optimizer_step(monkeypatch, device: int) -> list:
    """Make AdamW's second step kill worker ``device`` at its first op; returns the list of step calls made."""
    real_step, calls = dtorch.optim.AdamW.step, []

    def step_losing_device(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            dtorch.recovery.inject_fault(device, at_op=1, kind="kill")
        return real_step(self, *a, **k)

    monkeypatch.setattr(dtorch.optim.AdamW, "step", step_losing_device)
    return calls


def test_dtorch_train_recover_replace_reports_the_event_and_keeps_the_loss_curve(graph, monkeypatch, capsys):
    from dtorch.models import train_cli

    small = ["--layers", "2", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--seq", "16", "--batch", "4",
             "--pp", "1", "--ulysses-cp", "1", "--steps", "2", "--recover", "replace"]
    args = train_cli.build_parser().parse_args(small)
    with using(graph):
        clean = train_cli.train(args, progress=False).losses
        calls = lose_device_at_second_optimizer_step(monkeypatch, 2)
        capsys.readouterr()
        faulty = train_cli.train(args, progress=False).losses
    assert faulty == clean and len(calls) == 3  # the second step ran twice
    out = capsys.readouterr().out
    assert "dtorch train: recovered step 2: device 2 lost and replaced" in out and "s lost" in out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ray_kill", "kill"])  # ray.kill from the controller; the actor's own SIGKILL
def test_ray_backend_replaces_a_killed_actor_bit_for_bit(ray_cluster, kind):
    from .conftest import ray_graph

    g = ray_graph(workers=4, heartbeat_timeout_s=HEARTBEAT_S)
    try:
        ref = Trainer(g)
        want = ref.run()
        t = Trainer(g)
        old = g.worker_pids()
        got = t.run(fault=(1, 2, (ref.phases[0] + ref.phases[1]) // 2, kind))
        _same(got, want)
        (event,) = t.snap.events
        assert (event.step, event.devices) == (2, (2,)) and event.rebuilt == len(t.snap.tensors())
        assert "device actor 2 " in event.reason and " died " in event.reason, event.reason
        assert wait_gone(list(old.values())) == []
        assert sorted(g.worker_pids()) == [0, 1, 2, 3] and not set(g.worker_pids().values()) & set(old.values())
    finally:
        g.runtime.shutdown()


# -- the acceptance sweep: dp2 x fsdp2 x tp2, 8 workers, a worker SIGKILLed at random ops -----------------------
HSDP_TP = (("dp", 2), ("fsdp", 2), ("tp", 2))
SWEEP = 20


@pytest.fixture(scope="module")
def graph8():
    g = process_graph(workers=8, heartbeat_timeout_s=HEARTBEAT_S)
    yield g
    g.runtime.shutdown()


@pytest.fixture(scope="module")
def reference8(graph8):
    t = Trainer(graph8, dims=HSDP_TP)
    losses, weights = t.run()
    return losses, weights, random_faults(t, devices=8, seed=27)


def random_faults(t, devices: int, seed: int, runs: int = SWEEP) -> list:
    """``runs`` faults (step, device, op within the step, where) placed in forward, backward, optimizer step and
    at redistribution steps, in turn; ``t``: a trainer after its uninterrupted run (its op kinds and phases)."""
    kinds = t.kinds()
    fwd, bwd, _ = t.phases
    rng = random.Random(seed)
    where = {"forward": range(fwd), "backward": range(fwd, bwd), "optimizer": range(bwd, len(kinds)),
             "redistribution": [i for i, k in enumerate(kinds) if k == "step"]}
    faults = []
    for n in range(runs):
        phase = list(where)[n % 4]
        faults.append((rng.randrange(STEPS), rng.randrange(devices), rng.choice(list(where[phase])) + 1, phase))
    return faults


@pytest.mark.slow
@pytest.mark.parametrize("run", range(SWEEP))
def test_hsdp_tp_training_survives_a_killed_worker_at_random_ops(graph8, reference8, run):
    step, device, op, phase = reference8[2][run]
    t = Trainer(graph8, dims=HSDP_TP)
    got = t.run(fault=(step, device, op, "kill"))
    _same(got, reference8)
    assert [(e.step, e.devices) for e in t.snap.events] == [(step + 1, (device,))], phase
