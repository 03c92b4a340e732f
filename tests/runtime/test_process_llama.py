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

from .conftest import process_graph, using

CI = {"tp2", "pp2", "ulysses2", "ring2 uneven sequence"}
CASES = [pytest.param(lay, id=lay.name, marks=() if lay.name in CI else pytest.mark.slow) for lay in LAYOUTS]


@pytest.fixture(scope="module")
def proc():
    g = process_graph()
    yield g
    g.runtime.shutdown()


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
