"""Gradients of every op in the op table against torch.autograd.

The table is enumerated (``test_sweep_covers_the_table``), so an op added without gradient cases fails
by name. The cases are the forward sweep's (``tests/ops/test_op_table.SAMPLES``) with float inputs made
float64 and requiring grad, plus a few gradient-only ones (``EXTRA``). Each case runs forward and
backward on seeded random layouts of its inputs over a 1-D mesh of 3 and a 2x2 mesh (Shard on any dim,
Replicate, Partial sum/avg terms that differ per device; 5 rows over 3 or 2 devices, 7 over 2), with a
random cotangent in a random layout, and every input's ``.grad`` is compared with torch's (values at
1e-5, and mesh and placements: the input's, Partial reduced to Replicate). Outputs torch gives no grad
(argmax, eq, floor_divide) must have none here either. The default run takes a few layouts per op;
``-m slow`` runs many more.
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.ops.table import TABLE
from sweep import MESH_1D, MESH_2D, distribute
from tests.ops.test_op_table import SAMPLES, Case, _map_tensors, _reference, _tensors

TOL = {"rtol": 1e-5, "atol": 1e-5}
MESH_7 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["a"])


def _f64(*shape, seed=3):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# gradient-only cases: shapes that split unevenly over 2 (7 rows), the gradient paths the forward
# samples do not reach (Partial(max) reductions with indices, to_dtype both ways, embedding padding)
EXTRA: dict[str, list[Case]] = {
    "amax": [Case(lambda: ((_f64(7, 5), 0), {}))],
    "max": [Case(lambda: ((_f64(7, 5), 0), {})), Case(lambda: ((_f64(7, 5), 1, True), {}))],
    "min": [Case(lambda: ((_f64(7, 5), 0), {}))],
    "to_dtype": [Case(lambda: ((_f64(7, 5), torch.float32), {}), ref=lambda x, dt: x.to(dt))],
    "embedding": [Case(lambda: ((torch.tensor([[0, 3, 3], [9, 1, 0]]), _f64(10, 6)), {"padding_idx": 3}))],
    "matmul": [Case(lambda: ((_f64(7, 5), _f64(5, 3, seed=4)), {}))],
    "softmax": [Case(lambda: ((_f64(7, 5), 0), {}))],
    "cross_entropy": [Case(lambda: ((_f64(7, 5), torch.tensor([0, 4, 2, 2, 1, 3, 0])), {})),
                      Case(lambda: ((_f64(7, 5), torch.tensor([0, 4, -100, 2, 1, 3, 0])),
                                    {"reduction": "sum", "label_smoothing": 0.1}))],
    "mse_loss": [Case(lambda: ((_f64(7, 5), _f64(7, 5, seed=4)), {})),
                 Case(lambda: ((_f64(7, 5), _f64(7, 5, seed=4)), {"reduction": "none"}))],
    "getitem": [Case(lambda: ((_f64(7, 5), (slice(2, 6), slice(None, None, 2))), {}),
                     ref=lambda x, i: x[i])],
}


def _cases(name: str) -> list[Case]:
    return list(SAMPLES.get(name, [])) + EXTRA.get(name, [])


def _options(t: torch.Tensor, mesh, partial: bool) -> list[tuple]:
    """Every layout of ``t`` this sweep may pick on ``mesh``."""
    per_dim = [Replicate()] + [Shard(d) for d in range(t.ndim)]
    if partial and t.is_floating_point() and t.ndim:
        per_dim += [Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]
    if t.ndim == 0:
        per_dim = [Replicate()] + ([Partial("sum")] if partial and t.is_floating_point() else [])
    out = [()]
    for _ in range(mesh.ndim):
        out = [o + (p,) for o in out for p in per_dim]
    return out


def _dtensors(x) -> list:
    if isinstance(x, dtorch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _dtensors(v)]
    return []


def _wide(x):
    return x.double() if isinstance(x, torch.Tensor) and x.dtype == torch.float32 else x


def _outputs(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _grad_layout(placements) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


def _run_grad_case(name: str, case: Case, mesh, rnd: random.Random, seed: int) -> None:
    op = TABLE[name]
    ref = _reference(name, case)
    args, kwargs = case.make()
    args = _map_tensors(args, _wide)
    inputs = _tensors(args)
    leaves = [t.is_floating_point() for t in inputs]
    # torch: float inputs are leaves requiring grad; an in-place op writes into a non-leaf copy of its target
    t_leaves = [t.clone().requires_grad_() if f else t.clone() for t, f in zip(inputs, leaves)]
    it = iter(t_leaves)
    t_args = _map_tensors(args, lambda t: next(it))
    if case.inplace and leaves[0]:
        t_args = (t_args[0].clone(),) + tuple(t_args[1:])
    torch.manual_seed(1234)
    expected = _outputs(ref(*t_args, **kwargs))
    layouts = [rnd.choice(_options(t, mesh, case.partial)) for t in inputs]
    it = iter(zip(inputs, layouts))
    d_args = _map_tensors(args, lambda t: distribute(t, mesh, next(it)[1], seed=seed))
    d_leaves = _dtensors(d_args)
    for d, f in zip(d_leaves, leaves):
        if f:
            d.requires_grad_()
    if case.inplace and leaves[0]:
        d_args = (d_args[0].clone(),) + tuple(d_args[1:])
    where = f"dtorch.{name} on {mesh} with layouts {[list(map(str, p)) for p in layouts]}"
    torch.manual_seed(1234)
    try:
        got = _outputs(op.fn(*d_args, **kwargs))
    except Exception as exc:
        raise AssertionError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    assert len(got) == len(expected)
    diff = [k for k, e in enumerate(expected) if isinstance(e, torch.Tensor) and e.requires_grad]
    for k, (g, e) in enumerate(zip(got, expected)):
        if not isinstance(e, torch.Tensor):
            continue
        if case.values:
            torch.testing.assert_close(g.to_torch(), e.detach(), **TOL, equal_nan=True,
                                       msg=lambda m: f"{where}: {m}")
        assert g.requires_grad == e.requires_grad, \
            f"{where}: output {k} requires_grad {g.requires_grad}, torch's {e.requires_grad}"
        if not e.requires_grad:
            assert g.grad_fn is None, f"{where}: output {k} has a grad_fn; torch's has none"
    if not diff:
        return
    gen = torch.Generator().manual_seed(seed + 7)
    cts = [torch.randn(expected[k].shape, generator=gen, dtype=expected[k].dtype) for k in diff]
    d_cts = [distribute(c, mesh, rnd.choice(_options(c, mesh, True)), seed=seed + 1) for c in cts]
    try:
        torch.autograd.backward([expected[k] for k in diff], cts)
    except RuntimeError as exc:  # no derivative in torch (floor_divide): dtorch says so, naming the op
        with pytest.raises(RuntimeError, match=rf"dtorch\.{name.rstrip('_')}\b.*no gradient") as info:
            dtorch.autograd.backward([got[k] for k in diff], d_cts)
        assert "derivative" in str(info.value) and "derivative" in str(exc)
        return
    try:
        dtorch.autograd.backward([got[k] for k in diff], d_cts)
    except Exception as exc:
        raise AssertionError(f"{where}: backward raised {type(exc).__name__}: {exc}") from exc
    for n, (d, t, layout) in enumerate(zip(d_leaves, t_leaves, layouts)):
        if not leaves[n]:
            continue
        if t.grad is None:
            assert d.grad is None, f"{where}: input {n} got a gradient; torch gives it none"
            continue
        assert d.grad is not None, f"{where}: input {n} got no gradient; torch's is {t.grad}"
        assert d.grad.device_mesh == mesh and tuple(d.grad.placements) == _grad_layout(layout), \
            f"{where}: input {n}'s gradient is laid out {d.grad.placements}, expected {_grad_layout(layout)}"
        torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL, equal_nan=True,
                                   msg=lambda m: f"{where}: gradient of input {n}: {m}")


def _run_factory_case(name: str, case: Case, mesh, rnd: random.Random) -> None:
    """A factory's ``requires_grad=True``: a leaf that collects its gradient in its own layout."""
    op = TABLE[name]
    args, kwargs = case.make()
    torch.manual_seed(1234)
    expected = _reference(name, case)(*args, **kwargs)
    if not expected.is_floating_point():
        with pytest.raises(RuntimeError, match="floating point"):
            op.fn(*args, **kwargs, device_mesh=mesh, requires_grad=True)
        return
    pl = rnd.choice(_options(expected, mesh, False))
    args, kwargs = case.make()
    got = op.fn(*args, **kwargs, device_mesh=mesh, placements=list(pl), requires_grad=True)
    assert got.requires_grad and got.is_leaf and got.grad_fn is None
    w = _f64(*expected.shape).to(expected.dtype)
    (got * dtorch.Tensor(w, device_mesh=mesh)).sum().backward()
    assert tuple(got.grad.placements) == pl
    torch.testing.assert_close(got.grad.to_torch(), w, **TOL)


