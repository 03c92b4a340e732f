"""Element-wise ops: every placement of every operand on 1-D/2-D/3-D meshes equals torch."""
import re

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard
from promises import add, elementwise, mul, nonlinear
from sweep import MESH_2D, MESHES, check, distribute, run_sweep

torch.manual_seed(0)
A = torch.randn(5, 6, 7)
B = torch.randn(6, 7)          # broadcasts against A
C = torch.randn(5, 1, 7)       # size-1 broadcast dim
POS = torch.rand(5, 6, 7) + 0.5

UNARY = [
    ("exp", torch.exp), ("neg", torch.neg), ("abs", torch.abs), ("tanh", torch.tanh), ("sigmoid", torch.sigmoid),
    ("silu", F.silu), ("gelu", F.gelu), ("relu", torch.relu), ("sin", torch.sin), ("square", torch.square),
]


@pytest.mark.parametrize("name,ref", UNARY, ids=[u[0] for u in UNARY])
def test_unary_matches_torch(name, ref):
    promise = add if name == "neg" else nonlinear  # -P is P; every other unary op reduces a partial first
    n = run_sweep(getattr(dtorch, name), ref, [A], limit=25, placements=promise)
    assert n > 0


def test_unary_on_positive_inputs():
    for fn, ref in ((dtorch.log, torch.log), (dtorch.sqrt, torch.sqrt), (dtorch.rsqrt, torch.rsqrt),
                    (lambda x: x.reciprocal(), torch.reciprocal)):
        run_sweep(fn, ref, [POS], limit=15, placements=nonlinear)


@pytest.mark.parametrize("op", ["add", "sub", "mul", "div", "maximum", "pow"])
def test_binary_broadcast_matches_torch(op):
    a, b = (POS, POS[0] + 0.1) if op == "pow" else (A, B)
    partial = {"add": "add", "sub": "add", "mul": "mul", "div": "div"}.get(op)
    run_sweep(getattr(dtorch, op), getattr(torch, op), [a, b], limit=40,
              placements=lambda m, x, y: elementwise(m, x, y, partial=partial))


def test_binary_with_size_one_broadcast_dim():
    run_sweep(dtorch.add, torch.add, [A, C], limit=40, placements=add)
    run_sweep(dtorch.mul, torch.mul, [C, A], limit=40, placements=mul)


