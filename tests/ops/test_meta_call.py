"""Output specs without torch's Python meta kernels (registry.meta_call with a known output shape).

The first call of most of torch's meta kernels imports torch._dynamo and sympy (seconds); element-wise
ops, reductions, scans and matmul-like ops get their output shapes from their own shape rule and their
dtypes from small real tensors instead. These tests check that the first ops stay clear of those
imports and that the output specs are what torch gives on real tensors of the same shapes.
"""
import subprocess
import sys
import textwrap

import pytest
import torch

import dtorch
from dtorch.ops import matrix, pointwise, reduce
from dtorch.ops.registry import meta_call
from dtorch.spec import DTensorSpec

MESH = dtorch.init_device_mesh("cpu", (1,))


def test_first_ops_do_not_import_dynamo_or_sympy():
    code = textwrap.dedent("""
        import sys
        import dtorch
        x = dtorch.randn(8, 8)
        outs = [(x + 1), x * 2, x @ x, dtorch.softmax(x, -1), x.sum(), x.mean(0), x.amax(1), dtorch.cumsum(x, 0),
                x.var(0), dtorch.log_softmax(x, -1), x.exp(), (x > 0).any(), dtorch.matmul(x, x[0])]
        for o in outs:
            o.to_torch()
        print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def _spec(shape, dtype):
    return DTensorSpec(MESH, (dtorch.Replicate(),), tuple(shape), dtype)


def _outcome(fn, specs, **kw):
    """meta_call's (shape, dtype) of each output, or the exception type."""
    try:
        out = meta_call(fn, specs, **kw)
    except Exception as exc:  # noqa: BLE001
        return type(exc)
    assert all(o.device.type == "meta" for o in (out if isinstance(out, tuple) else (out,)))
    return _shapes(out)


def _torch(fn, specs):
    """The reference: what torch gives on real CPU tensors of these shapes. Where that fails (an op or
    dtype the CPU lacks, which another device may have), the meta tensors' answer, as before."""
    try:
        return _shapes(fn(*[torch.ones(s.shape, dtype=s.dtype) for s in specs]))
    except Exception:  # noqa: BLE001
        return _outcome(fn, specs)


def _shapes(out):
    return [(tuple(o.shape), o.dtype) for o in (out if isinstance(out, tuple) else (out,))]


DTYPES = [torch.float32, torch.float16, torch.int64, torch.bool]
UNARY_SHAPES = [(), (0,), (3, 1, 4)]
BINARY_SHAPES = [((3, 1), (1, 4)), ((), (2, 3)), ((0, 3), (1, 3)), ((2, 3), (3,)), ((3,), (4,))]


@pytest.mark.parametrize("name, fn", [(n, f) for n, f, _ in pointwise._UNARY] + [("to", "Tensor.to")], ids=str)
def test_unary_element_wise_matches_torch(name, fn):
    f = pointwise.resolve_torch(fn)
    call = (lambda x: f(x, torch.float16)) if name == "to" else f
    for dtype in DTYPES:
        for shape in UNARY_SHAPES:
            specs = (_spec(shape, dtype),)
            assert _outcome(call, specs, out_shape="broadcast") == _torch(call, specs), (name, dtype, shape)


@pytest.mark.parametrize("name, fn", pointwise._BINARY, ids=str)
def test_binary_element_wise_matches_torch(name, fn):
    f = pointwise.resolve_torch(fn)
    for da, db in [(torch.float32, torch.float32), (torch.int64, torch.float16), (torch.bool, torch.int64),
                   (torch.int64, torch.int64), (torch.float16, torch.float32)]:
        for sa, sb in BINARY_SHAPES:
            specs = (_spec(sa, da), _spec(sb, db))
            assert _outcome(f, specs, out_shape="broadcast") == _torch(f, specs), (name, da, db, sa, sb)
        for scalar in (2, 2.5, True):  # Python scalars promote differently from tensors
            specs = (_spec((2, 3), da),)
            g = lambda x: f(x, scalar)  # noqa: E731
            assert _outcome(g, specs, out_shape="broadcast") == _torch(g, specs), (name, da, scalar)


def test_where_masked_fill_addcmul_match_torch():
    cases = [
        (lambda c, a, b: torch.where(c, a, b), [((3, 1), torch.bool), ((1, 4), torch.int64), ((), torch.float32)]),
        (lambda c, a: torch.where(c, a, 0.5), [((3, 4), torch.bool), ((4,), torch.int64)]),
        (lambda a, m: torch.masked_fill(a, m, 1.0), [((1, 3), torch.float16), ((2, 3), torch.bool)]),
        (lambda a, m: torch.masked_fill(a, m, 1.0), [((2, 3), torch.float16), ((2, 3), torch.float32)]),  # bad mask
        (lambda a, b, c: torch.addcmul(a, b, c, value=2), [((3,), torch.float32), ((2, 1), torch.float32), ((), torch.float64)]),
    ]
    for fn, args in cases:
        specs = tuple(_spec(s, d) for s, d in args)
        assert _outcome(fn, specs, out_shape="broadcast") == _torch(fn, specs), args


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")  # var/std of one element: torch warns too
@pytest.mark.parametrize("op, kw", [("sum", ()), ("sum", (("dtype", torch.float64),)), ("mean", ()), ("amax", ()),
                                    ("amin", ()), ("all", ()), ("any", ()), ("prod", ()), ("argmax", ()), ("max_dim", ()),
                                    ("logsumexp", ()), ("var", (("correction", 1),)), ("std", (("correction", 0),)),
                                    ("norm", (("ord", 2),)), ("powsum", (("ord", 3),)), ("absmax", ())], ids=str)
def test_reduction_output_specs_match_torch(op, kw):
    for dtype in (torch.float32, torch.int64, torch.bool):
        for shape, dims in [((), ()), ((5,), (0,)), ((4, 1, 6), (2,)), ((4, 0, 6), (0,)), ((3, 4, 5), (0, 2)), ((2, 3), (0, 1))]:
            if op in ("argmax", "max_dim", "prod") and len(dims) > 1:
                continue  # single-dim ops (the front end takes one dim)
            for keepdim in (False, True):
                s = _spec(shape, dtype)
                neg = tuple(d - len(shape) for d in dims)
                want = _torch(lambda x: reduce._run(op, x, neg, keepdim, len(shape), dict(kw)), (s,))
                got = _plan_outcome(reduce._reduce_rule, (s,), op, dims, keepdim, kw)
                assert got == want, (op, dtype, shape, dims, keepdim)


@pytest.mark.parametrize("op", ["cumsum", "softmax", "log_softmax"])
def test_scan_output_specs_match_torch(op):
    for dtype in (torch.float32, torch.int64, torch.bool):
        for shape, dim, out_dtype in [((), 0, None), ((4, 5), 1, None), ((4, 5), 0, torch.float64), ((0, 3), 0, None)]:
            s = _spec(shape, dtype)
            want = _torch(lambda x: reduce._run_scan(op, x, dim - len(shape), len(shape), out_dtype), (s,))
            got = _plan_outcome(reduce._scan_rule, (s,), op, dim, out_dtype)
            assert got == want, (op, dtype, shape, dim, out_dtype)


def _plan_outcome(rule, *args):
    try:
        plan = rule(*args)
    except Exception as exc:  # noqa: BLE001
        return type(exc)
    return [(o.shape, o.dtype) for o in plan.out_specs]


@pytest.mark.parametrize("sa, sb", [((4, 3), (3, 5)), ((3,), (3,)), ((3,), (3, 5)), ((2, 4, 3), (3,)),
                                    ((2, 1, 4, 3), (5, 3, 2)), ((4, 3), (4, 5)), ((2, 4, 3), (3, 3, 5)),
                                    ((4, 1), (3, 5)), ((1, 3), (1, 3)), ((0, 3), (3, 2))], ids=str)
def test_matmul_linear_outer_einsum_output_specs_match_torch(sa, sb):
    for da, db in [(torch.float32, torch.float32), (torch.float64, torch.float64), (torch.float32, torch.float64)]:
        specs = (_spec(sa, da), _spec(sb, db))
        assert _plan_outcome(matrix._matmul_rule, specs, "matmul") == _torch(torch.matmul, specs), (sa, sb, da, db)
        if len(sb) == 2:  # dtorch's linear takes [out_features, in_features] weights only
            assert _plan_outcome(matrix._linear_rule, specs) == _torch(torch.nn.functional.linear, specs), (sa, sb)
        if len(sa) == len(sb) == 2:
            eq = "ij,jk->ik"
            assert _plan_outcome(matrix._einsum_rule, specs, eq) == _torch(lambda a, b: torch.einsum(eq, a, b), specs)
        if len(sa) == len(sb) == 1:
            assert _plan_outcome(matrix._outer_rule, specs) == _torch(torch.outer, specs), (sa, sb)
