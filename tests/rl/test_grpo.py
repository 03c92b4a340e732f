"""The GRPO pieces of dtorch.rl against plain-torch formulas: token_logprobs against Hugging Face's logits under
several layouts (never gathering the vocab), group_advantages and grpo_loss (values and gradients) on sharded
and on torch inputs, and their errors."""
from __future__ import annotations

import pytest
import torch
import transformers

import dtorch
from dtorch import CommLog, DeviceMesh, Replicate, Shard
from dtorch.models import LlamaForCausalLM
from dtorch.rl import group_advantages, grpo_loss, token_logprobs

VOCAB = 96  # (more than the hidden size: a gather of the logits would stand out from the embedding's)


def config() -> transformers.LlamaConfig:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
                                   initializer_range=0.1)
    cfg._attn_implementation = "sdpa"
    return cfg


def hf_logprobs(hf, ids, mask):
    """The plain formula: log_softmax of Hugging Face's logits at t, picked at token t + 1."""
    logits = hf(ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


LAYOUTS = {
    "one device": ((1,), ["tp"]),
    "dp2 x tp2": ((2, 2), ["dp", "tp"]),
    "fsdp4": ((4,), ["fsdp"]),
    "pp2 x tp2": ((2, 2), ["pp", "tp"]),
    "tp2 x ring_cp2": ((2, 2), ["tp", "ring_cp"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_logprobs_match_hugging_face(layout):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config()).eval()
    ids = torch.randint(0, VOCAB, (4, 9))
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    mask[2, -2:] = 0  # a right-padded one
    shape, names = LAYOUTS[layout]
    model = LlamaForCausalLM(config(), dtorch.init_device_mesh("cpu", shape, mesh_dim_names=names))
    model.load_state_dict(hf.state_dict())
    want = hf_logprobs(hf, ids, mask)
    for m in (mask, None):
        lp = token_logprobs(model, ids, m)
        assert isinstance(lp, dtorch.Tensor) and tuple(lp.shape) == (4, 8) and lp.dtype == torch.float32
        torch.testing.assert_close(lp.to_torch(), want if m is not None else hf_logprobs(hf, ids, None),
                                   rtol=1e-5, atol=1e-5)


def test_token_logprobs_never_gather_the_vocab_and_train_the_model():
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config())
    ids = torch.randint(0, VOCAB, (4, 9))
    model = LlamaForCausalLM(config(), dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"]))
    model.load_state_dict(hf.state_dict())
    with CommLog() as log:
        lp = token_logprobs(model, ids)
    logits_bytes = 4 * 9 * VOCAB * 4
    assert all(r.nbytes < logits_bytes for r in log.records if r.kind == "all_gather")
    assert list(lp.placements) == [Shard(0), Replicate()]  # batch over dp as computed, reduced over tp
    lp.sum().backward()
    hf_logprobs(hf, ids, None).sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.to_torch(), dict(hf.named_parameters())[name].grad, rtol=1e-4, atol=1e-5)


def advantages_formula(r, g):
    r = r.float().view(-1, g)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)


def test_dtorch_rl_is_reached_from_dtorch():
    assert dtorch.rl.token_logprobs is token_logprobs and dtorch.rl.grpo_loss is grpo_loss
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        dtorch.nonexistent


def test_group_advantages():
    r = torch.rand(12)
    torch.testing.assert_close(group_advantages(r, 4), advantages_formula(r, 4))
    torch.testing.assert_close(group_advantages(r, 3), advantages_formula(r, 3))
    ints = torch.tensor([0, 1, 1, 1, 0, 0])
    torch.testing.assert_close(group_advantages(ints, 3), advantages_formula(ints, 3))
    mesh = DeviceMesh("cpu", [0, 1, 2], mesh_dim_names=["dp"])
    d = group_advantages(dtorch.Tensor(r, device_mesh=mesh, placements=[Shard(0)]), 4)  # a group per device
    assert isinstance(d, dtorch.Tensor)
    torch.testing.assert_close(d.to_torch(), advantages_formula(r, 4))
    with pytest.raises(ValueError, match="do not split into groups of 5"):
        group_advantages(r, 5)
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        group_advantages(r, 1)
    with pytest.raises(ValueError, match="must be 1-D"):
        group_advantages(r.view(3, 4), 4)


def loss_formula(lp, old, ref, adv, mask, eps, kl, reduction):
    ratio = torch.exp(lp - old)
    a = adv[:, None]
    per = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps))
    if kl:
        d = ref - lp
        per = per + kl * (torch.exp(d) - d - 1)
    per = per * mask
    if reduction == "token_mean":
        return per.sum() / mask.sum()
    return (per.sum(1) / mask.sum(1)).mean()


def random_inputs(b=6, t=5):
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(b, t, generator=g) * 3
    old = lp + torch.randn(b, t, generator=g) * 0.5  # ratios well outside [0.8, 1.2]: the clipping acts
    ref = lp + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    mask[:, 0] = 1
    return lp, old, ref, adv, mask


@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("kl", [0.0, 0.1])
def test_grpo_loss_and_its_gradient_match_the_formula(reduction, kl):
    lp, old, ref, adv, mask = random_inputs()
    clipped = (torch.exp(lp - old) - 1).abs() > 0.2
    assert clipped.any() and (~clipped).any()
    x = lp.clone().requires_grad_()
    want = loss_formula(x, old, ref, adv, mask, 0.2, kl, reduction)
    want.backward()
    # torch in, torch out
    y = lp.clone().requires_grad_()
    got = grpo_loss(y, old, ref, adv, mask, clip_eps=0.2, kl_coef=kl, reduction=reduction)
    got.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(y.grad, x.grad)
    # dtorch logprobs sharded over dp (batch) and cp (tokens), the rest as torch tensors or dtorch on other meshes
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "cp"])
    other = DeviceMesh("cpu", [4, 5], mesh_dim_names=["tp"])
    d = dtorch.Tensor(lp, device_mesh=mesh, placements=[Shard(0), Shard(1)]).requires_grad_()
    d_ref = dtorch.Tensor(ref, device_mesh=other, placements=[Shard(0)])
    out = grpo_loss(d, old, d_ref, adv, mask.bool(), clip_eps=0.2, kl_coef=kl, reduction=reduction)
    out.backward()
    torch.testing.assert_close(out.to_torch(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(d.grad.to_torch(), x.grad, rtol=1e-6, atol=1e-7)


def test_on_policy_loss_is_the_advantage_weighted_mean():
    lp, _, _, adv, mask = random_inputs()
    got = grpo_loss(lp, None, None, adv, mask)  # old = lp: ratio 1, no KL
    torch.testing.assert_close(got, -(adv[:, None] * mask).sum() / mask.sum())


def test_grpo_loss_errors_name_every_problem():
    lp, old, ref, adv, mask = random_inputs()
    with pytest.raises(ValueError, match=r"reduction must be one of .*kl_coef=0.1 needs ref_logprobs.*mask must have "
                                         r"logprobs' shape \[6, 5\], got \[6, 4\].*advantages must be \[batch\] = \[6\]"):
        grpo_loss(lp, old, None, adv[:3], mask[:, :4], kl_coef=0.1, reduction="mean")
