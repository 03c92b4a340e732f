"""Training on padded and packed batches: ``model(ids, attention_mask=mask, labels=labels)`` (left and right
padding) and ``model(ids, position_ids=packed, labels=labels)`` give Hugging Face's loss, logits and every
parameter gradient (float32, 1e-4) under the layout matrix; a forward with a mask, positions or a cache
records gradients, whatever the ids' type (torch logits carry a history into dtorch's backward); a forward
with ``use_cache=True`` trains and returns a cache the next forward uses.

    pytest -q tests/models/test_llama_padding.py              # a representative subset of the layouts
    pytest -q -m slow tests/models/test_llama_padding.py      # the whole matrix (plus fsdp)
"""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch.models.forward import GenerationError, packed_sequences
from dtorch.models.llama import LlamaForCausalLM, activation_placements
from tests.llama_models import hf_model

from .test_llama import LAYOUTS, Layout
from .test_llama_train import FSDP_LAYOUTS, _compare_grads

TOL = 1e-4
KINDS = ("left padding", "right padding", "packed")

_DEFAULT = {"no mesh", "dp2 uneven batch", "tp2", "pp2", "ulysses2", "ring2 uneven sequence",
            "dp2 x tp2 x pp2 x ring2, batch 3, seq 7", "gqa 8/2 heads, tp4", "fsdp4 uneven batch",
            "pp2 x fsdp2 x ring2"}
ALL = LAYOUTS + FSDP_LAYOUTS
MATRIX = [pytest.param(lay, kind, id=f"{lay.name}, {kind}",
                       marks=() if lay.name in _DEFAULT else pytest.mark.slow) for lay in ALL for kind in KINDS]


