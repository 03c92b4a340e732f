"""A batch smaller than the devices sharding it (issue 22, deliverable 4): the devices with an empty shard run
nothing, the busy ones run each kernel once together (runtime/box.py), and values are torch's."""
from __future__ import annotations

import pytest
import torch
import transformers

import dtorch
from dtorch import Partial, Shard
from dtorch.models.llama import LlamaForCausalLM
from dtorch.runtime import inprocess
from sweep import distribute

from ..models.test_llama import Layout, make_config
from ..models.test_llama_train import TOL, _batch, _compare_grads

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def device_calls(monkeypatch):
    """Every kernel call the in-process backend makes for one device alone: [(kernel name, device index)]."""
    calls = []
    real = inprocess._Executable._run_on_device

    def counted(self, n, blocks_in, kwargs, device_args):
        calls.append((self.kernel.name, n))
        return real(self, n, blocks_in, kwargs, device_args)

    monkeypatch.setattr(inprocess._Executable, "_run_on_device", counted)
    return calls


def test_ops_on_a_batch_with_empty_shards_run_once_on_the_busy_devices_and_match_torch(device_calls):
    mesh = dtorch.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    x_ref = torch.randn(2, 6, requires_grad=True)
    w_ref = torch.randn(5, 6, requires_grad=True)
    x = dtorch.from_torch(x_ref.detach(), device_mesh=mesh, placements=[Shard(0)]).requires_grad_()  # rows 1, 1, 0, 0
    w = dtorch.from_torch(w_ref.detach(), device_mesh=mesh, placements=[dtorch.Replicate()]).requires_grad_()
    y = torch.nn.functional.linear((x * 2).relu(), w).softmax(-1)
    assert [tuple(b.shape) for b in y.local_blocks()] == [(1, 5), (1, 5), (0, 5), (0, 5)]
    ref = torch.nn.functional.linear((x_ref * 2).relu(), w_ref).softmax(-1)
    g = torch.randn(2, 5)
    y.backward(dtorch.from_torch(g, device_mesh=mesh, placements=[Shard(0)]))
    ref.backward(g)
    torch.testing.assert_close(y.to_torch(), ref.detach())
    torch.testing.assert_close(x.grad.to_torch(), x_ref.grad)
    torch.testing.assert_close(w.grad.to_torch(), w_ref.grad)
    assert device_calls == []  # no device ran anything alone: the busy ones together, the idle ones nothing


def _llama_step_calls(layers: int, device_calls) -> list:
    cfg = make_config(num_hidden_layers=layers)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    layout = Layout("fsdp4 batch 2", (("fsdp", 4),), batch=2, seq=5)
    ids, labels = _batch(layout, cfg.vocab_size)
    model = LlamaForCausalLM(cfg, layout.mesh())
    model.load_state_dict(hf.state_dict())
    device_calls.clear()
    out = model(ids, labels=labels)
    out.loss.backward()
    calls = list(device_calls)
    ref = hf(ids, labels=labels)
    ref.loss.backward()
    torch.testing.assert_close(out.loss.to_torch(), ref.loss.detach(), rtol=TOL, atol=TOL)
    _compare_grads(model, hf)
    return calls


def test_a_llama_step_with_empty_shards_costs_the_idle_devices_nothing_per_layer(device_calls):
    """fsdp4, batch 2: devices 2 and 3 hold no row. Loss and gradients are Hugging Face's; no device runs a
    decoder layer's kernel alone (the busy ones run each once together, the idle ones not at all). What the idle
    devices run alone is the loss's sums over their empty rows (a zero term each), the same for 1 layer as for 3."""
    one, three = _llama_step_calls(1, device_calls), _llama_step_calls(3, device_calls)
    assert {n for _, n in one + three} <= {2, 3}
    assert sorted(one) == sorted(three)
    assert len(one) <= 8, one


