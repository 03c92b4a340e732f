"""Generation for dtorch's Llama: ``generate``, with a KV cache (Hugging Face's forward arguments, which
it uses, are models/forward.py).

``model.generate(ids, ...)`` takes transformers' generation settings: its arguments over
``model.generation_config`` (loaded by ``from_pretrained`` from generation_config.json) over transformers'
defaults, resolved as transformers resolves them (``resolve_generation_config``). It prefills the prompt
with the model's layout (the sequence split over cp), then runs one decode step per new token. Each
step's next token is chosen on the devices (greedy: argmax; sampling: temperature, top-k, top-p, then
the inverse CDF at a uniform number the controller draws from the caller's ``torch.Generator`` for each
row), so the controller fetches only the new token ids, never logits. The uniform numbers depend only on
the generator, so a seed gives the same tokens under every layout.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from ..compile import compile as compile_step
from ..ops.attention.decode import last_position
from ..ops.sampling import next_token
from ..tensor import Tensor
from ._checkpoint import generation_config_from_model_config
from .forward import CausalLMOutputWithPast, GenerationError, check_ids
from .forward import forward_with_arguments as cached_forward  # (its name before models/forward.py)
from .kv_cache import CachedForward, KVCache
from .layout import cp_size, decode_placements


@dataclass
class GenerateOutput:
    """``generate(..., return_dict_in_generate=True)``: the ids, and with ``output_logits=True`` each step's
    logits ``[B, vocab]`` (fetched from the devices only when asked for)."""
    sequences: torch.Tensor
    logits: tuple | None = None
    past_key_values: KVCache | None = None
    timings: dict = field(default_factory=dict)  # prefill_s, decode_s, decode_steps


def _model_parts(model):
    llama = getattr(model, "model", None)
    if llama is None or not hasattr(model, "lm_head"):
        raise GenerationError(f"generation needs a dtorch LlamaForCausalLM, got {type(model).__name__}")
    return llama, model.lm_head


def _hidden(model, step: CachedForward, last_only: bool) -> Tensor:
    llama, _ = _model_parts(model)
    h = llama(step.ids, step=step)  # [B, S, H] on the last stage
    return last_position(h) if last_only else h


# generate's decode steps run under dtorch.compile (False: eagerly, e.g. to compare)
COMPILE_DECODE = True


def _logits(model, step: CachedForward) -> Tensor:
    """The last position's logits [B, vocab] (vocab over tp) of one cached forward."""
    _, lm_head = _model_parts(model)
    logits = lm_head(_hidden(model, step, last_only=True))  # [B, 1, vocab]
    return logits.view(logits.shape[0], logits.shape[-1])


def _decode_logits(model, cache: KVCache, tok: torch.Tensor, positions: torch.Tensor, attended: int | None) -> Tensor:
    """One decode step: the tokens ``tok`` [B, 1] at ``positions`` written into the cache, the next logits
    (attending the first ``attended`` slots: ``KVCache.attended_slots``)."""
    valid = torch.ones(tok.shape[0], 1, dtype=torch.bool)
    return _logits(model, CachedForward(model, tok, valid, positions, cache, attended=attended))


def _uniforms(b: int, sample: bool, generator) -> torch.Tensor | None:
    """[B] float64 in (0, 1]: each row's uniform number of a sampled step (None when greedy: nothing to send)."""
    # (0, 1]: a uniform number of 0 could pick a token of probability 0
    return 1.0 - torch.rand(b, generator=generator, dtype=torch.float64) if sample else None


def _choose(logits: Tensor, u: torch.Tensor | None, sampling: tuple) -> Tensor:
    if u is None:  # greedy: the argmax needs no uniform numbers (none placed on the devices each step)
        return next_token(logits, None, *sampling)
    mesh = logits.device_mesh
    ut = Tensor(u, device_mesh=mesh, placements=decode_placements(mesh, 1))
    return next_token(logits, ut, *sampling)


