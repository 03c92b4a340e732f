"""scaled_dot_product_attention against torch on the full tensors: plain sharding, Ulysses and Ring."""
import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import OpError, Partial, Replicate, Shard
from dtorch.models.layout import context_parallel
from promises import attention
from sweep import MESHES, check, distribute, run_sweep

TOL = dict(rtol=1e-4, atol=1e-4)


def _qkv(n=2, h=8, hk=2, l=8, s=None, e=4, ev=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s = l if s is None else s
    return (torch.randn(n, h, l, e, generator=g, dtype=dtype), torch.randn(n, hk, s, e, generator=g, dtype=dtype),
            torch.randn(n, hk, s, ev, generator=g, dtype=dtype))


def _sdpa(mod, *args, **kw):
    return mod.scaled_dot_product_attention(*args, **kw)


def sdpa(q, *args, **kw):
    """torch's SDPA on torch tensors; on dtorch tensors, dtorch's with context parallelism over the mesh's cp
    dims (chosen as the Llama chooses it: ``models.layout.context_parallel``, an explicit argument)."""
    if not isinstance(q, dtorch.Tensor):
        return F.scaled_dot_product_attention(q, *args, **kw)
    return dtorch.scaled_dot_product_attention(q, *args, **kw, context_parallel=context_parallel(q.device_mesh))


# -- plain: every placement of q, k, v --------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_plain_sweep_uneven(causal):
    q, k, v = _qkv(n=2, h=3, hk=3, l=5, s=6, e=4, ev=3)  # every dim uneven on 2- and 3-device mesh dims
    run_sweep(lambda a, b, c: _sdpa(F, a, b, c, is_causal=causal), lambda a, b, c: _sdpa(F, a, b, c, is_causal=causal),
              [q, k, v], limit=40, placements=attention, **TOL)


def test_plain_sweep_gqa_with_float_mask():
    q, k, v = _qkv(n=2, h=4, hk=2, l=5, s=6)
    mask = torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(1))  # broadcast over N
    run_sweep(lambda a, b, c, m: dtorch.scaled_dot_product_attention(a, b, c, attn_mask=m, enable_gqa=True),
              lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, attn_mask=m, enable_gqa=True),
              [q, k, v, mask], limit=30, placements=attention, **TOL)


def test_plain_bool_mask_with_fully_masked_rows():
    q, k, v = _qkv(n=2, h=4, hk=4, l=6, s=5)
    mask = torch.rand(2, 1, 6, 5, generator=torch.Generator().manual_seed(2)) > 0.4
    mask[:, :, 1] = False  # torch gives zeros for rows that see no key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    for mesh in MESHES:
        for pl in ([Shard(2)] * mesh.ndim, [Shard(0)] + [Shard(1)] * (mesh.ndim - 1)):
            out = F.scaled_dot_product_attention(*(distribute(x, mesh, pl) for x in (q, k, v)),
                                                 attn_mask=distribute(mask, mesh, [Replicate()] * mesh.ndim))
            assert not torch.isnan(out.to_torch()).any()
            check(out, expected, **TOL)


MESH_DT = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
MESH_3D = dtorch.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=["dp", "pp", "tp"])


