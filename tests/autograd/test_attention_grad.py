"""Gradients of scaled_dot_product_attention (plain, Ulysses, Ring, both) against torch.autograd on the
same global tensors: q, k, v and a float attn_mask; uneven ring blocks, GQA, cross-attention, dropout."""
import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from sweep import distribute
from tests.ops.test_attention import sdpa  # (context parallel over the mesh's cp dims, as the Llama asks)

F64 = dict(rtol=1e-5, atol=1e-5)
F32 = dict(rtol=1e-4, atol=1e-4)

TP_2 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
ULY_2 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["ulysess_cp"])
ULY_4 = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["ulysess_cp"])
RING_2 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["ring_cp"])
RING_3 = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["ring_cp"])
RING_4 = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["ring_cp"])
UR_22 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["ulysess_cp", "ring_cp"])
RU_32 = dtorch.init_device_mesh("cpu", (3, 2), mesh_dim_names=["ring_cp", "ulysses_cp"])
DP_RING = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "ring_cp"])
DP_TP_RING = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["dp", "tp", "ring_cp"])
TP_ULY_RING = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["tp", "ulysess_cp", "ring_cp"])


def _qkv(n=2, h=4, hk=4, l=8, s=None, e=4, ev=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    s = l if s is None else s
    return (torch.randn(n, h, l, e, generator=g, dtype=dtype), torch.randn(n, hk, s, e, generator=g, dtype=dtype),
            torch.randn(n, hk, s, ev, generator=g, dtype=dtype))


def _placements(mesh):
    """q/k/v layout of a mesh: batch on dp, heads on tp, sequence on the cp dims."""
    return [Shard(0) if nm == "dp" else Shard(1) if nm == "tp" else Shard(2) for nm in mesh.dim_names]


def _check_grads(mesh, q, k, v, mask=None, pl=None, tol=F64, seed=1, mask_grad=True, **kw):
    """Forward and backward on torch and on dtorch (q/k/v laid out ``pl``, the mask replicated) with the same
    output gradient; every input gradient must match (a float mask's too, unless ``mask_grad`` is False).
    Returns the dtorch output and its leaves."""
    pl = _placements(mesh) if pl is None else pl
    mask_grad = mask_grad and mask is not None and mask.is_floating_point()
    ts = [x.clone().requires_grad_() for x in (q, k, v)]
    tm = mask.clone().requires_grad_() if mask_grad else mask
    ref = sdpa(*ts, attn_mask=tm, **kw)
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=ref.dtype)
    wants = ts + ([tm] if tm is not None and tm.requires_grad else [])
    expected = torch.autograd.grad(ref, wants, go)

    ds = [distribute(x, mesh, pl).requires_grad_() for x in (q, k, v)]
    dm = None
    if mask is not None:
        dm = distribute(mask, mesh, [Replicate()] * mesh.ndim)
        if mask_grad:
            dm.requires_grad_()
    out = sdpa(*ds, attn_mask=dm, **kw)
    assert out.grad_fn is not None, "the output lost its history: gradients would be silently dropped"
    torch.testing.assert_close(out.to_torch(), ref.detach(), **tol)
    out.backward(dtorch.Tensor(go, device_mesh=mesh, placements=out.placements))
    leaves = ds + ([dm] if len(wants) == 4 else [])
    for name, d, want in zip(("q", "k", "v", "attn_mask"), leaves, expected):
        assert d.grad is not None, f"no gradient for {name}"
        assert d.grad.placements == d.placements, name
        torch.testing.assert_close(d.grad.to_torch(), want, **tol, msg=lambda m, name=name: f"grad of {name}: {m}")
    return out, leaves


def test_ring_output_records_history():
    # regression: the ring ran kernels and shifts directly, so its output had no grad_fn and backward raised
    q, k, v = (x.requires_grad_() for x in (distribute(t, RING_2, [Shard(2)]) for t in _qkv()))
    out = sdpa(q, k, v, is_causal=True)
    assert out.grad_fn is not None
    with dtorch.no_grad():
        assert sdpa(q, k, v, is_causal=True).grad_fn is None