def test_python_operators_and_scalars():
    # (call, the placements its rule promises): a scalar operand keeps a partial only under * and /
    ops = [
        (lambda x, y: x + y, add), (lambda x, y: x - y, add), (lambda x, y: x * y, mul),
        (lambda x, y: x / y, lambda m, x, y: elementwise(m, x, y, partial="div")),
        (lambda x, y: x ** 2, lambda m, x, y: nonlinear(m, x)), (lambda x, y: 2 ** x, lambda m, x, y: nonlinear(m, x)),
        (lambda x, y: 3.0 - x, lambda m, x, y: add(m, x, scalar=True)),
        (lambda x, y: 1 / (y + 10), lambda m, x, y: elementwise(m, add(m, y, scalar=True), partial="div", first=-1)),
        (lambda x, y: -x, lambda m, x, y: add(m, x)),
        (lambda x, y: x + 1.5, lambda m, x, y: add(m, x, scalar=True)), (lambda x, y: x * 2, lambda m, x, y: mul(m, x)),
        (lambda x, y: x // 0.7, lambda m, x, y: nonlinear(m, x)), (lambda x, y: x % 0.6, lambda m, x, y: nonlinear(m, x)),
        (lambda x, y: abs(x), lambda m, x, y: nonlinear(m, x)),
    ]
    for fn, promise in ops:
        run_sweep(fn, fn, [A, B], limit=20, placements=promise)


def test_comparisons_where_masked_fill_clamp():
    run_sweep(lambda x, y: x > y, lambda x, y: x > y, [A, B], limit=20, placements=nonlinear)
    run_sweep(lambda x, y: x <= 0.1, lambda x, y: x <= 0.1, [A, B], limit=10, vary=[0],
              placements=lambda m, x, y: nonlinear(m, x))
    run_sweep(lambda x, y: dtorch.where(x > 0, x, y), lambda x, y: torch.where(x > 0, x, y), [A, B], limit=30,
              placements=lambda m, x, y: nonlinear(m, nonlinear(m, x), x, y))
    run_sweep(lambda x, y: x.masked_fill(y > 0, -1.0), lambda x, y: x.masked_fill(y > 0, -1.0), [A, B], limit=30,
              placements=lambda m, x, y: nonlinear(m, x, nonlinear(m, y)))
    run_sweep(lambda x: x.clamp(-0.5, 0.5), lambda x: x.clamp(-0.5, 0.5), [A], limit=20, placements=nonlinear)
    run_sweep(lambda x: x.clamp(min=0.0), lambda x: x.clamp(min=0.0), [A], limit=20, placements=nonlinear)


def test_dtype_casts_and_promotion():
    ints = torch.arange(30).reshape(5, 6)
    # a cast is not in the linear list: a partial is reduced first
    run_sweep(lambda x: x.float(), lambda x: x.float(), [ints], limit=10, placements=nonlinear)
    run_sweep(lambda x: x.half(), lambda x: x.half(), [A], limit=10, partial=False, placements=nonlinear)
    run_sweep(lambda x: x.bfloat16(), lambda x: x.bfloat16(), [A], limit=10, partial=False, placements=nonlinear)
    run_sweep(lambda x: x.to(torch.float64), lambda x: x.to(torch.float64), [A], limit=10, placements=nonlinear)
    run_sweep(lambda x, y: x.type_as(y), lambda x, y: x.type_as(y), [ints, A[0, 0, :6]], limit=10,
              placements=lambda m, x, y: nonlinear(m, x))
    run_sweep(lambda x: x * 1.5, lambda x: x * 1.5, [ints], limit=10, placements=mul)  # int * float -> float
    run_sweep(lambda x: x / 2, lambda x: x / 2, [ints], limit=10, placements=mul)      # true division
    run_sweep(lambda x, y: x + y, lambda x, y: x + y, [ints, A[0, 0, :6]], limit=10, placements=add)  # int + float


def test_torch_function_dispatch():
    x = distribute(A, MESH_2D, [Shard(0), Shard(2)])
    check(torch.exp(x), torch.exp(A))
    check(F.silu(x), F.silu(A))
    check(torch.add(x, 1.0), A + 1.0)
    check(dtorch.nn.functional.gelu(x), F.gelu(A))


# -- placement propagation and communication ---------------------------------------------------

def test_replicate_plus_shard_is_free_and_sharded():
    x = distribute(A, MESH_2D, [Shard(0), Shard(1)])
    y = distribute(B, MESH_2D, [Replicate(), Replicate()])
    with dtorch.CommLog() as log:
        z = x + y
    assert log.counts() == {}
    assert z.placements == [Shard(0), Shard(1)]
    check(z, A + B)


def test_shard_on_broadcast_dim_of_other_operand_is_free():
    # B broadcasts over A's dim 0: A's shard of dim 0 needs nothing from B
    x = distribute(A, MESH_2D, [Shard(0), Replicate()])
    y = distribute(B, MESH_2D, [Replicate(), Shard(1)])
    with dtorch.CommLog() as log:
        z = x * y
    assert log.counts() == {}
    assert z.placements == [Shard(0), Shard(2)]
    check(z, A * B)


def test_partial_rules():
    mesh = MESH_2D
    p1 = distribute(A, mesh, [Partial(), Replicate()])
    p2 = distribute(A * 2, mesh, [Partial(), Replicate()])
    r = distribute(B, mesh, [Replicate(), Replicate()])
    with dtorch.CommLog() as log:
        s = p1 + p2          # P + P -> P, linear
        d = p1 - r           # P - R -> P, R becomes partial locally
        m = p1 * r           # P * R -> P
        q = p1 / 3.0         # P / c -> P
    assert log.counts() == {}
    assert [s.placements[0], d.placements[0], m.placements[0], q.placements[0]] == [Partial()] * 4
    check(s, A * 3), check(d, A - B), check(m, A * B), check(q, A / 3.0)
    with dtorch.CommLog() as log:
        e = p1 + 1.0         # P + scalar is not linear: reduce first
        pp = p1 * p2         # P * P: reduce
        t = dtorch.tanh(p1)  # nonlinear: reduce
    assert log.counts() == {("all_reduce", "a"): 4}  # p1 once per op, p2 once
    check(e, A + 1.0), check(pp, A * A * 2), check(t, torch.tanh(A))
    for x in (e, pp, t):
        assert x.placements[0] == Replicate()


def test_partial_meets_shard_reduce_scatters():
    p = distribute(A, MESH_2D, [Partial(), Replicate()])
    s = distribute(A, MESH_2D, [Shard(1), Replicate()])
    with dtorch.CommLog() as log:
        z = p + s
    assert log.counts() == {("reduce_scatter", "a"): 1}
    check(z, A + A)


def test_inputs_on_different_meshes_error():
    other = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["x"])
    x = distribute(A, MESH_2D, [Shard(0), Replicate()])
    y = distribute(A, other, [Shard(0)])
    with pytest.raises(dtorch.OpError, match="different meshes.*redistribute"):
        x + y
    check(x, A)  # still usable


