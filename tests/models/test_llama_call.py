"""Calling LlamaForCausalLM: forward hooks run on every form of the call, and a call inside a call (a hook
that runs the model again) keeps its own layout: the model stores nothing between laying the ids out and
handing the logits back."""
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.models.llama import LlamaForCausalLM
from tests.llama_models import hf_model
from tests.models.test_llama import ATOL, RTOL


def _model(mesh):
    hf = hf_model()
    model = LlamaForCausalLM(hf.config, mesh)
    model.load_state_dict(hf.state_dict())
    return hf, model


def test_forward_hooks_run_on_every_form_of_the_call():
    hf, model = _model(dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"]))
    seen = []
    pre = model.register_forward_pre_hook(lambda m, args, kwargs: seen.append(("pre", sorted(kwargs))),
                                          with_kwargs=True)
    post = model.register_forward_hook(lambda m, args, kwargs, out: seen.append(("post", type(out).__name__)),
                                       with_kwargs=True)
    ids = torch.randint(0, 160, (2, 5))
    model(ids)
    model(ids, labels=ids)
    model(ids, attention_mask=torch.ones_like(ids))
    assert seen == [("pre", []), ("post", "Tensor"), ("pre", ["labels"]), ("post", "CausalLMOutputWithPast"),
                    ("pre", ["attention_mask"]), ("post", "Tensor")]
    pre.remove()
    post.remove()
    model(ids)
    assert len(seen) == 6


def test_a_call_inside_a_call_keeps_its_own_layout():
    # ring_cp=2 and a sequence of 5: torch ids are padded to 6 for an even split and the logits cut back to 5;
    # the inner call (dtorch ids, another layout) must not change what the outer one hands back
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "ring_cp"])
    hf, model = _model(mesh)
    outer_ids = torch.randint(0, 160, (2, 5))
    inner_ids = dtorch.Tensor(torch.randint(0, 160, (2, 4)), device_mesh=mesh, placements=[Shard(0), Replicate()])
    inner, entered = [], []

    def hook(module, args):  # on lm_head: inside the outer call, between laying its ids out and its logits
        if not entered:  # once: the inner call runs this hook too
            entered.append(True)
            inner.append(model(inner_ids))

    model.lm_head.register_forward_pre_hook(hook)
    out = model(outer_ids)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5, 160)
    assert inner[0].placements == [Shard(0), Replicate()] and inner[0].shape == (2, 4, 160)
    with torch.no_grad():
        torch.testing.assert_close(out, hf(outer_ids).logits, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(inner[0].to_torch(), hf(inner_ids.to_torch()).logits, rtol=RTOL, atol=ATOL)
    assert not any(k in vars(model) for k in ("_caller", "_real_len"))
