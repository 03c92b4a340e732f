"""The pieces of a GRPO step (group relative policy optimization: DeepSeekMath, Shao et al. 2024) as
library functions; the loop is the user's (docs/rl.md writes one out, ``dtorch rl`` runs one).

    token_logprobs(model, ids, mask)   [B, S-1]  log p(ids[:, t+1] | ids[:, :t+1]), on the devices
    group_advantages(rewards, G)       [B]       (r - mean of its group) / (std of its group + 1e-4)
    grpo_loss(lp, old, ref, A, mask)   []        PPO's clipped surrogate + kl_coef * the k3 KL estimator

Each is a handful of dtorch ops, so autograd, placements and collectives come from the op rules. The
log-probs never gather the logits: they are ``-cross_entropy(reduction="none")`` of the shifted ids, which
reduces the max and the sum of exponentials over the vocab shards (Megatron's vocab-parallel cross
entropy, ops/loss.py). The other two also take plain torch tensors (and then return torch tensors).
"""
from __future__ import annotations

import torch
import torch.nn.functional as TF

from ..models.forward import check_ids, logits_as_computed
from ..nn import functional as F
from ..placement import Partial, Replicate, Shard
from ..tensor import Tensor

_REDUCTIONS = ("token_mean", "sequence_mean")


def token_logprobs(model, input_ids, attention_mask=None) -> Tensor:
    """``[B, S-1]``: the log-probability the model gives ``input_ids[:, t + 1]`` after ``input_ids[:, :t + 1]``
    (Hugging Face's shift: logits at position t predict token t + 1), in float32.

    ``model`` is a dtorch ``LlamaForCausalLM`` in any layout; ``input_ids`` ``[B, S]`` and ``attention_mask``
    (1: a token, 0: padding; None: all tokens) are torch or dtorch tensors, read as Hugging Face's forward
    reads them (positions 0, 1, 2, ... whatever the mask). The result lies on the model's last stage mesh,
    batch over dp/fsdp, sequence over the cp dims, replicated over tp; under grad mode it has the forward's
    history, so ``grpo_loss(...).backward()`` trains the model."""
    logits = logits_as_computed(model, input_ids, attention_mask)  # [B, S, vocab], vocab over tp
    ids = check_ids(input_ids)
    mesh = logits.device_mesh
    # the target of position t is token t + 1; the last position predicts nothing (ignored, then cut off)
    shifted = TF.pad(ids[:, 1:], (0, 1), value=-100)
    placements = [Replicate() if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == 2) else p
                  for p in logits.placements]
    target = Tensor(shifted, device_mesh=mesh, placements=placements)
    # [B, vocab, S] -> [B, S]: each vocab shard picks the targets it holds (a Partial sum over tp)
    nll = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none", ignore_index=-100)
    logprobs = -nll[:, :-1]
    return logprobs.redistribute(mesh, [Replicate() if isinstance(p, Partial) else p for p in logprobs.placements])


def group_advantages(rewards, group_size: int):
    """GRPO's advantages ``[B]``: each reward minus the mean of its group, over the group's standard deviation
    (unbiased, ``torch.std``'s) plus 1e-4. ``rewards`` ``[B]`` (torch or dtorch) holds ``B / group_size``
    groups of consecutive rows: the completions sampled for one prompt."""
    if rewards.ndim != 1:
        raise ValueError(f"group_advantages: rewards must be 1-D [batch], got shape {list(rewards.shape)}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2:
        raise ValueError(f"group_advantages: group_size must be an int >= 2 (the standard deviation of a group of "
                         f"one is undefined), got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"group_advantages: {rewards.shape[0]} rewards do not split into groups of {group_size}; "
                         "sample the same number of completions for every prompt")
    if not rewards.dtype.is_floating_point:
        rewards = rewards.float()
    r = rewards.reshape(-1, group_size)  # [B / G, G]
    a = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    return a.reshape(-1)


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, clip_eps: float = 0.2, kl_coef: float = 0.0,
              reduction: str = "token_mean"):
    """GRPO's loss: per token ``max(-A * ratio, -A * clamp(ratio, 1 - clip_eps, 1 + clip_eps))`` with
    ``ratio = exp(logprobs - old_logprobs)``, plus ``kl_coef * (exp(ref - logprobs) - (ref - logprobs) - 1)``
    (the k3 estimator of KL(policy || reference)); ``A`` is ``advantages`` ``[B]`` broadcast over the tokens.

    ``logprobs``, ``old_logprobs``, ``ref_logprobs`` and ``mask`` are ``[B, T]`` (1 where a token counts:
    the completion's tokens); ``old_logprobs`` None means on-policy (``logprobs`` detached: ratio 1),
    ``ref_logprobs`` may be None when ``kl_coef`` is 0. ``reduction``: ``"token_mean"`` averages over every
    counted token of the batch, ``"sequence_mean"`` over each row's counted tokens, then over the rows (a
    row or batch with no counted token counts as one token of loss 0). Inputs may mix torch and dtorch
    tensors: torch ones are laid out like ``logprobs``, dtorch ones on other meshes moved there."""
    problems = []
    if reduction not in _REDUCTIONS:
        problems.append(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not clip_eps >= 0:
        problems.append(f"clip_eps must be >= 0, got {clip_eps!r}")
    if ref_logprobs is None and kl_coef != 0:
        problems.append(f"kl_coef={kl_coef} needs ref_logprobs (the reference model's token_logprobs)")
    shape = tuple(logprobs.shape)
    if len(shape) != 2:
        problems.append(f"logprobs must be [batch, tokens], got shape {list(shape)}")
    for name, x in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs), ("mask", mask)):
        if x is not None and tuple(x.shape) != shape:
            problems.append(f"{name} must have logprobs' shape {list(shape)}, got {list(x.shape)}")
    if tuple(advantages.shape) != shape[:1]:
        problems.append(f"advantages must be [batch] = {list(shape[:1])}, got {list(advantages.shape)}")
    if problems:
        raise ValueError("grpo_loss: " + "; ".join(problems))
    old = logprobs.detach() if old_logprobs is None else _like(old_logprobs, logprobs)
    adv = _like(advantages, logprobs).to(logprobs.dtype).unsqueeze(-1)  # [B, 1]
    m = _like(mask, logprobs).to(logprobs.dtype)
    ratio = (logprobs - old).exp()
    per_token = (-adv * ratio).maximum(-adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    if kl_coef != 0:
        d = _like(ref_logprobs, logprobs) - logprobs
        per_token = per_token + kl_coef * (d.exp() - d - 1)
    per_token = per_token * m
    if reduction == "token_mean":
        return per_token.sum() / m.sum().clamp(min=1)
    return (per_token.sum(-1) / m.sum(-1).clamp(min=1)).mean()


def _like(x, ref):
    """``x`` where ``ref`` is: a torch tensor (or a list) laid out on ``ref``'s mesh like ``ref``'s leading dims,
    a dtorch tensor on another mesh moved there; as it is when ``ref`` is a torch tensor."""
    if not isinstance(ref, Tensor):
        return x.to_torch() if isinstance(x, Tensor) else torch.as_tensor(x)
    mesh = ref.device_mesh
    if isinstance(x, Tensor) and x.device_mesh == mesh:
        return x
    ndim = len(x.shape) if isinstance(x, Tensor) else torch.as_tensor(x).ndim
    placements = [p if isinstance(p, Shard) and p.dim < ndim else Replicate() for p in ref.placements]
    if isinstance(x, Tensor):
        return x.redistribute(mesh, placements)
    return Tensor(torch.as_tensor(x), device_mesh=mesh, placements=placements)
