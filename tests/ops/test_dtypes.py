"""Result dtypes of element-wise ops follow ``torch.result_type``: for every dtype pair, with the other
operand an n-d tensor, a 0-d tensor (promoted like a scalar) or a Python scalar, the spec's dtype, the
fetched data's dtype and torch's agree, and the values are torch's bit for bit (element-wise kernels
compute each element alone, so a shard computes what the whole tensor does)."""
from __future__ import annotations

import itertools

import pytest
import torch

import dtorch
from dtorch import Replicate, Shard

DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64]
MESH = dtorch.init_device_mesh("cpu", (2,))
MESH_2D = dtorch.init_device_mesh("cpu", (2, 2))


def _nd(dtype, shape=(5, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 3).to(dtype)
    return torch.randint(0, 6, shape, generator=g).to(dtype)


def _zero_d(dtype):
    return torch.tensor(True) if dtype == torch.bool else torch.tensor(2.75 if dtype.is_floating_point else 3).to(dtype)


def _scalar(dtype):
    return True if dtype == torch.bool else 2.75 if dtype.is_floating_point else 3


# op -> (dtorch function, torch function) of two operands
OPS = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "mul": (dtorch.mul, torch.mul),
    "div": (dtorch.div, torch.div),
    "maximum": (dtorch.maximum, torch.maximum),
    "eq": (dtorch.eq, torch.eq),
    "where": (lambda a, b: dtorch.where(_cond(a), a, b), lambda a, b: torch.where(_cond(a), a, b)),
    "clamp": (lambda a, b: dtorch.clamp(a, b, b), lambda a, b: torch.clamp(a, b, b)),
}


def _cond(a):
    shape = tuple(a.shape)
    mask = torch.arange(max(1, int(torch.tensor(shape).prod().item()) if shape else 1)).reshape(shape or ()) % 2 == 0
    return dtorch.Tensor(mask, device_mesh=a.device_mesh) if isinstance(a, dtorch.Tensor) else mask


def _dist(v, placements, mesh):
    if isinstance(v, torch.Tensor):
        return dtorch.Tensor(v, device_mesh=mesh, placements=placements if v.ndim else [Replicate()] * mesh.ndim)
    return v


def _check_pair(op: str, a, b, placements, mesh=MESH):
    dt_fn, t_fn = OPS[op]
    try:
        expected = t_fn(a, b)
    except (RuntimeError, TypeError) as exc:  # torch refuses the pair: dtorch must refuse it too
        with pytest.raises(Exception):
            dt_fn(_dist(a, placements, mesh), _dist(b, placements, mesh))
        return str(exc)
    got = dt_fn(_dist(a, placements, mesh), _dist(b, placements, mesh))
    data = got.to_torch()
    what = f"{op}({_desc(a)}, {_desc(b)}) with the n-d operand {placements}"
    assert got.dtype == data.dtype == expected.dtype, \
        f"{what}: spec {got.dtype}, data {data.dtype}, torch {expected.dtype}"
    assert data.shape == expected.shape, what
    torch.testing.assert_close(data, expected, rtol=0, atol=0, equal_nan=True, msg=what)
    return None


def _desc(v):
    if isinstance(v, torch.Tensor):
        return f"{'0-d' if v.ndim == 0 else list(v.shape)} {str(v.dtype)[6:]}"
    return f"{type(v).__name__} scalar"


def _forms(db):
    """The second operand's forms: n-d (broadcast row), 0-d tensor, Python scalar."""
    return [("nd", _nd(db, (3,), seed=1)), ("0d", _zero_d(db)), ("scalar", _scalar(db))]


LAYOUTS = [[Replicate()], [Shard(0)]]


@pytest.mark.parametrize("op", sorted(OPS))
def test_dtype_pairs_follow_torch(op):
    """Every dtype pair, the other operand n-d, 0-d or a scalar, on either side, replicated and sharded."""
    refused = 0
    for da, db in itertools.product(DTYPES, DTYPES):
        if op in ("where", "clamp") and (da == torch.bool or db == torch.bool) and da != db:
            continue  # (torch.clamp has no bool kernel; where's bool pairs are covered by the bool row)
        a = _nd(da)
        for form, b in _forms(db):
            for pl in LAYOUTS:
                refused += _check_pair(op, a, b, pl) is not None
                if form != "scalar" and op not in ("where", "clamp"):
                    refused += _check_pair(op, b, a, pl) is not None
    assert refused < 200  # the sweep mostly runs: torch refuses only a few pairs (bool arithmetic, ...)


