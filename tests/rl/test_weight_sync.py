"""Weight sync: ``dtorch.nn.utils.copy_parameters_`` from a trainer's layout into a rollout model's, and
``load_state_dict`` with dtorch tensors, which takes the same path.

After a sync the rollout model's logits equal the policy's (1e-6); CommLog holds only send_recv records,
one per bucket, whose bytes are the elements whose destination device does not hold them already; on the
process backend nothing passes through the controller."""
from __future__ import annotations

import tracemalloc

import pytest
import torch
import transformers

import dtorch
from dtorch import CommLog, DeviceMesh
from dtorch.models import LlamaForCausalLM
from dtorch.nn import skip_init
from dtorch.nn.utils import copy_parameters_
from tests.runtime.conftest import process_graph, using
from tests.runtime.test_move_into import changed_owner_bytes


def mesh(shape, names, first: int = 0) -> DeviceMesh:
    n = 1
    for s in shape:
        n *= s
    return DeviceMesh("cpu", torch.arange(first, first + n).reshape(shape), mesh_dim_names=names)


def config(**kw) -> transformers.LlamaConfig:
    args = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                vocab_size=40, max_position_embeddings=32, initializer_range=0.1)
    args.update(kw)
    cfg = transformers.LlamaConfig(**args)
    cfg._attn_implementation = "sdpa"
    return cfg


# the three trainer / rollout pairs
PAIRS = {
    "fsdp4 -> dp2 x tp2, colocated": (((4,), ["fsdp"], 0), ((2, 2), ["dp", "tp"], 0)),
    "dp2 x tp2 -> tp4, other devices": (((2, 2), ["dp", "tp"], 0), ((4,), ["tp"], 4)),
    "pp2 x tp2 -> tp2": (((2, 2), ["pp", "tp"], 0), ((2,), ["tp"], 0)),
}


def models(pair, cfg=None):
    (ts, tn, tf), (gs, gn, gf) = PAIRS[pair]
    cfg = cfg or config()
    torch.manual_seed(0)
    policy = LlamaForCausalLM(cfg, mesh(ts, tn, tf))
    torch.manual_seed(1)  # other weights: a sync that missed a parameter shows
    rollout = LlamaForCausalLM(cfg, mesh(gs, gn, gf))
    return policy, rollout


def logits(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("pair", PAIRS)
def test_after_a_sync_the_rollout_logits_equal_the_policy_logits(pair):
    policy, rollout = models(pair)
    ids = torch.randint(0, 40, (4, 11))
    assert not torch.allclose(logits(rollout, ids), logits(policy, ids), atol=1e-3)
    params = {n: p for n, p in rollout.named_parameters()}
    with CommLog() as log:
        moved = copy_parameters_(rollout, policy)
    torch.testing.assert_close(logits(rollout, ids), logits(policy, ids), rtol=1e-6, atol=1e-6)
    assert {n: p for n, p in rollout.named_parameters()} == params  # the same Parameter objects, written in place
    # only batched moves; their bytes: each destination block's elements its device does not hold already
    assert {r.kind for r in log.records} == {"send_recv"}
    want = 0
    for (name, p), q in zip(rollout.named_parameters(), policy.parameters()):
        want += changed_owner_bytes(q.device_mesh, q.placements, p.device_mesh, p.placements, tuple(p.shape), 4)
    assert moved == sum(r.nbytes for r in log.records) == want


def test_a_sync_after_training_steps_and_the_optimizer_still_holds_its_parameters():
    policy, rollout = models("fsdp4 -> dp2 x tp2, colocated")
    opt = dtorch.optim.AdamW(rollout.parameters(), lr=1e-2)  # (it must keep its parameters through syncs)
    popt = dtorch.optim.AdamW(policy.parameters(), lr=1e-2)
    ids = torch.randint(0, 40, (4, 9))
    for _ in range(2):
        policy(ids, labels=ids).loss.backward()
        popt.step()
        popt.zero_grad()
        copy_parameters_(rollout, policy)
        torch.testing.assert_close(logits(rollout, ids), logits(policy, ids), rtol=1e-6, atol=1e-6)
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], rollout.parameters()))


