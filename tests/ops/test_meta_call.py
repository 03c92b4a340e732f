"""Output specs without torch's Python meta kernels (rules.meta_call with a known output shape).

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
from dtorch.ops import attention, cat, matrix, pointwise, reduce, view, whole_dim
from dtorch.ops import nn as nn_ops
from dtorch.ops.rules import meta_call
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
    f = pointwise.TORCH_FNS[fn]  # (resolved when the op registered)
    call = (lambda x: f(x, torch.float16)) if name == "to" else f
    for dtype in DTYPES:
        for shape in UNARY_SHAPES:
            specs = (_spec(shape, dtype),)
            assert _outcome(call, specs, out_shape="broadcast") == _torch(call, specs), (name, dtype, shape)


@pytest.mark.parametrize("name, fn", pointwise._BINARY, ids=str)
def test_binary_element_wise_matches_torch(name, fn):
    f = pointwise.TORCH_FNS[fn]  # (resolved when the op registered)
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
            want = _torch(lambda x: whole_dim._run_scan(op, x, dim - len(shape), len(shape), out_dtype), (s,))
            got = _plan_outcome(whole_dim._scan_rule, (s,), op, dim, out_dtype)
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


# -- cat / stack / repeat / norms / embedding / attention, and a whole first Llama forward ----------

def test_first_llama_forward_does_not_import_dynamo_or_sympy():
    """A small Llama's first forwards (tensor parallel; grouped-query attention with fewer kv heads than
    tp devices; pipeline stages with Ulysses and Ring context parallel) plan every op without torch's
    slow first meta call. The config is a namespace: importing transformers is not what is checked."""
    code = textwrap.dedent("""
        import sys, types
        import torch
        import dtorch
        from dtorch.models.llama import LlamaForCausalLM
        def config(heads, kv_heads, hidden):
            return types.SimpleNamespace(hidden_size=hidden, intermediate_size=176, num_hidden_layers=2,
                                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=160,
                                         max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                                         attention_bias=False, mlp_bias=False, hidden_act="silu",
                                         tie_word_embeddings=False)
        for cfg, dims, seq in [(config(4, 4, 64), (("tp", 2),), 7),
                               (config(8, 2, 128), (("tp", 4),), 5),
                               (config(4, 2, 64), (("pp", 2), ("ulysess_cp", 2), ("ring_cp", 2)), 10)]:
            mesh = dtorch.init_device_mesh("cpu", [n for _, n in dims], mesh_dim_names=[d for d, _ in dims])
            logits = LlamaForCausalLM(cfg, mesh)(torch.randint(0, 160, (3, seq)))
            assert tuple(logits.shape) == (3, seq, 160), logits.shape
        print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_masked_ring_attention_and_broadcasting_copy_do_not_import_sympy():
    """Two spots that called torch.broadcast_shapes (its first call imports sympy): the ring attention
    kernel picking mask rows per device, and x.copy_(src) checking that src broadcasts."""
    code = textwrap.dedent("""
        import sys
        import torch
        import dtorch
        mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["ring_cp"])
        q, k, v = (dtorch.Tensor(torch.randn(1, 2, 6, 4), device_mesh=mesh, placements=[dtorch.Shard(2)])
                   for _ in range(3))
        mask = torch.ones(6, 6, dtype=torch.bool).tril()
        dtorch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).to_torch()
        x = dtorch.Tensor(torch.zeros(3, 4), device_mesh=mesh)
        x.copy_(torch.ones(4))
        x.to_torch()
        print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


PROMOTIONS = [(torch.float32, torch.float32), (torch.float32, torch.float64), (torch.int64, torch.bool),
              (torch.int32, torch.float16), (torch.float16, torch.bfloat16), (torch.bool, torch.bool)]


@pytest.mark.parametrize("stack", [False, True], ids=["cat", "stack"])
def test_cat_stack_output_specs_match_torch(stack):
    f = torch.stack if stack else torch.cat
    shape_sets = [[(3, 4), (5, 4)], [(3, 4), (3, 7)], [(3, 4), (3, 4), (3, 4)], [(2, 0, 3), (2, 5, 3)], [(5,), (0,)],
                  [(0,), (0,)], [(3, 4), (3, 5)], [(3, 4), (3,)], [(), ()], [(2, 3)], [(1, 3, 1), (1, 3, 1)]]
    for da, db in PROMOTIONS:
        for shapes in shape_sets:
            for dim in range(-len(shapes[0]) - 2, len(shapes[0]) + 2):  # (out of range too)
                specs = tuple(_spec(s, d) for s, d in zip(shapes, [da, db] + [da] * len(shapes)))
                want = _torch(lambda *ts: f(ts, dim), specs)
                assert _plan_outcome(cat._cat_rule, specs, dim, stack) == want, (da, db, shapes, dim)


def test_cat_legacy_empty_input_still_promotes():
    """torch.cat skips 1-D empty tensors next to higher-rank ones, yet their dtype still takes part in the
    type promotion (float32 with an empty float64 gives float64)."""
    x = torch.randn(3, 4)
    for empty in (torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.int64)):
        for order in ((empty, x), (x, empty)):
            want = torch.cat(order, 1)
            got = dtorch.cat([t if t is empty else dtorch.Tensor(t, device_mesh=MESH) for t in order], 1).to_torch()
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_repeat_output_specs_match_torch():
    for dtype in (torch.float32, torch.bool, torch.int32):
        for shape, reps in [((3, 4), (2, 1)), ((3, 4), (2, 1, 3)), ((), (2,)), ((), ()), ((0, 3), (2, 2)),
                            ((3, 4), (0, 1)), ((3, 4), (2,)), ((3, 4), (-1, 2)), ((3,), (2, -1))]:
            specs = (_spec(shape, dtype),)
            want = _torch(lambda t: t.repeat(reps), specs)
            assert _plan_outcome(view._repeat_rule, specs, reps) == want, (dtype, shape, reps)


# (x shape, normalized_shape, weight/bias shape): torch refuses the last four (the last one only with a weight)
NORM_SHAPES = [((2, 3, 5), (5,), (5,)), ((2, 3, 5), (3, 5), (3, 5)), ((4,), (4,), (4,)), ((3, 0, 2), (2,), (2,)),
               ((2, 3, 5), (3,), (3,)), ((2, 3, 5), (2, 3, 5, 1), (2, 3, 5, 1)), ((2, 3), (), ()),
               ((2, 3, 5), (5,), (4,))]
NORM_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
               (torch.float16, torch.float32), (torch.float64, torch.float64), (torch.float32, torch.float64),
               (torch.int64, torch.int64)]


@pytest.mark.parametrize("has_weight, has_bias", [(False, False), (True, False), (True, True)])
def test_layer_norm_output_specs_match_torch(has_weight, has_bias):
    for dx, dw in NORM_DTYPES:
        for shape, ns, wshape in NORM_SHAPES:
            specs = (_spec(shape, dx),) + (_spec(wshape, dw),) * (has_weight + has_bias)

            def f(x, *wb):
                return torch.nn.functional.layer_norm(x, ns, wb[0] if has_weight else None,
                                                      wb[-1] if has_bias else None)

            want = _torch(f, specs)
            assert _plan_outcome(nn_ops._layer_norm_rule, specs, ns, 1e-5, has_weight, has_bias) == want, (
                dx, dw, shape, ns)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own warning (bf16 x, f32 w)
@pytest.mark.parametrize("has_weight", [False, True])
def test_rms_norm_output_specs_match_torch(has_weight):
    for dx, dw in NORM_DTYPES:
        for shape, ns, wshape in NORM_SHAPES:
            specs = (_spec(shape, dx),) + (_spec(wshape, dw),) * has_weight
            want = _torch(lambda x, *w: torch.nn.functional.rms_norm(x, ns, *w), specs)
            assert _plan_outcome(nn_ops._rms_norm_rule, specs, ns, 1e-6) == want, (dx, dw, shape, ns, wshape)


def test_embedding_output_specs_match_torch():
    for dids in (torch.int32, torch.int64):
        for dw in (torch.float32, torch.bfloat16, torch.float64):
            for ids_shape in [(), (5,), (2, 3), (0, 4)]:
                specs = (_spec(ids_shape, dids), _spec((7, 3), dw))
                want = _torch(torch.nn.functional.embedding, specs)
                assert _plan_outcome(nn_ops._embedding_rule, specs, None) == want, (dids, dw, ids_shape)


def test_attention_output_specs_match_torch():
    cases = [((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 3), None, False),  # S != L, Ev != E
             ((1, 8, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), None, True),  # grouped-query heads
             ((2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8), (5, 5), False),
             ((2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 8), (2, 1, 5, 6), False)]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for mask_dtype in (torch.bool, dtype):
            for q, k, v, m, gqa in cases:
                for causal in ((False, True) if m is None else (False,)):
                    shapes = (q, k, v) + ((m,) if m else ())
                    specs = tuple(_spec(s, mask_dtype if n == 3 else dtype) for n, s in enumerate(shapes))

                    def f(q, k, v, *mask):
                        return torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, *mask, is_causal=causal, scale=0.5, enable_gqa=gqa)

                    got = _plan_outcome(attention._plain_rule, specs, m is not None, False, causal, 0.5, gqa)
                    assert got == _torch(f, specs), (dtype, mask_dtype, q, k, v, m, causal)