def test_issue_cases():
    # the reported cases, spelled as users wrote them
    x16 = torch.randn(4, 6, dtype=torch.float16)
    lo, hi = torch.tensor(0.0), torch.tensor(0.5)
    X, LO, HI = dtorch.Tensor(x16), dtorch.Tensor(lo), dtorch.Tensor(hi)
    for got, exp in [(dtorch.clamp(X, LO, HI), torch.clamp(x16, lo, hi)), (X + LO, x16 + lo),
                     (dtorch.maximum(X, LO), torch.maximum(x16, lo)),
                     (dtorch.where(X > 0, X, HI), torch.where(x16 > 0, x16, hi))]:
        assert got.dtype == got.to_torch().dtype == exp.dtype == torch.float16
        assert torch.equal(got.to_torch(), exp)
    i32 = torch.arange(7, dtype=torch.int32)
    got = dtorch.Tensor(i32, device_mesh=MESH, placements=[Shard(0)]) * dtorch.Tensor(torch.tensor(3), device_mesh=MESH)
    assert got.dtype == got.to_torch().dtype == torch.int32 and torch.equal(got.to_torch(), i32 * torch.tensor(3))
    bf = torch.randn(7, 5, dtype=torch.bfloat16)
    s = torch.tensor(1.3)
    got = dtorch.Tensor(bf, device_mesh=MESH, placements=[Shard(0)]) * dtorch.Tensor(s, device_mesh=MESH)
    assert got.dtype == got.to_torch().dtype == torch.bfloat16
    assert torch.equal(got.to_torch(), bf * s)


def test_zero_d_operand_of_each_layout():
    """A 0-d operand that differs per device (Partial terms) and n-d operands sharded on a 2-D mesh: the
    call runs per device with the 0-d block as a 0-d tensor."""
    x = torch.randn(5, 6, dtype=torch.float16)
    s = torch.tensor(0.3)
    terms = [torch.tensor(0.1), torch.tensor(0.2)]  # reduces to 0.3 (in float32)
    P = dtorch.Tensor.from_blocks(terms * 2, device_mesh=MESH_2D, placements=[Replicate(), dtorch.Partial()],
                                  shape=())
    for pl in ([Shard(0), Shard(1)], [Replicate(), Shard(1)], [Shard(1), Replicate()]):
        X = dtorch.Tensor(x, device_mesh=MESH_2D, placements=pl)
        for got, exp in ((X * P, x * s), (X + P, x + s)):  # both keep P: each device uses its own term
            assert got.dtype == got.to_torch().dtype == torch.float16
            torch.testing.assert_close(got.to_torch(), exp, rtol=2e-3, atol=2e-3)
        got = X * P.redistribute(placements=[Replicate(), Replicate()])
        assert got.dtype == got.to_torch().dtype == torch.float16 and torch.equal(got.to_torch(), x * s)


def test_zero_d_in_place_and_grad():
    x = torch.randn(5, 3, dtype=torch.float16)
    X = dtorch.Tensor(x, device_mesh=MESH, placements=[Shard(0)])
    X.add_(dtorch.Tensor(torch.tensor(0.1), device_mesh=MESH))
    assert X.dtype == X.to_torch().dtype == torch.float16 and torch.equal(X.to_torch(), x.add_(torch.tensor(0.1)))
    # gradients reach both the n-d operand and the 0-d one (float64: no rounding in the comparison)
    a = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    s = torch.tensor(0.7, requires_grad=True)
    (a * s).sum().backward()
    A = dtorch.Tensor(a.detach(), device_mesh=MESH, placements=[Shard(0)]).requires_grad_()
    S = dtorch.Tensor(s.detach(), device_mesh=MESH).requires_grad_()
    out = A * S
    assert out.dtype == torch.float64
    out.sum().backward()
    torch.testing.assert_close(A.grad.to_torch(), a.grad)
    torch.testing.assert_close(S.grad.to_torch(), s.grad)