def _layouts_per_case(slow: bool) -> dict:
    return {MESH_1D: 8 if slow else 2, MESH_2D: 8 if slow else 1, MESH_7: 3 if slow else 1}


def _sweep(name: str, slow: bool) -> None:
    assert _cases(name), (f"op {name!r} has no gradient cases: add samples to tests/ops/test_op_table.py "
                          f"or EXTRA in {__file__}")
    rnd = random.Random(zlib.crc32(name.encode()) + slow)
    for k, case in enumerate(_cases(name)):
        for mesh, n in _layouts_per_case(slow).items():
            for _ in range(n):
                if case.factory:
                    _run_factory_case(name, case, mesh, rnd)
                else:
                    _run_grad_case(name, case, mesh, rnd, seed=k)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_op_gradient_matches_torch(name):
    _sweep(name, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TABLE))
def test_op_gradient_matches_torch_many_layouts(name):
    _sweep(name, slow=True)


def test_sweep_covers_the_table():
    missing = sorted(n for n in TABLE if not _cases(n))
    assert not missing, f"ops without gradient cases: {missing}"
    assert not sorted(set(EXTRA) - set(TABLE)), "EXTRA names ops that are not in the op table"


# -- paths the random sweep may miss -----------------------------------------------------------------------

def _leaf(t, mesh, placements):
    return distribute(t, mesh, placements).requires_grad_()


