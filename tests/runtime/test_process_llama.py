"""The Llama layout matrix on the process backend: the same logits and the same communication as the
in-process backend (within 1e-5: see test_process_backend's note on kernels), Hugging Face's within 1e-4.

The CI subset runs the layouts that fit 2 cores (2 workers each: TP, PP hand-offs, Ulysses, Ring);
``-m slow`` runs every layout of the matrix.

    .venv/bin/pytest -q tests/runtime/test_process_llama.py
"""
from __future__ import annotations

import pytest
import torch

import dtorch
from tests.models.test_llama import ATOL, LAYOUTS, RTOL, run_layout

from .conftest import using

CI = {"tp2", "pp2", "ulysses2", "ring2 uneven sequence"}
CASES = [pytest.param(lay, id=lay.name, marks=() if lay.name in CI else pytest.mark.slow) for lay in LAYOUTS]


@pytest.mark.parametrize("layout", CASES)
def test_layout_matches_inprocess_and_hugging_face(proc, ref, layout):
    runs = []
    for g in (ref, proc):
        with using(g), dtorch.CommLog() as log:
            got, expected = run_layout(layout)
        runs.append((got, log.counts(), log.bytes()))
    (want, counts, nbytes), (got, p_counts, p_bytes) = runs
    assert (p_counts, p_bytes) == (counts, nbytes)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_tied_weight_copy_follows_in_place_writes(proc):
    # on workers the last stage's copy of a tied weight is real memory: an in-place write keeps the
    # parameter's handle, so only its _version tells the copy is stale
    import transformers

    from dtorch.models.llama import LlamaForCausalLM
    from tests.llama_models import make_config

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(make_config(tie_word_embeddings=True)).eval()
    ids = torch.randint(0, 160, (2, 6))
    with using(proc):
        mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["pp"])
        model = LlamaForCausalLM(hf.config, mesh)
        model.load_state_dict(hf.state_dict())
        w = model.model.embed_tokens.weight
        for scale in (0.5, 3.0):
            with torch.no_grad():  # a parameter requires grad: written in place outside autograd, as in torch
                w.mul_(scale)
                hf.model.embed_tokens.weight.mul_(scale)
                torch.testing.assert_close(model(ids), hf(ids).logits, rtol=RTOL, atol=ATOL)
