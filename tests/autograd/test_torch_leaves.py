"""torch tensors that require grad, used by dtorch ops, get torch's gradients in their ``.grad`` (issue 21
item 2): ``x @ w``, ``F.linear(x, w)``, ``x * w[0]`` with ``w`` a torch tensor requiring grad, and a
``torch.nn.Linear`` called on a dtorch tensor, which then trains under ``torch.optim``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate, Shard
from tests.runtime.conftest import process_graph, using

MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _both(fn, xt, ws, placements=(Shard(0), Replicate()), x_grad=False, backwards=1):
    """(dtorch, torch) gradients of ``fn(x, *ws).sum()``: dtorch's with ``x`` a dtorch tensor laid out as
    ``placements`` and ``ws`` torch tensors requiring grad; torch's all on one device."""
    ws_d = [w.clone().requires_grad_() for w in ws]
    x = dtorch.Tensor(xt, device_mesh=MESH, placements=list(placements))
    if x_grad:
        x.requires_grad_()
    out = fn(x, *ws_d)
    assert isinstance(out, dtorch.Tensor) and out.requires_grad
    for k in range(backwards):
        out.sum().backward(retain_graph=k + 1 < backwards)
    ws_t = [w.clone().requires_grad_() for w in ws]
    xr = xt.clone().requires_grad_(x_grad)
    ref = fn(xr, *ws_t)
    for k in range(backwards):
        ref.sum().backward(retain_graph=k + 1 < backwards)
    for got, want in zip(ws_d, ws_t):
        assert isinstance(got.grad, torch.Tensor) and not isinstance(got.grad, dtorch.Tensor)
        torch.testing.assert_close(got.grad, want.grad, **TOL)
    if x_grad:
        torch.testing.assert_close(x.grad.to_torch(), xr.grad, **TOL)


CASES = {
    "x @ w": (lambda x, w: x @ w, [(8, 5)]),
    "w.T @ x.T": (lambda x, w: w.t() @ x.t(), [(8, 5)]),
    "F.linear(x, w)": (lambda x, w: F.linear(x, w), [(5, 8)]),
    "F.linear(x, w, b)": (lambda x, w, b: F.linear(x, w, b), [(5, 8), (5,)]),
    "x * w[0]": (lambda x, w: x * w[0], [(3, 8)]),
    "torch.mul(w[1], x).tanh()": (lambda x, w: torch.mul(w[1], x).tanh(), [(3, 8)]),
    "x * w[0, 2] (0-d)": (lambda x, w: x * w[0, 2], [(3, 8)]),
    "w used twice": (lambda x, w: (x @ w).sin() * (x @ w), [(8, 5)]),
    "one non-leaf used twice": (lambda x, w: (lambda w0: x * w0 + x.exp() * w0)(w[0] * 2), [(3, 8)]),
    "two copies of w[0]": (lambda x, w: x * w[0] + x.cos() * w[0], [(3, 8)]),
    "torch.cat": (lambda x, w: torch.cat([x, w]), [(2, 8)]),
}


@pytest.mark.parametrize("placements", [(Shard(0), Replicate()), (Shard(0), Shard(1)), (Replicate(), Replicate())],
                         ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_weight_gets_torchs_gradient(case, placements):
    fn, shapes = CASES[case]
    xt = _randn(6, 8, seed=1)
    _both(fn, xt, [_randn(*s, seed=2 + k) for k, s in enumerate(shapes)], placements)


def test_uneven_rows_and_a_dtorch_input_that_requires_grad():
    _both(lambda x, w, b: F.linear(x, w, b).relu(), _randn(5, 7, seed=1), [_randn(3, 7, seed=2), _randn(3, seed=3)],
          placements=(Shard(0), Shard(1)), x_grad=True)


def test_gradients_accumulate_over_backwards_and_start_as_none():
    w = _randn(8, 5, seed=2).requires_grad_()
    x = dtorch.Tensor(_randn(6, 8, seed=1), device_mesh=MESH, placements=[Shard(0), Replicate()])
    y = x @ w
    assert w.grad is None
    y.sum().backward(retain_graph=True)
    first = w.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(w.grad, 2 * first)
    _both(lambda x, w: (x @ w).tanh(), _randn(6, 8, seed=1), [_randn(8, 5, seed=2)], backwards=2)


def test_retain_graph_through_a_non_leaf_torch_tensor():
    _both(lambda x, w: x * (w[0] * 3).exp(), _randn(6, 8, seed=1), [_randn(3, 8, seed=2)], backwards=2)


def test_no_grad_and_requires_grad_false_record_nothing():
    x = dtorch.Tensor(_randn(6, 8, seed=1), device_mesh=MESH, placements=[Shard(0), Replicate()])
    w = _randn(8, 5, seed=2).requires_grad_()
    with torch.no_grad():
        y = x @ w
    assert not y.requires_grad
    assert not (x @ w.detach()).requires_grad
    with dtorch.no_grad():
        assert not (x @ w[:, :1]).requires_grad
    assert w.grad is None


def test_autograd_grad_leaves_torch_grad_alone():
    x = dtorch.Tensor(_randn(6, 8, seed=1), device_mesh=MESH, placements=[Shard(0), Replicate()]).requires_grad_()
    w = _randn(8, 5, seed=2).requires_grad_()
    (gx,) = dtorch.autograd.grad((x @ w).sum(), x)
    assert w.grad is None
    torch.testing.assert_close(gx.to_torch(), w.detach().sum(1).expand(6, 8), **TOL)


def test_torch_linear_on_a_dtorch_tensor_trains_like_torch():
    """A torch.nn.Linear (torch parameters) called on dtorch activations, stepped by torch.optim.SGD: the
    same weights as the same model in torch after three steps."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model.load_state_dict(ref.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for step in range(3):
        xt = _randn(6, 8, seed=10 + step)
        x = dtorch.Tensor(xt, device_mesh=MESH, placements=[Shard(0), Replicate()])
        for m, opt, inp in ((model, opts[0], x), (ref, opts[1], xt)):
            loss = m(inp).pow(2).mean()
            assert loss.requires_grad
            loss.backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{name}: {m}")
    torch.manual_seed(0)
    assert not torch.allclose(model[0].weight, torch.nn.Linear(8, 6).weight, atol=1e-3)  # it moved


def test_torch_input_of_a_dtorch_module_gets_its_gradient():
    """A torch tensor requiring grad fed to a dtorch module (its input is laid out on the module's mesh)."""
    torch.manual_seed(0)
    layer = dtorch.nn.Linear(8, 4, device_mesh=MESH)
    ref = torch.nn.Linear(8, 4)
    layer.load_state_dict(ref.state_dict())
    h, h_ref = (_randn(6, 8, seed=1).requires_grad_() for _ in range(2))
    layer(h).sum().backward()
    ref(h_ref).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, **TOL)


def test_process_backend_fetches_the_gradient():
    g = process_graph(workers=4)
    w = _randn(8, 5, seed=2).requires_grad_()
    try:
        with using(g):
            x = dtorch.Tensor(_randn(6, 8, seed=1), device_mesh=MESH, placements=[Shard(0), Replicate()])
            (x @ w).tanh().sum().backward()
    finally:
        g.runtime.shutdown()
    w_ref = w.detach().clone().requires_grad_()
    (_randn(6, 8, seed=1) @ w_ref).tanh().sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad, **TOL)


