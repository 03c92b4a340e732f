"""Reductions, scans and softmax: placement sweeps against torch, partial rules, communication counts."""
import math

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import CommLog, OpError, Partial, Replicate, Shard
from promises import along, reduction
from sweep import MESH_1D, MESH_2D, check, distribute, run_sweep

torch.manual_seed(0)
X = torch.randn(5, 7, 3)
XB = X > 0.2
XI = torch.randint(-4, 5, (5, 7, 3))

# (id, dtorch call, torch call, input); the dtorch call goes through a mix of spellings
CASES = [
    ("sum", lambda x: x.sum(), lambda x: x.sum(), X),
    ("sum_dim", lambda x: dtorch.sum(x, 1), lambda x: torch.sum(x, 1), X),
    ("sum_tuple_keepdim", lambda x: torch.sum(x, (0, 2), keepdim=True), lambda x: torch.sum(x, (0, 2), keepdim=True), X),
    ("sum_dtype", lambda x: x.sum(-1, dtype=torch.float64), lambda x: x.sum(-1, dtype=torch.float64), X),
    ("sum_int", lambda x: x.sum(0), lambda x: x.sum(0), XI),
    ("mean", lambda x: x.mean(), lambda x: x.mean(), X),
    ("mean_dim", lambda x: torch.mean(x, dim=0), lambda x: torch.mean(x, dim=0), X),
    ("mean_tuple_keepdim", lambda x: dtorch.mean(x, (1, -1), keepdim=True), lambda x: x.mean((1, -1), keepdim=True), X),
    ("max", lambda x: torch.max(x), lambda x: torch.max(x), X),
    ("max_dim", lambda x: x.max(1), lambda x: x.max(1), X),
    ("max_dim_keepdim", lambda x: dtorch.max(x, dim=-1, keepdim=True), lambda x: x.max(-1, keepdim=True), X),
    ("min", lambda x: x.min(), lambda x: x.min(), X),
    ("min_dim", lambda x: torch.min(x, 0), lambda x: torch.min(x, 0), X),
    ("amax_tuple", lambda x: torch.amax(x, (0, 2)), lambda x: torch.amax(x, (0, 2)), X),
    ("amax_all", lambda x: x.amax(), lambda x: x.amax(), X),
    ("amax_int", lambda x: x.amax(0), lambda x: x.amax(0), XI),
    ("amin_keepdim", lambda x: dtorch.amin(x, 1, keepdim=True), lambda x: x.amin(1, keepdim=True), X),
    ("argmax", lambda x: x.argmax(), lambda x: x.argmax(), X),
    ("argmax_dim", lambda x: torch.argmax(x, 1), lambda x: torch.argmax(x, 1), X),
    ("argmin_keepdim", lambda x: dtorch.argmin(x, 0, keepdim=True), lambda x: x.argmin(0, keepdim=True), X),
    ("norm", lambda x: x.norm(), lambda x: x.norm(), X),
    ("norm_p1", lambda x: torch.norm(x, p=1, dim=0), lambda x: torch.norm(x, p=1, dim=0), X),
    ("norm_inf", lambda x: dtorch.norm(x, math.inf, dim=(0, 1)), lambda x: torch.norm(x, math.inf, dim=(0, 1)), X),
    ("norm_neginf", lambda x: x.norm(-math.inf, 2), lambda x: x.norm(-math.inf, 2), X),
    ("norm_fro", lambda x: x.norm("fro", dim=(0, 1)), lambda x: x.norm("fro", dim=(0, 1)), X),
    ("norm_p3_keepdim", lambda x: x.norm(3, dim=1, keepdim=True), lambda x: x.norm(3, dim=1, keepdim=True), X),
    ("norm_p0", lambda x: x.norm(0, dim=0), lambda x: x.norm(0, dim=0), X),
    ("var", lambda x: x.var(), lambda x: x.var(), X),
    ("var_dim", lambda x: torch.var(x, 0), lambda x: torch.var(x, 0), X),
    ("var_correction", lambda x: dtorch.var(x, (0, 1), correction=0, keepdim=True),
     lambda x: torch.var(x, (0, 1), correction=0, keepdim=True), X),
    ("var_unbiased", lambda x: x.var(1, unbiased=False), lambda x: x.var(1, unbiased=False), X),
    ("std", lambda x: x.std(), lambda x: x.std(), X),
    ("std_dim", lambda x: torch.std(x, dim=(0, 2), keepdim=True), lambda x: torch.std(x, dim=(0, 2), keepdim=True), X),
    ("prod", lambda x: x.prod(), lambda x: x.prod(), X),
    ("prod_dim", lambda x: torch.prod(x, 1), lambda x: torch.prod(x, 1), X),
    ("prod_int_keepdim", lambda x: x.prod(0, keepdim=True), lambda x: x.prod(0, keepdim=True), XI),
    ("all", lambda x: x.all(), lambda x: x.all(), XB),
    ("all_dim", lambda x: torch.all(x, 1), lambda x: torch.all(x, 1), XB),
    ("any_tuple", lambda x: dtorch.any(x, (0, 2)), lambda x: torch.any(x, (0, 2)), XB),
    ("all_int", lambda x: x.all(0), lambda x: x.all(0), XI),
    ("logsumexp", lambda x: x.logsumexp(1), lambda x: x.logsumexp(1), X),
    ("logsumexp_tuple", lambda x: torch.logsumexp(x, (0, 2), keepdim=True),
     lambda x: torch.logsumexp(x, (0, 2), keepdim=True), X),
    ("cumsum", lambda x: x.cumsum(0), lambda x: x.cumsum(0), X),
    ("cumsum_dtype", lambda x: torch.cumsum(x, -1, dtype=torch.float64), lambda x: torch.cumsum(x, -1, dtype=torch.float64), X),
    ("cumsum_int", lambda x: dtorch.cumsum(x, 1), lambda x: torch.cumsum(x, 1), XI),
    ("softmax", lambda x: x.softmax(0), lambda x: x.softmax(0), X),
    ("softmax_F", lambda x: F.softmax(x, dim=-1), lambda x: F.softmax(x, dim=-1), X),
    ("softmax_dtorchF", lambda x: dtorch.nn.functional.softmax(x, 1, dtype=torch.float64),
     lambda x: F.softmax(x, 1, dtype=torch.float64), X),
    ("log_softmax", lambda x: torch.log_softmax(x, 1), lambda x: torch.log_softmax(x, 1), X),
    ("log_softmax_F", lambda x: dtorch.nn.functional.log_softmax(x, dim=2), lambda x: F.log_softmax(x, dim=2), X),
]




