"""Choosing the next token on the devices (generation): greedy or sampled, from logits [B, vocab].

Every device of a batch row sees the whole vocabulary (an all_gather over the vocab's shards of [B, vocab]),
so the controller fetches only the chosen ids, never logits.
"""
from __future__ import annotations

import torch

from ..placement import Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from .dispatch import OpPlan, dispatch


@kernel("generation.next_token")
def _next_token_kernel(logits, u=None, *, sample: bool, temperature: float, top_k, top_p):
    """Per row: argmax, or a sample (temperature, then top-k, then top-p, as Hugging Face's warpers) at
    the uniform number ``u`` in (0, 1] of the filtered distribution's CDF (greedy: no ``u``)."""
    x = logits.float()
    if not sample:
        return x.argmax(-1)
    if temperature != 1.0:
        x = x / temperature
    neg = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if top_k:
        kth = torch.topk(x, min(int(top_k), x.shape[-1]), dim=-1).values[..., -1:]
        x = torch.where(x < kth, neg, x)
    if top_p is not None and top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        drop = sorted_x.softmax(-1).cumsum(-1) <= (1 - top_p)
        drop[..., -1:] = False  # keep at least one token
        x = torch.where(drop.scatter(-1, order, drop), neg, x)
    cdf = x.softmax(-1).cumsum(-1)
    target = u.to(cdf.dtype).unsqueeze(-1) * cdf[..., -1:]
    return (cdf < target).sum(-1).clamp(max=x.shape[-1] - 1)


def _next_token_rule(specs, sample: bool, temperature: float, top_k, top_p):
    logits, *u = specs  # (greedy: no u)
    # every device of a row sees the whole vocabulary (an all_gather over tp of [B, vocab])
    pl = tuple(Shard(0) if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in logits.placements)
    upl = tuple(Shard(0) if isinstance(p, Shard) else Replicate() for p in pl)
    out = DTensorSpec(logits.mesh, upl, logits.shape[:1], torch.int64)
    return OpPlan((logits.with_placements(pl), *(x.with_placements(upl) for x in u)), (out,), _next_token_kernel,
                  {"sample": sample, "temperature": temperature, "top_k": top_k, "top_p": top_p})


def next_token(logits, u, sample: bool, temperature: float, top_k, top_p):
    """The next token of each row [B] (int64, batch laid out like the logits'): the argmax, or with ``sample``
    the token at the uniform number ``u`` [B] in (0, 1] of the filtered distribution's CDF (greedy: ``u`` may
    be None, and is not used)."""
    if not sample and u is None:
        return dispatch("generation.next_token", _next_token_rule, (logits,), (sample, temperature, top_k, top_p))
    if u is None:
        raise ValueError("next_token: sampling needs the uniform numbers u [B]")
    return dispatch("generation.next_token", _next_token_rule, (logits, u), (sample, temperature, top_k, top_p))
