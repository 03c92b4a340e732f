"""Generation for dtorch's Llama: Hugging Face's forward arguments and ``generate``, with a KV cache.

``model(ids, attention_mask=..., position_ids=..., past_key_values=..., use_cache=...)`` has Hugging
Face's meaning (the attention mask covers the cached tokens and the new ones; position ids default to
the tokens' places after the cached ones) and returns ``CausalLMOutputWithPast(logits,
past_key_values)`` when a cache is used, the logits (torch) otherwise.

``model.generate(ids, ...)`` prefills the prompt with the model's layout (the sequence split over cp),
then runs one decode step per new token. Each step's next token is chosen on the devices (greedy:
argmax; sampling: temperature, top-k, top-p, then the inverse CDF at a uniform number the controller
draws from the caller's ``torch.Generator`` for each row), so the controller fetches only the new
token ids, never logits. The uniform numbers depend only on the generator, so a seed gives the same
tokens under every layout.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..autograd.mode import is_grad_enabled
from ..errors import DTorchError
from ..ops.registry import OpPlan, dispatch
from ..placement import Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .kv_cache import BATCH_DIMS, CachedForward, KVCache, cp_size, last_position

_CACHE_ARGS = ("attention_mask", "position_ids", "past_key_values", "use_cache")


class GenerationError(DTorchError, ValueError):
    """Arguments ``generate`` or a cached forward cannot take."""


@dataclass
class CausalLMOutputWithPast:
    """Hugging Face's output of a forward with a cache: ``.logits`` (torch ``[B, S, vocab]``) and
    ``.past_key_values`` (the ``KVCache``, filled with this forward's tokens)."""
    logits: torch.Tensor
    past_key_values: KVCache | None = None

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return tuple(v for v in (self.logits, self.past_key_values) if v is not None)[key]


@dataclass
class GenerateOutput:
    """``generate(..., return_dict_in_generate=True)``: the ids, and with ``output_logits=True`` each step's
    logits ``[B, vocab]`` (fetched from the devices only when asked for)."""
    sequences: torch.Tensor
    logits: tuple | None = None
    past_key_values: KVCache | None = None
    timings: dict = field(default_factory=dict)  # prefill_s, decode_s, decode_steps


def split_cache_arguments(args: tuple, kwargs: dict):
    """(the cache arguments given, the other positional arguments, the other keyword arguments): Hugging
    Face's ``forward(input_ids, attention_mask, position_ids, past_key_values, ...)`` order; arguments left at
    their defaults (None, False) count as not given."""
    cache_kw = {}
    for name, value in zip(_CACHE_ARGS, args):
        cache_kw[name] = value
    args = args[len(_CACHE_ARGS):]
    kwargs = dict(kwargs)
    for name in _CACHE_ARGS:
        if name in kwargs:
            cache_kw[name] = kwargs.pop(name)
    cache_kw = {k: v for k, v in cache_kw.items() if v is not None and v is not False}
    return cache_kw, args, kwargs


def _check_ids(input_ids, what: str = "input_ids") -> torch.Tensor:
    if isinstance(input_ids, Tensor):
        raise GenerationError(f"{what} with a mask, positions or a KV cache must be a torch tensor (the tokens are "
                              "laid out by the cache's layout); pass ids.to_torch()")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool:
        got = f"{type(input_ids).__name__} {getattr(input_ids, 'dtype', '')} of shape {list(getattr(input_ids, 'shape', []))}"
        raise GenerationError(f"{what} must be an integer torch tensor [batch, seq], got {got}")
    if input_ids.shape[1] == 0:
        raise GenerationError(f"{what} has no tokens (shape {list(input_ids.shape)})")
    return input_ids.cpu()


def _model_parts(model):
    llama = getattr(model, "model", None)
    if llama is None or not hasattr(model, "lm_head"):
        raise GenerationError(f"generation needs a dtorch LlamaForCausalLM, got {type(model).__name__}")
    return llama, model.lm_head


def _hidden(model, step: CachedForward, last_only: bool) -> Tensor:
    llama, _ = _model_parts(model)
    h = llama(step.ids, step=step)  # [B, S, H] on the last stage
    return last_position(h) if last_only else h


def cached_forward(model, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                   use_cache: bool = False, **unexpected):
    """``model(input_ids, attention_mask=, position_ids=, past_key_values=, use_cache=)`` (Hugging Face's
    meaning); see the module doc."""
    if unexpected:
        raise TypeError(f"LlamaForCausalLM with {', '.join(_CACHE_ARGS)} takes no other arguments; got "
                        f"{sorted(unexpected)}")
    if past_key_values is not None and not isinstance(past_key_values, KVCache):
        raise GenerationError(f"past_key_values must be a dtorch.models.kv_cache.KVCache (made by a forward with "
                              f"use_cache=True, or KVCache(model, batch_size, max_length)), got "
                              f"{type(past_key_values).__name__}")
    cache = past_key_values
    if (cache is not None or use_cache) and is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
        raise GenerationError("a forward with a KV cache records no gradients (the cache is written in place): run it "
                              "under `with torch.no_grad():` (generate does), or drop past_key_values/use_cache")
    ids = _check_ids(input_ids)
    b, s = ids.shape
    past = cache.get_seq_length() if cache is not None else 0
    valid = _valid_columns(attention_mask, b, past, s)
    if position_ids is None:
        positions = torch.arange(past, past + s).expand(b, s)
    else:
        positions = torch.as_tensor(position_ids).cpu()
        if positions.ndim == 1:
            positions = positions.unsqueeze(0)
        if positions.ndim != 2 or positions.shape[1] != s or positions.shape[0] not in (1, b) \
                or positions.is_floating_point():
            raise GenerationError(f"position_ids must be integers [batch, seq] = [{b}, {s}] (or [1, {s}]), got shape "
                                  f"{list(positions.shape)}")
        positions = positions.expand(b, s)
    grow = False
    if cache is None and use_cache:
        # made here: sized for this forward with room to grow (a later forward that does not fit doubles it)
        cache = KVCache(model, b, s + 64 * cp_size(model.model.stage_meshes[0]))
        grow = True
    elif cache is not None:
        grow = getattr(cache, "_growable", False)
    if cache is not None:
        cache._growable = grow
        if cache._model is not model.model:
            raise GenerationError("past_key_values was made for another model")
    step = CachedForward(model, ids, valid, positions.long(), cache, grow=grow)
    _, lm_head = _model_parts(model)
    logits = lm_head(_hidden(model, step, last_only=False)).to_torch()
    if step.pad:
        logits = logits[:, step.pad:].contiguous()
    if cache is None and not use_cache:
        return logits
    return CausalLMOutputWithPast(logits, cache if use_cache or past_key_values is not None else None)


def _valid_columns(attention_mask, b: int, past: int, s: int) -> torch.Tensor:
    """[B, S] bool: which of the new tokens are real (Hugging Face's mask covers past + new tokens)."""
    if attention_mask is None:
        return torch.ones(b, s, dtype=torch.bool)
    if isinstance(attention_mask, Tensor):
        attention_mask = attention_mask.to_torch()
    m = torch.as_tensor(attention_mask).cpu()
    if m.ndim != 2 or m.shape[0] != b or m.shape[1] not in (s, past + s):
        raise GenerationError(f"attention_mask must be [batch, cached + new tokens] = [{b}, {past + s}] (or [{b}, {s}] "
                              f"for the new tokens), got shape {list(m.shape)}")
    return m[:, -s:].bool()


# ------------------------------------------------------------------------------------------------
# choosing the next token on the devices


@kernel("generation.next_token")
def _next_token_kernel(logits, u, *, sample: bool, temperature: float, top_k, top_p):
    """Per row: argmax, or a sample (temperature, then top-k, then top-p, as Hugging Face's warpers) at
    the uniform number ``u`` in (0, 1] of the filtered distribution's CDF."""
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
    logits, u = specs
    # every device of a row sees the whole vocabulary (an all_gather over tp of [B, vocab])
    pl = tuple(Shard(0) if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in logits.placements)
    upl = tuple(Shard(0) if isinstance(p, Shard) else Replicate() for p in pl)
    out = DTensorSpec(logits.mesh, upl, logits.shape[:1], torch.int64)
    return OpPlan((logits.with_placements(pl), u.with_placements(upl)), (out,), _next_token_kernel,
                  {"sample": sample, "temperature": temperature, "top_k": top_k, "top_p": top_p})


def _batch_placements(mesh) -> list:
    return [Shard(0) if n in BATCH_DIMS else Replicate() for n in mesh.dim_names or [None] * mesh.ndim]


def _choose(logits: Tensor, sampling: tuple, generator) -> Tensor:
    b = logits.shape[0]
    sample = sampling[0]
    # (0, 1]: a uniform number of 0 could pick a token of probability 0
    u = 1.0 - torch.rand(b, generator=generator, dtype=torch.float64) if sample else torch.ones(b, dtype=torch.float64)
    mesh = logits.device_mesh
    ut = Tensor(u, device_mesh=mesh, placements=_batch_placements(mesh))
    return dispatch("generation.next_token", _next_token_rule, (logits, ut), sampling)


# ------------------------------------------------------------------------------------------------
# generate


def _check_generate(model, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p,
                    eos_token_id, pad_token_id, generator):
    ids = _check_ids(input_ids)
    problems = []
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        problems.append(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if do_sample:
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            problems.append(f"temperature must be a number > 0, got {temperature!r}")
        if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
            problems.append(f"top_k must be an int >= 1 or None, got {top_k!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            problems.append(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        problems.append(f"generator must be a torch.Generator, got {type(generator).__name__}")
    vocab = model.config.vocab_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        problems.append(f"input_ids must be token ids in [0, {vocab}), got values in [{int(ids.min())}, {int(ids.max())}]")
    if attention_mask is not None:
        m = torch.as_tensor(attention_mask.to_torch() if isinstance(attention_mask, Tensor) else attention_mask)
        if tuple(m.shape) != tuple(ids.shape):
            problems.append(f"attention_mask must have input_ids' shape {list(ids.shape)}, got {list(m.shape)}")
        elif not bool(m[:, -1].bool().all()):
            problems.append("attention_mask has padding in the last column: pad prompts on the left "
                            "(tokenizer padding_side='left'), so that every row's last token is a real one")
    eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if problems:
        raise GenerationError("generate: " + "; ".join(problems))
    return ids, eos


def generate(model, input_ids, attention_mask=None, max_new_tokens: int = 20, do_sample: bool = False,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None, eos_token_id=None,
             pad_token_id: int | None = None, generator: torch.Generator | None = None, streamer=None,
             output_logits: bool = False, return_dict_in_generate: bool = False):
    """Continue ``input_ids`` ``[B, S]`` (left-padded where ``attention_mask`` is 0) by up to ``max_new_tokens``.

    Greedy (``do_sample=False``: argmax, as ``transformers``' ``do_sample=False``) or sampled (temperature,
    ``top_k``, ``top_p``; the uniform numbers come from ``generator``, or torch's global generator).
    A row that produced ``eos_token_id`` (an int or a list; None: the config's, as Hugging Face does; ``[]``:
    none) gets ``pad_token_id`` (default: the config's, else the first eos id) afterwards; generation stops
    when every row has. ``streamer``: an object with ``put(ids)`` and ``end()``
    (``transformers``' streamers): ``put`` gets the prompt, then each step's new ids ``[B]``.
    Returns the ids ``[B, S + new]`` (torch), or a ``GenerateOutput`` with ``return_dict_in_generate``.
    """
    if eos_token_id is None:
        eos_token_id = getattr(model.config, "eos_token_id", None)
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None)
    ids, eos = _check_generate(model, input_ids, attention_mask, max_new_tokens, do_sample, temperature, top_k,
                               top_p, eos_token_id, pad_token_id, generator)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    sampling = (bool(do_sample), float(temperature), int(top_k) if top_k else None,
                float(top_p) if top_p is not None else None)
    if not do_sample:
        sampling = (False, 1.0, None, None)
    llama, lm_head = _model_parts(model)
    b, s = ids.shape
    mask = torch.ones(b, s, dtype=torch.bool) if attention_mask is None else torch.as_tensor(
        attention_mask.to_torch() if isinstance(attention_mask, Tensor) else attention_mask).cpu().bool()
    # Hugging Face's positions for a left-padded batch: each row counts its own real tokens
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)
    cp = cp_size(llama.stage_meshes[0])
    # every cp block holds its chunk of the (padded) prompt and its share of the new tokens
    cache = KVCache(model, b, cp * (-(-s // cp) + -(-max_new_tokens // cp)))
    eos_t = torch.tensor(eos, dtype=torch.long)
    finished = torch.zeros(b, dtype=torch.bool)
    out, step_logits = [ids], []
    timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    if streamer is not None:
        streamer.put(ids)
    with torch.no_grad():
        step = CachedForward(model, ids, mask, positions, cache)
        for i in range(max_new_tokens):
            t0 = time.perf_counter()
            logits = lm_head(_hidden(model, step, last_only=True))  # [B, 1, vocab], vocab over tp
            logits = logits.view(b, logits.shape[-1])
            tok = _choose(logits, sampling, generator).to_torch()  # the one fetch of a step: [B] ids
            timings["prefill_s" if i == 0 else "decode_s"] += time.perf_counter() - t0
            timings["decode_steps"] += i > 0
            if output_logits:
                step_logits.append(logits.to_torch())
            if eos:
                if pad_token_id is not None:
                    tok = torch.where(finished, torch.tensor(pad_token_id), tok)
                finished |= torch.isin(tok, eos_t)
            out.append(tok[:, None])
            if streamer is not None:
                streamer.put(tok)
            if i + 1 == max_new_tokens or (eos and bool(finished.all())):
                break
            positions = positions[:, -1:] + 1
            step = CachedForward(model, tok[:, None], torch.ones(b, 1, dtype=torch.bool), positions, cache)
    if streamer is not None:
        streamer.end()
    seqs = torch.cat(out, dim=1)
    if return_dict_in_generate:
        return GenerateOutput(seqs, tuple(step_logits) if output_logits else None, cache, timings)
    return seqs


__all__ = ["generate", "cached_forward", "CausalLMOutputWithPast", "GenerateOutput", "GenerationError", "KVCache"]