def _reduces(kind, dims=None, keepdim=False, outputs=1):
    def promise(mesh, x):
        out = reduction(mesh, x, kind, dims, keepdim)
        return [out] * outputs if outputs > 1 else out
    return promise


def _along(dim, linear):
    return lambda mesh, x: along(mesh, x, dim, linear)


# the placements each case's rule promises ("other": a reduction that gathers a sharded reduced dim)
PROMISES = {
    "sum": _reduces("sum"), "sum_dim": _reduces("sum", 1), "sum_tuple_keepdim": _reduces("sum", (0, 2), True),
    "sum_dtype": _reduces("sum", -1), "sum_int": _reduces("sum", 0),
    "mean": _reduces("mean"), "mean_dim": _reduces("mean", 0), "mean_tuple_keepdim": _reduces("mean", (1, -1), True),
    "max": _reduces("amax"), "max_dim": _reduces("other", 1, outputs=2),
    "max_dim_keepdim": _reduces("other", -1, True, outputs=2),
    "min": _reduces("amin"), "min_dim": _reduces("other", 0, outputs=2),
    "amax_tuple": _reduces("amax", (0, 2)), "amax_all": _reduces("amax"), "amax_int": _reduces("amax", 0),
    "amin_keepdim": _reduces("amin", 1, True),
    "argmax": _reduces("other"), "argmax_dim": _reduces("other", 1), "argmin_keepdim": _reduces("other", 0, True),
    "norm": _reduces("other"), "norm_p1": _reduces("norm1", 0), "norm_inf": _reduces("norminf", (0, 1)),
    "norm_neginf": _reduces("norm-inf", 2), "norm_fro": _reduces("other", (0, 1)),
    "norm_p3_keepdim": _reduces("other", 1, True), "norm_p0": _reduces("norm0", 0),
    "var": _reduces("var"), "var_dim": _reduces("var", 0), "var_correction": _reduces("var", (0, 1), True),
    "var_unbiased": _reduces("var", 1), "std": _reduces("other"), "std_dim": _reduces("other", (0, 2), True),
    "prod": _reduces("other"), "prod_dim": _reduces("other", 1), "prod_int_keepdim": _reduces("other", 0, True),
    "all": _reduces("all"), "all_dim": _reduces("all", 1), "any_tuple": _reduces("any", (0, 2)),
    "all_int": _reduces("all", 0),
    "logsumexp": _reduces("other", 1), "logsumexp_tuple": _reduces("other", (0, 2), True),
    "cumsum": _along(0, True), "cumsum_dtype": _along(-1, True), "cumsum_int": _along(1, True),
    "softmax": _along(0, False), "softmax_F": _along(-1, False), "softmax_dtorchF": _along(1, False),
    "log_softmax": _along(1, False), "log_softmax_F": _along(2, False),
}