def _decode_step(model, cache: KVCache, tok: torch.Tensor, positions: torch.Tensor, u: torch.Tensor,
                 sampling: tuple, attended: int | None):
    """One decode step, the token choice included (a replay of it leaves the host loop only the fetch of the
    ids): the tokens ``tok`` [B, 1] at ``positions`` written into the cache; (the next logits, the next ids).
    ``attended`` (``KVCache.attended_slots``) is an argument, so that each size is a trace of its own."""
    logits = _decode_logits(model, cache, tok, positions, attended)
    return logits, _choose(logits, u, sampling)


def _compiled_decode():
    # one trace per attended size (KVCache.attended_slots: ~8 + 4 log2(slots / 128)), all kept
    return compile_step(_decode_step, max_traces=64)


def _decode_state(model, batch: int, slots: int, keep: bool):
    """(the KV cache, the decode step) of a generate: kept on the model for its next generate of the same batch
    size, length and dtype, so that the decode step is traced once per attended size, not per call (its traces
    are bound to the cache's tensors, which they hold anyway). ``keep`` False (the caller gets the cache): a
    cache and a step of this call's own."""
    if not keep:
        return KVCache(model, batch, slots), _compiled_decode() if COMPILE_DECODE else _decode_step
    llama, _ = _model_parts(model)
    key = (batch, slots, llama.layers[0].self_attn.k_proj.weight.dtype)
    kept = model.__dict__.get("_generate_kept")
    if kept is None or kept[0] != key:
        kept = model.__dict__["_generate_kept"] = (key, KVCache(model, batch, slots), _compiled_decode())
    else:
        kept[1].reset()
    return kept[1], kept[2] if COMPILE_DECODE else _decode_step


# ------------------------------------------------------------------------------------------------
# generate


# settings of a GenerationConfig that change the tokens and that this generate does not implement, with the
# values that leave them off (after transformers' defaults are filled in)
_UNSUPPORTED = {"num_beams": (1,), "num_beam_groups": (1,), "num_return_sequences": (1,), "penalty_alpha": (None,),
                "repetition_penalty": (1.0,), "no_repeat_ngram_size": (0,), "bad_words_ids": (None,),
                "min_length": (0,), "min_new_tokens": (None,), "typical_p": (1.0,), "min_p": (None,),
                "epsilon_cutoff": (0.0,), "eta_cutoff": (0.0,), "top_h": (None,), "suppress_tokens": (None,),
                "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
                "sequence_bias": (None,), "stop_strings": (None,), "exponential_decay_length_penalty": (None,),
                "guidance_scale": (None, 1, 1.0), "dola_layers": (None,), "prompt_lookup_num_tokens": (None,),
                "watermarking_config": (None,), "constraints": (None,), "force_words_ids": (None,)}


