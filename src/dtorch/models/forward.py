"""Hugging Face's forward arguments for dtorch's Llama: ``attention_mask``, ``position_ids``,
``past_key_values``, ``use_cache`` (and ``labels`` with them).

``model(ids, attention_mask=..., position_ids=..., past_key_values=..., use_cache=..., labels=...)`` has
Hugging Face's meaning:

- the 2-D attention mask (1: a token, 0: padding; left or right) covers the cached tokens and the new
  ones and is combined with the causal mask; position ids default to the tokens' places after the
  cached ones (Hugging Face's forward does not derive them from the mask; ``generate`` does);
- position ids without a mask or a cache that restart within a row (``[0, 1, 2, 0, 1, 0, 1, 2, 3]``)
  are packed sequences: each token attends only the earlier tokens of its own sequence, as Hugging
  Face's masking utilities detect and do (``find_packed_sequence_indices``);
- ``labels`` give Hugging Face's shifted causal-LM loss (-100 ignored).

It records gradients under grad mode, like any forward: the logits (and the loss) have a history
whatever the arguments. A cache holds keys and values as constants: a forward that uses what an earlier
forward recorded into it under grad mode is refused (Hugging Face's gradient would flow through them).

Returns what a forward without these arguments returns (the logits in the caller's layout: torch for torch
ids, dtorch on the ids' mesh for dtorch ids), or with ``labels`` the loss and the logits; with a cache a
``CausalLMOutputWithPast`` whose ``past_key_values`` is the ``KVCache``.
"""
from __future__ import annotations

import torch

from .. import capture
from ..autograd.mode import is_grad_enabled
from ..errors import DTorchError
from ..placement import Partial, Replicate
from ..tensor import Tensor
from .kv_cache import CachedForward, KVCache
from .layout import cp_size
from .outputs import CausalLMOutputWithPast, labels_like, torch_logits

_ARGS = ("attention_mask", "position_ids", "past_key_values", "use_cache")


class GenerationError(DTorchError, ValueError):
    """Arguments ``generate`` or a forward with Hugging Face's arguments cannot take."""


def split_forward_arguments(args: tuple, kwargs: dict):
    """(the Hugging Face arguments given, the other positional arguments, the other keyword arguments): Hugging
    Face's ``forward(input_ids, attention_mask, position_ids, past_key_values, ...)`` order; arguments left at
    their defaults (None, False) count as not given."""
    given = dict(zip(_ARGS, args))
    args = args[len(_ARGS):]
    kwargs = dict(kwargs)
    for name in _ARGS:
        if name in kwargs:
            given[name] = kwargs.pop(name)
    given = {k: v for k, v in given.items() if v is not None and v is not False}
    return given, args, kwargs


def check_ids(input_ids, what: str = "input_ids") -> torch.Tensor:
    """Token ids as an integer torch tensor [batch, seq] with at least one token (dtorch ids are fetched)."""
    if isinstance(input_ids, Tensor):
        input_ids = input_ids.to_torch()
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point() \
            or input_ids.dtype == torch.bool:
        got = f"{type(input_ids).__name__} {getattr(input_ids, 'dtype', '')} of shape {list(getattr(input_ids, 'shape', []))}"
        raise GenerationError(f"{what} must be an integer tensor [batch, seq] (torch or dtorch), got {got}")
    if input_ids.shape[1] == 0:
        raise GenerationError(f"{what} has no tokens (shape {list(input_ids.shape)})")
    return input_ids.cpu()


def valid_columns(attention_mask, b: int, past: int, s: int) -> torch.Tensor:
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


def _positions(position_ids, b: int, s: int, past: int) -> torch.Tensor:
    if position_ids is None:
        return torch.arange(past, past + s).expand(b, s)
    if isinstance(position_ids, Tensor):
        position_ids = position_ids.to_torch()
    positions = torch.as_tensor(position_ids).cpu()
    if positions.ndim == 1:
        positions = positions.unsqueeze(0)
    if positions.ndim != 2 or positions.shape[1] != s or positions.shape[0] not in (1, b) \
            or positions.is_floating_point():
        raise GenerationError(f"position_ids must be integers [batch, seq] = [{b}, {s}] (or [1, {s}]), got shape "
                              f"{list(positions.shape)}")
    return positions.expand(b, s).long()


def packed_sequences(positions: torch.Tensor) -> torch.Tensor | None:
    """Hugging Face's ``find_packed_sequence_indices``: the sequence index of each token ([B, S]; a new one
    wherever the position does not follow the one before), or None when every row is one sequence."""
    diff = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    segments = (diff != 1).cumsum(-1)
    return None if bool((segments[:, -1] == 0).all()) else segments