@pytest.mark.parametrize("name, dt_fn, torch_fn, x", CASES, ids=[c[0] for c in CASES])
def test_sweep(name, dt_fn, torch_fn, x):
    assert run_sweep(dt_fn, torch_fn, [x], limit=25, placements=PROMISES[name]) > 0


def test_every_case_has_a_promise():
    assert set(PROMISES) == {c[0] for c in CASES}


@pytest.mark.parametrize("fn, promise", [
    (lambda x: x.sum(), _reduces("sum")), (lambda x: x.mean(0), _reduces("mean", 0)),
    (lambda x: x.max(0), _reduces("other", 0, outputs=2)), (lambda x: x.amax(), _reduces("amax")),
    (lambda x: x.argmax(0), _reduces("other", 0)), (lambda x: x.norm(), _reduces("other")),
    (lambda x: x.var(0), _reduces("var", 0)), (lambda x: x.prod(), _reduces("other")),
    (lambda x: x.cumsum(0), _along(0, True)), (lambda x: x.softmax(-1), _along(-1, False)),
    (lambda x: x.logsumexp(0), _reduces("other", 0)),
])
def test_small_ranks(fn, promise):
    # 0-d and uneven 1-D inputs (5 over 3 devices: 2, 2, 1; over 4: 2, 2, 1, 0)
    mesh4 = dtorch.init_device_mesh("cpu", (4,))
    run_sweep(fn, fn, [torch.tensor(2.5)], meshes=[MESH_1D], placements=promise)
    run_sweep(fn, fn, [torch.randn(5)], meshes=[MESH_1D, MESH_2D, mesh4], placements=promise)


def test_return_types():
    x = distribute(X, MESH_2D, [Shard(0), Shard(1)])
    out = x.max(1)
    assert isinstance(out, torch.return_types.max) and out.indices.dtype == torch.int64
    check(out.values, X.max(1).values)
    assert isinstance(torch.min(x, 0), torch.return_types.min)
    y = distribute(X.flip(0), MESH_2D, [Shard(2), Replicate()])
    check(torch.max(x, y), torch.max(X, X.flip(0)))  # element-wise form
    check(x.min(y), X.min(X.flip(0)))


# -- placements and communication ------------------------------------------------------------------

def _no_comm(fn, *args):
    with CommLog() as log:
        out = fn(*args)
    assert log.counts() == {}, log.table()
    return out


def test_sum_over_sharded_dim_is_partial_without_communication():
    x = distribute(X, MESH_2D, [Shard(0), Shard(1)])
    out = _no_comm(lambda: x.sum(0))
    assert out.placements == [Partial("sum"), Shard(0)]
    check(out, X.sum(0))
    out = _no_comm(lambda: x.sum((0, 1), keepdim=True))
    assert out.placements == [Partial("sum"), Partial("sum")]
    check(out, X.sum((0, 1), keepdim=True))


@pytest.mark.parametrize("n", [3, 4])
def test_mean_over_uneven_shards_divides_by_global_count(n):
    # 5 rows over 3 devices: 2, 2, 1; over 4: 2, 2, 1, 0 (an empty shard)
    mesh = dtorch.init_device_mesh("cpu", (n,))
    x = distribute(X, mesh, [Shard(0)])
    out = _no_comm(lambda: x.mean(0))
    assert out.placements == [Partial("sum")]
    check(out, X.mean(0))
    out = _no_comm(lambda: x.mean())
    check(out, X.mean())


