"""Activation checkpointing of dtorch blocks (issue 21 item 10): ``torch.utils.checkpoint.checkpoint`` on
dtorch tensors, in all its forms, gives torch's values and gradients and recomputes the block in the
backward, like ``dtorch.autograd.checkpoint.checkpoint``; torch tensors keep torch's checkpoint."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.utils.checkpoint as tc

import dtorch
from dtorch import Replicate, Shard
from dtorch.autograd.checkpoint import checkpoint as dtorch_checkpoint

MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
TOL = {"rtol": 1e-5, "atol": 1e-5}
FORMS = {
    "use_reentrant=True": lambda fn, *a: tc.checkpoint(fn, *a, use_reentrant=True),
    "use_reentrant=False": lambda fn, *a: tc.checkpoint(fn, *a, use_reentrant=False),
    "default": lambda fn, *a: tc.checkpoint(fn, *a),
    "dtorch": lambda fn, *a: dtorch_checkpoint(fn, *a),
}


class Block:
    """Two linear layers with a tanh between, as dtorch modules (tp col then row) and as torch ones, with
    the same weights; counts its forwards."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.ref = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 8))
        self.up = dtorch.nn.Linear(8, 6, device_mesh=MESH, tp_shard_type="col")
        self.down = dtorch.nn.Linear(6, 8, device_mesh=MESH, tp_shard_type="row")
        self.up.load_state_dict(self.ref[0].state_dict())
        self.down.load_state_dict(self.ref[2].state_dict())
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return self.down(self.up(x).tanh())

    def params(self):
        return [self.up.weight, self.up.bias, self.down.weight, self.down.bias]


def _input(seed=1):
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("form", list(FORMS))
def test_block_between_layers_gets_torchs_gradients_and_is_recomputed(form):
    """The block sits between ops on inputs that require grad (where reentrant torch checkpoint used to
    lose the block's parameter gradients silently): every gradient is torch's."""
    blk = Block()
    xt = _input()
    pre = torch.randn(8, 8, generator=torch.Generator().manual_seed(2))
    x = dtorch.Tensor(xt, device_mesh=MESH, placements=[Shard(0), Replicate()]).requires_grad_()
    w = dtorch.Tensor(pre, device_mesh=MESH).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's warning about use_reentrant not given (the default form)
        out = FORMS[form](blk, (x @ w).sin())
    assert blk.calls == 1 and out.requires_grad
    (out * out).sum().backward()
    assert blk.calls == 2  # recomputed in the backward
    xr, wr = xt.clone().requires_grad_(), pre.clone().requires_grad_()
    ref = blk.ref((xr @ wr).sin())
    (ref * ref).sum().backward()
    torch.testing.assert_close(out.to_torch(), ref.detach(), **TOL)
    torch.testing.assert_close(x.grad.to_torch(), xr.grad, **TOL)
    torch.testing.assert_close(w.grad.to_torch(), wr.grad, **TOL)
    for p, q in zip(blk.params(), blk.ref.parameters()):
        assert p.grad is not None and p.grad.placements == p.placements
        torch.testing.assert_close(p.grad.to_torch(), q.grad, **TOL)


@pytest.mark.parametrize("reentrant", [True, False])
def test_first_block_on_an_input_without_grad(reentrant):
    blk = Block()
    x = dtorch.Tensor(_input(), device_mesh=MESH, placements=[Shard(0), Replicate()])
    tc.checkpoint(blk, x, use_reentrant=reentrant).sum().backward()
    blk.ref(_input()).sum().backward()
    for p, q in zip(blk.params(), blk.ref.parameters()):
        torch.testing.assert_close(p.grad.to_torch(), q.grad, **TOL)


@pytest.mark.parametrize("form", ["use_reentrant=True", "use_reentrant=False", "dtorch"])
def test_dropout_inside_draws_the_same_mask_when_recomputed(form):
    blk = Block()
    drop = dtorch.nn.Dropout(0.5)
    x = dtorch.Tensor(_input(), device_mesh=MESH, placements=[Shard(0), Replicate()])
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(7)
        fn = lambda t: drop(blk(t))  # noqa: E731
        out = FORMS[form](fn, x) if ckpt else fn(x)
        torch.manual_seed(123)  # the generator moves on between the forward and the backward
        out.pow(2).sum().backward()
        grads.append([p.grad.to_torch().clone() for p in blk.params()])
        for p in blk.params():
            p.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_weight_used_inside_and_outside_gets_one_sum_and_autograd_grad_sees_inside():
    blk = Block()
    x = dtorch.Tensor(_input(), device_mesh=MESH, placements=[Shard(0), Replicate()])
    out = tc.checkpoint(blk, x, use_reentrant=True)
    loss = (out @ blk.up.weight.t()).sum()  # up.weight also used after the block
    (g_up, g_down) = dtorch.autograd.grad(loss, [blk.up.weight, blk.down.weight], retain_graph=True)
    assert blk.up.weight.grad is None and blk.down.weight.grad is None  # autograd.grad stores nothing
    loss.backward()
    xr = _input()
    ref = (blk.ref(xr) @ blk.ref[0].weight.t()).sum()
    ref.backward()
    for got in (g_up, blk.up.weight.grad):
        torch.testing.assert_close(got.to_torch(), blk.ref[0].weight.grad, **TOL)
    for got in (g_down, blk.down.weight.grad):
        torch.testing.assert_close(got.to_torch(), blk.ref[2].weight.grad, **TOL)


