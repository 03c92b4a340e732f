"""nn ops against torch.nn.functional on the full tensors: embedding, layer_norm, rms_norm, dropout."""
import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import OpError, Partial, Replicate, Shard
from promises import embedding, normalization
from sweep import MESHES, check, distribute, run_sweep

MESH_TP = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "tp"])


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# -- embedding -------------------------------------------------------------------------------------

def test_embedding_sweep_every_placement():
    g = _gen()
    weight = torch.randn(7, 5, generator=g)  # uneven vocab and embedding dims on every mesh
    ids = torch.randint(0, 7, (3, 4), generator=g)
    n = run_sweep(lambda i, w: dtorch.embedding(i, w), F.embedding, [ids, weight], limit=40, placements=embedding)
    assert n > 60


def test_embedding_vocab_sharded_gives_partial_without_communication():
    g = _gen(1)
    weight, ids = torch.randn(11, 6, generator=g), torch.randint(0, 11, (2, 5), generator=g)
    for mesh in MESHES:
        w = distribute(weight, mesh, [Shard(0)] * mesh.ndim)
        i = distribute(ids, mesh, [Replicate()] * mesh.ndim)
        with dtorch.CommLog() as log:
            out = F.embedding(i, w)
        assert log.counts() == {}
        # (a Shard on a size-1 mesh dim is Replicate(): that dim's one device looks up every row)
        assert out.placements == [Partial("sum") if n > 1 else Replicate() for n in mesh.shape]
        check(out, F.embedding(ids, weight))


@pytest.mark.parametrize("w_pl, ids_pl, out_pl", [
    ([Replicate(), Shard(1)], [Shard(0), Replicate()], [Shard(0), Shard(2)]),  # dp ids, tp embedding dim
    ([Replicate(), Shard(0)], [Shard(1), Replicate()], [Shard(1), Partial()]),  # seq-sharded ids, tp vocab
    ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(0), Shard(1)]),
    ([Partial(), Shard(1)], [Replicate(), Replicate()], [Partial(), Shard(2)]),
])
def test_embedding_layouts_are_communication_free(w_pl, ids_pl, out_pl):
    g = _gen(2)
    weight, ids = torch.randn(9, 7, generator=g), torch.randint(0, 9, (4, 6), generator=g)
    w, i = distribute(weight, MESH_TP, w_pl), distribute(ids, MESH_TP, ids_pl)
    with dtorch.CommLog() as log:
        out = dtorch.nn.functional.embedding(i, w, padding_idx=0)
    assert log.counts() == {}
    assert out.placements == out_pl
    check(out, F.embedding(ids, weight, padding_idx=0))


def test_embedding_torch_ids_and_weight_unchanged():
    g = _gen(3)
    weight, ids = torch.randn(6, 4, generator=g), torch.randint(0, 6, (5,), generator=g)
    w = distribute(weight, MESH_TP, [Shard(1), Shard(0)])
    out = F.embedding(ids, w)  # a torch ids tensor becomes a replicated dtorch tensor
    check(out, F.embedding(ids, weight))
    assert w.placements == [Shard(1), Shard(0)]
    torch.testing.assert_close(w.to_torch(), weight, rtol=0, atol=0)


def test_embedding_bad_input_raises():
    w = distribute(torch.randn(5, 3), MESH_TP, [Replicate(), Shard(0)])
    ids = distribute(torch.tensor([1, 2]), MESH_TP, [Replicate(), Replicate()])
    with pytest.raises(OpError, match="max_norm"):
        dtorch.embedding(ids, w, max_norm=1.0)
    with pytest.raises(OpError, match="padding_idx"):
        dtorch.embedding(ids, w, padding_idx=5)
    with pytest.raises(OpError, match="integer"):
        dtorch.embedding(distribute(torch.tensor([1.0]), MESH_TP, [Replicate()] * 2), w)
    with pytest.raises(OpError, match="2-D"):
        dtorch.embedding(ids, distribute(torch.randn(5, 3, 2), MESH_TP, [Replicate()] * 2))