@pytest.mark.parametrize("mesh,placements,dim", [
    (MESH_1D, [Shard(0)], 0), (MESH_7, [Shard(0)], 0), (MESH_2D, [Shard(0), Shard(1)], 1),
    (MESH_2D, [Shard(1), Shard(0)], None)])
@pytest.mark.parametrize("op", ["amax", "amin", "max", "min"])
def test_reduction_to_partial_max_masks_the_cotangent(op, mesh, placements, dim):
    # a max over a sharded dim leaves Partial(max): only the device holding the extreme gets the gradient
    x = _f64(7, 5)
    t = x.clone().requires_grad_()
    d = _leaf(x, mesh, placements)
    if op in ("max", "min") and dim is not None:
        out_t, idx_t = getattr(torch, op)(t, dim)
        out_d, idx_d = getattr(dtorch, op)(d, dim)
        assert idx_d.grad_fn is None and torch.equal(idx_d.to_torch(), idx_t)
    else:
        out_t = getattr(torch, op)(t) if dim is None else getattr(torch, op)(t, dim)
        out_d = getattr(dtorch, op)(d) if dim is None else getattr(dtorch, op)(d, dim)
    w = _f64(*out_t.shape, seed=5)
    (out_t * w).sum().backward()
    (out_d * dtorch.Tensor(w, device_mesh=mesh)).sum().backward()
    assert tuple(d.grad.placements) == tuple(placements)
    torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)


