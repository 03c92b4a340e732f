"""The global-view RNG on the process backend: fills, ``torch.nn.init`` and a seeded Llama give torch's (and
Hugging Face's) values bit for bit, as in process, with every block written on its worker."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

import dtorch
from dtorch import Partial, Replicate, Shard, nn
from dtorch.models.llama import LlamaForCausalLM
from tests.llama_models import make_config

from .conftest import using


def test_fills_and_inits_equal_torch(proc):
    with using(proc):
        mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
        for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Partial(), Shard(1)]):
            p = nn.Parameter(dtorch.zeros(5, 7, device_mesh=mesh, placements=placements))
            ref = torch.nn.Parameter(torch.zeros(5, 7))
            for t in (ref, p):
                torch.manual_seed(4)
                torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))
                torch.nn.init.trunc_normal_(t, std=0.5)
                with torch.no_grad():
                    t.bernoulli_(0.3)
                    t.normal_(1.0, 2.0)
            assert p.placements == placements
            assert torch.equal(p.to_torch(), ref.detach())


def test_seeded_llama_equals_hugging_face(proc):
    config = make_config("gqa", tie_word_embeddings=True)
    torch.manual_seed(2)
    expected = transformers.LlamaForCausalLM(config).state_dict()
    with using(proc):
        torch.manual_seed(2)
        model = LlamaForCausalLM(config, dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "tp"]))
        got = model.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())