@pytest.mark.parametrize("mesh, pl", [
    (MESH_DT, [Shard(0), Shard(1)]),                 # dp batch, tp heads (8 q / 2 kv heads over 2: aligned)
    (MESH_DT, [Shard(1), Shard(1)]),                 # heads over both dims (4 devices, 2 kv heads: see below)
    (MESH_DT, [Shard(0), Replicate()]),
    (MESH_3D, [Shard(0), Replicate(), Shard(1)]),
])
@pytest.mark.parametrize("causal", [False, True])
def test_plain_batch_and_head_shards_communicate_nothing(mesh, pl, causal):
    hk = 4 if pl.count(Shard(1)) == 2 else 2  # kv heads must split like q heads to stay local
    q, k, v = _qkv(h=8, hk=hk, l=6)
    ins = [distribute(x, mesh, pl) for x in (q, k, v)]
    with dtorch.CommLog() as log:
        out = dtorch.nn.functional.scaled_dot_product_attention(*ins, is_causal=causal, enable_gqa=True)
    assert log.counts() == {}
    assert out.placements == pl
    check(out, F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_plain_batch_and_head_shards_give_torchs_fused_bits_per_device(causal):
    """Devices that hold whole heads and keys run one fused SDPA call over their stacked blocks (forward and
    backward): each device's block is bit for bit torch's fused kernel on that block alone."""
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    q, k, v = _qkv(n=4, h=8, hk=4, l=16, e=8, ev=8)
    ins = [distribute(x, mesh, [Shard(0), Shard(1)]).requires_grad_() for x in (q, k, v)]
    out = dtorch.nn.functional.scaled_dot_product_attention(*ins, is_causal=causal, enable_gqa=True)
    out.sum().backward()
    want, grads = [], [[], [], []]
    for rows in (slice(0, 2), slice(2, 4)):
        blocks = []
        for heads, kv in ((slice(0, 4), slice(0, 2)), (slice(4, 8), slice(2, 4))):
            xs = [x[rows, h].clone().requires_grad_() for x, h in zip((q, k, v), (heads, kv, kv))]
            o = F.scaled_dot_product_attention(*xs, is_causal=causal, enable_gqa=True)
            o.sum().backward()
            blocks.append((o.detach(), [x.grad for x in xs]))
        want.append(torch.cat([b[0] for b in blocks], 1))
        for i in range(3):
            grads[i].append(torch.cat([b[1][i] for b in blocks], 1))
    assert torch.equal(out.to_torch(), torch.cat(want))
    for x, g in zip(ins, grads):
        assert torch.equal(x.grad.to_torch(), torch.cat(g))


@pytest.mark.parametrize("l", [6, 7])
def test_plain_causal_query_sequence_shard_uses_global_positions(l):
    q, k, v = _qkv(h=4, hk=4, l=l)
    mesh = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["sp"])
    qd = distribute(q, mesh, [Shard(2)])
    kd, vd = distribute(k, mesh, [Replicate()]), distribute(v, mesh, [Replicate()])
    with dtorch.CommLog() as log:
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
    assert log.counts() == {}
    assert out.placements == [Shard(2)]
    check(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), **TOL)


def test_plain_gqa_misaligned_heads_replicate_kv():
    q, k, v = _qkv(h=8, hk=2)
    mesh = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["tp"])
    out = F.scaled_dot_product_attention(*(distribute(x, mesh, [Shard(1)]) for x in (q, k, v)), enable_gqa=True)
    assert out.placements == [Shard(1)]
    check(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), **TOL)


def test_plain_value_partial_and_embedding_shard_pass_through():
    q, k, v = _qkv(h=3, hk=3, l=5, ev=5)
    mesh = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["a"])
    rep = [Replicate()]
    for v_pl in ([Partial()], [Shard(3)]):
        with dtorch.CommLog() as log:
            out = F.scaled_dot_product_attention(distribute(q, mesh, rep), distribute(k, mesh, rep),
                                                 distribute(v, mesh, v_pl))
        assert log.counts() == {} and out.placements == v_pl
        check(out, F.scaled_dot_product_attention(q, k, v), **TOL)


def test_dropout_matches_torch_for_the_same_seed():
    q, k, v = _qkv(h=4, hk=2, l=6)
    torch.manual_seed(7)
    expected = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, enable_gqa=True)
    for mesh, pl in ((MESH_DT, [Shard(0), Shard(1)]), (MESH_DT, [Shard(2), Replicate()]),
                     (RING_2, [Shard(2)]), (UR_22, [Shard(2), Shard(2)])):
        torch.manual_seed(7)
        out = F.scaled_dot_product_attention(*(distribute(x, mesh, pl) for x in (q, k, v)), dropout_p=0.3,
                                             enable_gqa=True)
        check(out, expected, **TOL)


# -- context parallel -------------------------------------------------------------------------------

ULY_2 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["ulysess_cp"])
RING_2 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["ring_cp"])
RING_4 = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["ring_cp"])
UR_22 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["ulysess_cp", "ring_cp"])
RU_22 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["ring_cp", "ulysses_cp"])  # alias spelling
DP_TP_RING = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["dp", "tp", "ring_cp"])
TP_ULY_RING = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["tp", "ulysess_cp", "ring_cp"])
DP_ULY = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "ulysess_cp"])