def test_div_with_rounding_mode_reduces_a_partial_first():
    # found by the gradient sweep: floor(a / b) is not linear in a, so P(sum) / R must not stay partial
    a, b = _f64(5, 6), torch.rand(5, 6, dtype=torch.float64) + 0.5
    for mode in ("floor", "trunc"):
        x = distribute(a, MESH_1D, [Partial("sum")])
        y = dtorch.Tensor(b, device_mesh=MESH_1D)
        torch.testing.assert_close(dtorch.div(x, y, rounding_mode=mode).to_torch(), torch.div(a, b, rounding_mode=mode))
        torch.testing.assert_close(dtorch.div(x, 2.0, rounding_mode=mode).to_torch(),
                                   torch.div(a, 2.0, rounding_mode=mode))


def test_autograd_grad_matches_torch():
    x, w = _f64(7, 5), _f64(5, 3, seed=4)
    tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
    dx, dw = _leaf(x, MESH_2D, [Shard(0), Replicate()]), _leaf(w, MESH_2D, [Replicate(), Shard(1)])
    ref = torch.autograd.grad(torch.tanh(tx @ tw).logsumexp(1).sum(), (tx, tw))
    got = dtorch.autograd.grad(dtorch.tanh(dx @ dw).logsumexp(1).sum(), (dx, dw))
    for g, r, leaf in zip(got, ref, (dx, dw)):
        assert tuple(g.placements) == tuple(leaf.placements)
        torch.testing.assert_close(g.to_torch(), r, **TOL)
    assert dx.grad is None and dw.grad is None  # autograd.grad leaves .grad alone
    # several outputs with their cotangents, a non-leaf input, a Partial leaf (gradient: Replicate)
    p = _leaf(x, MESH_1D, [Partial("sum")])
    tp = x.clone().requires_grad_()
    h_t, h_d = tp.exp(), p.exp()
    a_t, b_t = h_t.split([3, 4])
    a_d, b_d = h_d.split([3, 4])
    ga, gb = _f64(3, 5, seed=6), _f64(4, 5, seed=7)
    ref = torch.autograd.grad([a_t, b_t], [tp, h_t], [ga, gb])
    got = dtorch.autograd.grad([a_d, b_d], [p, h_d], [dtorch.Tensor(ga, device_mesh=MESH_1D),
                                                      distribute(gb, MESH_1D, [Partial("sum")])])
    assert tuple(got[0].placements) == (Replicate(),)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.to_torch(), r, **TOL)