@pytest.mark.parametrize("t", [X, XI], ids=["float", "int"])
def test_amax_amin_over_uneven_shards_with_an_empty_block(t):
    mesh = dtorch.init_device_mesh("cpu", (4,))
    x = distribute(t, mesh, [Shard(0)])
    assert _no_comm(lambda: x.amax(0)).placements == [Partial("max")]
    check(_no_comm(lambda: x.amax(0)), t.amax(0))
    assert _no_comm(lambda: x.amin((0, 1))).placements == [Partial("min")]
    check(x.amin((0, 1)), t.amin((0, 1)))
    check(_no_comm(lambda: x.max()), t.max())
    b = distribute(XB, mesh, [Shard(0)])
    assert _no_comm(lambda: b.all(0)).placements == [Partial("min")]
    check(b.all(0), XB.all(0))
    check(_no_comm(lambda: b.any()), XB.any())


def test_reductions_over_unsharded_dims_keep_shards():
    x = distribute(X, MESH_2D, [Shard(0), Shard(2)])
    for fn, expected in [
        (lambda: x.sum(1), [Shard(0), Shard(1)]),
        (lambda: x.var(1, keepdim=True), [Shard(0), Shard(2)]),
        (lambda: x.argmax(1), [Shard(0), Shard(1)]),
        (lambda: x.max(1).values, [Shard(0), Shard(1)]),
        (lambda: x.norm(dim=1), [Shard(0), Shard(1)]),
        (lambda: x.logsumexp(1), [Shard(0), Shard(1)]),
        (lambda: x.softmax(1), [Shard(0), Shard(2)]),
        (lambda: x.cumsum(1), [Shard(0), Shard(2)]),
    ]:
        assert _no_comm(fn).placements == expected


def test_partial_inputs():
    p = distribute(X, MESH_2D, [Partial("sum"), Shard(1)])
    out = _no_comm(lambda: p.sum(2))  # linear: stays partial
    assert out.placements == [Partial("sum"), Shard(1)]
    check(out, X.sum(2))
    check(_no_comm(lambda: p.mean((0, 2))), X.mean((0, 2)))
    check(_no_comm(lambda: p.cumsum(0)), X.cumsum(0))
    a = distribute(X, MESH_2D, [Partial("avg"), Replicate()])
    assert _no_comm(lambda: a.sum(0)).placements == [Partial("avg"), Replicate()]
    check(a.sum(0), X.sum(0))
    m = distribute(X, MESH_2D, [Partial("max"), Shard(0)])
    out = _no_comm(lambda: m.amax(0))  # max of maxes: stays P(max) and gains one from the shard
    assert out.placements == [Partial("max"), Partial("max")]
    check(out, X.amax(0))
    with CommLog() as log:  # nonlinear: the partial terms are reduced first
        out = p.amax(0)
    assert log.counts() == {("all_reduce", "a"): 1}
    check(out, X.amax(0))
    check(m.sum(), X.sum())
    check(m.softmax(-1), X.softmax(-1))


def test_softmax_dim_must_be_whole():
    x = distribute(X, MESH_2D, [Shard(0), Shard(2)])
    out = _no_comm(lambda: F.softmax(x, dim=1))  # the softmax dim is not sharded: free
    assert out.placements == [Shard(0), Shard(2)]
    with CommLog() as log:
        out = torch.log_softmax(x, -1)
    assert log.counts() == {("all_gather", "b"): 1}
    assert out.placements == [Shard(0), Replicate()]
    check(out, X.log_softmax(-1))


def test_norm_and_var_over_sharded_dims_communicate_reduced_size_only():
    x = distribute(X, MESH_1D, [Shard(1)])
    small = X.sum(1).numel() * 4 * 3  # one reduced-size block per device
    with CommLog() as log:
        out = x.norm(dim=1)
    assert log.counts() == {("all_reduce", "a"): 1} and log.bytes()[("all_reduce", "a")] == small
    check(out, X.norm(dim=1))
    assert _no_comm(lambda: x.norm(1, dim=1)).placements == [Partial("sum")]
    assert _no_comm(lambda: x.norm(math.inf, dim=1)).placements == [Partial("max")]
    with CommLog() as log:
        out = x.var(1)  # mean is reduced (small), the sum of squared deviations stays partial
    assert log.counts() == {("all_reduce", "a"): 1} and out.placements == [Partial("sum")]
    check(out, X.var(1))
    check(x.std(1, keepdim=True), X.std(1, keepdim=True))