def test_masked_fill_with_a_torch_value_that_requires_grad():
    mask = _randn(6, 8, seed=4) > 0
    _both(lambda x, v: x.masked_fill(mask, v[1]) * x, _randn(6, 8, seed=1), [_randn(3, seed=2)])


def test_in_place_masked_fill_with_a_torch_value_that_requires_grad():
    mask = _randn(6, 8, seed=4) > 0

    def fill_(x, v):
        y = x * 1
        y.masked_fill_(mask, v[1])
        return y * y

    _both(fill_, _randn(6, 8, seed=1), [_randn(3, seed=2)])


def test_autograd_grad_of_torch_tensors():
    """``dtorch.autograd.grad`` with torch tensors among the inputs: torch gradients, through torch's graph
    where the tensor used was computed from the one asked about; nothing stored in ``.grad``."""
    x = dtorch.Tensor(_randn(6, 8, seed=1), device_mesh=MESH, placements=[Shard(0), Replicate()]).requires_grad_()
    w, v = _randn(8, 5, seed=2).requires_grad_(), _randn(3, 8, seed=3).requires_grad_()
    unused = _randn(2, seed=4).requires_grad_()
    loss = ((x @ w).tanh().sum(0) * (x * v[1]).sum()).sum()
    gw, gx, gv, gu = dtorch.autograd.grad(loss, [w, x, v, unused], allow_unused=True)
    assert w.grad is None and v.grad is None and x.grad is None and gu is None
    xr = x.to_torch().requires_grad_()
    ref = ((xr @ w).tanh().sum(0) * (xr * v[1]).sum()).sum()
    rw, rx, rv = torch.autograd.grad(ref, [w, xr, v])
    assert isinstance(gw, torch.Tensor) and isinstance(gv, torch.Tensor)
    torch.testing.assert_close(gw, rw, **TOL)
    torch.testing.assert_close(gv, rv, **TOL)
    torch.testing.assert_close(gx.to_torch(), rx, **TOL)
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        dtorch.autograd.grad((x @ w).sum(), [w, unused])


def test_torch_autograd_backward_and_grad_on_dtorch_tensors():
    """``torch.autograd.backward(loss)`` / ``torch.autograd.grad(loss, [x])`` with dtorch tensors run dtorch's
    backward (torch hands them over through __torch_function__), with torch's keyword arguments."""
    x = dtorch.Tensor(_randn(6, 8, seed=1), device_mesh=MESH, placements=[Shard(0), Replicate()]).requires_grad_()
    xr = x.to_torch().requires_grad_()
    torch.autograd.backward((x.tanh() * x).sum())
    torch.autograd.backward((xr.tanh() * xr).sum())
    torch.testing.assert_close(x.grad.to_torch(), xr.grad, **TOL)
    (gx,) = torch.autograd.grad((x * x).sum(), [x])
    (rx,) = torch.autograd.grad((xr * xr).sum(), [xr])
    torch.testing.assert_close(gx.to_torch(), rx, **TOL)
    unused = dtorch.Tensor(_randn(3, seed=2), device_mesh=MESH).requires_grad_()
    gx, gu = torch.autograd.grad((x * 2).sum(), [x, unused], materialize_grads=True)
    torch.testing.assert_close(gu.to_torch(), torch.zeros(3))
    with pytest.raises(NotImplementedError, match="dtorch.autograd.grad"):
        torch.autograd.backward((x * 2).sum(), inputs=[x])
