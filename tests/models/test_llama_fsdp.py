"""The Llama under FSDP (issue 22): the collectives of a step, ZeRO-2, mixed precision against the same policy in
plain torch, frozen layers, selective activation checkpointing. The loss/gradient matrix against Hugging Face
(fsdp layouts included) is tests/models/test_llama_train.py's."""
from __future__ import annotations

import copy

import pytest
import torch

import dtorch
from dtorch import CommLog, MixedPrecisionPolicy
from dtorch.models.llama import LlamaForCausalLM
from tests.llama_models import hf_model

from .test_llama import Layout
from .test_llama_train import TOL, _batch, _compare_grads

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FSDP2 = Layout("fsdp2", (("fsdp", 2),), batch=4, seq=6)


def _model(layout=FSDP2, config="base", **kw):
    hf = hf_model(config)
    model = LlamaForCausalLM(hf.config, layout.mesh(), **kw)
    model.load_state_dict(hf.state_dict())
    return model, hf


@pytest.mark.parametrize("policy", [None, BF16], ids=["float32", "bf16"])
def test_each_weight_is_gathered_once_forward_and_backward_and_reduced_once_in_the_reduce_dtype(policy):
    model, hf = _model(mp_policy=policy)
    ids, labels = _batch(FSDP2, hf.config.vocab_size)
    n = len(list(model.parameters()))
    compute = torch.bfloat16 if policy else torch.float32
    for step in range(2):  # the second step prefetches the next module's weights
        with CommLog() as fwd:
            loss = model(ids, labels=labels).loss
        with CommLog() as bwd:
            loss.backward()
        model.zero_grad()
        # (besides the loss's two all-reduces of [batch, seq]-sized terms: its sum and its token count)
        assert fwd.counts() == {("all_gather", "fsdp"): n, ("all_reduce", "fsdp"): 2}, (step, fwd.table())
        assert bwd.counts() == {("all_gather", "fsdp"): n, ("reduce_scatter", "fsdp"): n}, (step, bwd.table())
        assert {r.dtype for r in fwd.records + bwd.records if r.kind == "all_gather"} == {compute}
        assert {r.dtype for r in bwd.records if r.kind == "reduce_scatter"} == {torch.float32}


@pytest.mark.parametrize("layout", [FSDP2, Layout("dp2 x fsdp2 x tp2", (("dp", 2), ("fsdp", 2), ("tp", 2)), batch=4)],
                         ids=lambda lay: lay.name)
def test_reshard_after_forward_false_gives_hugging_faces_gradients_with_no_gather_in_the_backward(layout):
    model, hf = _model(layout, reshard_after_forward=False)
    hf.zero_grad()
    ids, labels = _batch(layout, hf.config.vocab_size)
    out = model(ids, labels=labels)
    with CommLog() as bwd:
        out.loss.backward()
    assert ("all_gather", "fsdp") not in bwd.counts(), bwd.table()
    ref = hf(ids, labels=labels)
    ref.loss.backward()
    torch.testing.assert_close(out.loss.to_torch(), ref.loss.detach(), rtol=TOL, atol=TOL)
    _compare_grads(model, hf)
    hf.zero_grad()


def test_mixed_precision_tracks_the_same_policy_in_plain_torch_over_ten_adamw_steps():
    """Plain torch's policy: a bf16 copy of the float32 master weights computes, the loss is float32 (HF
    upcasts the logits), the bf16 gradients land on the float32 master, which AdamW updates."""
    model, hf = _model(mp_policy=BF16)
    master = copy.deepcopy(hf).train()
    work = copy.deepcopy(hf).train().to(torch.bfloat16)
    ours = dtorch.optim.AdamW(model.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(master.parameters(), lr=1e-2, foreach=False)
    ids, labels = _batch(FSDP2, hf.config.vocab_size, seed=100)
    got, want = [], []
    for _ in range(10):
        out = model(ids, labels=labels)
        assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
        out.loss.backward()
        ours.step()
        ours.zero_grad()
        got.append(out.loss.item())
        work.load_state_dict(master.state_dict())
        ref = work(ids, labels=labels).loss
        ref.backward()
        for pm, pw in zip(master.parameters(), work.parameters()):
            pm.grad, pw.grad = pw.grad.float(), None
        theirs.step()
        theirs.zero_grad()
        want.append(ref.item())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # float32 master weights and states
    assert all(v.dtype == torch.float32 for st in ours.state.values() for k, v in st.items() if k != "step")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)
    assert want[-1] < want[0] - 1.0


def test_frozen_decoder_layers_give_hugging_faces_gradients_for_the_rest():
    model, hf = _model()
    hf = copy.deepcopy(hf)
    for m in (model, hf):
        for layer in m.model.layers:
            layer.requires_grad_(False)
    ids, labels = _batch(FSDP2, hf.config.vocab_size)
    model(ids, labels=labels).loss.backward()
    hf(ids, labels=labels).loss.backward()
    refs = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        if refs[name].grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad.to_torch(), refs[name].grad, rtol=TOL, atol=TOL, msg=name)