def test_index_reductions_gather_only_per_device_candidates():
    # (each device's max and its global index are gathered: two small all_gathers, never the input)
    x = distribute(X, MESH_2D, [Shard(1), Shard(0)])
    with CommLog() as log:
        out = x.argmax(1)
    assert log.counts() == {("all_gather", "a"): 2} and out.placements == [Replicate(), Shard(0)]
    assert sum(r.nbytes for r in log.records) < X.numel() * X.element_size()
    check(out, X.argmax(1))


def test_plans_are_cached():
    x = distribute(X, MESH_2D, [Shard(0), Replicate()])
    x.sum(0)
    misses = dtorch.ops.dispatch.stats["plan_misses"]
    x.sum(0)
    assert dtorch.ops.dispatch.stats["plan_misses"] == misses  # the second call found the plan


def test_bad_input_raises_typed_errors():
    x = distribute(X, MESH_1D, [Shard(0)])
    with pytest.raises(OpError, match=r"dim 3 is out of range for a 3-D tensor"):
        x.sum(3)
    with pytest.raises(OpError, match="twice"):
        x.sum((0, -3))
    with pytest.raises(OpError, match="dim must be an int"):
        x.max((0, 1))
    with pytest.raises(OpError, match="dtorch.mean"):
        distribute(XI, MESH_1D, [Shard(0)]).mean()
    with pytest.raises(OpError, match="p='nuc'"):
        x.norm("nuc")
    with pytest.raises(OpError, match="either unbiased or correction"):
        x.var(0, unbiased=True, correction=1)


def test_low_precision_mean_over_a_sharded_dim_accumulates_like_torch():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["a"])
    ones = torch.ones(200_001, dtype=torch.float16)  # a float16 running sum overflows to inf
    x = dtorch.Tensor(ones, device_mesh=mesh, placements=[Shard(0)])
    got = x.mean()
    assert got.dtype == torch.float16 and torch.equal(got.to_torch(), ones.mean())


def test_scan_needs_one_dim():
    x = dtorch.Tensor(torch.ones(3, 2))
    with pytest.raises(dtorch.OpError, match="dim must be an int, got None"):
        dtorch.cumsum(x, None)


def _mixed_partial(terms, placements, mesh=MESH_2D):
    """A [rows, cols] tensor whose device (a, b) holds terms[a, b] (per-device terms, nothing replicated)."""
    return dtorch.Tensor.from_blocks([terms[c].clone() for c in mesh.coordinates()], device_mesh=mesh,
                                     placements=placements, shape=terms.shape[2:])


@pytest.mark.parametrize("ops", [("sum", "max"), ("max", "sum"), ("sum", "min"), ("avg", "max"), ("min", "max")],
                         ids=str)
def test_mixed_partial_inputs_reduce_outer_mesh_dim_first(ops):
    # the value of [P(a), P(b)] is reduce_b(reduce_a(terms)): every op must see that value, also the ones
    # that keep one of the partials (sum keeps P(sum), amax keeps P(max), cumsum keeps P(sum))
    red = {"sum": lambda t: t.sum(0), "avg": lambda t: t.mean(0), "max": lambda t: t.amax(0),
           "min": lambda t: t.amin(0)}
    terms = torch.randn(2, 2, 5, 3, generator=torch.Generator().manual_seed(1))
    want = red[ops[1]](red[ops[0]](terms))
    x = _mixed_partial(terms, [Partial(ops[0]), Partial(ops[1])])
    torch.testing.assert_close(x.to_torch(), want)
    check(x.sum(), want.sum())
    check(x.sum(0), want.sum(0))
    check(x.amax(), want.amax())
    check(x.mean(1), want.mean(1))
    check(dtorch.cumsum(x, 0), want.cumsum(0))
    check(torch.softmax(x, -1), want.softmax(-1))


def test_integer_avg_partials_are_reduced_before_sum_and_cumsum():
    # integer avg terms reduce to a floored mean, which is not linear: sum(floor(mean)) != floor(mean(sum))
    terms = torch.tensor([[1, 1], [1, 0], [0, 1]]).reshape(3, 1, 2)  # 3 devices, each a [1, 2] term
    mesh = dtorch.init_device_mesh("cpu", (3,))
    x = dtorch.Tensor.from_blocks(list(terms), device_mesh=mesh, placements=[Partial("avg")], shape=(1, 2))
    want = terms.sum(0).div(3, rounding_mode="floor")
    assert torch.equal(x.to_torch(), want)
    assert torch.equal(x.sum().to_torch(), want.sum())
    assert torch.equal(dtorch.cumsum(x, 1).to_torch(), want.cumsum(1))