@pytest.mark.parametrize("bad", [32, 40, -1])
def test_embedding_token_id_out_of_range_is_named(bad):
    # torch refuses ids outside [0, V); dtorch used to fail deep inside a kernel (replicated weight) or
    # give zero rows (vocab-sharded weight)
    weight = torch.randn(32, 6, generator=_gen(4))
    ids = torch.tensor([[1, 2, bad], [3, 4, 5]])
    with pytest.raises(IndexError):
        F.embedding(ids, weight)
    message = f"token id {bad} out of range for an embedding of 32 rows"
    cases = [(w_pl, i_pl) for w_pl in ([Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Shard(1)],
                                       [Partial(), Shard(1)])
             for i_pl in ([Replicate(), Replicate()], [Shard(1), Shard(0)])]
    for w_pl, i_pl in cases:
        w = distribute(weight, MESH_TP, w_pl)
        # dtorch ids: the kernel checks them (on the process backend a kernel's error comes back as the
        # WorkerError that stops the workers, carrying the kernel's message)
        with pytest.raises((IndexError, dtorch.RuntimeBackendError), match=message):
            dtorch.embedding(distribute(ids, MESH_TP, i_pl), w).to_torch()
        w = distribute(weight, MESH_TP, w_pl)  # (its blocks are gone when the workers were stopped)
        with pytest.raises(IndexError, match=message):  # torch ids: checked on the controller
            F.embedding(ids, w)
        check(F.embedding(ids.clamp(0, 31), w), F.embedding(ids.clamp(0, 31), weight))  # in range: still fine
    with dtorch.Graph.default_graph().device_mesh_guard(MESH_TP):
        layer = dtorch.nn.Embedding(32, 6, vocab_parallel=True)
    with pytest.raises(IndexError, match=message):
        layer(ids)


# -- norms -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("normalized", [(6,), (5, 6)])
def test_layer_norm_sweep(normalized):
    g = _gen(4)
    x = torch.randn(3, 5, 6, generator=g) * 3 + 1
    w, b = torch.randn(normalized, generator=g), torch.randn(normalized, generator=g)
    run_sweep(lambda a, ww, bb: F.layer_norm(a, normalized, ww, bb, eps=1e-5),
              lambda a, ww, bb: F.layer_norm(a, normalized, ww, bb, eps=1e-5), [x, w, b], limit=30, rtol=1e-5, atol=1e-5,
              placements=lambda m, a, ww, bb: normalization(m, a, len(normalized)))


def test_layer_norm_optional_affine():
    g = _gen(5)
    x, b = torch.randn(4, 7, generator=g), torch.randn(7, generator=g)
    run_sweep(lambda a: dtorch.layer_norm(a, 7), lambda a: F.layer_norm(a, (7,)), [x], rtol=1e-5, atol=1e-5,
              placements=lambda m, a: normalization(m, a, 1))
    run_sweep(lambda a, bb: dtorch.nn.functional.layer_norm(a, [7], bias=bb, eps=1e-3),
              lambda a, bb: F.layer_norm(a, [7], bias=bb, eps=1e-3), [x, b], limit=20, rtol=1e-5, atol=1e-5,
              placements=lambda m, a, bb: normalization(m, a, 1))


@pytest.mark.parametrize("normalized", [(6,), (5, 6)])
def test_rms_norm_sweep(normalized):
    g = _gen(6)
    x = torch.randn(3, 5, 6, generator=g) * 2
    w = torch.randn(normalized, generator=g)
    run_sweep(lambda a, ww: F.rms_norm(a, normalized, ww, eps=1e-6),
              lambda a, ww: F.rms_norm(a, normalized, ww, eps=1e-6), [x, w], limit=30, rtol=1e-5, atol=1e-5,
              placements=lambda m, a, ww: normalization(m, a, len(normalized)))
    run_sweep(lambda a: dtorch.rms_norm(a, normalized), lambda a: F.rms_norm(a, normalized), [x],
              rtol=1e-5, atol=1e-5, placements=lambda m, a: normalization(m, a, len(normalized)))