def _problems(values: dict) -> list[str]:
    """What is wrong with these generation settings (given, or resolved): each says what to change."""
    problems = []
    n = values.get("max_new_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        problems.append(f"max_new_tokens must be an int >= 1, got {n!r}")
    if values.get("do_sample"):
        t, k, p = values.get("temperature"), values.get("top_k"), values.get("top_p")
        if t is not None and not (isinstance(t, (int, float)) and t > 0):
            problems.append(f"temperature must be a number > 0, got {t!r}")
        if k is not None and not (isinstance(k, int) and k >= 0):
            problems.append(f"top_k must be an int >= 0 (0 or None: no top-k filter), got {k!r}")
        if p is not None and not (isinstance(p, (int, float)) and 0 < p <= 1):
            problems.append(f"top_p must be a number in (0, 1] or None, got {p!r}")
    return problems


def resolve_generation_config(model, input_length: int, generation_config=None, **kwargs):
    """The ``transformers.GenerationConfig`` ``generate`` runs with, resolved as transformers' ``generate``
    resolves it: ``kwargs`` over ``generation_config`` (or a blank one) over ``model.generation_config`` over
    transformers' defaults (greedy; sampling: temperature 1, top_k 50, top_p 1). ``max_new_tokens`` wins
    over ``max_length`` (which counts the prompt); with neither set anywhere, 20 new tokens, within
    ``max_position_embeddings``. Its ``max_length`` is the prompt plus the new tokens."""
    base = model.generation_config
    default_max_length = kwargs.get("max_length") is None and base.max_length is None \
        and (generation_config is None or generation_config.max_length is None)
    if generation_config is None:
        from transformers import GenerationConfig

        cfg = GenerationConfig()
    else:
        cfg = copy.deepcopy(generation_config)
    try:
        cfg.update(**base.to_dict(), defaults_only=True, allow_custom_entries=True)
        cfg.update(**base._get_default_generation_params(), defaults_only=True)
        unused = cfg.update(**kwargs)
    except ValueError as exc:  # transformers' own validation of the settings
        raise GenerationError(f"generate: {exc}") from None
    if unused:
        raise GenerationError(f"generate takes no argument {', '.join(sorted(unused))} (it takes the fields of "
                              "transformers.GenerationConfig, attention_mask, generation_config, generator, streamer)")
    if cfg.max_new_tokens is not None:
        cfg.max_length = cfg.max_new_tokens + input_length
    elif default_max_length:
        cfg.max_length += input_length
        limit = getattr(model.config, "max_position_embeddings", None)
        cfg.max_length = cfg.max_length if limit is None else min(cfg.max_length, limit)
    return cfg


def _settings(model, ids: torch.Tensor, generation_config, kwargs: dict):
    """(the resolved GenerationConfig, eos ids, pad id), every problem raised at once."""
    problems = _problems(kwargs)
    if problems:
        raise GenerationError("generate: " + "; ".join(problems))
    cfg = resolve_generation_config(model, ids.shape[1], generation_config, **kwargs)
    problems = _problems(cfg.to_dict())
    unsupported = [f"{k}={getattr(cfg, k)!r}" for k, off in _UNSUPPORTED.items() if getattr(cfg, k, None) not in off]
    if unsupported:
        problems.append(f"{', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported (dtorch's "
                        "generate is greedy or samples with temperature, top_k and top_p); set it to its default in "
                        "the arguments or in model.generation_config")
    if cfg.max_length <= ids.shape[1]:
        problems.append(f"the prompt has {ids.shape[1]} tokens but max_length is {cfg.max_length} (it counts the "
                        "prompt); set max_new_tokens")
    if problems:
        raise GenerationError("generate: " + "; ".join(problems))
    eos = cfg.eos_token_id
    eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else None)
    return cfg, eos, pad


def _check_inputs(model, ids: torch.Tensor, attention_mask, generator) -> None:
    problems = []
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
    if problems:
        raise GenerationError("generate: " + "; ".join(problems))


def _attention_mask(ids: torch.Tensor, attention_mask, eos: list, pad) -> torch.Tensor:
    """[B, S] bool. Without a mask, as transformers infers one: the pad id's places are padding when the
    prompt holds it and it is no eos id; else every token is real."""
    if attention_mask is not None:
        m = attention_mask.to_torch() if isinstance(attention_mask, Tensor) else attention_mask
        return torch.as_tensor(m).cpu().bool()
    if pad is not None and pad not in eos and bool((ids == pad).any()):
        return ids != pad
    return torch.ones(ids.shape, dtype=torch.bool)


