"""``backward(retain_graph=True)`` then a second backward through the same graph: the gradients accumulate
as torch's do, on every backend (the in-process backend keeps each op's local torch graph from the forward,
which a first backward must not free), for single ops on a dp x tp mesh and a Llama with two losses."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from tests.llama_models import hf_model
from tests.models.test_llama import Layout
from tests.runtime.conftest import BlocksRuntime, process_graph, using

MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
TOL = {"rtol": 1e-5, "atol": 1e-5}

UNARY = ["tanh", "sin", "exp", "relu", "sigmoid"]
LAYOUTS = [[Shard(0), Replicate()], [Shard(0), Shard(1)], [Replicate(), Replicate()], [Shard(1), Shard(0)]]


def _graph(backend):
    g = dtorch.Graph(backend="inprocess" if backend == "blocks" else backend)
    if backend == "blocks":  # the in-process backend on its per-device path (no kept graph: it recomputes)
        g.runtime = BlocksRuntime()
    return g


def _twice(loss):
    loss.backward(retain_graph=True)
    loss.backward()


@pytest.mark.parametrize("backend", ["inprocess", "reference", "blocks"])
@pytest.mark.parametrize("placements", LAYOUTS, ids=str)
@pytest.mark.parametrize("op", UNARY + ["mul", "matmul"])
def test_second_backward_accumulates_like_torch(op, placements, backend):
    xt = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    wt = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with using(_graph(backend)):
        x = dtorch.Tensor(xt, device_mesh=MESH, placements=placements).requires_grad_()
        w = dtorch.Tensor(wt, device_mesh=MESH, placements=[Replicate(), Shard(1)]).requires_grad_()
        fn = {"mul": lambda a, b: a * a * b[:6], "matmul": lambda a, b: a @ b}.get(
            op, lambda a, b: getattr(a @ b, op)())
        _twice(fn(x, w).sum())
        gx, gw = x.grad.to_torch(), w.grad.to_torch()
        assert x.grad.placements == x.placements and w.grad.placements == w.placements
    xr, wr = xt.clone().requires_grad_(), wt.clone().requires_grad_()
    _twice(fn(xr, wr).sum())
    torch.testing.assert_close(gx, xr.grad, **TOL)
    torch.testing.assert_close(gw, wr.grad, **TOL)


def test_third_backward_without_retain_raises_torchs_error():
    x = dtorch.randn(4, 6, device_mesh=MESH, placements=[Shard(0), Shard(1)], requires_grad=True)
    loss = x.tanh().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_autograd_grad_then_backward_on_one_graph():
    """``dtorch.autograd.grad(..., retain_graph=True)`` leaves the graph usable for a backward."""
    xt = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    x = dtorch.Tensor(xt, device_mesh=MESH, placements=[Shard(0), Replicate()]).requires_grad_()
    loss = (x.exp() * x).sum()
    (g,) = dtorch.autograd.grad(loss, x, retain_graph=True)
    loss.backward()
    xr = xt.clone().requires_grad_()
    ref = (xr.exp() * xr).sum()
    (gr,) = torch.autograd.grad(ref, xr, retain_graph=True)
    torch.testing.assert_close(g.to_torch(), gr, **TOL)
    torch.testing.assert_close(x.grad.to_torch(), gr, **TOL)


def test_llama_two_losses_on_one_forward():
    """The causal-LM loss and a second loss on the same logits, one forward, two backwards: Hugging Face's
    accumulated gradients (even shapes: the in-process backend keeps its local graphs)."""
    from dtorch.models.llama import LlamaForCausalLM

    layout = Layout("dp2 x tp2", (("dp", 2), ("tp", 2)), batch=4, seq=6)
    hf = hf_model()
    hf.zero_grad()
    model = LlamaForCausalLM(hf.config, layout.mesh())
    model.load_state_dict(hf.state_dict())
    ids = torch.randint(0, hf.config.vocab_size, (layout.batch, layout.seq), generator=torch.Generator().manual_seed(4))
    out = model(ids, labels=ids)
    out.loss.backward(retain_graph=True)
    out.logits.pow(2).mean().backward()
    ref = hf(ids, labels=ids)
    ref.loss.backward(retain_graph=True)
    ref.logits.pow(2).mean().backward()
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.to_torch(), hf_params[name].grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
    hf.zero_grad()


def test_process_backend_second_backward():
    g = process_graph(workers=4)
    try:
        xt = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
        with using(g):
            x = dtorch.Tensor(xt, device_mesh=MESH, placements=[Shard(0), Shard(1)]).requires_grad_()
            _twice((x.tanh() * x).sum())
            got = x.grad.to_torch()
    finally:
        g.runtime.shutdown()
    xr = xt.clone().requires_grad_()
    _twice((xr.tanh() * xr).sum())
    torch.testing.assert_close(got, xr.grad, **TOL)
