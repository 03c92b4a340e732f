"""The cyclic collector is paused over a step's calls (dtorch/_collector.py): a forward, a backward and a
pipeline step run no collection, the collector is on again after them (also after an error), one the user
disabled stays off, and cyclic garbage made inside is collected afterwards.

    .venv/bin/pytest -q tests/test_collector.py
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import dtorch
from dtorch._collector import collector_paused
from dtorch.models.llama import LlamaForCausalLM
from dtorch.pipeline import one_f_one_b, split_micro_batches
from tests.llama_models import hf_model


class Collections:
    """Counts the collector's runs while in the ``with`` block."""

    def __enter__(self):
        self.n = 0
        gc.callbacks.append(self._count)
        return self

    def _count(self, phase, info):
        self.n += phase == "start"

    def __exit__(self, *exc):
        gc.callbacks.remove(self._count)


class _NoPause:
    """The gc module with ``disable`` a no-op: the step as it ran before the pause."""

    def __getattr__(self, name):
        return getattr(gc, name)

    def disable(self):
        pass


def test_a_pipeline_step_and_a_forward_backward_run_no_collection(monkeypatch):
    hf = hf_model()
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, hf.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    mbs = split_micro_batches(ids, ids, chunks=2)

    def step():
        one_f_one_b(model, mbs)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss

    step()  # warm: plans, executables
    old = gc.get_threshold()
    gc.set_threshold(1)  # every tracked allocation outside a paused call triggers a young collection
    try:
        with Collections() as paused:
            loss = step()
        with monkeypatch.context() as m:
            m.setattr("dtorch._collector.gc", _NoPause())
            with Collections() as unpaused:
                step()
    finally:
        gc.set_threshold(*old)
    # the few left are the allocations between the calls (the loss's attribute, the tuple of micro-batches)
    assert paused.n < 20 < 1000 < unpaused.n
    assert gc.isenabled()
    assert loss.item() == pytest.approx(hf(ids, labels=ids).loss.item(), abs=1e-5)


def test_the_collector_comes_back_after_an_error_and_a_disabled_one_stays_off():
    @collector_paused
    def fails():
        assert not gc.isenabled()
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails()
    assert gc.isenabled()
    gc.disable()
    try:
        @collector_paused
        def inside():
            return gc.isenabled()
        assert inside() is False
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_cyclic_garbage_made_inside_is_collected_afterwards():
    class Node:
        pass

    @collector_paused
    def make_cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    ref = make_cycle()
    assert ref() is not None  # a cycle: reference counting alone does not free it
    gc.collect()
    assert ref() is None


def test_no_pause_while_a_graph_measures_memory():
    @collector_paused
    def enabled_inside():
        return gc.isenabled()

    graph = dtorch.Graph()
    graph.track_memory()
    try:
        assert enabled_inside() is True  # frees the accounting sees happen when they would without dtorch
    finally:
        graph.track_memory(False)
    assert enabled_inside() is False