@pytest.mark.parametrize("batch", [1, 2])
def test_conv_and_pool_with_empty_blocks_run_on_the_box_and_match_torch(batch, device_calls):
    """dp2 x sp2, spatial shards: the stride-2 conv on 2 rows leaves the sp device 1 with no output row (its
    cotangent block is empty), and batch 1 leaves dp device 1 with no row at all. The halo-extended input of that
    conv is even, so the box takes it from a whole-mesh grid: the box covers one device of sp, and that grid
    dim must be cut to the box's device (else the VJP adds the other device's window to the weight gradient).
    Values and every gradient are torch's; no conv or pool kernel runs on a device alone (a device whose window
    has no output row is idle too)."""
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "sp"])
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
           for s in ((batch, 2, 4, 5), (3, 2, 3, 3), (3,), (4, 3, 3, 3), (4,))]

    def net(x, w1, b1, w2, b2):
        y = torch.nn.functional.max_pool2d(torch.nn.functional.conv2d(x, w1, b1, padding=1), 2)  # [.., 2, 2]
        y = torch.nn.functional.conv2d(y, w2, b2, stride=2, padding=1)  # one output row: on sp device 0
        return torch.nn.functional.avg_pool2d(y, 1) * 3

    want = net(*ref)
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want.backward(g)
    ins = [dtorch.from_torch(ref[0].detach(), device_mesh=mesh, placements=[Shard(0), Shard(2)]).requires_grad_()]
    ins += [dtorch.from_torch(t.detach(), device_mesh=mesh, placements=[dtorch.Replicate()] * 2).requires_grad_()
            for t in ref[1:]]
    out = net(*ins)
    out.backward(dtorch.from_torch(g, device_mesh=mesh, placements=[Shard(0), dtorch.Replicate()]))
    torch.testing.assert_close(out.to_torch(), want.detach())
    for k, (got, r) in enumerate(zip(ins, ref)):
        torch.testing.assert_close(got.grad.to_torch(), r.grad, msg=lambda m: f"gradient of input {k}: {m}")
    # (an idle device builds its halo-extended block alone: padding where its block is empty)
    assert [c for c in device_calls if c[0].removeprefix("vjp:") in ("conv.conv", "pool.pool")] == []


@pytest.mark.parametrize("op", ["avg", "max"])
def test_a_non_sum_partial_with_empty_blocks_runs_on_the_box_and_matches_torch(op, device_calls):
    """x [S(0), P(op)] with one row over 2: the busy devices' terms differ, the idle ones hold no row. The box
    never takes an idle device's term for zero (their outputs are empty); values and gradients are torch's."""
    mesh = dtorch.init_device_mesh("cpu", (2, 2))
    gen = torch.Generator().manual_seed(0)
    x_ref, w_ref = (torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in ((1, 5), (3, 5)))
    x = distribute(x_ref.detach(), mesh, [Shard(0), Partial(op)], seed=1).requires_grad_()
    w = dtorch.from_torch(w_ref.detach(), device_mesh=mesh, placements=[dtorch.Replicate()] * 2).requires_grad_()

    def net(x, w):  # (the linear keeps P(avg), amax P(max); exp needs the value: a reduction first)
        y = torch.nn.functional.linear(x, w) if op == "avg" else x.amax(-1, keepdim=True)
        return y, (y * w.sum(-1)).exp() * 2

    want = net(x_ref, w_ref)[1]
    g = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want.backward(g)
    y, out = net(x, w)
    assert y.placements[1] == Partial(op)  # the partial reaches kernels that run on the box
    out.backward(dtorch.from_torch(g, device_mesh=mesh, placements=[Shard(0), dtorch.Replicate()]))
    torch.testing.assert_close(out.to_torch(), want.detach())
    torch.testing.assert_close(x.grad.to_torch(), x_ref.grad)
    torch.testing.assert_close(w.grad.to_torch(), w_ref.grad)
    assert device_calls == []  # no device ran anything alone: the busy ones together, the idle ones nothing