def test_kv_heads_repeated_for_a_wider_tp_are_converted():
    """2 kv heads: the dp2 x tp2 trainer holds each once, the tp4 rollout holds each twice (its held form)."""
    policy, rollout = models("dp2 x tp2 -> tp4, other devices", config(num_key_value_heads=2))
    assert rollout.model.layers[0].self_attn.kv_repeats == 2
    copy_parameters_(rollout, policy)
    ids = torch.randint(0, 40, (2, 7))
    torch.testing.assert_close(logits(rollout, ids), logits(policy, ids), rtol=1e-6, atol=1e-6)
    copy_parameters_(policy, rollout)  # and back
    torch.testing.assert_close(logits(rollout, ids), logits(policy, ids), rtol=1e-6, atol=1e-6)


def test_models_that_do_not_correspond_are_refused_before_anything_is_written():
    policy, rollout = models("pp2 x tp2 -> tp2")
    other = LlamaForCausalLM(config(num_hidden_layers=3, hidden_size=48, intermediate_size=48), mesh((2,), ["tp"], 0))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=r"missing in src_model: model\.layers\.2\.self_attn\.q_proj\.weight.*"
                                         r"model\.embed_tokens\.weight: \[40, 32\] in src_model, \[40, 48\] in dst_model"):
        copy_parameters_(other, policy)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    with pytest.raises(TypeError, match="must be a dtorch.nn.Module"):
        copy_parameters_(rollout, torch.nn.Linear(2, 2))


def test_load_state_dict_with_dtorch_tensors_moves_device_to_device():
    policy, rollout = models("dp2 x tp2 -> tp4, other devices")
    with CommLog() as log:
        rollout.load_state_dict(policy.state_dict(keep_vars=True))
    ids = torch.randint(0, 40, (2, 7))
    torch.testing.assert_close(logits(rollout, ids), logits(policy, ids), rtol=1e-6, atol=1e-6)
    assert {r.kind for r in log.records} == {"send_recv"}  # no gather to a whole tensor anywhere
    # the dtorch values stay the policy's own: nothing aliases them
    w = policy.model.norm.weight
    before = w.to_torch()
    with torch.no_grad():
        rollout.model.norm.weight.mul_(2)
    assert torch.equal(w.to_torch(), before)


def test_the_sync_runs_worker_to_worker_on_the_process_backend():
    """The policy fsdp4 -> rollout dp2 x tp2 on 4 worker processes: the weights, the controller's Python heap
    (tracemalloc) and its data plane (no block put or fetched) during the sync; records only."""
    cfg = config(hidden_size=128, intermediate_size=256, vocab_size=4096)  # lm_head and embedding: 2 MiB each
    g = process_graph(workers=4)
    try:
        with using(g):
            torch.manual_seed(0)
            policy = LlamaForCausalLM(cfg, mesh((4,), ["fsdp"]))
            with skip_init():
                rollout = LlamaForCausalLM(cfg, mesh((2, 2), ["dp", "tp"]))
            copy_parameters_(rollout, policy)  # (the first sync defines the plans on the workers)
            g.runtime.sync()
            stats = dict(g.runtime.stats)
            tracemalloc.start()
            with CommLog() as log:
                moved = copy_parameters_(rollout, policy)
            g.runtime.sync()
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            after = dict(g.runtime.stats)
            want = policy.state_dict()
            assert all(torch.equal(v, want[k]) for k, v in rollout.state_dict().items())  # bit for bit
    finally:
        g.runtime.shutdown()
    assert peak < 2 << 20, f"the controller's heap grew by {peak} bytes during a sync of {moved} bytes"
    for key in ("bytes_put", "bytes_fetched", "bytes_shm"):
        assert after.get(key, 0) == stats.get(key, 0), key
    assert after["bytes_pushed"] - stats.get("bytes_pushed", 0) < 64 << 10  # the records themselves
    assert moved > 4 << 20 and [r.kind for r in log.records] == ["send_recv"]
