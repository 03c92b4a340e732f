"""dtorch.compile(fn, backend="inductor"): the replay's local calls run as torch.compile'd segments and give the
eager step's values within torch.compile's own float32 tolerance (``torch.testing.assert_close``'s defaults:
rtol 1.3e-6, atol 1e-5; torch.compile of the same torch function differs from eager by as much, see
``test_the_tolerance_is_torch_compiles_own``).

torch.compile is slow to compile on a CPU (its first compile in a process with a cold cache: ~40 s on the shared
2-core machine): the default tests compile two small segments (a forward on one device, an AdamW update on dp2 x
tp2); the AdamW update on one device, the Llama forwards and generate are marked slow.
"""
from __future__ import annotations

import time

import pytest
import torch

import dtorch
from dtorch.compile import inductor
from dtorch import Replicate, Shard

from .test_compile import _train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _mesh(*shape, names=("dp", "tp")):
    return dtorch.init_device_mesh("cpu", shape, mesh_dim_names=list(names[:len(shape)])) if shape else \
        dtorch.DeviceMesh("cpu")


def _t(x, mesh, placements):
    return dtorch.Tensor(x, device_mesh=mesh, placements=placements)


def _mlp(mesh, seed=0):
    torch.manual_seed(seed)
    return dtorch.nn.Sequential(dtorch.nn.Linear(6, 16, device_mesh=mesh), dtorch.nn.ReLU(),
                                dtorch.nn.Linear(16, 3, device_mesh=mesh))


def _forward(model, x):
    return (model(x) * 2 + 1).softmax(-1)


def _graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def test_a_no_grad_forward_runs_as_one_compiled_segment_with_eager_values():
    mesh = _mesh()
    model = _mlp(mesh)
    step = dtorch.compile(_forward, backend="inductor")
    before = _graphs()
    with torch.no_grad():
        for n in range(6):
            x = _t(torch.randn(5, 6, generator=torch.Generator().manual_seed(n)), mesh, [Replicate()])
            torch.testing.assert_close(step(model, x).to_torch(), _forward(model, x).to_torch())
    assert step.stats["replays"] == 5, step.stats
    (seg,) = step.inductor.segments  # linear, relu, linear, *2, +1, softmax: one segment
    assert len(seg.calls) >= 6 and seg.compiled is not None and seg.calls_made == 4
    assert _graphs() - before == 1  # compiled once, no recompile
    assert not step.inductor.fallbacks
    assert "1 compiled" in step.explain(model, x)


def test_a_tensor_parallel_forward_fuses_its_all_reduce_and_matches_eager():
    mesh = _mesh(2, 2)
    torch.manual_seed(0)
    model = dtorch.nn.Sequential(dtorch.nn.ColumnParallelLinear(6, 16, device_mesh=mesh), dtorch.nn.ReLU(),
                                 dtorch.nn.RowParallelLinearWithReplicateOutput(16, 3, device_mesh=mesh))
    step = dtorch.compile(_forward, backend="inductor")
    with torch.no_grad():
        for n in range(6):
            x = _t(torch.randn(6, 6, generator=torch.Generator().manual_seed(n)), mesh, [Shard(0), Replicate()])
            torch.testing.assert_close(step(model, x).to_torch(), _forward(model, x).to_torch())
    assert step.stats["replays"] == 5 and step.inductor.segments and not step.inductor.fallbacks
    kinds = [kind for seg in step.inductor.segments for _, (kind, _) in seg.calls]
    assert "step" in kinds and "run" in kinds  # the row-parallel linear's all-reduce runs inside a segment
    assert all(seg.compiled is not None for seg in step.inductor.segments)


@pytest.mark.parametrize("shape", [pytest.param((), marks=pytest.mark.slow), (2, 2)],
                         ids=["one device", "dp2 x tp2"])
def test_adamw_steps_with_the_update_fused_match_eager(shape):
    mesh = _mesh(*shape)
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    (m1, m2) = _mlp(mesh), _mlp(mesh)
    o1, o2 = (dtorch.optim.AdamW(m.parameters(), lr=1e-2) for m in (m1, m2))
    step = dtorch.compile(_train, backend="inductor")
    before = _graphs()
    for n in range(7):  # warm-up, trace, replay, rebuilt replay (segment eager), then compiled replays
        g = torch.Generator().manual_seed(n)
        x, y = _t(torch.randn(8, 6, generator=g), mesh, placements), _t(torch.randn(8, 3, generator=g), mesh, placements)
        torch.testing.assert_close(step(m2, o2, x, y).to_torch(), _train(m1, o1, x, y).to_torch())
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p2.to_torch(), p1.to_torch())
        torch.testing.assert_close(o2.state[p2]["exp_avg_sq"].to_torch(), o1.state[p1]["exp_avg_sq"].to_torch())
        assert float(o2.state[p2]["step"]) == float(o1.state[p1]["step"]) == 7
    (seg,) = step.inductor.segments  # the whole AdamW update (3 in-place kernels a parameter) is one segment
    assert len(seg.calls) == 3 * len(list(m1.parameters())) and seg.compiled is not None
    # the bias corrections change every step: passed as tensors, they do not make torch.compile recompile
    assert _graphs() - before == 1 and not step.inductor.fallbacks