def _recording(model) -> bool:
    return is_grad_enabled() and any(p.requires_grad for p in model.parameters())


def forward_with_arguments(model, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                           use_cache: bool = False, labels=None, **unexpected):
    """``model(input_ids, attention_mask=, position_ids=, past_key_values=, use_cache=, labels=)``; see the
    module doc."""
    if unexpected:
        raise TypeError(f"LlamaForCausalLM with {', '.join(_ARGS)} takes no other arguments; got {sorted(unexpected)}")
    if past_key_values is not None and not isinstance(past_key_values, KVCache):
        raise GenerationError(f"past_key_values must be a dtorch.models.kv_cache.KVCache (made by a forward with "
                              f"use_cache=True, or KVCache(model, batch_size, max_length)), got "
                              f"{type(past_key_values).__name__}")
    caller = (input_ids.device_mesh, input_ids.placements) if isinstance(input_ids, Tensor) else None
    ids = check_ids(input_ids)
    labels = None if labels is None else labels_like(labels, ids)
    recording = _recording(model)
    cache = past_key_values
    if cache is not None and recording and cache._recorded and cache._next > 0:
        raise GenerationError("past_key_values holds keys and values that a forward recorded under grad mode; the "
                              "cache keeps them as constants, so the gradient through them into that forward "
                              "(Hugging Face's) cannot flow: make that forward under torch.no_grad(), or run the "
                              "tokens in one forward")
    b, s = ids.shape
    past = cache.get_seq_length() if cache is not None else 0
    valid = valid_columns(attention_mask, b, past, s)
    positions = _positions(position_ids, b, s, past)
    packed = None
    if position_ids is not None and attention_mask is None and cache is None and not use_cache:
        packed = packed_sequences(positions)  # (Hugging Face looks for packing only without a mask or a cache)
    grow = False
    if cache is None and use_cache:
        # made here: sized for this forward with room to grow (a later forward that does not fit doubles it)
        cache = KVCache(model, b, s + 64 * cp_size(model.model.stage_meshes[0]))
        grow = True
    elif cache is not None:
        grow = getattr(cache, "_growable", False)
    if cache is not None:
        # the cache's write position is Python state (``_next``) a replay would not advance
        capture.refuse("the forward uses a KV cache, whose write position is Python state a replay does not advance: "
                       "decode steps run eagerly under dtorch.compile")
        cache._growable = grow
        if cache._model is not model.model:
            raise GenerationError("past_key_values was made for another model")
        cache._recorded |= recording
    step = CachedForward(model, ids, valid, positions, cache, grow=grow, segments=packed, recording=recording)
    logits = model.lm_head(model.model(step.ids, step=step))  # [B, pad + S, vocab]
    returned_cache = cache if use_cache or past_key_values is not None else None
    if labels is not None:
        out = model.causal_lm_loss(logits, labels, front=step.pad)
        out.past_key_values = returned_cache
        return out
    logits = _hand_back(logits, step.pad, caller)
    return logits if returned_cache is None else CausalLMOutputWithPast(logits=logits, past_key_values=returned_cache)


def logits_as_computed(model, input_ids, attention_mask=None) -> Tensor:
    """The logits ``[B, S, vocab]`` of ``model(input_ids, attention_mask=...)`` laid out as the model computed
    them, never gathered: on its last stage's mesh, batch over dp/fsdp, sequence over the cp dims, vocab over
    tp. For code that reduces them on the devices (log-probs of given tokens, losses); recorded under grad
    mode like any forward."""
    ids = check_ids(input_ids)
    b, s = ids.shape
    step = CachedForward(model, ids, valid_columns(attention_mask, b, 0, s), _positions(None, b, s, 0), None,
                         recording=_recording(model))
    logits = model.lm_head(model.model(step.ids, step=step))  # [B, pad + S, vocab]
    return logits[:, step.pad:] if step.pad else logits


def _hand_back(logits: Tensor, pad: int, caller):
    """The logits of the real columns in the caller's layout: torch (keeping a history under grad mode) for
    torch ids, on the ids' mesh and placements for dtorch ids."""
    if caller is None:
        out = torch_logits(logits)
        return out[:, pad:].contiguous() if pad else out
    if pad:
        logits = logits[:, pad:]
    mesh, placements = caller
    return logits.redistribute(mesh, [Replicate() if isinstance(p, Partial) else p for p in placements])


__all__ = ["forward_with_arguments", "split_forward_arguments", "packed_sequences", "logits_as_computed",
           "GenerationError", "CausalLMOutputWithPast"]
