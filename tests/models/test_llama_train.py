"""Training the Llama: loss and every parameter gradient equal Hugging Face's under the whole layout matrix
(plus fsdp), optimizer steps track torch.optim on the HF model, and the backward's communication is the
one the layout implies (CommLog)."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import CommLog, Replicate
from dtorch.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaRotaryEmbedding
from tests.llama_models import hf_model, make_config

from .test_llama import LAYOUTS, Layout

TOL = 1e-4

FSDP_LAYOUTS = [
    Layout("fsdp2", (("fsdp", 2),), batch=4, seq=6),
    Layout("fsdp4 uneven batch", (("fsdp", 4),), batch=5, seq=5),
    Layout("dp2 x fsdp2 (HSDP) x tp2", (("dp", 2), ("fsdp", 2), ("tp", 2)), batch=4, seq=6),
    Layout("pp2 x fsdp2 x ring2", (("pp", 2), ("fsdp", 2), ("ring_cp", 2)), batch=2, seq=7),
    Layout("gqa fsdp2 x tp4", (("fsdp", 2), ("tp", 4)), batch=2, seq=5, config="gqa"),
    Layout("dp2 x fsdp2 (HSDP)", (("dp", 2), ("fsdp", 2)), batch=4, seq=6),
    Layout("fsdp2 x ulysses2 x tp2", (("fsdp", 2), ("ulysess_cp", 2), ("tp", 2)), batch=2, seq=6),
]


def _saved_grad(model, name, grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A held gradient in the saved (HF) layout: kv heads held repeated over tp keep one copy each."""
    form = model.get_submodule(name.rpartition(".")[0])._saved_form(name.rpartition(".")[2])
    return grad if form is None else form.save(grad)


def _batch(layout: Layout, vocab: int, seed: int = 1):
    torch.manual_seed(seed)
    ids = torch.randint(0, vocab, (layout.batch, layout.seq))
    labels = ids.clone()
    labels[0, : min(2, layout.seq)] = -100  # ignored positions count as HF counts them
    return ids, labels


def _compare_grads(model, hf):
    hf_params = dict(hf.named_parameters())
    seen = 0
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.device_mesh == p.device_mesh and p.grad.placements == p.placements, name
        ref = hf_params[name].grad
        got = _saved_grad(model, name, p.grad.to_torch(), ref)
        torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
        seen += 1
    assert seen == len(hf_params)


