"""A batch smaller than the devices sharding it (issue 22, deliverable 4): the devices with an empty shard run
nothing, the busy ones run each kernel once together (runtime/box.py), and values are torch's."""
from __future__ import annotations

import pytest
import torch
import transformers

import dtorch
from dtorch import Shard
from dtorch.models.llama import LlamaForCausalLM
from dtorch.runtime import inprocess

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