# (name, mesh, placements of q/k/v, expected collectives: (kind, mesh dim) -> count)
CP_LAYOUTS = [
    ("ulysses2", ULY_2, [Shard(2)], {("all_to_all", "ulysess_cp"): 4}),
    ("ring2", RING_2, [Shard(2)], {("send_recv", "ring_cp"): 2}),
    ("ring4", RING_4, [Shard(2)], {("send_recv", "ring_cp"): 6}),
    ("ulysses2_ring2", UR_22, [Shard(2), Shard(2)], {("all_to_all", "ulysess_cp"): 4, ("send_recv", "ring_cp"): 2}),
    ("ring2_ulysses2", RU_22, [Shard(2), Shard(2)], {("all_to_all", "ulysses_cp"): 4, ("send_recv", "ring_cp"): 2}),
    ("dp_tp_ring", DP_TP_RING, [Shard(0), Shard(1), Shard(2)], {("send_recv", "ring_cp"): 2}),
    ("tp_ulysses_ring", TP_ULY_RING, [Shard(1), Shard(2), Shard(2)],
     {("all_to_all", "ulysess_cp"): 4, ("send_recv", "ring_cp"): 2}),
    ("dp_ulysses", DP_ULY, [Shard(0), Shard(2)], {("all_to_all", "ulysess_cp"): 4}),
]