@pytest.mark.parametrize("dims", [(("fsdp", 2),), (("tp", 2), ("pp", 2))], ids=str)
def test_selective_checkpointing_recomputes_every_nth_layer_and_keeps_the_gradients(dims):
    hf = hf_model("three_layers")
    layout = Layout("sac", dims, batch=4, seq=6, config="three_layers")
    ids, labels = _batch(layout, hf.config.vocab_size)
    grads, forwards = [], []
    for option in (None, 2):
        model = LlamaForCausalLM(hf.config, layout.mesh())
        model.load_state_dict(hf.state_dict())
        if option:
            model.gradient_checkpointing_enable(selective_ac_option=option)
        calls = [0] * len(model.model.layers)
        for i, layer in enumerate(model.model.layers):
            def counted(*a, forward=layer.forward, i=i, **k):
                calls[i] += 1
                return forward(*a, **k)
            layer.forward = counted
        model(ids, labels=labels).loss.backward()
        forwards.append(calls)
        grads.append({n: p.grad.to_torch() for n, p in model.named_parameters()})
    assert forwards == [[1, 1, 1], [1, 2, 1]]  # the 2nd layer (of 3) runs again in the backward
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-6, msg=name)


def test_selective_checkpointing_takes_a_layer_interval():
    model, _ = _model()
    for bad in (0, "op", -1):
        with pytest.raises(ValueError, match="layer interval"):
            model.gradient_checkpointing_enable(selective_ac_option=bad)
    model.gradient_checkpointing_enable(selective_ac_option="2")  # torchtitan's spelling
    assert model.is_gradient_checkpointing


def test_checkpointed_layers_gather_each_weight_once_more_for_the_recomputation_only():
    model, hf = _model()
    model.gradient_checkpointing_enable()
    model.train()
    ids, labels = _batch(FSDP2, hf.config.vocab_size)
    loss = model(ids, labels=labels).loss
    with CommLog() as bwd:
        loss.backward()
    n = len(list(model.parameters()))
    # the recomputed layers' gathers serve their own backward (FSDP2 with activation checkpointing: the
    # forward's gather and the backward's); the other weights are gathered again as usual
    assert bwd.counts() == {("all_gather", "fsdp"): n, ("reduce_scatter", "fsdp"): n}, bwd.table()


def test_no_gathered_weight_outlives_a_step_or_an_inference_forward():
    graph = dtorch.Graph()
    with graph:
        model, hf = _model()
        ids, labels = _batch(FSDP2, hf.config.vocab_size)
        for _ in range(2):  # the second step prefetches
            model(ids, labels=labels).loss.backward()
        graph.track_memory()
        gathered = lambda: graph.get_memory_breakdown()[("cpu", 0)]["gathered"]["allocated"]  # noqa: E731
        assert gathered() == 0
        with torch.no_grad():
            for _ in range(2):
                model(ids)
                assert gathered() == 0
        out = model(ids, labels=labels)
        assert gathered() == 0  # (the forward let every copy go, prefetched ones included)
        out.loss.backward()
        assert gathered() == 0
        graph.track_memory(False)


@pytest.mark.parametrize("policy", [None, BF16], ids=["float32", "bf16"])
def test_kept_local_graphs_of_gathered_weights_give_the_same_gradients_and_gathers(policy, monkeypatch):
    """``KEEP_GRAPHS_OF_GATHERED`` (on by default): the local graph of an op on a gathered weight is kept with a
    place for the weight, gathered again in the backward. Loss, gradients and the backward's CommLog stay those
    of the recomputing backward (the switch off)."""
    from dtorch.autograd import dispatched

    def run():
        model, hf = _model(mp_policy=policy)
        ids, labels = _batch(FSDP2, hf.config.vocab_size)
        loss = model(ids, labels=labels).loss
        with CommLog() as bwd:
            loss.backward()
        return model, loss.item(), bwd.counts()

    monkeypatch.setattr(dispatched, "KEEP_GRAPHS_OF_GATHERED", False)
    ref_model, ref_loss, ref_counts = run()
    monkeypatch.setattr(dispatched, "KEEP_GRAPHS_OF_GATHERED", True)
    kept = []
    real = dispatched.KernelNode.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        if self.tape is not None and self.regathers:
            kept.append(self.op)

    monkeypatch.setattr(dispatched.KernelNode, "__init__", spy)
    model, loss, counts = run()
    assert kept, "no op on a gathered weight kept its local graph"
    assert loss == ref_loss and counts == ref_counts
    tol = dict(rtol=TOL, atol=TOL) if policy is None else dict(rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad.to_torch(), **tol, msg=name)
