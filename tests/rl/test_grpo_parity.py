"""GRPO in dtorch (trainer and rollout in two layouts, weights synced between them) against a plain torch +
Hugging Face implementation of the same steps on one device: the same initial weights, the same prompts, the
completions dtorch's rollout sampled fed to both. Over 3 iterations of rollout, reference log-probs, two
policy updates (the second one off-policy: the clipping acts) and a weight sync: the loss, every gradient
and the weights after each update agree at 1e-4, on the issue's three layout pairs."""
from __future__ import annotations

import pytest
import torch
import transformers

import dtorch
from dtorch import DeviceMesh
from dtorch.models import LlamaForCausalLM
from dtorch.nn import skip_init
from dtorch.nn.utils import copy_parameters_
from dtorch.rl import group_advantages, grpo_loss, token_logprobs
from dtorch.rl.task import ReverseDigits

TOL = dict(rtol=1e-4, atol=1e-4)
PROMPTS, GROUP, ITERATIONS, UPDATES = 8, 4, 3, 2
CLIP, KL, LR = 0.2, 0.1, 1e-2

PAIRS = {
    "train fsdp4 / rollout dp2 x tp2, colocated": (((4,), ["fsdp"], 0), ((2, 2), ["dp", "tp"], 0)),
    "train dp2 x tp2 / rollout tp4, other devices": (((2, 2), ["dp", "tp"], 0), ((4,), ["tp"], 4)),
    "train pp2 x tp2 / rollout tp2": (((2, 2), ["pp", "tp"], 0), ((2,), ["tp"], 4)),
}


def mesh(shape, names, first: int) -> DeviceMesh:
    n = 1
    for s in shape:
        n *= s
    return DeviceMesh("cpu", torch.arange(first, first + n).reshape(shape), mesh_dim_names=names)


def config(task: ReverseDigits) -> transformers.LlamaConfig:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=4, vocab_size=task.vocab_size, max_position_embeddings=32,
                                   initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"
    return cfg


# -- the plain implementation: torch and Hugging Face on one device ------------------------------------

def plain_logprobs(model, seqs):
    logits = model(seqs).logits.float()
    return torch.log_softmax(logits, -1)[:, :-1].gather(-1, seqs[:, 1:, None]).squeeze(-1)


def plain_loss(lp, old, ref, rewards, mask):
    r = rewards.view(-1, GROUP)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)
    ratio = torch.exp(lp - old)
    per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP, 1 + CLIP))
    d = ref - lp
    per = per + KL * (torch.exp(d) - d - 1)
    return (per * mask).sum() / mask.sum()


@pytest.mark.parametrize("pair", PAIRS)
def test_grpo_matches_torch_and_hugging_face(pair):
    (ts, tn, tf), (gs, gn, gf) = PAIRS[pair]
    task = ReverseDigits(3)
    cfg = config(task)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    hf_ref = transformers.LlamaForCausalLM(cfg).requires_grad_(False)
    hf_ref.load_state_dict(hf.state_dict())
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=LR, weight_decay=0.0)

    policy = LlamaForCausalLM(cfg, mesh(ts, tn, tf))
    policy.load_state_dict(hf.state_dict())
    with skip_init():
        rollout, reference = LlamaForCausalLM(cfg, mesh(gs, gn, gf)), LlamaForCausalLM(cfg, mesh(gs, gn, gf))
    copy_parameters_(rollout, policy)
    copy_parameters_(reference, policy)
    opt = dtorch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)

    gen = torch.Generator().manual_seed(0)
    n_prompt, n_new = task.prompt_length, task.completion_length
    mask = torch.zeros(PROMPTS * GROUP, n_prompt + n_new - 1)
    mask[:, n_prompt - 1:] = 1
    hf_params = dict(hf.named_parameters())
    clipped = 0  # tokens whose ratio the clipping cut
    for it in range(ITERATIONS):
        prompts = task.prompts(PROMPTS, gen).repeat_interleave(GROUP, 0)
        seqs = rollout.generate(prompts, max_new_tokens=n_new, do_sample=True, top_k=0, generator=gen)
        rewards = task.reward(prompts, seqs[:, n_prompt:])
        with torch.no_grad():
            ref_lp, old_lp = token_logprobs(reference, seqs), token_logprobs(policy, seqs)
            hf_ref_lp, hf_old_lp = plain_logprobs(hf_ref, seqs), plain_logprobs(hf, seqs)
        torch.testing.assert_close(ref_lp.to_torch(), hf_ref_lp, **TOL)
        torch.testing.assert_close(old_lp.to_torch(), hf_old_lp, **TOL)
        for u in range(UPDATES):
            where = f"{pair}, iteration {it}, update {u}"
            loss = grpo_loss(token_logprobs(policy, seqs), old_lp, ref_lp, group_advantages(rewards, GROUP), mask,
                             clip_eps=CLIP, kl_coef=KL)
            loss.backward()
            hf_lp = plain_logprobs(hf, seqs)
            hf_loss = plain_loss(hf_lp, hf_old_lp, hf_ref_lp, rewards, mask)
            hf_loss.backward()
            clipped += int((((hf_lp - hf_old_lp).exp() - 1).abs() * mask > CLIP).sum())
            torch.testing.assert_close(loss.to_torch(), hf_loss.detach(), **TOL, msg=lambda m: f"{where}, loss: {m}")
            for name, p in policy.named_parameters():
                torch.testing.assert_close(p.grad.to_torch(), hf_params[name].grad, **TOL,
                                           msg=lambda m: f"{where}, gradient of {name}: {m}")
            opt.step()
            opt.zero_grad()
            hf_opt.step()
            hf_opt.zero_grad()
            for name, p in policy.named_parameters():
                torch.testing.assert_close(p.to_torch(), hf_params[name].detach(), **TOL,
                                           msg=lambda m: f"{where}, {name} after the update: {m}")
        copy_parameters_(rollout, policy)
        for name, p in rollout.named_parameters():
            torch.testing.assert_close(p.to_torch(), hf_params[name].detach(), **TOL, msg=lambda m: f"rollout {name}: {m}")
    assert rewards.mean() > 0  # (the completions are the model's samples, not all wrong)
    assert clipped > 0
