"""``Module.register_forward_pre_hook`` / ``register_forward_hook`` with torch.nn.Module's semantics (issue 21
item 14): each case runs the same hooks on a torch.nn module and on the dtorch.nn one with the same weights,
and compares what the hooks saw, what they changed and the order they ran in."""
from __future__ import annotations

import warnings

import pytest
import torch

import dtorch
from dtorch import Shard

MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _torch(v):
    return v.to_torch() if isinstance(v, dtorch.Tensor) else v


def _pair(tp_shard_type="col"):
    torch.manual_seed(0)
    ref = torch.nn.Linear(6, 4)
    mod = dtorch.nn.Linear(6, 4, device_mesh=MESH, tp_shard_type=tp_shard_type)
    mod.load_state_dict(ref.state_dict())
    return ref, mod


def _x(on_dtorch):
    t = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
    return dtorch.Tensor(t, device_mesh=MESH, placements=[Shard(0), Shard(1)]) if on_dtorch else t


def _run_both(install, call=lambda m, x: m(x)):
    """``install(module, log)`` registers hooks that append to ``log``; returns (torch's, dtorch's) (log,
    output), values made torch tensors."""
    out = []
    for on_dtorch, module in zip((False, True), _pair()):
        log = []
        install(module, log)
        y = call(module, _x(on_dtorch))
        out.append(([(k, _torch(v)) for k, v in log], _torch(y)))
    return out


def _assert_same(runs):
    (log_t, y_t), (log_d, y_d) = runs
    assert [k for k, _ in log_d] == [k for k, _ in log_t]
    for (k, a), (_, b) in zip(log_t, log_d):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(b, a, **TOL, msg=lambda m: f"{k}: {m}")
        else:
            assert b == a, k
    torch.testing.assert_close(y_d, y_t, **TOL)


def test_pre_hook_replaces_the_arguments_and_forward_hook_the_output():
    def install(m, log):
        m.register_forward_pre_hook(lambda mod, args: log.append(("pre1", args[0])) or args[0] * 2)  # one value
        m.register_forward_pre_hook(lambda mod, args: log.append(("pre2", args[0])))
        m.register_forward_hook(lambda mod, args, out: log.append(("post-args", args[0])) or out.tanh())
        m.register_forward_hook(lambda mod, args, out: log.append(("post-out", out)))

    _assert_same(_run_both(install))


def test_prepend_and_remove():
    def install(m, log):
        m.register_forward_hook(lambda mod, a, out: log.append(("a", 0)))
        h = m.register_forward_hook(lambda mod, a, out: log.append(("b", 0)), prepend=True)
        m.register_forward_pre_hook(lambda mod, a: log.append(("p", 0)))
        m.register_forward_pre_hook(lambda mod, a: log.append(("q", 0)), prepend=True)
        m.register_forward_hook(lambda mod, a, out: log.append(("removed", 0))).remove()

        def call_twice(mod, x):
            mod(x)
            h.remove()
            log.append(("---", 0))
            return mod(x)

        install.call = call_twice

    runs = _run_both(install, lambda m, x: install.call(m, x))
    assert [k for k, _ in runs[1][0]] == ["q", "p", "b", "a", "---", "q", "p", "a"]
    _assert_same(runs)


def test_with_kwargs_hooks():
    def install(m, log):
        def pre(mod, args, kwargs):
            log.append(("pre-kwargs", tuple(sorted(kwargs))))
            return (args[0] + 1,), {}

        m.register_forward_pre_hook(pre, with_kwargs=True)
        m.register_forward_hook(lambda mod, args, kwargs, out: log.append(("post", args[0])) or out * 3,
                                with_kwargs=True)

    _assert_same(_run_both(install))

    _, mod = _pair()
    mod.register_forward_pre_hook(lambda m, a, k: a, with_kwargs=True)  # not an (args, kwargs) pair
    with pytest.raises(RuntimeError, match=r"forward pre-hook must return None or a tuple of \(new_args, new_kwargs\)"):
        mod(_x(True))


def test_always_call_runs_when_the_forward_raises():
    _, mod = _pair()
    log = []
    mod.register_forward_hook(lambda m, a, out: log.append(("always", out)), always_call=True)
    mod.register_forward_hook(lambda m, a, out: log.append(("normal", out)))
    with pytest.raises(dtorch.errors.OpError):
        mod(dtorch.randn(5, 7, device_mesh=MESH))  # 7 features for a 6-input layer
    assert log == [("always", None)]

    def failing(m, a, out):
        raise ValueError("hook failed")

    mod.register_forward_hook(failing, always_call=True)
    with pytest.warns(UserWarning, match="raised an exception that was silenced"), pytest.raises(dtorch.errors.OpError):
        mod(dtorch.randn(5, 7, device_mesh=MESH))


def test_hooks_on_children_and_gradients_through_a_replaced_output():
    """A hook on a child of a Sequential changes what the next layer and the backward see."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    mod = dtorch.nn.Sequential(dtorch.nn.Linear(6, 4, device_mesh=MESH), dtorch.nn.Linear(4, 2, device_mesh=MESH))
    mod.load_state_dict(ref.state_dict())
    grads = []
    for m, x in ((ref, _x(False)), (mod, _x(True))):
        m[0].register_forward_hook(lambda mm, a, out: out.sigmoid())
        m(x).pow(2).sum().backward()
        grads.append([_torch(p.grad) for p in m.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, **TOL)


def test_backward_hooks_are_refused_clearly():
    _, mod = _pair()
    with pytest.raises(NotImplementedError, match="register_hook"):
        mod.register_full_backward_hook(lambda m, gi, go: None)


def test_global_torch_module_hooks_do_not_run():
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: seen.append(type(m)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _pair()[1](_x(True))
    finally:
        handle.remove()
    assert dtorch.nn.Linear not in seen
