"""scaled_dot_product_attention, layout [N, H, L, E]: the op, and the attention algorithms it is built from.

    sdpa.py              block math (attend one K/V block, merge blocks by log-sum-exp) and the plain rule
    context_parallel.py  the sequence split over mesh dims the caller names (``ContextParallel``): Ulysses
                         (all_to_all between sequence and heads) and Ring plans, built by keyword
    ring.py              ring attention: the steps, the backward node, causal block skipping
    decode.py            decoding with a KV cache: write, attend and merge kernels (flash-decoding)

Which algorithm runs is the caller's explicit choice (``context_parallel=``), never read from mesh dim
names; a new variant is a new module here and a value of that argument (docs/internals.md, "Adding an
attention variant").
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from ...errors import AttentionInputError, OpError
from ...tensor import Tensor
from ..rules import to_dtensors
from ..table import register
from .context_parallel import ContextParallel
from .context_parallel import context_parallel as cp_attention
from .sdpa import NAME, _plain_rule, _sdpa_kernel, plain

__all__ = ["ContextParallel", "scaled_dot_product_attention"]


# ------------------------------------------------------------------------------------------------
# the op


def _check_mask_with_causal(q, k, v, mask, dropout_p: float, scale, gqa: bool) -> None:
    """``attn_mask`` with ``is_causal=True``: torch's fused kernels combine the two (``_with_causal``), its math
    kernel refuses the pair. Which one torch would run depends on the shapes (4-D, one head size for q, k and
    v, ...), on dropout and on the backends ``torch.nn.attention.sdpa_kernel`` enables: torch's own choice,
    asked with stand-ins of these shapes and dtypes (one row of memory each, expanded), decides."""
    device = "cuda" if q.device_mesh.device_type == "cuda" and torch.cuda.is_available() else "cpu"

    def stand_in(x: Tensor) -> torch.Tensor:
        row = torch.empty(x.shape[-1:], dtype=x.dtype, device=device, requires_grad=x.requires_grad)
        return row.expand(tuple(x.shape))

    try:
        choice = torch._fused_sdp_choice(*(stand_in(x) for x in (q, k, v, mask)), dropout_p, True, scale=scale,
                                         enable_gqa=gqa)
    except RuntimeError as exc:  # no backend enabled can run it
        raise AttentionInputError(f"dtorch.{NAME}: {exc}") from exc
    if choice == int(SDPBackend.MATH):
        raise AttentionInputError(
            f"dtorch.{NAME}: Explicit attn_mask should not be set when is_causal=True: for these inputs torch runs "
            "its math kernel, which refuses the pair (dropout, 3-D inputs, a value head size other than the query's, "
            "a 3-D mask, or sdpa_kernel(SDPBackend.MATH)); fold the causal mask into attn_mask "
            "(& torch.ones(L, S, dtype=torch.bool).tril()) or drop one of them")


@register(rule=_plain_rule, kernel=_sdpa_kernel, torch_fns=(F.scaled_dot_product_attention,), functional=True)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None, enable_gqa: bool = False, *,
                                 context_parallel: ContextParallel | None = None):
    """``F.scaled_dot_product_attention`` on [N, H, L, E] tensors; context parallel over the mesh dims
    ``context_parallel`` names (a ``ContextParallel``: Ulysses and/or Ring; None: the plain rule).

    With ``dropout_p > 0`` the dropout mask is drawn for the global [N, H, L, S] attention weights by
    torch on the controller (on CPU the same values as torch's SDPA for the same seed)."""
    q, k, v, mask = to_dtensors(NAME, [query, key, value, attn_mask])
    if not all(isinstance(x, Tensor) for x in (q, k, v)):
        raise OpError(f"dtorch.{NAME}: query, key and value must be tensors")
    if is_causal and isinstance(mask, Tensor):  # (before the 3-D form becomes 4-D: torch refuses it there)
        _check_mask_with_causal(q, k, v, mask, dropout_p, scale, bool(enable_gqa))
    if q.ndim == 3 and k.ndim == 3 and v.ndim == 3:  # torch also takes [N, L, E]: one head
        mask = mask.unsqueeze(-3) if isinstance(mask, Tensor) and mask.ndim == 3 else mask
        out = scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), mask, dropout_p,
                                           is_causal, scale, enable_gqa, context_parallel=context_parallel)
        return out.squeeze(1)
    if not 0.0 <= dropout_p <= 1.0:
        raise OpError(f"dtorch.{NAME}: dropout_p must be in [0, 1], got {dropout_p}")
    e = q.shape[-1] if q.ndim else 1
    scale = float(1.0 / math.sqrt(e) if scale is None else scale)
    noise = None
    if dropout_p > 0.0 and q.ndim == 4 and k.ndim == 4:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        # torch's recipe: empty_like(attn).bernoulli_(1 - p).div_(1 - p); p == 1 drops everything
        full = (torch.zeros(shape, dtype=q.dtype) if dropout_p == 1.0
                else torch.empty(shape, dtype=q.dtype).bernoulli_(1 - dropout_p).div_(1 - dropout_p))
        noise = Tensor(full, device_mesh=q.device_mesh)
    u, r = context_parallel.dims(q.device_mesh) if context_parallel is not None else (None, None)
    if u is None and r is None:
        return plain(q, k, v, mask, noise, bool(is_causal), scale, bool(enable_gqa))
    return cp_attention(q, k, v, mask, noise, bool(is_causal), scale, bool(enable_gqa), u, r)