def test_a_segment_torch_compile_cannot_take_runs_eagerly_and_says_why(monkeypatch):
    def refuse(fn, **kw):
        def compiled(*args):
            raise RuntimeError("no C++ compiler (a test's stand-in for a torch.compile failure)")
        return compiled

    monkeypatch.setattr(inductor.torch, "compile", refuse)
    mesh = _mesh(2)
    model = _mlp(mesh)
    step = dtorch.compile(_forward, backend="inductor")
    with torch.no_grad():
        for n in range(5):
            x = _t(torch.randn(4, 6), mesh, [Shard(0)])
            assert torch.equal(step(model, x).to_torch(), _forward(model, x).to_torch())  # eager: the same bits
    assert step.stats["replays"] == 4
    assert len(step.inductor.fallbacks) == 1 and "no C++ compiler" in step.inductor.fallbacks[0]
    assert "ran eagerly: " in step.inductor.describe()


def test_a_segment_slower_compiled_than_eager_runs_eagerly(monkeypatch):
    def slow_compile(fn, **kw):
        def compiled(*args):
            time.sleep(0.01)  # a compiled call's fixed cost, exaggerated
            return fn(*args)
        return compiled

    monkeypatch.setattr(inductor.torch, "compile", slow_compile)
    mesh = _mesh(2)
    model = _mlp(mesh)
    step = dtorch.compile(_forward, backend="inductor")
    with torch.no_grad():
        for n in range(12):  # trace, replay, then the segment: eager, compiled (x4), eager (x3), then its choice
            x = _t(torch.randn(4, 6), mesh, [Shard(0)])
            assert torch.equal(step(model, x).to_torch(), _forward(model, x).to_torch())
    (seg,) = step.inductor.segments
    assert seg.calls_made == 10 and seg.compiled is None and step.inductor.slower == 1
    assert not step.inductor.fallbacks and "measured faster" in step.inductor.describe()


def test_inductor_is_in_process_only_and_says_so():
    with dtorch.Graph(backend="reference"):
        mesh = _mesh(2)
        x = _t(torch.randn(4, 3), mesh, [Shard(0)])
        with pytest.raises(ValueError, match="in-process backend only"):
            dtorch.compile(lambda a: a + 1, backend="inductor")(x)


def test_the_tolerance_is_torch_compiles_own():
    """torch.compile of a torch function differs from torch eager as our segments differ from dtorch eager: both
    within assert_close's float32 defaults (a softmax and a fused AdamW-like update on the same values)."""
    def f(w, x, v):
        y = (x @ w).relu() * 2 + 1
        w.addcdiv_(y.sum(0).expand_as(w), (v.sqrt() / 0.3).add_(1e-8), value=-1e-3)
        return y.softmax(-1)

    gen = torch.Generator().manual_seed(0)
    w, x, v = torch.randn(16, 16, generator=gen), torch.randn(8, 16, generator=gen), torch.rand(16, 16, generator=gen)
    w2 = w.clone()
    got = torch.compile(f, fullgraph=True, dynamic=False)(w2, x, v)
    want = f(w, x, v)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(w2, w)


def _llama(mesh):
    from dtorch.models.llama import LlamaForCausalLM
    from tests.llama_models import hf_model

    hf = hf_model("decode_mha")
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    return model


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(), (2, 2)], ids=["one device", "dp2 x tp2"])
def test_a_no_grad_llama_forward_matches_eager(shape):
    model = _llama(_mesh(*shape) if shape else None)
    step = dtorch.compile(lambda m, ids: m.forward(ids), backend="inductor")  # dtorch logits
    with torch.no_grad():
        for n in range(5):
            ids = torch.randint(0, 150, (2, 7), generator=torch.Generator().manual_seed(n))
            torch.testing.assert_close(step(model, ids).to_torch(), model.forward(ids).to_torch())
    assert step.stats["replays"] == 4 and step.inductor.segments and not step.inductor.fallbacks
    assert all(s.compiled is not None for s in step.inductor.segments)


@pytest.mark.slow
def test_generate_with_inductor_decode_gives_eager_tokens(monkeypatch):
    import dtorch.models.generation as generation

    model = _llama(_mesh(2, names=("tp",)))
    ids = torch.randint(0, 150, (2, 6), generator=torch.Generator().manual_seed(0))
    want = model.generate(ids, max_new_tokens=8, return_dict_in_generate=True)
    made = []

    def compile_step(fn, **kwargs):  # (generate's own options: max_traces)
        made.append(dtorch.compile(fn, backend="inductor", **kwargs))
        return made[-1]

    monkeypatch.setattr(generation, "compile_step", compile_step)
    got = model.generate(ids, max_new_tokens=8, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    (step,) = made
    assert step.stats["replays"] == 6 and any(s.compiled is not None for s in step.inductor.segments)
    assert not step.inductor.fallbacks