def generate(model, input_ids, attention_mask=None, generation_config=None, generator: torch.Generator | None = None,
             streamer=None, **kwargs):
    """Continue ``input_ids`` ``[B, S]`` (left-padded where ``attention_mask`` is 0) like ``transformers``'
    ``generate``, with its settings: ``kwargs`` (``max_new_tokens``, ``max_length``, ``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ``pad_token_id``, ``output_logits``,
    ``return_dict_in_generate``: any field of ``transformers.GenerationConfig``) override
    ``generation_config`` (a ``GenerationConfig``) and ``model.generation_config`` (``from_pretrained`` reads
    the checkpoint's generation_config.json), then transformers' defaults (``resolve_generation_config``).

    Greedy (argmax) or sampled (temperature, top-k, top-p; the uniform numbers come from ``generator``, or
    torch's global generator). A row that produced any of the eos ids gets the pad id (default: the first
    eos id) afterwards; generation stops when every row has. ``streamer``: an object with ``put(ids)`` and
    ``end()`` (``transformers``' streamers): ``put`` gets the prompt, then each step's new ids ``[B]``.
    Returns the ids ``[B, S + new]`` (torch), or a ``GenerateOutput`` with ``return_dict_in_generate``.
    """
    ids = check_ids(input_ids)
    cfg, eos, pad_token_id = _settings(model, ids, generation_config, kwargs)
    _check_inputs(model, ids, attention_mask, generator)
    max_new_tokens = cfg.max_length - ids.shape[1]
    output_logits, return_dict = bool(cfg.output_logits), bool(cfg.return_dict_in_generate)
    sampling = (False, 1.0, None, None)
    if cfg.do_sample:
        sampling = (True, float(cfg.temperature), int(cfg.top_k) if cfg.top_k else None,
                    float(cfg.top_p) if cfg.top_p is not None else None)
    llama, lm_head = _model_parts(model)
    b, s = ids.shape
    mask = _attention_mask(ids, attention_mask, eos, pad_token_id)
    # Hugging Face's positions for a left-padded batch: each row counts its own real tokens
    positions = (mask.long().cumsum(-1) - 1).masked_fill(~mask, 0)
    cp = cp_size(llama.stage_meshes[0])
    # every cp block holds its chunk of the (padded) prompt and its share of the new tokens; the decode step is
    # traced once and replayed (dtorch.compile): same tokens, none of the front end's Python
    cache, decode = _decode_state(model, b, cp * (-(-s // cp) + -(-max_new_tokens // cp)), keep=not return_dict)
    replays = decode.stats["replays"] if COMPILE_DECODE else 0
    eos_t = torch.tensor(eos, dtype=torch.long)
    finished = torch.zeros(b, dtype=torch.bool)
    out, step_logits = [ids], []
    timings = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
    if streamer is not None:
        streamer.put(ids)
    with torch.no_grad():
        for i in range(max_new_tokens):
            t0 = time.perf_counter()
            u = _uniforms(b, sampling[0], generator)
            if i == 0:  # the prefill
                logits = _logits(model, CachedForward(model, ids, mask, positions, cache))
                chosen = _choose(logits, u, sampling)
            else:
                logits, chosen = decode(model, cache, tok[:, None], positions, u, sampling, cache.attended_slots(1))
            tok = chosen.to_torch()  # the one fetch of a step: [B] ids
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
    if COMPILE_DECODE:
        timings["decode_replays"] = decode.stats["replays"] - replays
    if streamer is not None:
        streamer.end()
    seqs = torch.cat(out, dim=1)
    if return_dict:
        return GenerateOutput(seqs, tuple(step_logits) if output_logits else None, cache, timings)
    return seqs


__all__ = ["generate", "resolve_generation_config", "cached_forward", "CausalLMOutputWithPast", "GenerateOutput",
           "GenerationError", "KVCache"]


class GenerationMixin:
    """``generate`` and ``generation_config`` of a causal LM (as transformers' ``GenerationMixin``): the model
    supplies ``model`` (the decoder, with ``stage_meshes`` and ``layers``), ``lm_head`` and ``config``."""

    @property
    def generation_config(self):
        """transformers' ``GenerationConfig`` that ``generate`` starts from (its arguments override it): read
        by ``from_pretrained`` from the checkpoint's generation_config.json, else made from the config, as
        transformers does."""
        if self.__dict__.get("_generation_config") is None:
            self.__dict__["_generation_config"] = generation_config_from_model_config(self.config)
        return self.__dict__["_generation_config"]

    @generation_config.setter
    def generation_config(self, value) -> None:
        self.__dict__["_generation_config"] = value

    def generate(self, input_ids, attention_mask=None, **kwargs):
        """Greedy or sampled continuation of ``input_ids`` with a KV cache, like ``transformers``' ``generate``:
        returns the ids ``[batch, prompt + new]`` as a torch tensor (see ``generation.generate``)."""
        return generate(self, input_ids, attention_mask, **kwargs)
