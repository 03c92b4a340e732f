"""The gradient of a redistribution, and the engine's behaviour against torch's.

Property (hypothesis): for random source and target layouts (1-3-D meshes, uneven and nested shards,
Partial sources of every reduce op, other meshes), the gradient through ``x.redistribute(...)`` is the
cotangent itself in value, laid out like ``x`` (Partial mesh dims reduced), on ``x``'s mesh: the
transpose of a redistribution is the redistribution of the gradient back. Then the engine: accumulation,
retain_graph, torch's errors, grad modes, detach, retain_grad, the version check, in-place ops on non-leaves.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard
from sweep import distribute
from tests.test_redistribute import meshes, placement, placements, shapes

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _value(shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _leaf(full, mesh, pl):
    return distribute(full, mesh, pl, seed=1).requires_grad_()


def _grad_placements(pl, ndim) -> tuple:
    return tuple(Replicate() if isinstance(p, Partial) else Shard(p.dim % ndim) if isinstance(p, Shard) else p
                 for p in pl)


def _check_redistribute_grad(shape, src_mesh, src, dst_mesh, dst, ct_pl):
    full = _value(shape)
    x = _leaf(full, src_mesh, src)
    y = x.redistribute(dst_mesh, dst)
    assert y.requires_grad and y.device_mesh == dst_mesh
    ct = _value(shape, seed=2)
    y.backward(distribute(ct, dst_mesh, ct_pl, seed=3))
    g = x.grad
    assert g.device_mesh == src_mesh, "the gradient goes back to the source mesh"
    assert tuple(g.placements) == _grad_placements(x.placements, len(shape))  # (as normalised: S on a size-1 dim is R)
    torch.testing.assert_close(g.to_torch(), ct, **TOL)
    return x


@st.composite
def same_mesh_case(draw):
    mesh = draw(meshes(max_devices=8, ndim=draw(st.integers(1, 3))))
    shape = draw(shapes())
    n = len(shape)
    return mesh, shape, draw(placements(mesh, n)), draw(placements(mesh, n)), draw(placements(mesh, n))


@SETTINGS
@given(same_mesh_case())
def test_gradient_of_a_redistribution_is_the_cotangent_laid_out_back(case):
    mesh, shape, src, dst, ct_pl = case
    _check_redistribute_grad(shape, mesh, src, mesh, dst, ct_pl)


@st.composite
def nested_case(draw):
    """Several mesh dims shard one tensor dim (uneven sizes: 5 or 7 over 2x2), in the source, target or both."""
    mesh = draw(meshes(max_devices=8, ndim=draw(st.integers(2, 3))))
    shape = draw(st.lists(st.sampled_from([1, 3, 5, 7]), min_size=1, max_size=3).map(tuple))
    k = draw(st.integers(0, len(shape) - 1))
    nested = st.one_of(st.just(Shard(k)), placement(len(shape)))
    src = draw(st.lists(nested, min_size=mesh.ndim, max_size=mesh.ndim))
    dst = draw(st.lists(nested, min_size=mesh.ndim, max_size=mesh.ndim))
    return mesh, shape, src, dst, draw(st.lists(nested, min_size=mesh.ndim, max_size=mesh.ndim))


@SETTINGS
@given(nested_case())
def test_gradient_through_nested_uneven_shards(case):
    mesh, shape, src, dst, ct_pl = case
    _check_redistribute_grad(shape, mesh, src, mesh, dst, ct_pl)


@st.composite
def cross_mesh_case(draw):
    a = draw(meshes(max_devices=8, ndim=draw(st.integers(1, 3))))
    b = draw(meshes(max_devices=8, ndim=draw(st.integers(1, 3))))
    shape = draw(shapes())
    n = len(shape)
    return a, b, shape, draw(placements(a, n)), draw(placements(b, n)), draw(placements(b, n))


@SETTINGS
@given(cross_mesh_case())
def test_cross_mesh_move_sends_the_gradient_back(case):
    a, b, shape, src, dst, ct_pl = case
    _check_redistribute_grad(shape, a, src, b, dst, ct_pl)


def test_pipeline_stages_pass_gradients_back():
    # two stages on disjoint devices, each a 1-D tp mesh: x -> stage 0 (tanh(x @ w0)) -> move -> stage 1
    s0 = DeviceMesh("cpu", np.array([0, 1]), mesh_dim_names=["tp"])
    s1 = DeviceMesh("cpu", np.array([2, 3]), mesh_dim_names=["tp"])
    x, w0, w1 = _value((7, 5)), _value((5, 4), seed=1), _value((4, 3), seed=2)
    tx, tw0, tw1 = (t.clone().requires_grad_() for t in (x, w0, w1))
    (torch.tanh(tx @ tw0) @ tw1).pow(2).sum().backward()
    dx = dtorch.Tensor(x, device_mesh=s0, placements=[Shard(0)]).requires_grad_()
    dw0 = dtorch.Tensor(w0, device_mesh=s0, placements=[Shard(1)]).requires_grad_()
    dw1 = dtorch.Tensor(w1, device_mesh=s1, placements=[Shard(0)]).requires_grad_()
    h = dtorch.tanh(dx @ dw0)
    h1 = h.redistribute(s1, [Shard(1)])
    (h1 @ dw1).pow(2).sum().backward()
    for d, t, mesh in ((dx, tx, s0), (dw0, tw0, s0), (dw1, tw1, s1)):
        assert d.grad.device_mesh == mesh and d.grad.placements == d.placements
        torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)


# -- the engine ---------------------------------------------------------------------------------------

MESH = DeviceMesh("cpu", np.arange(4).reshape(2, 2), mesh_dim_names=["dp", "tp"])


def _pair(shape=(7, 5), pl=(Shard(0), Replicate()), seed=0):
    full = _value(shape, seed)
    return full.clone().requires_grad_(), _leaf(full, MESH, pl)


def _torch_error(fn) -> str:
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


def test_gradients_accumulate_across_backward_calls():
    t, d = _pair()
    for _ in range(2):
        (t * t).sum().backward()
        (d * d).sum().backward()
    torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)
    torch.testing.assert_close(d.grad.to_torch(), 4 * t.detach(), **TOL)


def test_retain_graph_and_the_second_backward_error():
    t, d = _pair()
    yt, yd = (t.exp() * t).sum(), (d.exp() * d).sum()
    yt.backward(retain_graph=True)
    yd.backward(retain_graph=True)
    yt.backward()
    yd.backward()
    torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)
    msg = _torch_error(yt.backward)
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time") as info:
        yd.backward()
    assert str(info.value) == msg


def test_non_scalar_backward_needs_a_gradient():
    t, d = _pair()
    msg = _torch_error(lambda: (t * 2).backward())
    with pytest.raises(RuntimeError) as info:
        (d * 2).backward()
    assert str(info.value) == msg


def test_backward_without_grad_fn_raises():
    t = _value((7, 5))
    d = dtorch.Tensor(t, device_mesh=MESH)
    msg = _torch_error(lambda: t.sum().backward())
    with pytest.raises(RuntimeError) as info:
        d.sum().backward()
    assert str(info.value) == msg


def test_grad_modes_context_managers_and_decorators():
    _, d = _pair()
    with dtorch.no_grad():
        assert not (d * 2).requires_grad
        with dtorch.enable_grad():
            assert (d * 2).requires_grad
    with torch.no_grad():  # one switch with torch's
        assert not (d * 2).requires_grad and not dtorch.autograd.is_grad_enabled()
    with dtorch.set_grad_enabled(False):
        assert not (d * 2).requires_grad

    @dtorch.no_grad()
    def off(x):
        return x * 2

    @torch.no_grad()
    def off_torch(x):
        return x * 2

    @dtorch.enable_grad()
    def on(x):
        return x * 2

    assert not off(d).requires_grad and not off_torch(d).requires_grad
    with dtorch.no_grad():
        y = on(d)
    assert y.requires_grad and y.grad_fn is not None
    assert (d * 2).requires_grad


def test_detach_stops_the_gradient():
    t, d = _pair()
    (t * t.detach()).sum().backward()
    dd = d.detach()
    assert not dd.requires_grad and dd.is_leaf and dd.placements == d.placements
    (d * dd).sum().backward()
    torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)


def test_retain_grad_keeps_a_non_leaf_gradient():
    t, d = _pair()
    ht, hd = t.sin(), d.sin()
    ht.retain_grad()
    hd.retain_grad()
    other_t, other_d = ht * 3, hd * 3
    (other_t * ht).sum().backward()
    (other_d * hd).sum().backward()
    assert hd.retains_grad and other_d.grad is None
    torch.testing.assert_close(hd.grad.to_torch(), ht.grad, **TOL)
    torch.testing.assert_close(d.grad.to_torch(), t.grad, **TOL)


def test_requires_grad_on_an_integer_tensor_raises():
    i = torch.arange(6)
    assert "only Tensors of floating point" in _torch_error(lambda: i.requires_grad_())
    d = dtorch.Tensor(i, device_mesh=MESH)
    with pytest.raises(RuntimeError, match="(?i)only Tensors of floating point"):
        d.requires_grad_()
    with pytest.raises(RuntimeError, match="(?i)only Tensors of floating point"):
        d.requires_grad = True
    assert not d.requires_grad


def test_in_place_write_of_a_saved_input_raises_at_backward():
    t, d = _pair()
    at, ad = t * 2, d * 2
    yt, yd = at.sin(), ad.sin()  # sin saves its input
    at.add_(1)
    ad.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        yt.sum().backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        yd.sum().backward()


def test_in_place_on_a_leaf_requiring_grad_raises_unless_no_grad():
    t, d = _pair()
    with pytest.raises(RuntimeError, match="leaf"):
        t.add_(1)
    with pytest.raises(RuntimeError, match="leaf"):
        d.add_(1)
    with dtorch.no_grad():
        d.add_(1)  # an optimizer's update
    torch.testing.assert_close(d.to_torch(), t.detach() + 1)
    assert d.requires_grad and d.is_leaf


@pytest.mark.parametrize("pl", [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Partial("sum"), Shard(0))])
def test_in_place_ops_on_non_leaves_give_torchs_gradients(pl):
    t, d = _pair(pl=pl)
    ut, ud = _pair(pl=(Replicate(), Shard(1)), seed=1)

    def run(x, u, m):
        a = x * 2
        a.mul_(u)  # saves a's old value and u
        a += x
        a.exp_()
        b = a[1:6].clone()
        b.copy_(u[1:6] * 3)
        b.masked_fill_(b > 1.0, 0.5)
        return (a.sum() + b.pow(2).sum())

    run(t, ut, torch).backward()
    run(d, ud, dtorch).backward()
    for dv, tv in ((d, t), (ud, ut)):
        assert dv.grad.placements == list(_grad_placements(dv.placements, 2))
        torch.testing.assert_close(dv.grad.to_torch(), tv.grad, **TOL)