def _padding(batch: int, seq: int, left: bool) -> torch.Tensor:
    """[B, S] long: row r has (2, 0, 4, 1, 3)[r % 5] padding tokens (at most seq - 2), on the left or right."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    for r in range(batch):
        n = min((2, 0, 4, 1, 3)[r % 5], seq - 2)
        if n:
            mask[r, :n] = 0 if left else 1
            if not left:
                mask[r, seq - n:] = 0
    return mask


def _packed_positions(batch: int, seq: int) -> torch.Tensor:
    """[B, S]: each row several sequences packed (lengths cycling 3, 1, 4, 2 from a row-dependent start);
    row 1 is one sequence."""
    rows = []
    for r in range(batch):
        lengths, k, pos = (3, 1, 4, 2), r, []
        while len(pos) < seq:
            n = seq if r == 1 else lengths[k % 4]
            pos += list(range(n))
            k += 1
        rows.append(pos[:seq])
    return torch.tensor(rows)


def batch_of(kind: str, layout: Layout, vocab: int, seed: int = 1):
    """(ids, forward arguments, labels, real [B, S] bool) for one kind of batch."""
    torch.manual_seed(seed)
    ids = torch.randint(0, vocab, (layout.batch, layout.seq))
    if kind == "packed":
        pos = _packed_positions(layout.batch, layout.seq)
        labels = ids.masked_fill(pos == 0, -100)  # a sequence's first token is not predicted from the one before
        return ids, {"position_ids": pos}, labels, torch.ones_like(ids, dtype=torch.bool)
    mask = _padding(layout.batch, layout.seq, left=kind == "left padding")
    return ids, {"attention_mask": mask}, ids.masked_fill(mask == 0, -100), mask.bool()


def _hf_kwargs(kwargs: dict) -> dict:
    # Hugging Face's forward makes an empty cache by default (config.use_cache), and with a cache its masking
    # does not look for packed sequences; dtorch's forward defaults to use_cache=False, like HF called so
    return dict(kwargs, use_cache=False)


@pytest.mark.parametrize("layout,kind", MATRIX)
def test_padded_and_packed_batches_train_like_hugging_face(layout, kind):
    hf = hf_model(layout.config)
    hf.zero_grad()
    ids, kwargs, labels, real = batch_of(kind, layout, hf.config.vocab_size)
    model = LlamaForCausalLM(hf.config, layout.mesh())
    model.load_state_dict(hf.state_dict())
    out = model(ids, **kwargs, labels=labels)
    ref = hf(ids, **_hf_kwargs(kwargs), labels=labels)
    out.loss.backward()
    ref.loss.backward()
    torch.testing.assert_close(out.loss.to_torch(), ref.loss.detach(), rtol=TOL, atol=TOL)
    logits = out.logits.to_torch()
    assert logits.shape == ref.logits.shape
    torch.testing.assert_close(logits[real], ref.logits.detach()[real], rtol=TOL, atol=TOL)
    _compare_grads(model, hf)
    hf.zero_grad()


def test_the_masks_matter():
    """Without the mask (or with packed positions read as one sequence) Hugging Face's logits move far beyond
    the tolerance: the matrix above tells a mask that is ignored from one that is applied."""
    hf = hf_model()
    layout = Layout("x", (), batch=3, seq=9)
    with torch.no_grad():
        for kind in KINDS:
            ids, kwargs, _, _ = batch_of(kind, layout, hf.config.vocab_size)
            with_mask = hf(ids, **_hf_kwargs(kwargs)).logits
            if kind == "packed":  # the positions kept, the sequences not told apart
                without = hf(ids, **kwargs, use_cache=True).logits
            else:
                without = hf(ids).logits
            assert (with_mask - without).abs().max() > 100 * TOL, kind


def test_packed_sequences_are_hugging_faces():
    from transformers.masking_utils import find_packed_sequence_indices

    pos = _packed_positions(4, 11)
    assert torch.equal(packed_sequences(pos), find_packed_sequence_indices(pos))
    assert packed_sequences(torch.arange(3, 9).expand(2, 6)) is None  # one sequence per row (an offset)


@pytest.mark.parametrize("dims", [(("dp", 2), ("tp", 2)), (("pp", 2), ("ring_cp", 2))], ids=str)
def test_torch_logits_train_with_a_torch_loss(dims):
    """``model(ids, attention_mask=mask)`` on torch ids returns torch logits with a history: a torch loss's
    backward fills the dtorch parameters' gradients, Hugging Face's."""
    hf = hf_model()
    hf.zero_grad()
    layout = Layout("x", dims, batch=4, seq=6)
    ids, kwargs, labels, _ = batch_of("left padding", layout, hf.config.vocab_size)
    model = LlamaForCausalLM(hf.config, layout.mesh())
    model.load_state_dict(hf.state_dict())

    def torch_loss(logits):
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    logits = model(ids, **kwargs)
    assert isinstance(logits, torch.Tensor) and logits.requires_grad
    loss = torch_loss(logits)
    loss.backward()
    ref = torch_loss(hf(ids, **kwargs).logits)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=TOL, atol=TOL)
    _compare_grads(model, hf)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()  # (torch's own error: the graph was freed)
    hf.zero_grad()
    # no history where torch has none
    with torch.no_grad():
        assert not model(ids, **kwargs).requires_grad
    assert not model(ids).detach().requires_grad


def test_dtorch_ids_with_a_mask_give_dtorch_logits_with_a_history():
    hf = hf_model()
    hf.zero_grad()
    layout = Layout("x", (("dp", 2), ("ring_cp", 2)), batch=4, seq=6)
    ids, kwargs, labels, _ = batch_of("right padding", layout, hf.config.vocab_size)
    mesh = layout.mesh()
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    placements = activation_placements(mesh)
    logits = model(dtorch.Tensor(ids, device_mesh=mesh, placements=placements), **kwargs)
    assert isinstance(logits, dtorch.Tensor) and logits.requires_grad
    assert logits.device_mesh == mesh and logits.placements == placements
    target = dtorch.Tensor(torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100), device_mesh=mesh,
                           placements=placements)
    loss = dtorch.nn.functional.cross_entropy(logits.transpose(1, 2), target)
    loss.backward()
    ref = hf(ids, **kwargs, labels=labels).loss
    ref.backward()
    torch.testing.assert_close(loss.to_torch(), ref.detach(), rtol=TOL, atol=TOL)
    _compare_grads(model, hf)
    hf.zero_grad()


# -- use_cache under grad mode ----------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(), (("pp", 2), ("ring_cp", 2), ("tp", 2)), (("dp", 2), ("ulysess_cp", 2))], ids=str)
def test_a_forward_with_use_cache_trains_and_its_cache_serves_the_next(dims):
    """Hugging Face's forward with use_cache=True under grad mode: the loss and gradients of the forward, and
    a cache that a following forward continues from (here one that records gradients too: its cached keys
    come from a forward under no_grad, so they are constants in Hugging Face's gradient as well)."""
    hf = hf_model()
    hf.zero_grad()
    layout = Layout("x", dims, batch=4, seq=7)
    ids, kwargs, labels, real = batch_of("left padding", layout, hf.config.vocab_size)
    model = LlamaForCausalLM(hf.config, layout.mesh())
    model.load_state_dict(hf.state_dict())
    out = model(ids, **kwargs, labels=labels, use_cache=True)
    ref = hf(ids, **kwargs, labels=labels, use_cache=True)
    assert out.past_key_values.get_seq_length() == 7 and out[0] is out.loss and out[2] is out.past_key_values
    out.loss.backward()
    ref.loss.backward()
    torch.testing.assert_close(out.loss.to_torch(), ref.loss.detach(), rtol=TOL, atol=TOL)
    _compare_grads(model, hf)
    hf.zero_grad()
    model.zero_grad()
    # without labels: the logits (torch ids: torch, with a history) and the cache
    out = model(ids, **kwargs, use_cache=True)
    assert isinstance(out.logits, torch.Tensor) and out.logits.requires_grad
    # the cache's keys were recorded: a forward that would need their gradient is refused, one without runs
    nxt = torch.randint(0, hf.config.vocab_size, (4, 3), generator=torch.Generator().manual_seed(2))
    grown = torch.cat([kwargs["attention_mask"], torch.ones(4, 3, dtype=torch.long)], dim=1)
    with pytest.raises(GenerationError, match=r"recorded under grad mode.*torch.no_grad\(\)"):
        model(nxt, attention_mask=grown, past_key_values=out.past_key_values)
    with torch.no_grad():
        cache = model(ids, **kwargs, use_cache=True).past_key_values
        ref_cache = hf(ids, **kwargs, use_cache=True).past_key_values
        got = model(nxt, attention_mask=grown, past_key_values=out.past_key_values)
        want = hf(nxt, attention_mask=grown, past_key_values=hf(ids, **kwargs, use_cache=True).past_key_values)
        torch.testing.assert_close(got.logits, want.logits, rtol=TOL, atol=TOL)
    # a recorded forward after a prefill under no_grad: gradients through the new tokens, Hugging Face's
    out = model(nxt, attention_mask=grown, past_key_values=cache, use_cache=True, labels=nxt)
    ref = hf(nxt, attention_mask=grown, past_key_values=ref_cache, use_cache=True, labels=nxt)
    assert out.past_key_values is cache and cache.get_seq_length() == 10
    out.loss.backward()
    ref.loss.backward()
    torch.testing.assert_close(out.loss.to_torch(), ref.loss.detach(), rtol=TOL, atol=TOL)
    torch.testing.assert_close(out.logits.to_torch(), ref.logits.detach(), rtol=TOL, atol=TOL)
    _compare_grads(model, hf)
    hf.zero_grad()


@pytest.mark.parametrize("kind", ["left padding", "packed"])
def test_gradient_checkpointing_with_a_mask_gives_the_same_gradients(kind):
    hf = hf_model()
    layout = Layout("ckpt", (("tp", 2), ("pp", 2)), batch=4, seq=6)
    ids, kwargs, labels, _ = batch_of(kind, layout, hf.config.vocab_size)
    grads = []
    for ckpt in (False, True):
        model = LlamaForCausalLM(hf.config, layout.mesh())
        model.load_state_dict(hf.state_dict())
        if ckpt:
            model.gradient_checkpointing_enable()
        model(ids, **kwargs, labels=labels).loss.backward()
        grads.append({n: p.grad.to_torch() for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-6)