# (mesh, seq) per layout: uneven ring splits (7 over 2, 10 over 3, 6 over 4 = blocks 2, 2, 2, 0)
LAYOUTS = [
    ("tp2", TP_2, 8),
    ("ulysses2", ULY_2, 8),
    ("ring2_seq7", RING_2, 7),
    ("ring3_seq10", RING_3, 10),
    ("ring4_seq6_empty_block", RING_4, 6),
    ("ulysses2_ring2_seq12", UR_22, 12),  # per Ulysses chunk 6 over ring 2
    ("ulysses2_ring2_seq10", UR_22, 10),  # per Ulysses chunk 5 over ring 2: the padded [U, L / U] view
    ("ring3_ulysses2_seq10", RU_32, 10),  # ring outside Ulysses: ring block of 10 over 3
    ("dp2_ring3_seq10", DP_RING, 10),
    ("dp_tp_ring_seq7", DP_TP_RING, 7),
    ("tp_ulysses_ring_seq8", TP_ULY_RING, 8),
]


@pytest.mark.parametrize("name, mesh, l", LAYOUTS, ids=[c[0] for c in LAYOUTS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa4/2"])
def test_grads_match_torch_float64(name, mesh, l, causal, heads):
    h, hk = heads
    _check_grads(mesh, *_qkv(h=h, hk=hk, l=l), is_causal=causal, enable_gqa=h != hk)


@pytest.mark.parametrize("mesh, l", [(RING_2, 7), (UR_22, 8), (TP_ULY_RING, 8)], ids=str)
def test_grads_match_torch_float32(mesh, l):
    _check_grads(mesh, *_qkv(h=8, hk=2, l=l, e=8, ev=8, dtype=torch.float32), tol=F32, is_causal=True,
                 enable_gqa=True)


def test_gqa_kv_heads_expanded_for_ulysses():
    # 2 kv heads over ulysses 4: each kv head is repeated in place first; its gradient sums the copies
    _check_grads(ULY_4, *_qkv(h=8, hk=2, l=8), is_causal=True, enable_gqa=True)
    _check_grads(TP_ULY_RING, *_qkv(h=8, hk=2, l=8), enable_gqa=True)


@pytest.mark.parametrize("mesh, l, s", [(RING_2, 7, 5), (RING_3, 10, 4), (RING_4, 5, 9), (RU_32, 8, 10)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cross_attention_uneven(mesh, l, s, causal):
    _check_grads(mesh, *_qkv(l=l, s=s), is_causal=causal)


@pytest.mark.parametrize("mesh, l, s", [(RING_3, 10, 11), (ULY_2, 8, 8), (UR_22, 8, 8), (RU_32, 6, 6),
                                        (DP_TP_RING, 7, 5)], ids=str)
@pytest.mark.parametrize("shape", [(2, 4, -1, -2), (-1, -2), (4, 1, -2), (2, 1, -1, -2)], ids=str)
def test_float_mask_gets_torch_gradient(mesh, l, s, shape):
    # the mask's gradient: each ring device adds its rows x the columns of every K/V block it saw
    q, k, v = _qkv(l=l, s=s)
    full = [l if d == -1 else s if d == -2 else d for d in shape]
    mask = torch.randn(full, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    _check_grads(mesh, q, k, v, mask=mask)


@pytest.mark.parametrize("mesh, l", [(RING_3, 10), (UR_22, 8)], ids=str)
def test_bool_mask_with_fully_masked_rows(mesh, l):
    q, k, v = _qkv(h=4, hk=2, l=l)
    mask = torch.rand(2, 1, l, l, generator=torch.Generator().manual_seed(6)) > 0.5
    mask[:, :, 1] = False  # rows that see no key: output 0, gradient 0 (no NaN from log 0)
    _check_grads(mesh, q, k, v, mask=mask, enable_gqa=True)


def test_dropout_same_seed_as_torch():
    q, k, v = _qkv(l=7)
    ts = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(11)
    ref = sdpa(*ts, dropout_p=0.3)
    go = torch.randn(ref.shape, dtype=ref.dtype)
    ref.backward(go)
    ds = [distribute(x, RING_2, [Shard(2)]).requires_grad_() for x in (q, k, v)]
    torch.manual_seed(11)
    out = sdpa(*ds, dropout_p=0.3)
    torch.testing.assert_close(out.to_torch(), ref.detach(), **F64)
    out.backward(dtorch.Tensor(go, device_mesh=RING_2, placements=out.placements))
    for d, t in zip(ds, ts):
        torch.testing.assert_close(d.grad.to_torch(), t.grad, **F64)


@pytest.mark.parametrize("mesh", [RING_3, UR_22], ids=str)
@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
def test_only_one_input_requires_grad(mesh, which):
    q, k, v = _qkv(l=10)
    ds = [distribute(x, mesh, [Shard(2)] * mesh.ndim) for x in (q, k, v)]
    ds[which].requires_grad_()
    ts = [q, k, v]
    ts[which] = ts[which].clone().requires_grad_()
    out = sdpa(*ds, is_causal=True)
    (got,) = dtorch.autograd.grad(out.sum(), [ds[which]])
    (want,) = torch.autograd.grad(sdpa(*ts, is_causal=True).sum(), [ts[which]])
    torch.testing.assert_close(got.to_torch(), want, **F64)
    assert all(d.grad is None for d in ds)


def test_replicated_inputs_and_three_dim_inputs():
    q, k, v = _qkv(l=9)
    _check_grads(RING_3, q, k, v, pl=[Replicate()], is_causal=True)
    # a mesh dim that splits nothing: every device on it computes the same, the gradient stays Replicate
    _check_grads(DP_RING, q, k, v, pl=[Replicate(), Shard(2)], is_causal=True)
    _check_grads(DP_RING, q[:, 0], k[:, 0], v[:, 0], pl=[Replicate(), Shard(1)], is_causal=True)  # [N, L, E]


@pytest.mark.parametrize("mesh, l, comms", [
    (RING_2, 7, {("send_recv", "ring_cp"): 6}),
    (RING_4, 6, {("send_recv", "ring_cp"): 14}),
    (DP_TP_RING, 8, {("send_recv", "ring_cp"): 6}),
    (UR_22, 8, {("all_to_all", "ulysess_cp"): 4, ("send_recv", "ring_cp"): 6}),
], ids=str)
def test_ring_backward_only_shifts_blocks(mesh, l, comms):
    # K/V shift R - 1 times each, dK/dV R times each (the last shift brings them home); no gather of the
    # sequence. Ulysses: dO goes to heads and dQ/dK/dV back to the sequence (one all_to_all each).
    q, k, v = _qkv(h=4, hk=4, l=l)
    pl = _placements(mesh)
    ds = [distribute(x, mesh, pl).requires_grad_() for x in (q, k, v)]
    out = sdpa(*ds, is_causal=True)
    go = dtorch.Tensor(torch.randn(out.shape, dtype=out.dtype), device_mesh=mesh, placements=out.placements)
    with dtorch.CommLog() as log:
        out.backward(go)
    assert log.counts() == comms
    for d in ds:
        assert d.grad.placements == pl


def test_retain_graph_and_second_backward():
    q, k, v = _qkv(l=7)
    ds = [distribute(x, RING_2, [Shard(2)]).requires_grad_() for x in (q, k, v)]
    out = sdpa(*ds, is_causal=True)
    loss = out.sum()
    loss.backward(retain_graph=True)
    first = ds[1].grad.to_torch()
    loss.backward()
    torch.testing.assert_close(ds[1].grad.to_torch(), 2 * first, **F64)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


SP_3 = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["sp"])
TP_4 = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"])


@pytest.mark.parametrize("mesh, pls, heads", [
    (SP_3, [[Shard(2)], [Replicate()], [Replicate()]], (4, 4)),  # query rows split, causal by global offsets
    (TP_4, [[Shard(1)]] * 3, (8, 2)),  # 2 kv heads over 4: kv replicated, each device picks its heads
    (SP_3, [[Replicate()], [Replicate()], [Shard(3)]], (4, 2)),  # value's embedding split
    (DP_RING, [[Shard(0), Shard(1)]] * 3, (4, 4)),  # a mesh named ring_cp but nothing on the sequence
], ids=["q_rows", "gqa_misaligned_heads", "value_embedding", "dp_heads"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_plain_rule_layouts(mesh, pls, heads, causal):
    h, hk = heads
    q, k, v = _qkv(h=h, hk=hk, l=7, ev=6)
    ts = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = sdpa(*ts, is_causal=causal, enable_gqa=h != hk)
    go = torch.randn(ref.shape, dtype=ref.dtype)
    ref.backward(go)
    ds = [distribute(x, mesh, pl).requires_grad_() for x, pl in zip((q, k, v), pls)]
    out = sdpa(*ds, is_causal=causal, enable_gqa=h != hk)
    out.backward(dtorch.Tensor(go, device_mesh=mesh, placements=out.placements))
    for d, t in zip(ds, ts):
        torch.testing.assert_close(d.grad.to_torch(), t.grad, **F64)


@pytest.mark.parametrize("l, s", [(1, 1), (1, 5), (4, 1)], ids=str)
def test_ring_tiny_sequences_with_empty_blocks(l, s):
    _check_grads(RING_2, *_qkv(l=l, s=s), is_causal=False)
    _check_grads(RING_4, *_qkv(l=l, s=s), is_causal=True)


def test_input_written_in_place_after_forward_raises():
    q, k, v = (distribute(x, RING_2, [Shard(2)]) for x in _qkv(l=8))  # even: the ring reads k itself
    q.requires_grad_()
    out = sdpa(q, k, v, is_causal=True)
    with dtorch.no_grad():
        k.mul_(2)  # k is saved for the backward as it was
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


DP_TP = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
# (name, mesh, q/k/v placements or None for _placements(mesh)): every layout sdpa has, plain and context parallel
MASK_CAUSAL_LAYOUTS = [
    ("replicated", DP_TP, [Replicate(), Replicate()]),
    ("batch_heads", DP_TP, [Shard(0), Shard(1)]),
    ("query_rows", SP_3, [Shard(2)]),
    ("ulysses2", ULY_2, None),
    ("ring3", RING_3, None),
    ("ring4", RING_4, None),
    ("ulysses2_ring2", UR_22, None),
    ("ring3_ulysses2", RU_32, None),
    ("dp_tp_ring", DP_TP_RING, None),
]


@pytest.mark.parametrize("name, mesh, pl", MASK_CAUSAL_LAYOUTS, ids=[c[0] for c in MASK_CAUSAL_LAYOUTS])
@pytest.mark.parametrize("l, s", [(6, 6), (4, 8), (8, 6)], ids=str)  # even: Ulysses splits both
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attn_mask_with_is_causal_values_and_grads(name, mesh, pl, l, s, kind):
    # torch 2.13's default CPU kernel combines them (the mask and the top-left causal mask, L != S too): dtorch
    # refused the pair. GQA 4/2, one head size (e = ev) and a float mask that needs no gradient: else torch
    # runs its math kernel, which refuses the pair (tests/ops/test_attention.py checks dtorch refuses it alike)
    q, k, v = _qkv(h=4, hk=2, l=l, s=s, e=4, ev=4, seed=7)
    g = torch.Generator().manual_seed(8)
    if kind == "bool":
        mask = torch.rand(l, s, generator=g) > 0.3
        mask[0, 0] = False  # row 0: its only causal key masked, a row that sees nothing (zeros like torch)
    else:
        mask = torch.randn(2, 1, l, s, generator=g, dtype=torch.float64)
    _check_grads(mesh, q, k, v, mask=mask, pl=pl, mask_grad=False, is_causal=True, enable_gqa=True)