def test_torch_linear_inside_a_checkpointed_block():
    """torch parameters used by dtorch ops inside the block get their gradient through the recomputation."""
    torch.manual_seed(0)
    lin, ref = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)
    ref.load_state_dict(lin.state_dict())
    x = dtorch.Tensor(_input(), device_mesh=MESH, placements=[Shard(0), Replicate()])
    tc.checkpoint(lambda t: lin(t).exp(), x, use_reentrant=True).sum().backward()
    ref(_input()).exp().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, **TOL)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, **TOL)


def test_checkpoint_sequential_of_dtorch_modules():
    blk = Block()
    x = dtorch.Tensor(_input(), device_mesh=MESH, placements=[Shard(0), Replicate()]).requires_grad_()
    mods = [blk.up, dtorch.nn.GELU(), blk.down]
    out = tc.checkpoint_sequential(mods, 2, x, use_reentrant=False)
    out.sum().backward()
    xr = _input().requires_grad_()
    torch.nn.Sequential(blk.ref[0], torch.nn.GELU(), blk.ref[2])(xr).sum().backward()
    torch.testing.assert_close(x.grad.to_torch(), xr.grad, **TOL)
    torch.testing.assert_close(blk.down.weight.grad.to_torch(), blk.ref[2].weight.grad, **TOL)


def test_torch_tensors_keep_torchs_checkpoint():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    for reentrant in (True, False):
        lin.zero_grad()
        out = tc.checkpoint(lambda t: lin(t).tanh(), x, use_reentrant=reentrant)
        assert isinstance(out, torch.Tensor) and out.grad_fn is not None
        out.sum().backward()
        want = torch.autograd.grad(lin(x).tanh().sum(), lin.weight)[0]
        torch.testing.assert_close(lin.weight.grad, want)


def test_torch_options_that_cannot_apply_are_refused():
    blk = Block()
    x = dtorch.Tensor(_input(), device_mesh=MESH)
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        tc.checkpoint(blk, x, use_reentrant=True, scale=2)
    with pytest.raises(NotImplementedError, match="dtorch.autograd.checkpoint.checkpoint"):
        tc.checkpoint(blk, x, use_reentrant=False, context_fn=lambda: (torch.no_grad(), torch.no_grad()))
    with pytest.warns(UserWarning, match="use_reentrant parameter should be passed explicitly"):
        tc.checkpoint(blk, x)


def test_a_reference_taken_before_dtorch_is_imported_is_routed():
    """``from torch.utils.checkpoint import checkpoint`` before ``import dtorch`` (transformers does): the
    function it holds runs dtorch's checkpoint too."""
    code = (
        "from torch.utils.checkpoint import checkpoint\n"
        "import torch, dtorch\n"
        "mesh = dtorch.init_device_mesh('cpu', (2,))\n"
        "w = dtorch.randn(4, 4, device_mesh=mesh, requires_grad=True)\n"
        "x = dtorch.randn(3, 4, device_mesh=mesh)\n"
        "checkpoint(lambda t: (t @ w).tanh(), x, use_reentrant=True).sum().backward()\n"
        "ref = w.to_torch().requires_grad_()\n"
        "(x.to_torch() @ ref).tanh().sum().backward()\n"
        "torch.testing.assert_close(w.grad.to_torch(), ref.grad)\n"
        "print('routed')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0 and "routed" in res.stdout, res.stderr[-3000:]


def test_block_with_several_outputs_and_keyword_arguments():
    blk = Block()
    x = dtorch.Tensor(_input(), device_mesh=MESH, placements=[Shard(0), Replicate()]).requires_grad_()

    def fn(t, *, scale):
        h = blk(t)
        return [h * scale, h.exp()]

    a, b = tc.checkpoint(fn, x, scale=3.0, use_reentrant=False)
    (a.sum() + b.sum()).backward()
    xr = _input().requires_grad_()
    h = blk.ref(xr)
    (h.sum() * 3.0 + h.exp().sum()).backward()
    torch.testing.assert_close(x.grad.to_torch(), xr.grad, **TOL)
    torch.testing.assert_close(blk.up.weight.grad.to_torch(), blk.ref[0].weight.grad, **TOL)