def test_norms_keep_batch_shards_without_communication():
    g = _gen(7)
    x, w, b = torch.randn(4, 6, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    xd = distribute(x, MESH_TP, [Shard(0), Shard(1)])
    wd, bd = distribute(w, MESH_TP, [Replicate()] * 2), distribute(b, MESH_TP, [Replicate()] * 2)
    with dtorch.CommLog() as log:
        y1 = F.layer_norm(xd, (8,), wd, bd)
        y2 = F.rms_norm(xd, (8,), wd)
    assert log.counts() == {}
    assert y1.placements == y2.placements == [Shard(0), Shard(1)]
    check(y1, F.layer_norm(x, (8,), w, b), rtol=1e-5, atol=1e-5)
    check(y2, F.rms_norm(x, (8,), w), rtol=1e-5, atol=1e-5)


def test_norms_reduce_partial_and_gather_normalized_dims():
    g = _gen(8)
    x = torch.randn(4, 6, generator=g)
    xd = distribute(x, MESH_TP, [Partial(), Shard(1)])
    with dtorch.CommLog() as log:
        y = dtorch.rms_norm(xd, [6])
    assert log.counts() == {("all_reduce", "dp"): 1, ("all_gather", "tp"): 1}
    assert y.placements == [Replicate(), Replicate()]
    check(y, F.rms_norm(x, [6]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_norms_other_dtypes(dtype):
    g = _gen(9)
    x, w = torch.randn(3, 8, generator=g).to(dtype), torch.randn(8, generator=g).to(dtype)
    xd = distribute(x, MESH_TP, [Shard(0), Replicate()])
    wd = distribute(w, MESH_TP, [Replicate(), Shard(0)])
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-10
    check(F.layer_norm(xd, (8,), wd), F.layer_norm(x, (8,), w), rtol=tol, atol=tol)
    check(F.rms_norm(xd, (8,), wd), F.rms_norm(x, (8,), w), rtol=tol, atol=tol)


def test_norm_shape_mismatch_raises():
    xd = distribute(torch.randn(3, 8), MESH_TP, [Shard(0), Replicate()])
    with pytest.raises(OpError, match="layer_norm"):
        dtorch.layer_norm(xd, (7,))
    with pytest.raises(OpError, match="rms_norm"):
        dtorch.rms_norm(xd, (8,), torch.randn(4))


# -- dropout ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: str(m))
def test_dropout_matches_torch_for_the_same_seed_in_every_layout(mesh):
    x = torch.randn(4, 6, 5, generator=_gen(10))
    torch.manual_seed(123)
    expected = F.dropout(x, 0.3)
    layouts = [[Replicate()] * mesh.ndim, [Shard(0)] * mesh.ndim, [Partial()] + [Shard(2)] * (mesh.ndim - 1),
               [Shard(d % 3) for d in range(mesh.ndim)]]
    for pl in layouts:
        xd = distribute(x, mesh, pl)
        torch.manual_seed(123)
        with dtorch.CommLog() as log:
            y = F.dropout(xd, p=0.3, training=True)
        assert log.counts() == {}, pl
        assert y.placements == xd.placements
        check(y, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(xd.to_torch(), x, rtol=1e-6, atol=1e-6)


def test_dropout_statistics_and_identities():
    x = torch.ones(200, 100)
    xd = distribute(x, MESH_TP, [Shard(0), Shard(1)])
    y = dtorch.nn.functional.dropout(xd, 0.25).to_torch()
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.02
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.75))
    assert dtorch.dropout(xd, 0.5, training=False) is xd
    assert dtorch.dropout(xd, 0.0) is xd
    check(dtorch.dropout(xd, 1.0), torch.zeros_like(x))
    with pytest.raises(OpError, match="between 0 and 1"):
        dtorch.dropout(xd, 1.5)


def test_torch_spellings_of_nn_ops():
    g = _gen(11)
    w, x = torch.randn(10, 4, generator=g), torch.randn(3, 4, generator=g)
    ids = torch.randint(0, 10, (3, 5), generator=g)
    dw = distribute(w, MESH_TP, [Replicate(), Shard(0)])
    dx = distribute(x, MESH_TP, [Shard(0), Replicate()])
    check(torch.embedding(dw, distribute(ids, MESH_TP, [Shard(0), Replicate()])), F.embedding(ids, w))
    check(torch.layer_norm(dx, [4]), F.layer_norm(x, [4]), rtol=1e-5, atol=1e-5)
    check(torch.rms_norm(dx, [4]), F.rms_norm(x, [4]), rtol=1e-5, atol=1e-5)


def test_dropout_takes_torch_tensors_like_other_ops():
    y = dtorch.dropout(torch.ones(3, 4), 0.0)
    assert isinstance(y, dtorch.Tensor) and torch.equal(y.to_torch(), torch.ones(3, 4))