@pytest.mark.parametrize("name, mesh, pl, comms", CP_LAYOUTS, ids=[c[0] for c in CP_LAYOUTS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa8/2", "mha4"])
def test_context_parallel_matches_torch(name, mesh, pl, comms, causal, heads):
    h, hk = heads
    q, k, v = _qkv(h=h, hk=hk, l=8, e=4, ev=6)
    ins = [distribute(x, mesh, pl) for x in (q, k, v)]
    with dtorch.CommLog() as log:
        out = sdpa(*ins, is_causal=causal, enable_gqa=hk != h)
    assert log.counts() == comms
    assert out.placements == pl  # leaves the way it came: Shard(2) on the cp dims
    got = out.to_torch()
    assert not torch.isnan(got).any()
    check(out, sdpa(q, k, v, is_causal=causal, enable_gqa=hk != h), **TOL)
    for d, x in zip(ins, (q, k, v)):
        assert d.placements == pl
        torch.testing.assert_close(d.to_torch(), x, rtol=0, atol=0)


@pytest.mark.parametrize("mesh", [RING_2, RING_4, UR_22, TP_ULY_RING], ids=str)
def test_context_parallel_long_sequence_numerics(mesh):
    # large logits spread over many blocks: where an LSE merge without max-subtraction would drift
    q, k, v = _qkv(n=1, h=8, hk=2, l=64, e=16, ev=8, seed=3)
    q = q * 4
    pl = [Shard(1) if nm == "tp" else Shard(2) for nm in mesh.dim_names]
    for causal in (False, True):
        out = sdpa(*(distribute(x, mesh, pl) for x in (q, k, v)), is_causal=causal,
                                             enable_gqa=True)
        check(out, sdpa(q, k, v, is_causal=causal, enable_gqa=True), **TOL)


def test_ring_uneven_sequence_and_cross_attention():
    q, k, v = _qkv(h=4, hk=4, l=7, s=5)
    for causal in (False, True):
        out = sdpa(*(distribute(x, RING_2, [Shard(2)]) for x in (q, k, v)),
                                             is_causal=causal)
        check(out, sdpa(q, k, v, is_causal=causal), **TOL)


@pytest.mark.parametrize("mesh", [ULY_2, RING_4, UR_22, RU_22], ids=str)
def test_context_parallel_with_attn_mask(mesh):
    q, k, v = _qkv(h=4, hk=2, l=8)
    g = torch.Generator().manual_seed(4)
    for mask in (torch.randn(2, 4, 8, 8, generator=g), torch.rand(8, 8, generator=g) > 0.3):
        out = sdpa(*(distribute(x, mesh, [Shard(2)] * mesh.ndim) for x in (q, k, v)),
                                             attn_mask=mask, enable_gqa=True)
        check(out, sdpa(q, k, v, attn_mask=mask, enable_gqa=True), **TOL)


def test_context_parallel_replicated_inputs_leave_sequence_sharded():
    q, k, v = _qkv(h=4, hk=4, l=8)
    out = sdpa(*(distribute(x, UR_22, [Replicate()] * 2) for x in (q, k, v)),
                                              is_causal=True)
    assert out.placements == [Shard(2), Shard(2)]
    check(out, sdpa(q, k, v, is_causal=True), **TOL)


def test_context_parallel_bfloat16():
    q, k, v = _qkv(h=4, hk=2, l=8, dtype=torch.bfloat16)
    out = sdpa(*(distribute(x, UR_22, [Shard(2)] * 2) for x in (q, k, v)),
                                         is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16
    check(out, sdpa(q, k, v, is_causal=True, enable_gqa=True), rtol=2e-2, atol=2e-2)


# -- errors ------------------------------------------------------------------------------------------

def test_bad_inputs_raise_typed_errors():
    q, k, v = _qkv(h=4, hk=2, l=8)
    rep = [Replicate()] * 2
    qd, kd, vd = (distribute(x, MESH_DT, rep) for x in (q, k, v))
    with pytest.raises(OpError, match="enable_gqa=True"):
        sdpa(qd, kd, vd)
    with pytest.raises(OpError, match="should not be set when is_causal=True"):  # ev != e: torch's math kernel
        sdpa(qd, kd, vd, attn_mask=torch.ones(8, 8, dtype=torch.bool),
                                            is_causal=True, enable_gqa=True)
    with pytest.raises(OpError, match=r"\[N, H, L, E\]"):
        sdpa(distribute(q[0], MESH_DT, rep), kd, vd, enable_gqa=True)
    with pytest.raises(OpError, match="broadcast"):
        sdpa(qd, kd, vd, attn_mask=torch.ones(3, 8), enable_gqa=True)
    q6, k6, v6 = _qkv(h=6, hk=6, l=8)
    uly4 = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["ulysess_cp"])
    with pytest.raises(OpError, match="6 query heads"):
        sdpa(*(distribute(x, uly4, [Shard(2)]) for x in (q6, k6, v6)))
    q4, k4, v4 = _qkv(h=4, hk=4, l=6)
    with pytest.raises(OpError, match="divisible by ulysess_cp"):
        sdpa(*(distribute(x, uly4, [Shard(2)]) for x in (q4, k4, v4)))


def test_three_dim_inputs_like_torch():
    g = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(4, n, 8, generator=g) for n in (6, 5, 5))
    mask = torch.rand(4, 6, 5, generator=g) > 0.3
    ref = sdpa(q, k, v, attn_mask=mask)
    d = lambda t, p: distribute(t, MESH_DT, p)  # noqa: E731
    out = sdpa(d(q, [Shard(0), Replicate()]), d(k, [Shard(0), Replicate()]),
                                         d(v, [Shard(0), Shard(2)]), attn_mask=d(mask, [Shard(0), Replicate()]))
    check(out, ref, rtol=1e-4, atol=1e-5)


# -- uneven ring splits with empty blocks (torch.chunk sizes) ----------------------------------------

TIGHT = dict(rtol=1e-5, atol=1e-5)
RING_3 = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["ring_cp"])
UR_24 = dtorch.init_device_mesh("cpu", (2, 4), mesh_dim_names=["ulysess_cp", "ring_cp"])
RU_42 = dtorch.init_device_mesh("cpu", (4, 2), mesh_dim_names=["ring_cp", "ulysses_cp"])
DP_TP_RING4 = dtorch.init_device_mesh("cpu", (2, 2, 4), mesh_dim_names=["dp", "tp", "ring_cp"])