@pytest.mark.parametrize("layout", LAYOUTS + FSDP_LAYOUTS, ids=lambda lay: lay.name)
def test_loss_and_gradients_match_hugging_face(layout):
    hf = hf_model(layout.config)
    hf.zero_grad()
    ids, labels = _batch(layout, hf.config.vocab_size)
    model = LlamaForCausalLM(hf.config, layout.mesh())
    model.load_state_dict(hf.state_dict())
    out = model(ids, labels=labels)
    ref = hf(ids, labels=labels)
    out.loss.backward()
    ref.loss.backward()
    torch.testing.assert_close(out.loss.to_torch(), ref.loss.detach(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(out.logits.to_torch(), ref.logits.detach(), rtol=TOL, atol=TOL)
    _compare_grads(model, hf)
    hf.zero_grad()


def test_the_gradient_check_can_fail():
    """A gradient off by one layer's contribution is far outside the tolerance: the comparison above bites."""
    hf = hf_model()
    hf.zero_grad()
    layout = LAYOUTS[0]
    ids, labels = _batch(layout, hf.config.vocab_size)
    hf(ids, labels=labels).loss.backward()
    g = hf.model.layers[0].mlp.down_proj.weight.grad
    assert g.abs().max() > 100 * TOL
    hf.zero_grad()


@pytest.mark.parametrize("dims", [(("tp", 2), ("pp", 2)), (("fsdp", 2),)], ids=str)
def test_gradient_checkpointing_gives_the_same_gradients(dims):
    hf = hf_model()
    layout = Layout("ckpt", dims, batch=4, seq=6)
    ids, labels = _batch(layout, hf.config.vocab_size)
    grads = []
    for ckpt in (False, True):
        model = LlamaForCausalLM(hf.config, layout.mesh())
        model.load_state_dict(hf.state_dict())
        if ckpt:
            model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
        model(ids, labels=labels).loss.backward()
        grads.append({n: p.grad.to_torch() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-6)


def test_kv_heads_repeated_over_tp_share_one_gradient():
    """8 query / 2 kv heads on tp=4: each kv head is held twice; both copies get the same (summed) gradient,
    so an optimizer step keeps them equal."""
    hf = hf_model("gqa")
    mesh = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"])
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids, labels = _batch(Layout("x", (), batch=2, seq=5), hf.config.vocab_size)
    model(ids, labels=labels).loss.backward()
    k = model.model.layers[0].self_attn.k_proj.weight.grad.to_torch().unflatten(0, (2, 2, -1))
    torch.testing.assert_close(k[:, 0], k[:, 1], rtol=0, atol=0)


# -- communication ---------------------------------------------------------------------------------

def _grad_comms(mesh_dims, batch=4, seq=6):
    hf = hf_model()
    layout = Layout("comm", mesh_dims, batch=batch, seq=seq)
    ids, labels = _batch(layout, hf.config.vocab_size)
    model = LlamaForCausalLM(hf.config, layout.mesh())
    model.load_state_dict(hf.state_dict())
    loss = model(ids, labels=labels).loss
    with CommLog() as log:
        loss.backward()
    return model, log


def test_dp2_reduces_each_gradient_once():
    model, log = _grad_comms((("dp", 2),))
    n_params = len(list(model.parameters()))
    assert log.counts() == {("all_reduce", "dp"): n_params}


def test_fsdp2_reduce_scatters_each_gradient_once_and_gathers_each_weight_again():
    model, log = _grad_comms((("fsdp", 2),))
    n_params = len(list(model.parameters()))
    assert log.counts() == {("reduce_scatter", "fsdp"): n_params, ("all_gather", "fsdp"): n_params}


def test_tp2_decoder_layer_backward_has_the_megatron_count():
    """Megatron: the backward of a tensor-parallel decoder layer all-reduces the activation gradient twice
    (before each column-parallel block's input); the norms' weights come out whole, no more reductions."""
    cfg = make_config()
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    ref = hf_model().model.layers[0]
    with dtorch.default_graph().device_mesh_guard(mesh):
        layer = LlamaDecoderLayer(cfg, 0)
        rope = LlamaRotaryEmbedding(cfg)
    layer.load_state_dict(ref.state_dict())
    cos, sin = rope(dtorch.arange(6, device_mesh=mesh))
    torch.manual_seed(3)
    x = torch.randn(2, 6, cfg.hidden_size, requires_grad=True)
    h = dtorch.Tensor(x.detach(), device_mesh=mesh).requires_grad_()
    out = layer(h, cos, sin)
    w = torch.randn(out.shape)
    with CommLog() as log:
        (out * dtorch.Tensor(w, device_mesh=mesh)).sum().backward()
    assert log.counts() == {("all_reduce", "tp"): 2}
    ref.zero_grad()
    expected = ref(x, position_embeddings=(cos.to_torch()[None], sin.to_torch()[None]))
    expected = expected[0] if isinstance(expected, tuple) else expected
    (expected * w).sum().backward()
    torch.testing.assert_close(h.grad.to_torch(), x.grad, rtol=TOL, atol=TOL)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad.to_torch(), dict(ref.named_parameters())[name].grad, rtol=TOL, atol=TOL)
    ref.zero_grad()


def test_vocab_sharded_logits_are_never_gathered_by_the_loss():
    hf = hf_model()
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids, labels = _batch(Layout("x", (), batch=2, seq=6), hf.config.vocab_size)
    with CommLog() as log:
        model(ids, labels=labels).loss.backward()
    # bytes moved by one collective (all devices together): a gather of the logits would move at least
    # their whole size; the loss's own reductions are [batch, seq]-sized (max, sum-exp, target logit)
    logits_bytes = 2 * 6 * hf.config.vocab_size * 4
    assert all(r.nbytes < logits_bytes for r in log.records), log.table()
    row_sized = [r for r in log.records if r.nbytes <= 2 * 6 * 4 * 2]
    assert len(row_sized) == 3 and all(r.kind == "all_reduce" for r in row_sized), log.table()


# -- optimizer steps against torch.optim on the Hugging Face model -----------------------------------

def _train_both(layout: Layout, make_opt, steps: int = 10):
    """(dtorch losses, torch losses, dtorch model, HF model) after ``steps`` steps on the same batches."""
    import copy

    hf = copy.deepcopy(hf_model(layout.config)).train()
    model = LlamaForCausalLM(hf.config, layout.mesh())
    model.load_state_dict(hf.state_dict())
    ours, theirs = make_opt(dtorch.optim, model.parameters()), make_opt(torch.optim, hf.parameters())
    got, want = [], []
    for step in range(steps):
        ids, labels = _batch(layout, hf.config.vocab_size, seed=100)  # one batch: the loss must fall
        loss = model(ids, labels=labels).loss
        loss.backward()
        ours.step()
        ours.zero_grad()
        ref = hf(ids, labels=labels).loss
        ref.backward()
        theirs.step()
        theirs.zero_grad()
        got.append(loss.item())
        want.append(ref.item())
    return got, want, model, hf


TRAIN_LAYOUTS = [Layout("dp2 x tp2", (("dp", 2), ("tp", 2)), batch=4, seq=6),
                 Layout("fsdp2 x pp2", (("fsdp", 2), ("pp", 2)), batch=4, seq=6),
                 Layout("ring2 x tp2", (("ring_cp", 2), ("tp", 2)), batch=2, seq=7, config="gqa")]


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS, ids=lambda lay: lay.name)
def test_ten_sgd_steps_match_torch(layout):
    got, want, model, hf = _train_both(layout, lambda optim, params: optim.SGD(params, lr=0.1, momentum=0.9))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=TOL, atol=TOL)
    assert want[-1] < want[0] - 0.5  # it trains: the comparison is not between two idle models
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        w = _saved_grad(model, name, p.to_torch(), None)
        torch.testing.assert_close(w, hf_params[name].detach(), rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS[:2], ids=lambda lay: lay.name)
def test_ten_adamw_steps_track_torch(layout):
    got, want, _, _ = _train_both(layout, lambda optim, params: optim.AdamW(params, lr=1e-2, weight_decay=0.1))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-3, atol=1e-3)
    assert want[-1] < want[0] - 0.5
