"""Bit identity with torch: on a one-device mesh, and on a 2-device mesh with every input replicated,
each op makes torch's own call on the whole tensors, so ``torch.equal(result.to_torch(), torch_result)``
holds (users compare with torch.equal).

The sweep runs every op of the op table on its cases from tests/ops/test_op_table.py (an op without
cases fails there and here), in float32 and, on one device, with float inputs in float16 and bfloat16.
Where bit identity cannot hold, ``NOT_EXACT`` says why; those cases are still compared (to 1e-6 / one
low-precision ulp) and must not turn exact silently (the entry is then stale and fails).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Replicate
from dtorch.ops.table import TABLE
from tests.ops.test_op_table import SAMPLES, _map_tensors, _reference

M1 = dtorch.init_device_mesh("cpu", (1,))
M2 = dtorch.init_device_mesh("cpu", (2,))

# op -> why its result is not torch's bits on one device
NOT_EXACT = {
}
# (op, case index, dtype) whose inputs torch itself refuses in that dtype: nothing to compare
_HALF = (torch.float16, torch.bfloat16)


def _results(got, expected):
    gs = got if isinstance(got, (tuple, list)) else [got]
    es = expected if isinstance(expected, (tuple, list)) else [expected]
    assert len(gs) == len(es)
    return [(g, e) for g, e in zip(gs, es) if isinstance(e, torch.Tensor)]


def _run(name, k, case, mesh, dtype):
    conv = (lambda t: t.to(dtype) if t.is_floating_point() else t) if dtype is not None else (lambda t: t)
    args, kwargs = case.make()
    args = _map_tensors(args, conv)
    torch.manual_seed(1234)
    try:
        expected = _reference(name, case)(*args, **kwargs)
    except (RuntimeError, TypeError, NotImplementedError):
        if dtype is None:
            raise
        return 1  # torch has no kernel for this dtype (e.g. an op without a float16 CPU kernel): nothing differs
    args, kwargs = case.make()
    args = _map_tensors(args, conv)
    torch.manual_seed(1234)
    if case.factory:
        got = TABLE[name].fn(*args, **kwargs, device_mesh=mesh, placements=[Replicate()] * mesh.ndim)
    else:
        dargs = _map_tensors(args, lambda t: dtorch.Tensor(t, device_mesh=mesh))
        torch.manual_seed(1234)
        got = TABLE[name].fn(*dargs, **kwargs)
    exact = 0
    for g, e in _results(got, expected):
        data = g.to_torch()
        where = f"dtorch.{name} case {k} on {mesh.size()} device(s){'' if dtype is None else ' in ' + str(dtype)}"
        assert g.dtype == data.dtype == e.dtype and data.shape == e.shape, where
        if not case.values:  # (empty: torch leaves the values undefined)
            continue
        if name in NOT_EXACT:
            tol = 2e-2 if dtype in _HALF else 1e-6  # (one bfloat16 ulp of values up to 4)
            torch.testing.assert_close(data, e, rtol=tol, atol=tol, equal_nan=True, msg=where)
            exact += bool(torch.equal(data, e))
        else:
            torch.testing.assert_close(data, e, rtol=0, atol=0, equal_nan=True,
                                       msg=lambda m: f"{where} is not torch's bits: {m}")
    return exact if case.values else 1


@pytest.mark.parametrize("name", sorted(TABLE))
def test_op_is_torch_bit_for_bit(name):
    if name not in SAMPLES:
        pytest.fail(f"op {name!r} has no cases in tests/ops/test_op_table.py SAMPLES")
    exact = []
    for k, case in enumerate(SAMPLES[name]):
        for mesh in (M1, M2):
            exact.append(_run(name, k, case, mesh, None))
        if not case.factory:
            for dt in _HALF:
                exact.append(_run(name, k, case, M1, dt))
    if name in NOT_EXACT:
        assert not all(exact), f"dtorch.{name} is torch's bits in every case now: drop it from NOT_EXACT"


def test_not_exact_names_ops():
    assert set(NOT_EXACT) <= set(TABLE)


def _both(mesh, *ts):
    return [dtorch.Tensor(t, device_mesh=mesh) for t in ts]


@pytest.mark.parametrize("mesh", [M1, M2], ids=["1dev", "2dev-replicated"])
def test_issue_cases(mesh):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(s, generator=g)  # noqa: E731
    a, b, m = r(16), r(16), r(8, 16)
    for x, y in ((a, b), (m, b)):
        X, Y = _both(mesh, x, y)
        assert torch.equal((X @ Y).to_torch(), x @ y)
    x, w, bias = r(3, 5, 16), r(7, 16), r(7)
    assert torch.equal(F.linear(*_both(mesh, x, w, bias)).to_torch(), F.linear(x, w, bias))
    assert torch.equal(F.linear(*_both(mesh, x, w)).to_torch(), F.linear(x, w))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x, w, bias = r(4, 5, 16).to(dt), r(16).to(dt), r(16).to(dt)
        X, W, B = _both(mesh, x, w, bias)
        assert torch.equal(F.layer_norm(X, (16,), W, B, 1e-5).to_torch(), F.layer_norm(x, (16,), w, bias, 1e-5))
    q, k, v = r(2, 4, 5, 8).half(), r(2, 2, 6, 8).half(), r(2, 2, 6, 8).half()
    mask = torch.rand(5, 6, generator=g) > 0.3
    for kw in ({}, {"is_causal": True}, {"attn_mask": mask}, {"scale": 0.3}):
        Q, K, V = _both(mesh, q, k, v)
        kw_d = {key: dtorch.Tensor(val, device_mesh=mesh) if isinstance(val, torch.Tensor) else val
                for key, val in kw.items()}
        got = F.scaled_dot_product_attention(Q, K, V, enable_gqa=True, **kw_d)
        assert got.dtype == torch.float16
        assert torch.equal(got.to_torch(), F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)), kw


def test_sdpa_dropout_float32_is_torch_bits():
    # the same dropout mask as torch's (drawn on the controller) and torch's math path in its order
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    for mesh in (M1, M2):
        for causal in (False, True):
            torch.manual_seed(3)
            e = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=causal)
            torch.manual_seed(3)
            got = F.scaled_dot_product_attention(*_both(mesh, q, k, v), dropout_p=0.3, is_causal=causal)
            assert torch.equal(got.to_torch(), e)


def test_sharded_results_stay_close():
    # not a bit-identity case (a shard computes with other GEMM sizes): the exact paths must not change what
    # sharded layouts compute
    x, w = torch.randn(7, 16), torch.randn(5, 16)
    X = dtorch.Tensor(x, device_mesh=M2, placements=[dtorch.Shard(1)])
    W = dtorch.Tensor(w, device_mesh=M2, placements=[dtorch.Shard(1)])
    torch.testing.assert_close(F.linear(X, W).to_torch(), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(F.layer_norm(X, (16,)).to_torch().sum()))