def test_failing_op_names_op_and_leaves_inputs_usable():
    x = distribute(A, MESH_2D, [Shard(0), Replicate()])
    y = distribute(torch.randn(4, 3), MESH_2D, [Replicate(), Replicate()])
    with pytest.raises(dtorch.OpError, match=r"dtorch\.add.*\[5, 6, 7\]"):
        x + y
    check(x + 1, A + 1)


def test_torch_tensor_operand_becomes_replicate():
    x = distribute(A, MESH_2D, [Shard(2), Replicate()])
    z = x + B
    assert z.placements == [Shard(2), Replicate()]
    check(z, A + B)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: str(m))
def test_uneven_and_empty_shards(mesh):
    small = torch.randn(1, 3)  # fewer rows than devices: some shards are empty
    run_sweep(lambda x: x * 2 + 1, lambda x: x * 2 + 1, [small], meshes=[mesh], limit=30,
              placements=lambda m, x: add(m, mul(m, x), scalar=True))


def test_torch_tensor_on_the_left_tensor_keywords_and_torch_spellings():
    x = distribute(A, MESH_2D, [Shard(0), Shard(2)])
    for fn in (lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a * b, lambda a, b: a / b,
               lambda a, b: a > b, lambda a, b: a == b, lambda a, b: a // b, lambda a, b: a % b):
        check(fn(B, x), fn(B, A))  # torch tensor on the left: torch hands over to dtorch
    y = distribute(B, MESH_2D, [Replicate(), Replicate()])
    check(x.clamp(min=y), A.clamp(min=B))        # tensors as keyword arguments
    check(x.add(other=y, alpha=2), A.add(B, alpha=2))
    check(dtorch.maximum(x, other=y), torch.maximum(A, B))
    check(x.masked_fill(x > 0, torch.tensor(1.5)), A.masked_fill(A > 0, 1.5))  # 0-d tensor value
    check(F.relu(x, inplace=False), F.relu(A))
    for fn in (F.relu, F.silu, lambda t, inplace: F.leaky_relu(t, 0.1, inplace=inplace)):  # inplace=True: x written
        xi, Ai = x.clone(), A.clone()
        out, expected = fn(xi, inplace=True), fn(Ai, inplace=True)
        assert out is xi and xi.placements == x.placements
        check(xi, expected)
        check(x, A)  # the clone's source is untouched


# -- out= and comparisons with non-tensors -------------------------------------------------------

def test_out_writes_the_result_into_out_on_every_route():
    """torch's ``out=``: the result is written into out's own storage in out's layout, out is returned (the
    same object), and views of out see the write."""
    x = distribute(A, MESH_2D, [Shard(0), Shard(2)])
    w = distribute(torch.randn(7, 3), MESH_2D, [Replicate(), Replicate()])
    xt, wt = x.to_torch(), w.to_torch()
    calls = [
        (lambda out: torch.add(x, 1, out=out), xt + 1),
        (lambda out: torch.exp(x, out=out), xt.exp()),
        (lambda out: torch.sum(x, 0, out=out), xt.sum(0)),
        (lambda out: torch.matmul(x, w, out=out), xt @ wt),
        (lambda out: torch.cat([x, x], out=out), torch.cat([xt, xt])),
        (lambda out: torch.where(x > 0, x, x * 2, out=out), torch.where(xt > 0, xt, xt * 2)),
        (lambda out: dtorch.add(x, 1, out=out), xt + 1),
        (lambda out: x.add(1, out=out), xt + 1),
        (lambda out: x.exp(out=out), xt.exp()),
        (lambda out: dtorch.where(x > 0, x, 0.0, out=out), torch.where(xt > 0, xt, 0.0)),
        (lambda out: dtorch.addcmul(x, x, x, value=2, out=out), torch.addcmul(xt, xt, xt, value=2)),
        (lambda out: dtorch.sum(x, 0, out=out), xt.sum(0)),
        (lambda out: dtorch.matmul(x, w, out=out), xt @ wt),
        (lambda out: dtorch.cat([x, x], out=out), torch.cat([xt, xt])),
        (lambda out: dtorch.zeros(2, out=out), torch.zeros(2)),
    ]
    for call, expected in calls:
        for placements in ([Shard(0), Replicate()], [Partial(), Replicate()], [Replicate(), Replicate()]):
            out = distribute(torch.full(expected.shape, 7.0), MESH_2D, placements)
            ident = id(out)
            row = out[0]  # a live view of out
            got = call(out)
            assert got is out and id(out) == ident and out.placements == placements
            check(out, expected)
            check(row, expected[0])
    check(x, A)
    # out=None is torch's default and changes nothing
    check(torch.add(x, 1, out=None), A + 1)
    check(x.add(1, out=None), A + 1)
    check(dtorch.sum(x, 0, out=None), A.sum(0))


def test_out_errors_leave_out_unchanged():
    x = distribute(A, MESH_2D, [Shard(0), Shard(2)])
    wrong_shape = distribute(torch.zeros(2, 3), MESH_2D, [Replicate(), Replicate()])
    with pytest.raises(dtorch.OpError, match=r"out has shape \[2, 3\] but the result has shape \[5, 6, 7\]"):
        torch.add(x, 1, out=wrong_shape)
    ints = distribute(torch.zeros(5, 6, 7, dtype=torch.long), MESH_2D, [Replicate(), Replicate()])
    with pytest.raises(dtorch.OpError, match="can't be cast to the desired output type"):
        torch.exp(x, out=ints)
    t = torch.zeros(5, 6, 7)
    with pytest.raises(NotImplementedError, match="needs a dtorch tensor as out"):
        torch.add(x, 1, out=t)
    assert torch.equal(t, torch.zeros(5, 6, 7))
    assert torch.equal(wrong_shape.to_torch(), torch.zeros(2, 3))
    assert torch.equal(ints.to_torch(), torch.zeros(5, 6, 7, dtype=torch.long))
    # like torch: no out= while autograd records
    y = x.detach().requires_grad_()
    o = distribute(torch.zeros(5, 6, 7), MESH_2D, [Replicate(), Replicate()])
    with pytest.raises(RuntimeError, match="don't support automatic differentiation"):
        torch.exp(y, out=o)
    with dtorch.no_grad():
        torch.exp(y, out=o)
    check(o, A.exp())


def test_out_with_only_the_out_argument_distributed():
    o = distribute(torch.zeros(3), MESH_2D, [Shard(0), Replicate()])
    assert torch.add(torch.ones(3), 1, out=o) is o
    check(o, torch.full((3,), 2.0))


def test_comparison_with_none_and_other_objects_like_torch():
    x = distribute(A, MESH_2D, [Shard(0), Partial()])
    for other in (None, "a", object(), [1.0, 2.0]):
        assert (x == other) is (A == other) and (A == other) is False
        assert (x != other) is (A != other) and (A != other) is True
        assert (other == x) is (other == A)
        for op in (lambda a, b: a < b, lambda a, b: a + b, lambda a, b: b * a):
            with pytest.raises(TypeError):
                op(A, other)
            with pytest.raises(TypeError):
                op(x, other)
    y = distribute(A, MESH_2D, [Shard(0), Shard(2)])  # exact values (partial terms round): == is exact
    check(y == A[0], A == A[0])  # tensors and numbers still compare element-wise
    check(y != A[0, 0, 0].item(), A != A[0, 0, 0].item())
