"""Hugging Face's weight initialisation, drawn from torch's generator in Hugging Face's order.

``transformers.LlamaForCausalLM(config)`` after ``torch.manual_seed(s)`` consumes the generator so:

1. ``LlamaModel.__init__`` builds its modules: torch's own ``reset_parameters`` draws (the embedding's
   ``normal_``, each linear's ``kaiming_uniform_`` and bias ``uniform_``), values then overwritten;
2. its ``post_init`` runs ``_init_weights`` over the modules, children before parents
   (``smart_apply``): every ``Linear`` weight ``normal_(0, initializer_range)`` and bias zero, the
   ``Embedding`` ``normal_(0, initializer_range)`` with the padding row zero, norms one;
3. ``LlamaForCausalLM`` builds ``lm_head`` (a ``kaiming_uniform_`` draw) and its ``post_init`` draws
   ``normal_`` for it (modules already initialised are skipped); a tied ``lm_head`` is then replaced by
   the embedding, so its two draws are made and dropped.

dtorch's modules make the draws of step 1 themselves (they initialise like torch's); the functions here
make steps 2 and 3 with the very same calls, each on the parameter's Hugging Face (state-dict) shape,
then lay the value out in the parameter's placements (``ops.random.write_global``). So the same seed gives
Hugging Face's weights bit for bit in every layout.
"""
from __future__ import annotations

import math

import torch

from .. import nn
from ..nn._layout import init_enabled
from ..ops.random import write_global


def initializer_range(config) -> float:
    """Hugging Face's ``std``: the config's ``initializer_range``, 0.02 when it is unset or 0."""
    return getattr(config, "initializer_range", None) or 0.02


def _normal_(module: nn.Module, name: str, std: float, zero_row: int | None = None) -> None:
    """``init.normal_(param, 0, std)`` drawn on the parameter's saved shape (a kv projection held with
    repeated heads draws each head once, as Hugging Face holds it), then written into the parameter."""
    p = module._parameters[name]
    form = module._saved_form(name)
    value = torch.empty(form.saved_shape(p.shape) if form else tuple(p.shape), dtype=p.dtype).normal_(0.0, std)
    if zero_row is not None:
        value[zero_row] = 0
    with torch.no_grad():
        write_global(p, form.load(value) if form else value)


def init_weights_like_hf(root: nn.Module, config) -> None:
    """Hugging Face's ``_init_weights`` on every module under ``root`` (``root`` included), children first."""
    if not init_enabled():  # (values about to be loaded: nothing is drawn, as in from_pretrained)
        return
    std = initializer_range(config)

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if isinstance(module, nn.Linear):
            _normal_(module, "weight", std)
            if module.bias is not None:
                with torch.no_grad():
                    module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            _normal_(module, "weight", std, module.padding_idx)
        # norms hold ones already and rotary tables are not random: nothing to draw

    visit(root)


def skip_tied_lm_head_draws(config, dtype: torch.dtype) -> None:
    """The draws of the ``nn.Linear`` lm_head Hugging Face builds and initialises before tying it to the
    embedding (its ``kaiming_uniform_``, then ``normal_``), made and dropped so the generator stays in step."""
    if not init_enabled():
        return
    scratch = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
    torch.nn.init.kaiming_uniform_(scratch, a=math.sqrt(5))
    scratch.normal_(0.0, initializer_range(config))
