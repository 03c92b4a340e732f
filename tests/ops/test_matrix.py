"""Linear algebra: placement sweeps against torch, the S/R/P algebra, communication counts."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import CommLog, OpError, Partial, Replicate, Shard
from promises import contract
from sweep import MESH_1D, MESH_2D, MESH_3D, check, distribute, run_sweep

torch.manual_seed(0)


def r(*shape):
    return torch.randn(*shape)


# (id, dtorch call, torch call, inputs); the dtorch call goes through a mix of spellings
CASES = [
    ("matmul_2d", lambda a, b: a @ b, torch.matmul, [r(5, 7), r(7, 3)]),
    ("matmul_3d_2d", lambda a, b: torch.matmul(a, b), torch.matmul, [r(2, 5, 7), r(7, 3)]),
    ("matmul_2d_3d", lambda a, b: a.matmul(b), torch.matmul, [r(5, 7), r(3, 7, 2)]),
    ("matmul_batch_broadcast", dtorch.matmul, torch.matmul, [r(3, 1, 5, 7), r(2, 7, 4)]),
    ("matmul_1d_2d", lambda a, b: a @ b, torch.matmul, [r(7), r(7, 3)]),
    ("matmul_3d_1d", lambda a, b: a @ b, torch.matmul, [r(2, 5, 7), r(7)]),
    ("matmul_1d_1d", dtorch.matmul, torch.matmul, [r(7), r(7)]),
    ("mm", lambda a, b: a.mm(b), torch.mm, [r(5, 7), r(7, 3)]),
    ("bmm", lambda a, b: torch.bmm(a, b), torch.bmm, [r(3, 5, 7), r(3, 7, 2)]),
    ("dot", lambda a, b: torch.dot(a, b), torch.dot, [r(7), r(7)]),
    ("outer", lambda a, b: a.outer(b), torch.outer, [r(5), r(3)]),
    ("linear", lambda x, w: F.linear(x, w), F.linear, [r(2, 5, 7), r(3, 7)]),
    ("linear_bias", lambda x, w, b: dtorch.nn.functional.linear(x, w, b), F.linear, [r(2, 5, 7), r(3, 7), r(3)]),
    ("linear_1d", dtorch.linear, F.linear, [r(7), r(3, 7), r(3)]),
    ("einsum_bmm", lambda a, b: torch.einsum("bij,bjk->bik", a, b), lambda a, b: torch.einsum("bij,bjk->bik", a, b),
     [r(2, 5, 7), r(2, 7, 3)]),
    ("einsum_chain", lambda a, b, c: dtorch.einsum("ij,jk,kl->il", a, b, c),
     lambda a, b, c: torch.einsum("ij,jk,kl->il", a, b, c), [r(5, 3), r(3, 7), r(7, 2)]),
    ("einsum_implicit", lambda a, b: dtorch.einsum("ij,jk", [a, b]), lambda a, b: torch.einsum("ij,jk", a, b),
     [r(5, 7), r(7, 3)]),
    ("einsum_ellipsis_broadcast", lambda a, b: dtorch.einsum("...ij,...jk->...ik", a, b),
     lambda a, b: torch.einsum("...ij,...jk->...ik", a, b), [r(1, 5, 7), r(3, 7, 2)]),
    ("einsum_attention", lambda q, k: dtorch.einsum("bhqd,bhkd->bhqk", q, k),
     lambda q, k: torch.einsum("bhqd,bhkd->bhqk", q, k), [r(2, 3, 5, 4), r(2, 3, 7, 4)]),
    ("einsum_outer_sum", lambda a, b: dtorch.einsum("ij,k->ik", a, b), lambda a, b: torch.einsum("ij,k->ik", a, b),
     [r(5, 7), r(3)]),
    ("einsum_diagonal", lambda a: dtorch.einsum("ii->i", a), lambda a: torch.einsum("ii->i", a), [r(5, 5)]),
    ("einsum_transpose", lambda a: dtorch.einsum("ijk->kji", a), lambda a: torch.einsum("ijk->kji", a), [r(5, 7, 3)]),
]


# each case in einsum labels (batch dims spelled out; "+bias": the last operand is a bias over the output's last
# dim): the strategies its rule chooses between, and so the placement it promises where one is free
EQUATIONS = {
    "matmul_2d": "mk,kn->mn", "matmul_3d_2d": "bmk,kn->bmn", "matmul_2d_3d": "mk,bkn->bmn",
    "matmul_batch_broadcast": "abmk,bkn->abmn", "matmul_1d_2d": "k,kn->n", "matmul_3d_1d": "bmk,k->bm",
    "matmul_1d_1d": "k,k->", "mm": "mk,kn->mn", "bmm": "bmk,bkn->bmn", "dot": "k,k->", "outer": "m,n->mn",
    "linear": "bmk,nk->bmn", "linear_bias": "bmk,nk->bmn+bias", "linear_1d": "k,nk->n+bias",
    "einsum_bmm": "bij,bjk->bik", "einsum_chain": "ij,jk,kl->il", "einsum_implicit": "ij,jk->ik",
    "einsum_ellipsis_broadcast": "bij,bjk->bik", "einsum_attention": "bhqd,bhkd->bhqk",
    "einsum_outer_sum": "ij,k->ik", "einsum_diagonal": "ii->i", "einsum_transpose": "ijk->kji",
}


def _promise(equation):
    if equation.endswith("+bias"):
        return lambda mesh, *ops: contract(mesh, equation[:-5], *ops[:-1], bias=ops[-1])
    return lambda mesh, *ops: contract(mesh, equation, *ops)


@pytest.mark.parametrize("name, dt_fn, torch_fn, inputs", CASES, ids=[c[0] for c in CASES])
def test_sweep(name, dt_fn, torch_fn, inputs):
    assert run_sweep(dt_fn, torch_fn, inputs, limit=30, placements=_promise(EQUATIONS[name])) > 0


def test_every_case_has_an_equation():
    assert set(EQUATIONS) == {c[0] for c in CASES}


def test_torch_tensor_operands():
    A, B = r(5, 7), r(7, 3)
    a = distribute(A, MESH_2D, [Shard(0), Replicate()])
    b = distribute(B, MESH_2D, [Replicate(), Shard(1)])
    check(A @ b, A @ B)  # torch.Tensor.__matmul__ -> __torch_function__
    check(a @ B, A @ B)
    check(torch.matmul(A, b), A @ B)


# -- the S/R/P algebra, observed through CommLog --------------------------------------------------

def _free(fn):
    with CommLog() as log:
        out = fn()
    assert log.counts() == {}, log.table()
    return out


A, B = r(5, 7), r(7, 3)


@pytest.mark.parametrize("pa, pb, out", [
    (Shard(1), Shard(0), Partial()),       # contracting dim sharded on both: partial sums, no collective
    (Replicate(), Shard(1), Shard(1)),     # free dim of b passes through
    (Shard(0), Replicate(), Shard(0)),     # free dim of a passes through
    (Partial(), Replicate(), Partial()),   # linear in a
    (Replicate(), Partial(), Partial()),   # linear in b
    (Shard(1), Replicate(), Partial()),    # b's contracting dim is cut locally (R -> S)
    (Replicate(), Shard(0), Partial()),
    (Replicate(), Replicate(), Replicate()),
])
def test_matmul_placements_without_communication(pa, pb, out):
    for mesh in (MESH_1D, MESH_2D):
        pl_a = [pa] + [Replicate()] * (mesh.ndim - 1)
        pl_b = [pb] + [Replicate()] * (mesh.ndim - 1)
        c = _free(lambda: distribute(A, mesh, pl_a) @ distribute(B, mesh, pl_b))
        assert c.placements == [out] + [Replicate()] * (mesh.ndim - 1)
        check(c, A @ B)


def test_matmul_2d_mesh_combines_per_mesh_dim():
    a = distribute(A, MESH_2D, [Shard(0), Shard(1)])
    b = distribute(B, MESH_2D, [Replicate(), Shard(0)])
    c = _free(lambda: a @ b)  # rows over "a", partial sums over "b"
    assert c.placements == [Shard(0), Partial()]
    check(c, A @ B)


def test_matmul_gathers_the_cheaper_operand():
    big = r(7, 40)
    a = distribute(A, MESH_1D, [Shard(0)])
    b = distribute(big, MESH_1D, [Shard(1)])
    with CommLog() as log:
        c = a @ b  # gather a (5x7), not b (7x40)
    assert log.counts() == {("all_gather", "a"): 1} and c.placements == [Shard(1)]
    assert log.bytes()[("all_gather", "a")] == A.numel() * 4
    check(c, A @ big)


def test_batched_and_broadcast_batch_dims():
    X, Y = r(4, 5, 7), r(4, 7, 3)
    c = _free(lambda: torch.bmm(distribute(X, MESH_2D, [Shard(0), Replicate()]),
                                distribute(Y, MESH_2D, [Shard(0), Shard(1)])))
    assert c.placements == [Shard(0), Partial()]
    check(c, X @ Y)
    Z = r(4, 1, 5, 7)
    W = r(3, 7, 2)
    c = _free(lambda: distribute(Z, MESH_1D, [Shard(0)]) @ distribute(W, MESH_1D, [Replicate()]))
    assert c.placements == [Shard(0)]
    check(c, Z @ W)
    with CommLog() as log:  # a broadcast size-1 dim cannot carry a shard: both move to the contracted dim
        c = distribute(Z, MESH_1D, [Shard(1)]) @ distribute(W, MESH_1D, [Shard(0)])
    assert log.counts() == {("all_to_all", "a"): 2} and c.placements == [Partial()]
    check(c, Z @ W)


def test_tensor_parallel_linear():
    X, W, b = r(2, 5, 7), r(6, 7), r(6)
    x = distribute(X, MESH_2D, [Shard(0), Replicate()])
    col = _free(lambda: F.linear(x, distribute(W, MESH_2D, [Replicate(), Shard(0)]),
                                 distribute(b, MESH_2D, [Replicate(), Shard(0)])))
    assert col.placements == [Shard(0), Shard(2)]
    check(col, F.linear(X, W, b))
    xs = distribute(X, MESH_2D, [Shard(0), Shard(2)])
    row = _free(lambda: F.linear(xs, distribute(W, MESH_2D, [Replicate(), Shard(1)]), dtorch.Tensor(b, device_mesh=MESH_2D)))
    assert row.placements == [Shard(0), Partial()]
    check(row, F.linear(X, W, b))  # the bias is added once, not once per device


def test_einsum_three_operands_comm_free():
    X, Y, Z = r(5, 3), r(3, 7), r(7, 2)
    out = _free(lambda: dtorch.einsum("ij,jk,kl->il", distribute(X, MESH_2D, [Shard(0), Replicate()]),
                                      distribute(Y, MESH_2D, [Replicate(), Shard(1)]),
                                      distribute(Z, MESH_2D, [Replicate(), Shard(0)])))
    assert out.placements == [Shard(0), Partial()]
    check(out, X @ Y @ Z)


def test_3d_mesh_all_placements_of_one_input():
    mesh = MESH_3D
    for pl in [(Shard(0), Replicate(), Shard(1)), (Partial(), Shard(0), Shard(0)), (Shard(1), Shard(1), Shard(1))]:
        check(distribute(A, mesh, pl) @ distribute(B, mesh, [Replicate()] * 3), A @ B)


def test_plans_are_cached():
    a, b = distribute(A, MESH_1D, [Shard(0)]), distribute(B, MESH_1D, [Replicate()])
    a @ b
    misses = dtorch.ops.dispatch.stats["plan_misses"]
    a @ b
    assert dtorch.ops.dispatch.stats["plan_misses"] == misses  # the second call found the plan


def test_bad_input_raises_typed_errors():
    a = distribute(A, MESH_1D, [Shard(0)])
    with pytest.raises(OpError, match="dtorch.matmul"):
        a @ dtorch.Tensor(r(5, 3), device_mesh=MESH_1D)
    with pytest.raises(OpError, match="dtorch.mm"):
        dtorch.mm(dtorch.Tensor(r(2, 5, 7), device_mesh=MESH_1D), dtorch.Tensor(B, device_mesh=MESH_1D))
    with pytest.raises(OpError, match="different meshes"):
        a @ dtorch.Tensor(B, device_mesh=MESH_2D)
    with pytest.raises(OpError, match="weight must be 2-D"):
        F.linear(a, dtorch.Tensor(r(7), device_mesh=MESH_1D))
    with pytest.raises(OpError, match="names 2 operands"):
        dtorch.einsum("ij,jk->ik", a)
    with pytest.raises(OpError, match="does not match"):
        dtorch.einsum("ijk,kl->il", a, dtorch.Tensor(B, device_mesh=MESH_1D))


@pytest.mark.parametrize("a_shape, b_shape, na, nb, lead, b_transposed", [
    ((2, 1, 3, 1, 8), (1, 2, 6, 8), 3, 2, 2, True),  # a stacked column-parallel linear's decode step (dp x tp grid)
    ((2, 1, 3, 5, 8), (1, 2, 6, 8), 3, 2, 2, True),  # ... a prefill (rows over dp, columns over tp)
    ((2, 2, 3, 1, 4), (1, 2, 6, 4), 3, 2, 2, True),  # a row-parallel one (the contraction over tp: a bmm)
    ((2, 3, 7), (1, 7, 5), 2, 2, 1, False),  # rows only on a's grid dim
    ((2, 5), (2, 5, 3), 1, 2, 1, False),  # a vector operand
])
def test_local_gemm_without_autograd_is_the_same_call(a_shape, b_shape, na, nb, lead, b_transposed):
    """Without autograd a stacked GEMM's view ops run as one as_strided per operand (ops/matrix.py _strided_plan):
    the GEMM gets the same sizes and strides, so the result is the view-op path's bit for bit, laid out alike."""
    from dtorch.ops.matrix import _matmul_local

    a = torch.randn(a_shape)
    b = torch.randn(b_shape).transpose(-1, -2) if b_transposed else torch.randn(b_shape)
    with torch.enable_grad():
        want = _matmul_local(a, b, na, nb, lead)
    with torch.no_grad():
        got = _matmul_local(a, b, na, nb, lead)
    assert torch.equal(got, want) and got.shape == want.shape and got.stride() == want.stride()
    # and the views agree with torch.matmul on each device's blocks
    grid = torch.broadcast_shapes(a.shape[:lead], b.shape[:lead])
    for idx in np.ndindex(*grid):
        ai = a[tuple(min(i, g - 1) for i, g in zip(idx, a.shape[:lead]))]
        bi = b[tuple(min(i, g - 1) for i, g in zip(idx, b.shape[:lead]))]
        torch.testing.assert_close(got[idx], torch.matmul(ai, bi), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("create_graph", [False, True])
def test_stacked_bmm_gradients_are_torchs_laid_out_as_their_operands(create_graph):
    # a stacked linear's bmm over tp blocks: the input a view of a column-parallel output (rows, then tp), the
    # weight transposed (column-major); torch's bmm derivative makes both gradients contiguous
    from dtorch.ops.matrix import _Bmm
    tp, m, k, n = 2, 6, 5, 3
    a0 = torch.randn(m, tp, k).requires_grad_()
    w0 = torch.randn(tp, n, k).requires_grad_()
    g = torch.randn(tp, m, n)
    want = torch.autograd.grad(torch.bmm(a0.transpose(0, 1), w0.transpose(1, 2)), (a0, w0), g)
    a, b = a0.transpose(0, 1), w0.transpose(1, 2)
    out = _Bmm.apply(a, b)
    assert torch.equal(out, torch.bmm(a, b))
    ga, gb = torch.autograd.grad(out, (a, b), g, create_graph=create_graph)
    torch.testing.assert_close(ga, want[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gb, want[1].transpose(1, 2), rtol=1e-6, atol=1e-6)
    if not create_graph:  # (a double backward takes torch's differentiable bmm: contiguous)
        assert ga.stride() == a.stride() and gb.stride() == b.stride()


@pytest.mark.parametrize("k", [8, 7])
def test_row_parallel_linear_gradients_are_torchs(k):
    # F.linear with the weight's input dim split over tp (row-parallel: a stacked bmm over tp; 7 over 2 uneven)
    # and the batch over dp
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x0, w0 = torch.randn(4, 3, k, requires_grad=True), torch.randn(5, k, requires_grad=True)
    F.linear(x0, w0).pow(2).sum().backward()
    x = distribute(x0.detach(), mesh, [Shard(0), Shard(2)]).requires_grad_()
    w = distribute(w0.detach(), mesh, [Replicate(), Shard(1)]).requires_grad_()
    dtorch.nn.functional.linear(x, w).pow(2).sum().backward()
    torch.testing.assert_close(w.grad.to_torch(), w0.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.to_torch(), x0.grad, rtol=1e-5, atol=1e-5)
