"""``Tensor.register_hook`` with torch's semantics (issue 21 item 14): the hook gets the gradient (a dtorch
tensor) during the backward, a tensor it returns replaces it, ``remove()`` unregisters it; on leaves (the
summed gradient, before ``.grad``) and non-leaves. Each case runs the same code on torch and on dtorch."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard

MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _leaf(on_dtorch, seed, shape, placements=(Shard(0), Replicate())):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if on_dtorch:
        return dtorch.Tensor(t, device_mesh=MESH, placements=list(placements)).requires_grad_()
    return t.requires_grad_()


def _torch(v):
    return v.to_torch() if isinstance(v, dtorch.Tensor) else v


def _compare(program):
    """``program(on_dtorch) -> dict of tensors / lists of tensors``; the dtorch run's values are torch's."""
    want, got = program(False), program(True)
    assert want.keys() == got.keys()
    for k in want:
        ws, gs = (want[k], got[k]) if isinstance(want[k], list) else ([want[k]], [got[k]])
        assert len(ws) == len(gs), k
        for w, g in zip(ws, gs):
            if w is None:
                assert g is None, k
                continue
            if isinstance(g, dtorch.Tensor):
                assert g.device_mesh == MESH, k
            torch.testing.assert_close(_torch(g), w, **TOL, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("placements", [(Shard(0), Replicate()), (Shard(0), Shard(1)), (Replicate(), Shard(0))], ids=str)
def test_non_leaf_hook_sees_and_replaces_the_gradient(placements):
    def program(d):
        x = _leaf(d, 1, (6, 4), placements)
        w = _leaf(d, 2, (4, 5), (Replicate(), Shard(1)))
        y = x @ w
        seen = []
        y.register_hook(lambda g: seen.append(_torch(g).clone()))
        y.register_hook(lambda g: g * 10)  # runs second: the first saw the gradient unchanged
        (y.tanh() * y).sum().backward()
        return {"seen": seen, "x": x.grad, "w": w.grad}

    _compare(program)


def test_leaf_hook_sees_the_summed_gradient_once_and_its_result_is_stored():
    def program(d):
        w = _leaf(d, 2, (6, 4))
        seen = []
        w.register_hook(lambda g: seen.append(_torch(g).clone()))
        w.register_hook(lambda g: g.clamp(-0.5, 0.5))
        (w.sin() * 2 + w * w).sum().backward()
        return {"seen": seen, "grad": w.grad}

    _compare(program)


def test_remove_and_handles():
    def program(d):
        w = _leaf(d, 2, (6, 4))
        calls = []
        h = w.register_hook(lambda g: calls.append(1) or g * 3)
        loss = (w * w).sum()
        loss.backward(retain_graph=True)
        first = _torch(w.grad).clone()
        h.remove()
        loss.backward()
        return {"first": first, "grad": w.grad, "calls": [torch.tensor(float(len(calls)))]}

    _compare(program)
    w = _leaf(True, 2, (3,), (Replicate(), Replicate()))
    assert isinstance(w.register_hook(lambda g: g), torch.utils.hooks.RemovableHandle)


def test_retain_grad_sees_what_the_hooks_made():
    def program(d):
        x = _leaf(d, 1, (6, 4))
        y = x.exp()
        y.retain_grad()
        y.register_hook(lambda g: g + 1)
        (y * x).sum().backward()
        return {"y": y.grad, "x": x.grad}

    _compare(program)


def test_autograd_grad_runs_leaf_hooks_and_captures_non_leaves_before_theirs():
    def program(d):
        x = _leaf(d, 1, (6, 4))
        y = x * 2
        y.register_hook(lambda g: g * 10)
        x.register_hook(lambda g: g * 100)
        gy, gx = (dtorch.autograd.grad if d else torch.autograd.grad)((y * y).sum(), [y, x])
        return {"gy": gy, "gx": gx, "x.grad": x.grad}

    _compare(program)


def test_hook_errors_are_torchs():
    x = dtorch.randn(4, 3, device_mesh=MESH)
    with pytest.raises(RuntimeError, match="cannot register a hook on a tensor that doesn't require gradient"):
        x.register_hook(lambda g: g)
    w = _leaf(True, 2, (4, 3))
    w.register_hook(lambda g: g.sum(0))
    with pytest.raises(RuntimeError, match="has changed the size of value"):
        (w * 2).sum().backward()


def test_hook_may_return_a_torch_tensor():
    w = _leaf(True, 2, (6, 4))
    w.register_hook(lambda g: torch.ones(6, 4, dtype=torch.float64))
    (w * 3).sum().backward()
    assert w.grad.placements == w.placements
    torch.testing.assert_close(w.grad.to_torch(), torch.ones(6, 4, dtype=torch.float64))