# (name, mesh, placements, batch, L, S): every case leaves some ring device with no rows at all
EMPTY_BLOCKS = [
    ("ring4_L6", RING_4, [Shard(2)], 2, 6, 6),             # blocks 2, 2, 2, 0
    ("ring4_L3", RING_4, [Shard(2)], 2, 3, 3),             # 1, 1, 1, 0
    ("ring3_L4", RING_3, [Shard(2)], 2, 4, 4),             # 2, 2, 0
    ("ring2_L1", RING_2, [Shard(2)], 2, 1, 1),             # 1, 0
    ("ring4_L3_S6", RING_4, [Shard(2)], 2, 3, 6),          # cross attention, both sides uneven
    ("ring4_L6_S1", RING_4, [Shard(2)], 2, 6, 1),          # key blocks 1, 0, 0, 0
    ("uly2_ring4_L12", UR_24, [Shard(2)] * 2, 2, 12, 12),  # ring splits each Ulysses chunk of 6: 2, 2, 2, 0
    ("ring4_uly2_L6", RU_42, [Shard(2)] * 2, 2, 6, 6),     # ring blocks 2, 2, 2, 0, then Ulysses
    ("dp_tp_ring4_L6", DP_TP_RING4, [Shard(0), Shard(1), Shard(2)], 2, 6, 6),
    ("dp_tp_ring4_L6_N3", DP_TP_RING4, [Shard(0), Shard(1), Shard(2)], 3, 6, 6),  # uneven batch too
]