@pytest.mark.parametrize("name", ["zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "empty_like"])
def test_like_factories_take_requires_grad(name):
    x = dtorch.Tensor(_f64(7, 5), device_mesh=MESH_7, placements=[Shard(0)]).requires_grad_()
    args = (2.5,) if name == "full_like" else ()
    plain = getattr(dtorch, name)(x, *args)
    assert not plain.requires_grad and plain.grad_fn is None  # like torch: no history from the input
    leaf = getattr(dtorch, name)(x, *args, requires_grad=True)
    assert leaf.requires_grad and leaf.is_leaf and tuple(leaf.placements) == (Shard(0),)
    leaf.sum().backward()
    torch.testing.assert_close(leaf.grad.to_torch(), torch.ones(7, 5, dtype=torch.float64))
    assert x.grad is None


def test_from_torch_and_tensor_make_new_leaves():
    t = _f64(7, 5).requires_grad_()
    for make in (dtorch.tensor, dtorch.from_torch):
        d = make(t * 2, device_mesh=MESH_7, placements=[Shard(0)], requires_grad=True)
        assert d.is_leaf and d.requires_grad
        d.exp().sum().backward()
        torch.testing.assert_close(d.grad.to_torch(), (t * 2).detach().exp())
    with pytest.raises(RuntimeError, match="floating point"):
        dtorch.tensor([1, 2, 3], requires_grad=True)


def test_embedding_padding_row_gets_no_gradient_on_a_sharded_table():
    ids = torch.tensor([[0, 3, 3], [9, 1, 0]])
    w = _f64(10, 6)
    tw = w.clone().requires_grad_()
    torch.nn.functional.embedding(ids, tw, padding_idx=3).pow(2).sum().backward()
    for pl in ([Shard(0)], [Shard(1)], [Replicate()]):
        dw = _leaf(w, MESH_1D, pl)
        dtorch.nn.functional.embedding(dtorch.Tensor(ids, device_mesh=MESH_1D), dw, padding_idx=3).pow(2).sum() \
            .backward()
        torch.testing.assert_close(dw.grad.to_torch(), tw.grad, **TOL)
        dw2 = _leaf(w, MESH_1D, pl)  # torch.embedding's own spelling (-1: no padding) keeps the padding row
        torch.embedding(dw2, dtorch.Tensor(ids, device_mesh=MESH_1D), 3).pow(2).sum().backward()
        torch.testing.assert_close(dw2.grad.to_torch(), tw.grad, **TOL)


def test_no_derivative_names_the_op():
    x = _leaf(_f64(7, 5), MESH_7, [Shard(0)])
    y = dtorch.floor_divide(x, 2.0)
    with pytest.raises(RuntimeError, match=r"dtorch\.floor_divide has no gradient"):
        y.sum().backward()


@pytest.mark.parametrize("op,make,placements", [
    ("embedding", lambda: (torch.tensor([[0, 3, 9], [4, 1, 0]]), _f64(10, 6)), [[Replicate(), Replicate()],
                                                                                [Shard(0), Replicate()]]),
    ("tril", lambda: (_f64(7, 5), 1), [[Shard(0), Replicate()]]),
    ("triu", lambda: (_f64(7, 5), -1), [[Replicate(), Shard(1)]]),
    ("cross_entropy", lambda: (_f64(5, 6), torch.tensor([0, 5, 2, 3, 3])), [[Shard(1), Replicate()],
                                                                          [Replicate(), Replicate()]]),
])
def test_per_device_values_on_a_mesh_dim_every_input_replicates(op, make, placements):
    # a shard's offset differs over mesh dim 0 while the blocks are stored once on dim 1 (replicated):
    # the local VJP must keep each device's gradient apart (it summed the two replicas: twice the gradient)
    args = make()
    fn = getattr(dtorch.nn.functional, op, None) or getattr(dtorch, op)
    ref_fn = getattr(torch.nn.functional, op, None) or getattr(torch, op)
    leaves_t = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args]
    ref_fn(*leaves_t).sum().backward() if op != "cross_entropy" else ref_fn(*leaves_t).backward()
    d_args = []
    for a, pl in zip(args, placements + [None]):
        if isinstance(a, torch.Tensor):
            a = distribute(a, MESH_2D, pl)
            if a.is_floating_point():
                a.requires_grad_()
        d_args.append(a)
    out = fn(*d_args)
    (out.sum() if op != "cross_entropy" else out).backward()
    for d, t in zip(d_args, leaves_t):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)


@pytest.mark.parametrize("mesh", [MESH_1D, MESH_7])
def test_partial_max_ties_split_like_torch(mesh):
    # relu zeroes whole rows: their max is a tie held by every device (as many tied elements on each: 6
    # columns over 2 or 3 devices), and a replicated operand made Partial(max) ties on every device too
    x = _f64(4, 6)
    x[1] = -1.0
    x[3, :] = 0.25
    t = x.clone().requires_grad_()
    torch.relu(t).amax(1).mul(_f64(4, seed=9)).sum().backward()
    d = _leaf(x, mesh, [Shard(1)])
    dtorch.relu(d).amax(1).mul(dtorch.Tensor(_f64(4, seed=9), device_mesh=mesh)).sum().backward()
    torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)
    a, b = _f64(5, 6), _f64(3, 6, seed=4)
    ta, tb = a.clone().requires_grad_(), b.clone().requires_grad_()
    torch.cat([ta, tb]).pow(2).sum().backward()
    da, db = _leaf(a, mesh, [Partial("max")]), _leaf(b, mesh, [Replicate()])
    dtorch.cat([da, db]).pow(2).sum().backward()
    torch.testing.assert_close(da.grad.to_torch(), ta.grad, **TOL)
    torch.testing.assert_close(db.grad.to_torch(), tb.grad, **TOL)