@pytest.mark.parametrize("name, mesh, pl, n, l, s", EMPTY_BLOCKS, ids=[c[0] for c in EMPTY_BLOCKS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa8/2", "mha4"])
def test_ring_empty_blocks_match_torch(name, mesh, pl, n, l, s, causal, heads):
    h, hk = heads
    q, k, v = _qkv(n=n, h=h, hk=hk, l=l, s=s, e=4, ev=6, seed=5)
    out = sdpa(*(distribute(x, mesh, pl) for x in (q, k, v)), is_causal=causal,
                                         enable_gqa=hk != h)
    assert out.placements == pl
    assert not torch.isnan(out.to_torch()).any()
    check(out, sdpa(q, k, v, is_causal=causal, enable_gqa=hk != h), **TIGHT)


@pytest.mark.parametrize("mesh, l", [(RING_4, 6), (UR_24, 12), (RU_42, 6)], ids=["ring4", "uly2_ring4", "ring4_uly2"])
def test_ring_empty_blocks_with_masks_and_dropout(mesh, l):
    q, k, v = _qkv(h=4, hk=2, l=l, seed=6)
    g = torch.Generator().manual_seed(7)
    bool_mask = torch.rand(l, l, generator=g) > 0.5
    bool_mask[l - 1] = False  # a row that sees no key (the last, padded-next-to row): zeros like torch
    masks = (torch.randn(2, 1, l, l, generator=g), bool_mask)
    ins = [distribute(x, mesh, [Shard(2)] * mesh.ndim) for x in (q, k, v)]
    for mask in masks:
        out = sdpa(*ins, attn_mask=mask, enable_gqa=True)
        check(out, sdpa(q, k, v, attn_mask=mask, enable_gqa=True), **TIGHT)
    torch.manual_seed(8)
    expected = sdpa(q, k, v, dropout_p=0.4, is_causal=True, enable_gqa=True)
    torch.manual_seed(8)
    check(sdpa(*ins, dropout_p=0.4, is_causal=True, enable_gqa=True), expected, **TIGHT)


def test_uneven_ring_runs_one_stacked_kernel_per_step():
    # Performance of uneven splits (bench/ring_attention.py): the blocks are padded to one size, so the
    # in-process backend runs each ring step once on all devices' stacked blocks ("grid"), not in a loop
    # over devices (that loop made ring_cp=3 at seq 10 take 3x seq 12).
    mesh = dtorch.init_device_mesh("cpu", (1, 3), mesh_dim_names=["dp", "ring_cp"])  # used by this test only
    q, k, v = _qkv(h=4, hk=2, l=10)
    with dtorch.Graph(backend="inprocess"):  # that backend's storage, whatever backend the run tests (--backend)
        out = sdpa(*(distribute(x, mesh, [Replicate(), Shard(2)]) for x in (q, k, v)),
                                             is_causal=True, enable_gqa=True)
    check(out, sdpa(q, k, v, is_causal=True, enable_gqa=True), **TIGHT)
    rt = out._graph.runtime
    steps = [ex for key, ex in rt._exec_cache.items()
             if key[0] == "sdpa_ring_step" and key[1][0].mesh.shape == (1, 3)]
    assert len(steps) == 2  # the first step (no accumulator yet) and the later ones
    assert all(ex.grid for ex in steps)


def test_float64_accumulates_in_float64():
    q, k, v = _qkv(h=4, hk=2, l=10, dtype=torch.float64, seed=9)
    expected = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    for mesh, pl in ((MESH_DT, [Shard(0), Shard(1)]), (RING_3, [Shard(2)]), (UR_22, [Shard(2)] * 2)):
        out = sdpa(*(distribute(x, mesh, pl) for x in (q, k, v)), is_causal=True,
                                             enable_gqa=True)
        check(out, expected, rtol=1e-12, atol=1e-12)


# -- torch's argument rules: attn_mask with is_causal, mask dtypes, scale, broadcast masks ---------------

def _torch_or_error(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - whatever torch raises, dtorch must raise alike
        return None, exc


@pytest.mark.parametrize("mesh", [MESH_DT, ULY_2, RING_4, UR_22], ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("ev", [4, 3], ids=["ev=e", "ev!=e"])
def test_attn_mask_with_is_causal_like_torch(mesh, kind, ev):
    # torch 2.13 on the CPU: its fused kernel combines the two when the head sizes agree (ev=e, a value), its
    # math kernel refuses the pair otherwise (dtorch used to refuse it always)
    q, k, v = _qkv(h=4, hk=2, l=8, ev=ev)
    g = torch.Generator().manual_seed(10)
    mask = torch.rand(8, 8, generator=g) > 0.3 if kind == "bool" else torch.randn(8, 8, generator=g)
    expected, err = _torch_or_error(
        lambda: sdpa(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True))
    ins = [distribute(x, mesh, [Shard(2)] * mesh.ndim) for x in (q, k, v)]
    call = lambda: sdpa(*ins, attn_mask=mask, is_causal=True, enable_gqa=True)  # noqa: E731
    if err is None:
        check(call(), expected, **TIGHT)
        return
    with pytest.raises(type(err)) as info:  # torch 2.13: RuntimeError "Explicit attn_mask should not be set ..."
        call()
    assert isinstance(info.value, OpError)
    assert "attn_mask should not be set when is_causal=True" in str(err)
    assert "attn_mask should not be set when is_causal=True" in str(info.value)


def _mask_causal_cases():
    """Calls of attn_mask with is_causal=True that torch 2.13 takes or refuses depending on its kernel choice."""
    q, k, v = _qkv(h=4, hk=2, l=6, s=9, ev=4)
    mask = torch.rand(6, 9, generator=torch.Generator().manual_seed(14)) > 0.3
    return {
        "default": (dict(), (q, k, v, mask)),
        "dropout": (dict(dropout_p=0.3), (q, k, v, mask)),
        "3d_mask": (dict(), (q, k, v, mask.expand(4, 6, 9))),  # [H, L, S]
        "3d_inputs": (dict(), (q[:, 0], k[:, 0], v[:, 0], mask)),
        "float_mask_needs_grad": (dict(), (q, k, v, torch.randn(6, 9).requires_grad_())),
    }


@pytest.mark.parametrize("case", ["default", "dropout", "3d_mask", "3d_inputs", "float_mask_needs_grad"])
@pytest.mark.parametrize("backends", [None, "math", "flash_math", "efficient"])
def test_attn_mask_with_is_causal_follows_torchs_backend_choice(case, backends):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kw, (q, k, v, mask) = _mask_causal_cases()[case]
    chosen = {"math": [SDPBackend.MATH], "flash_math": [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
              "efficient": [SDPBackend.EFFICIENT_ATTENTION]}.get(backends)

    def run(fn, q, k, v, mask):
        torch.manual_seed(0)
        if chosen is None:
            return fn(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True, **kw)
        with sdpa_kernel(chosen):
            return fn(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=True, **kw)

    expected, err = _torch_or_error(lambda: run(sdpa, q, k, v, mask))
    rep = [Replicate()] * 2
    ins = [distribute(x.detach(), MESH_DT, [Shard(0), Replicate()] if i < 3 else rep).requires_grad_(x.requires_grad)
           for i, x in enumerate((q, k, v, mask))]
    if err is None:
        check(run(sdpa, *ins), expected, **TIGHT)
        assert case == "default" and backends in (None, "flash_math")
        return
    with pytest.raises(type(err)) as info:
        run(sdpa, *ins)
    assert isinstance(info.value, OpError)
    assert case != "default" or backends in ("math", "efficient")


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_attn_mask_dtypes_like_torch(q_dtype):
    q, k, v = _qkv(h=4, hk=4, l=7, dtype=q_dtype)
    base = torch.randn(7, 7, generator=torch.Generator().manual_seed(11))
    tol = dict(rtol=2e-2, atol=2e-2) if q_dtype == torch.bfloat16 else TIGHT
    for m_dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int64, torch.bool):
        mask = base > 0 if m_dtype == torch.bool else base.to(m_dtype)
        expected, err = _torch_or_error(lambda: sdpa(q, k, v, attn_mask=mask))
        for mesh in (RING_2, MESH_DT):
            ins = [distribute(x, mesh, [Shard(2)] * mesh.ndim) for x in (q, k, v)]
            if err is None:
                check(sdpa(*ins, attn_mask=mask), expected, **tol)
            else:
                with pytest.raises(type(err), match="attn_mask dtype"):
                    sdpa(*ins, attn_mask=mask)


@pytest.mark.parametrize("mesh", [ULY_2, RING_4, UR_22, RU_22, UR_24], ids=str)
def test_context_parallel_broadcast_masks_and_scale(mesh):
    # L = 6: uneven (and on ring_cp=4 empty) ring blocks; masks broadcast over batch, heads or rows
    n, h, hk, l = 2, 4, 2, 6
    q, k, v = _qkv(n=n, h=h, hk=hk, l=l, seed=12)
    g = torch.Generator().manual_seed(13)
    minus_inf_row = torch.randn(l, l, generator=g)
    minus_inf_row[2] = float("-inf")
    masks = [torch.randn(n, 1, l, l, generator=g), torch.rand(1, h, l, l, generator=g) > 0.4,
             torch.randn(h, l, l, generator=g), torch.rand(n, h, 1, l, generator=g) > 0.3, minus_inf_row]
    ins = [distribute(x, mesh, [Shard(2)] * mesh.ndim) for x in (q, k, v)]
    for mask in masks:
        for scale in (None, 0.37):
            out = sdpa(*ins, attn_mask=mask, scale=scale, enable_gqa=True)
            check(out, sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True),
                  **TIGHT)
    for causal in (False, True):
        out = sdpa(*ins, is_causal=causal, scale=2.5, enable_gqa=True)
        check(out, sdpa(q, k, v, is_causal=causal, scale=2.5, enable_gqa=True), **TIGHT)


def test_context_parallel_is_the_callers_choice():
    # the mesh's dim names choose nothing: without the argument a ring_cp mesh runs the plain rule (the
    # sequence gathered, no ring), with it the ring; bad arguments say what to change
    from dtorch.ops.attention import ContextParallel

    q, k, v = _qkv(h=4, hk=4, l=8)
    ins = [distribute(x, RING_2, [Shard(2)]) for x in (q, k, v)]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for cp, kinds in ((None, {"all_gather"}), (ContextParallel(ring="ring_cp"), {"send_recv"}),
                      (ContextParallel(ring=0), {"send_recv"})):
        with dtorch.CommLog() as log:
            out = dtorch.scaled_dot_product_attention(*ins, is_causal=True, context_parallel=cp)
        assert {kind for kind, _ in log.counts()} == kinds, (cp, log.counts())
        check(out, want, **TOL)
    with pytest.raises(OpError, match="does not have"):
        dtorch.scaled_dot_product_attention(*ins, context_parallel=ContextParallel(ring="ulysess_cp"))
    with pytest.raises(OpError, match="same mesh dim"):
        dtorch.scaled_dot_product_attention(*ins, context_parallel=ContextParallel(ulysses=0, ring=0))
