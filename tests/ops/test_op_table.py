"""Every op in the op table is swept: the table is enumerated, so an op added without samples here
fails ``test_op_matches_torch`` by name.

``SAMPLES`` maps each op name to cases (OpInfo style): a function making fresh torch arguments, the
torch reference (default: the op's first torch function) and a few knobs. Each case runs on a 1-D
mesh of 3 devices (replicated, sharded on the first dim, sharded on the last dim, partial) and on a
2x2 mesh (sharded on the first and last dims), its tensor arguments laid out so, and is compared
with torch on one device. Shapes are uneven on purpose (5 rows on 3 or 2 devices).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.ops.table import TABLE, TORCH_FUNCTIONS
from sweep import MESH_1D, MESH_2D, check, distribute


@dataclass
class Case:
    make: Callable  # () -> (args, kwargs) of fresh torch values (tensors may sit inside lists)
    ref: Callable | None = None  # the torch function; default: the op's first torch function
    partial: bool = True  # also lay float inputs out as Partial(sum) (off where terms would change the meaning)
    values: bool = True  # compare values (off for empty: torch leaves them undefined)
    factory: bool = False  # no tensor input: dtorch gets device_mesh= and placements= for its output
    tol: dict = field(default_factory=dict)
    inplace: bool = False  # writes into its first argument: the result must be that very object, its layout kept


def _gen():
    return torch.Generator().manual_seed(0)


def f(*shape):
    return torch.randn(shape, generator=_gen())


def g(*shape):  # another float tensor (other values)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))


def pos(*shape):
    return torch.rand(shape, generator=_gen()) + 0.5


def unit(*shape):
    return torch.rand(shape, generator=_gen()) * 1.8 - 0.9


def ints(*shape, lo=-6, hi=7):
    return torch.randint(lo, hi, shape, generator=_gen())


def nonzero_ints(*shape):
    x = ints(*shape, lo=1, hi=7)
    return torch.where(ints(*shape, lo=0, hi=2) == 0, -x, x)


def bools(*shape, seed=0):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) > 0.5


def special(*shape):
    x = f(*shape)
    x[0, 0], x[1, 1], x[2, 2] = float("nan"), float("inf"), -float("inf")
    return x


def c(*args, **kwargs):
    return lambda: (args, kwargs)


def one(make_x, *rest, **kwargs):
    """Case maker: a fresh tensor from ``make_x`` followed by constant arguments."""
    return lambda: ((make_x(),) + rest, kwargs)


X = lambda: f(5, 6)  # noqa: E731


def _unary(x=X, **kw):
    return [Case(one(x), **kw)]


def _binary(a=X, b=lambda: g(5, 6), scalar=None, scalar_first=False, **kw):
    """tensor op tensor, tensor op scalar, and scalar op tensor where torch's function takes it."""
    out = [Case(lambda: ((a(), b()), {}), **kw)]
    if scalar is not None:
        out.append(Case(lambda: ((a(), scalar), {}), **kw))
    if scalar_first:
        out.append(Case(lambda: ((scalar, b()), {}), **kw))
    return out


SAMPLES: dict[str, list[Case]] = {}

# -- factories ----------------------------------------------------------------------------------------
for _n in ("zeros", "ones", "empty"):
    SAMPLES[_n] = [Case(c(5, 6), factory=True, values=_n != "empty"), Case(c((5, 6), dtype=torch.float64),
                                                                            factory=True, values=_n != "empty")]
SAMPLES["rand"] = [Case(lambda: ((5, 6), {"generator": _gen()}), factory=True)]
SAMPLES["randn"] = [Case(lambda: ((5, 6), {"generator": _gen()}), factory=True)]
SAMPLES["full"] = [Case(c((5, 6), 2.5), factory=True), Case(c((5, 6), 3), factory=True)]
SAMPLES["randint"] = [Case(lambda: ((0, 10, (5, 6)), {"generator": _gen()}), factory=True)]
SAMPLES["arange"] = [Case(c(7), factory=True), Case(c(0.0, 2.5, 0.5), factory=True)]
SAMPLES["tensor"] = [Case(c([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), ref=torch.tensor, factory=True)]
SAMPLES["from_torch"] = [Case(one(X), ref=lambda x: x.clone(), factory=True)]
for _n in ("zeros_like", "ones_like", "rand_like", "randn_like"):
    SAMPLES[_n] = [Case(one(X))]
SAMPLES["empty_like"] = [Case(one(X), values=False)]
SAMPLES["full_like"] = [Case(one(X, 2.5))]
SAMPLES["randint_like"] = [Case(one(X, 10))]

# -- element-wise -------------------------------------------------------------------------------------
for _n in ("abs", "neg", "positive", "exp", "exp2", "expm1", "square", "sin", "cos", "tan", "atan", "sinh", "cosh",
           "tanh", "sigmoid", "erf", "floor", "ceil", "trunc", "frac", "sign", "relu", "silu", "mish",
           "logsigmoid", "relu6", "hardswish", "hardsigmoid", "selu"):
    SAMPLES[_n] = _unary()
for _n in ("log", "log2", "log10", "log1p", "sqrt", "rsqrt", "reciprocal"):
    SAMPLES[_n] = _unary(pos)
for _n in ("asin", "acos", "erfinv"):
    SAMPLES[_n] = _unary(unit, tol={"rtol": 1e-3, "atol": 1e-4})
SAMPLES["round"] = _unary() + [Case(one(X, decimals=1))]
SAMPLES["logical_not"] = _unary(lambda: bools(5, 6))
SAMPLES["bitwise_not"] = _unary(lambda: ints(5, 6))
for _n in ("isnan", "isinf", "isfinite"):
    SAMPLES[_n] = _unary(lambda: special(5, 6), partial=False)
SAMPLES["nan_to_num"] = [Case(one(lambda: special(5, 6), nan=0.5, posinf=9.0, neginf=-9.0), partial=False)]
SAMPLES["clamp"] = [Case(one(X, -0.5, 0.5)), Case(one(X, min=0.0))]
SAMPLES["clip"] = [Case(one(X, -0.3, 0.8))]
SAMPLES["gelu"] = _unary() + [Case(one(X, approximate="tanh"))]
SAMPLES["softplus"] = _unary() + [Case(one(X, beta=2.0, threshold=1.0))]
SAMPLES["elu"] = _unary() + [Case(one(X, alpha=0.5))]
SAMPLES["leaky_relu"] = _unary() + [Case(one(X, 0.2))]
SAMPLES["hardtanh"] = _unary() + [Case(one(X, -0.5, 0.5))]

for _n in ("add", "sub", "mul", "maximum", "minimum", "atan2", "hypot", "copysign", "eq", "ne", "lt", "le", "gt",
           "ge"):
    SAMPLES[_n] = _binary(scalar=None if _n in ("maximum", "minimum", "atan2", "hypot") else 0.25)
SAMPLES["add"].append(Case(lambda: ((f(5, 6), g(6)), {"alpha": 2})))  # broadcast, keyword scalar
for _n in ("div", "true_divide"):
    SAMPLES[_n] = _binary(b=lambda: pos(5, 6), scalar=1.5)
SAMPLES["div"].append(Case(lambda: ((f(5, 6), pos(5, 6)), {"rounding_mode": "floor"})))
for _n in ("floor_divide", "remainder", "fmod"):
    SAMPLES[_n] = _binary(b=lambda: pos(5, 6), scalar=0.7) + [
        Case(lambda: ((ints(5, 6), nonzero_ints(5, 6)), {})), Case(lambda: ((ints(5, 6), 3), {}))]
SAMPLES["pow"] = _binary(a=lambda: pos(5, 6), b=lambda: g(5, 6), scalar=2, scalar_first=True) + [
    Case(lambda: ((ints(5, 6), 2), {}))]
for _n in ("logical_and", "logical_or", "logical_xor"):
    SAMPLES[_n] = [Case(lambda: ((bools(5, 6), bools(5, 6, seed=1)), {}))]
for _n in ("bitwise_and", "bitwise_or", "bitwise_xor"):
    SAMPLES[_n] = [Case(lambda: ((ints(5, 6), ints(5, 6, lo=0, hi=9)), {})), Case(lambda: ((ints(5, 6), 5), {}))]
SAMPLES["lerp"] = [Case(lambda: ((f(5, 6), g(5, 6), 0.3), {})), Case(lambda: ((f(5, 6), g(5, 6), unit(5, 6)), {}))]
SAMPLES["xlogy"] = [Case(lambda: ((f(5, 6), pos(5, 6)), {})), Case(lambda: ((2.0, pos(5, 6)), {}))]
SAMPLES["where"] = [Case(lambda: ((bools(5, 6), f(5, 6), g(5, 6)), {})), Case(lambda: ((bools(5, 6), f(5, 6), 0.0), {}))]
SAMPLES["masked_fill"] = [Case(lambda: ((f(5, 6), bools(5, 6), -1.5), {}))]
SAMPLES["addcmul"] = [Case(lambda: ((f(5, 6), g(5, 6), unit(5, 6)), {"value": 0.5}))]
SAMPLES["clone"] = _unary()
SAMPLES["detach"] = _unary()
SAMPLES["to_dtype"] = [Case(one(X, torch.float64), ref=lambda x, dt: x.to(dt)),
                       Case(one(lambda: ints(5, 6), torch.float32), ref=lambda x, dt: x.to(dt))]

# -- shapes and views ---------------------------------------------------------------------------------
SAMPLES["view"] = [Case(one(lambda: f(4, 6), 2, 12), ref=torch.Tensor.view),
                   Case(one(lambda: f(4, 6), (4, 2, 3)), ref=torch.Tensor.view)]
SAMPLES["reshape"] = [Case(one(X, (3, 10))), Case(one(lambda: f(2, 3, 4), (-1, 4)))]
SAMPLES["flatten"] = [Case(one(lambda: f(2, 3, 4), 1))]
SAMPLES["unflatten"] = [Case(one(lambda: f(4, 6), 1, (2, 3)))]
SAMPLES["squeeze"] = [Case(one(lambda: f(5, 1, 6), 1)), Case(one(lambda: f(5, 1, 6)))]
SAMPLES["unsqueeze"] = [Case(one(X, 1))]
SAMPLES["transpose"] = [Case(one(X, 0, 1)), Case(one(lambda: f(2, 3, 4), -1, 0))]
SAMPLES["t"] = [Case(one(X))]
SAMPLES["permute"] = [Case(one(lambda: f(2, 3, 4), (2, 0, 1)))]
SAMPLES["movedim"] = [Case(one(lambda: f(2, 3, 4), 0, 2))]
SAMPLES["expand"] = [Case(one(lambda: f(1, 6), 5, 6), ref=torch.Tensor.expand)]
SAMPLES["broadcast_to"] = [Case(one(lambda: f(6), (5, 6)))]
SAMPLES["repeat"] = [Case(one(X, 2, 1), ref=torch.Tensor.repeat)]
SAMPLES["repeat_interleave"] = [Case(one(X, 2, 0)), Case(one(X, 2))]
SAMPLES["narrow"] = [Case(one(X, 1, 1, 3))]
SAMPLES["getitem"] = [Case(one(X, (slice(1, 4), 2)), ref=operator.getitem),
                      Case(one(X, (None, Ellipsis, slice(0, 6, 2))), ref=operator.getitem)]
SAMPLES["chunk"] = [Case(one(X, 3, 1))]
SAMPLES["split"] = [Case(one(X, 2, 0)), Case(one(X, [1, 5], 1))]
SAMPLES["tensor_split"] = [Case(one(X, 3, 1))]
SAMPLES["unbind"] = [Case(one(X, 1))]
for _n in ("cat", "concat", "concatenate"):
    SAMPLES[_n] = [Case(lambda: (([f(5, 6), g(3, 6)], 0), {})), Case(lambda: (([f(5, 6), g(5, 2)], 1), {}))]
SAMPLES["stack"] = [Case(lambda: (([f(5, 6), g(5, 6)], 1), {}))]
SAMPLES["select"] = [Case(one(X, 1, -2)), Case(one(lambda: f(2, 3, 4), 0, 1))]
SAMPLES["diagonal"] = [Case(one(X)), Case(one(X, 1)), Case(one(lambda: f(2, 5, 4), -1, 2, 1))]
SAMPLES["data"] = [Case(one(X), ref=lambda x: x.data)]
SAMPLES["tril"] = [Case(one(X, 1))]
SAMPLES["triu"] = [Case(one(X, -1))]

# -- reductions, scans --------------------------------------------------------------------------------
for _n in ("sum", "mean", "amax", "amin", "logsumexp"):
    SAMPLES[_n] = [Case(one(X, 1)), Case(one(X, (0, 1), keepdim=True))]
SAMPLES["sum"].append(Case(one(X)))
for _n in ("max", "min"):
    SAMPLES[_n] = [Case(one(X)), Case(one(X, 1)), Case(lambda: ((f(5, 6), g(5, 6)), {}))]
for _n in ("argmax", "argmin"):
    SAMPLES[_n] = [Case(one(X, 0)), Case(one(X))]
SAMPLES["prod"] = [Case(one(lambda: unit(5, 6), 1))]
for _n in ("all", "any"):
    SAMPLES[_n] = [Case(one(lambda: bools(5, 6))), Case(one(lambda: bools(5, 6), 1))]
SAMPLES["norm"] = [Case(one(X)), Case(one(X, 1, 1)), Case(one(X, float("inf"), 0))]
for _n in ("var", "std"):
    SAMPLES[_n] = [Case(one(X, 1)), Case(one(X, 0, correction=0))]
for _n in ("cumsum", "softmax", "log_softmax"):
    SAMPLES[_n] = [Case(one(X, 1)), Case(one(X, 0))]

# -- matrix, nn ---------------------------------------------------------------------------------------
SAMPLES["matmul"] = [Case(lambda: ((f(5, 6), g(6, 4)), {})), Case(lambda: ((f(2, 5, 6), g(6)), {}))]
SAMPLES["mm"] = [Case(lambda: ((f(5, 6), g(6, 4)), {}))]
SAMPLES["bmm"] = [Case(lambda: ((f(2, 3, 4), g(2, 4, 5)), {}))]
SAMPLES["dot"] = [Case(lambda: ((f(6), g(6)), {}))]
SAMPLES["outer"] = [Case(lambda: ((f(5), g(4)), {}))]
SAMPLES["linear"] = [Case(lambda: ((f(5, 6), g(4, 6), g(4)), {})), Case(lambda: ((f(2, 5, 6), g(4, 6)), {}))]
SAMPLES["einsum"] = [Case(lambda: (("ij,jk->ik", f(5, 6), g(6, 4)), {}))]
SAMPLES["embedding"] = [Case(lambda: ((ints(4, 5, lo=0, hi=10), f(10, 6)), {}))]
SAMPLES["layer_norm"] = [Case(lambda: ((f(5, 6), (6,), g(6), pos(6)), {})), Case(lambda: ((f(5, 6), (6,)), {}))]
SAMPLES["rms_norm"] = [Case(lambda: ((f(5, 6), (6,), g(6)), {"eps": 1e-6}))]
# the same seed before torch's run and dtorch's: the same dropout mask
SAMPLES["dropout"] = [Case(one(X, 0.4, True)), Case(one(X, 0.4, False))]
SAMPLES["scaled_dot_product_attention"] = [
    Case(lambda: ((f(2, 4, 5, 6), g(2, 4, 5, 6), pos(2, 4, 5, 6)), {}), tol={"rtol": 1e-4, "atol": 1e-4}),
    Case(lambda: ((f(2, 4, 5, 6), g(2, 4, 3, 6), pos(2, 4, 3, 6)), {"is_causal": True}), tol={"rtol": 1e-4, "atol": 1e-4}),
]
# (deeper sweeps with gradients: tests/ops/test_loss.py)
SAMPLES["cross_entropy"] = [Case(lambda: ((f(5, 6), ints(5, lo=0, hi=6)), {})),
                            Case(lambda: ((f(5, 6), ints(5, lo=0, hi=6)), {"reduction": "none", "label_smoothing": 0.1,
                                                                           "ignore_index": 2}))]
SAMPLES["mse_loss"] = [Case(lambda: ((f(5, 6), g(5, 6)), {})), Case(lambda: ((f(5, 6), g(5, 6)), {"reduction": "sum"}))]

# -- CNN ops (ops/conv.py, pool.py, norm2d.py; deeper sweeps: tests/ops/test_conv.py, test_pool_norm.py) ----
_CNN_TOL = {"rtol": 1e-4, "atol": 1e-4}
SAMPLES["conv1d"] = [Case(lambda: ((f(3, 4, 7), g(5, 4, 3), g(5)), {"padding": 1}), tol=_CNN_TOL)]
SAMPLES["conv2d"] = [Case(lambda: ((f(3, 4, 7, 6), g(5, 4, 3, 3), g(5)), {"padding": 1}), tol=_CNN_TOL),
                     Case(lambda: ((f(3, 4, 7, 6), g(6, 2, 3, 3)), {"stride": 2, "groups": 2, "dilation": (1, 2)}),
                          tol=_CNN_TOL)]
SAMPLES["conv3d"] = [Case(lambda: ((f(2, 3, 5, 4, 6), g(4, 3, 3, 3, 3)), {"padding": "same"}), tol=_CNN_TOL)]
SAMPLES["conv_transpose1d"] = [Case(lambda: ((f(3, 4, 7), g(4, 5, 3), g(5)), {"stride": 2}), tol=_CNN_TOL)]
SAMPLES["conv_transpose2d"] = [Case(lambda: ((f(3, 4, 5, 6), g(4, 2, 3, 3), g(2)),
                                             {"stride": 2, "padding": 1, "output_padding": 1}), tol=_CNN_TOL)]
SAMPLES["max_pool1d"] = [Case(lambda: ((f(3, 4, 7), 3), {"stride": 2, "padding": 1}))]
SAMPLES["max_pool2d"] = [Case(lambda: ((f(3, 4, 7, 6), 3), {"stride": 2, "padding": 1})),
                         Case(lambda: ((f(3, 4, 7, 6), 2), {"ceil_mode": True}))]
SAMPLES["avg_pool1d"] = [Case(lambda: ((f(3, 4, 7), 3), {"stride": 2, "padding": 1}))]
SAMPLES["avg_pool2d"] = [Case(lambda: ((f(3, 4, 7, 6), 3), {"stride": 2, "padding": 1})),
                         Case(lambda: ((f(3, 4, 7, 6), 2), {"count_include_pad": False, "padding": 1}))]
SAMPLES["adaptive_avg_pool1d"] = [Case(lambda: ((f(3, 4, 7), 1), {})), Case(lambda: ((f(3, 4, 7), 3), {}))]
SAMPLES["adaptive_avg_pool2d"] = [Case(lambda: ((f(3, 4, 7, 6), 1), {})), Case(lambda: ((f(3, 4, 7, 6), (2, 3)), {}))]
SAMPLES["interpolate"] = [Case(lambda: ((f(3, 4, 5, 6),), {"scale_factor": 2, "mode": "bilinear", "align_corners": True})),
                          Case(lambda: ((f(3, 4, 5, 6),), {"size": (7, 4), "mode": "nearest"}))]
SAMPLES["pad"] = [Case(lambda: ((f(3, 4, 5, 6), (1, 2, 0, 1)), {"mode": mode}))
                  for mode in ("constant", "reflect", "replicate", "circular")] + [
                  Case(lambda: ((f(3, 4, 5, 6), (1, 1)), {"value": 2.5}))]
# (running statistics get no gradient in torch: the reference detaches them)
SAMPLES["batch_norm"] = [Case(lambda: ((f(5, 4, 3, 6), g(4), pos(4), g(4), pos(4)), {"training": False}), tol=_CNN_TOL,
                              ref=lambda x, rm, rv, *a, **k: F.batch_norm(x, rm.detach(), rv.detach(), *a, **k)),
                         Case(lambda: ((f(5, 4, 3, 6), None, None, g(4), pos(4)), {"training": True}), tol=_CNN_TOL)]
SAMPLES["group_norm"] = [Case(lambda: ((f(3, 4, 5, 6), 2, g(4), pos(4)), {}), tol=_CNN_TOL)]
SAMPLES["instance_norm"] = [Case(lambda: ((f(3, 4, 5, 6), None, None, g(4), pos(4)), {}), tol=_CNN_TOL)]

# -- advanced indexing, item assignment, gather/scatter (ops/index.py) ------------------------------------
def _setitem_ref(x, index, value):
    x[index] = value
    return x


def _unique_rows(rows, cols, n, seed=0):  # scatter's positions, unique per column (torch leaves duplicates open)
    return torch.argsort(torch.rand(n, cols, generator=torch.Generator().manual_seed(seed)), 0)[:rows]


SAMPLES["getitem"] += [Case(one(X, (torch.tensor([4, 0, 2]),)), ref=operator.getitem),
                       Case(one(X, (slice(None), [5, 1])), ref=operator.getitem),
                       Case(lambda: ((f(5, 6), bools(5, 6)), {}), ref=operator.getitem),
                       Case(one(X, (Ellipsis, 1, Ellipsis)), ref=operator.getitem),
                       Case(one(X, (slice(1, 5, 2), torch.tensor([[0], [5]]))), ref=operator.getitem)]
SAMPLES["setitem"] = [Case(one(X, (slice(1, 4), 2), 1.5), ref=_setitem_ref, inplace=True),
                      Case(lambda: ((f(5, 6), (slice(None), slice(0, 6, 2)), g(5, 3)), {}), ref=_setitem_ref, inplace=True),
                      Case(lambda: ((f(5, 6), (slice(None), slice(1, 3)), g(5, 2)), {}), ref=_setitem_ref, inplace=True),
                      Case(lambda: ((f(5, 6), (torch.tensor([4, 0]),), g(2, 6)), {}), ref=_setitem_ref, inplace=True),
                      Case(lambda: ((f(5, 6), bools(5, 6), 0.5), {}), ref=_setitem_ref, inplace=True),
                      Case(lambda: ((f(5, 6), (None, Ellipsis, 3), g(5)), {}), ref=_setitem_ref, inplace=True)]
SAMPLES["index_put"] = [Case(lambda: ((f(5, 6), (torch.tensor([4, 0, 4]),), g(3, 6)), {"accumulate": True})),
                        Case(lambda: ((f(5, 6), (torch.tensor([1, 3]), torch.tensor([0, 5])), g(2)), {}))]
SAMPLES["index_copy"] = [Case(lambda: ((f(5, 6), 1, torch.tensor([5, 0]), g(5, 2)), {})),
                         Case(lambda: ((f(5, 6), 0, torch.tensor([3]), g(1, 6)), {}))]
SAMPLES["gather"] = [Case(lambda: ((f(5, 6), 0, ints(3, 6, lo=0, hi=5)), {})),
                     Case(lambda: ((f(5, 6), 1, ints(5, 4, lo=0, hi=6)), {}))]
SAMPLES["scatter"] = [Case(lambda: ((f(5, 6), 0, _unique_rows(3, 6, 5), g(3, 6)), {})),
                      Case(lambda: ((f(5, 6), 1, _unique_rows(2, 5, 6).T.contiguous(), 2.5), {}))]
SAMPLES["scatter_add"] = [Case(lambda: ((f(5, 6), 0, ints(4, 6, lo=0, hi=5), g(4, 6)), {}))]
SAMPLES["scatter_reduce"] = [Case(lambda: ((f(5, 6), 0, ints(4, 6, lo=0, hi=5), g(4, 6), "amax"), {})),
                             Case(lambda: ((f(5, 6), 1, ints(5, 4, lo=0, hi=6), g(5, 4), "sum"), {"include_self": False})),
                             Case(lambda: ((f(5, 6), 0, ints(4, 6, lo=0, hi=5), g(4, 6), "mean"), {}))]
SAMPLES["index_select"] = [Case(lambda: ((f(5, 6), 0, torch.tensor([4, 0, 4])), {})),
                           Case(lambda: ((f(5, 6), 1, torch.tensor([5, 1])), {}))]
SAMPLES["take_along_dim"] = [Case(lambda: ((f(5, 6), ints(5, 2, lo=0, hi=6), 1), {})),
                             Case(lambda: ((f(5, 6), ints(3, lo=0, hi=30)), {}))]
SAMPLES["masked_select"] = [Case(lambda: ((f(5, 6), bools(5, 6)), {})), Case(lambda: ((f(5, 6), bools(6)), {}))]
SAMPLES["masked_scatter"] = [Case(lambda: ((f(5, 6), bools(5, 6), g(5, 6)), {})),
                             Case(lambda: ((f(5, 6), bools(6), g(40)), {}))]
SAMPLES["nonzero"] = [Case(one(lambda: bools(5, 6))), Case(one(lambda: ints(5, 6), as_tuple=True))]
SAMPLES["argwhere"] = [Case(one(lambda: ints(5, 6)))]

# -- sorting, reductions with indices, scans, data movers (ops/reduce.py) ---------------------------------
SAMPLES["topk"] = [Case(one(X, 2)), Case(one(X, 3, 0, False))]
SAMPLES["sort"] = [Case(one(X, 0)), Case(one(X, 1, True))]
SAMPLES["argsort"] = [Case(one(X, 0)), Case(one(X, descending=True))]
SAMPLES["median"] = [Case(one(X)), Case(one(X, 0)), Case(one(X, 1, True))]
for _n in ("cummax", "cummin"):
    SAMPLES[_n] = [Case(one(X, 0)), Case(one(X, 1))]
SAMPLES["cumprod"] = [Case(one(X, 1)), Case(one(X, 0))]
SAMPLES["flip"] = [Case(one(X, (0,))), Case(one(X, (0, 1)))]
SAMPLES["roll"] = [Case(one(X, 2, 0)), Case(one(X, 3)), Case(one(X, (1, -2), (0, 1)))]
SAMPLES["unfold"] = [Case(one(X, 0, 2, 1), ref=torch.Tensor.unfold), Case(one(X, 1, 3, 2), ref=torch.Tensor.unfold)]


def _with_nans(*shape):
    x = f(*shape)
    x[0, 0], x[3, 2] = float("nan"), float("nan")
    return x


SAMPLES["nansum"] = [Case(one(lambda: _with_nans(5, 6), 1), partial=False), Case(one(lambda: _with_nans(5, 6)), partial=False),
                     Case(one(X, 0))]
SAMPLES["count_nonzero"] = [Case(one(lambda: ints(5, 6))), Case(one(lambda: ints(5, 6), 1)), Case(one(X, 0))]

# -- misc (ops/misc.py) -----------------------------------------------------------------------------------
SAMPLES["one_hot"] = [Case(lambda: ((ints(5, 3, lo=0, hi=4),), {})), Case(lambda: ((ints(5, lo=0, hi=4), 6), {}))]
SAMPLES["normalize"] = [Case(one(X)), Case(one(X, 1.0, 0))]
SAMPLES["cosine_similarity"] = [Case(lambda: ((f(5, 6), g(5, 6)), {})), Case(lambda: ((f(5, 6), g(6), 0), {}))]
SAMPLES["glu"] = [Case(one(X)), Case(one(lambda: f(4, 6), 0))]
SAMPLES["equal"] = [Case(lambda: ((f(5, 6), f(5, 6)), {})), Case(lambda: ((f(5, 6), g(5, 6)), {}))]


# -- in place: the out-of-place op's cases whose first operand can take the result (torch decides) -----------
def _inplace_ref(method: str):
    def ref(x, *args, **kwargs):
        out = getattr(x, method)(*args, **kwargs)
        assert out is x
        return out
    return ref


def _torch_takes_inplace(method: str, case: Case) -> bool:
    args, kwargs = case.make()
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    try:
        getattr(args[0], method)(*args[1:], **kwargs)
    except (RuntimeError, TypeError):  # another shape or an uncastable dtype: torch refuses it too
        return False
    return True


for _n in [n for n in TABLE if n.endswith("_") and n[:-1] in SAMPLES]:
    SAMPLES[_n] = [Case(cs.make, ref=_inplace_ref(_n), partial=cs.partial, tol=cs.tol, inplace=True)
                   for cs in SAMPLES[_n[:-1]] if _torch_takes_inplace(_n, cs)]
SAMPLES["copy_"] = [Case(lambda: ((f(5, 6), g(5, 6)), {}), ref=_inplace_ref("copy_"), inplace=True),
                    Case(lambda: ((f(5, 6), g(6).double()), {}), ref=_inplace_ref("copy_"), inplace=True)]
SAMPLES["fill_"] = [Case(one(X, 2.5), ref=_inplace_ref("fill_"), inplace=True),
                    Case(one(lambda: ints(5, 6), 3), ref=_inplace_ref("fill_"), inplace=True)]
SAMPLES["zero_"] = [Case(one(X), ref=_inplace_ref("zero_"), inplace=True)]
SAMPLES["masked_fill_"] = [Case(lambda: ((f(5, 6), bools(5, 6), 1.5), {}), ref=_inplace_ref("masked_fill_"),
                                inplace=True)]
SAMPLES["index_fill_"] = [Case(lambda: ((f(5, 6), 0, torch.tensor([4, 1]), 2.5), {}), ref=_inplace_ref("index_fill_"),
                               inplace=True)]

# -- the global-view RNG: the same seed before torch's call and dtorch's gives the same values, exactly ----------
_EXACT = {"rtol": 0, "atol": 0}
for _n, _args in (("normal_", (0.5, 2.0)), ("uniform_", (-1.0, 3.0)), ("bernoulli_", (0.3,)), ("random_", (0, 9)),
                  ("exponential_", (1.5,)), ("geometric_", (0.4,)), ("cauchy_", ()), ("log_normal_", ())):
    SAMPLES[_n] = [Case(one(X, *_args), ref=_inplace_ref(_n), inplace=True, tol=_EXACT)]
# (an explicit generator= and bernoulli_'s probability tensor: tests/ops/test_random.py)
SAMPLES["init.normal_"] = [Case(one(X, 0.0, 0.02), inplace=True, tol=_EXACT)]
SAMPLES["init.uniform_"] = [Case(one(X, -0.5, 0.5), inplace=True, tol=_EXACT)]
SAMPLES["init.constant_"] = [Case(one(X, 0.25), inplace=True, tol=_EXACT)]
SAMPLES["init.kaiming_uniform_"] = [Case(one(X), inplace=True, tol=_EXACT),
                                    Case(one(X, a=5 ** 0.5, mode="fan_out"), inplace=True, tol=_EXACT)]
for _n in ("new_empty", "new_zeros", "new_ones"):
    SAMPLES[_n] = [Case(one(X, (2, 3)), ref=lambda x, *a, _n=_n, **k: getattr(x, _n)(*a, **k), values=_n != "new_empty"),
                   Case(one(X, 4, dtype=torch.float64), ref=lambda x, *a, _n=_n, **k: getattr(x, _n)(*a, **k),
                        values=_n != "new_empty")]
SAMPLES["new_full"] = [Case(one(X, (2, 3), 1.5), ref=lambda x, *a, **k: x.new_full(*a, **k))]
SAMPLES["new_tensor"] = [Case(one(X, [[1, 2], [3, 4]]), ref=lambda x, *a, **k: x.new_tensor(*a, **k))]


# ------------------------------------------------------------------------------------------------------
# the sweep

def _layouts(mesh, t: torch.Tensor, partial: bool):
    """The layouts one tensor takes on ``mesh`` in this sweep (a few per mesh: every op, quickly)."""
    n = mesh.ndim
    R = (Replicate(),) * n
    if t.ndim == 0:
        return [R]
    last = Shard(t.ndim - 1)
    if n == 1:
        out = [R, (Shard(0),), (last,)]
        if partial and t.is_floating_point():
            out.append((Partial("sum"),))
        return out
    return [(Shard(0), last)]


def _map_tensors(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, list):
        return [_map_tensors(v, fn) for v in x]
    if isinstance(x, tuple):
        return tuple(_map_tensors(v, fn) for v in x)
    return x


def _tensors(x) -> list:
    out = []
    _map_tensors(x, lambda t: out.append(t) or t)
    return out


def _reference(name: str, case: Case) -> Callable:
    if case.ref is not None:
        return case.ref
    first = TABLE[name].torch_fns[0] if TABLE[name].torch_fns else None
    first = first[0] if isinstance(first, tuple) else first
    return first if first is not None else getattr(torch, name)


def _run_case(name: str, case: Case, mesh, k: int) -> int:
    op = TABLE[name]
    ref = _reference(name, case)
    args, kwargs = case.make()
    torch.manual_seed(1234)
    expected = ref(*args, **kwargs)
    tol = {"rtol": 1e-4, "atol": 1e-5, **case.tol}
    if case.factory:
        out_ndim = expected.ndim
        runs = 0
        for pl in _layouts(mesh, expected, partial=False):
            args, kwargs = case.make()
            torch.manual_seed(1234)
            got = op.fn(*args, **kwargs, device_mesh=mesh, placements=list(pl))
            assert tuple(got.placements) == pl and got.ndim == out_ndim
            _compare(got, expected, case, tol)
            runs += 1
        return runs
    inputs = _tensors(args)
    per_input = [_layouts(mesh, t, case.partial) for t in inputs]
    runs = 0
    for j in range(max(len(p) for p in per_input)):
        layout = [p[min(j, len(p) - 1)] for p in per_input]
        it = iter(layout)
        args, kwargs = case.make()
        dargs = _map_tensors(args, lambda t: distribute(t, mesh, next(it), seed=k))
        torch.manual_seed(1234)
        try:
            got = op.fn(*dargs, **kwargs)
        except Exception as exc:
            raise AssertionError(f"dtorch.{name} on {mesh} with layouts {[list(map(str, p)) for p in layout]} "
                                 f"raised {type(exc).__name__}: {exc}") from exc
        if case.inplace:
            assert got is dargs[0] and tuple(got.placements) == tuple(layout[0]), \
                f"dtorch.{name} must return its first argument with its placements {layout[0]}, got {got.placements}"
        try:
            _compare(got, expected, case, tol)
        except AssertionError as exc:
            raise AssertionError(f"dtorch.{name} on {mesh} with layouts {[list(map(str, p)) for p in layout]}: "
                                 f"{exc}") from None
        runs += 1
    return runs


def _compare(got, expected, case: Case, tol):
    if case.values:
        check(got, expected, **tol)
    else:
        assert isinstance(got, dtorch.Tensor) and tuple(got.shape) == tuple(expected.shape)
        assert got.dtype == expected.dtype


@pytest.mark.parametrize("name", sorted(TABLE))
def test_op_matches_torch(name):
    if name not in SAMPLES:
        pytest.fail(f"op {name!r} is in the op table but has no sweep samples: add cases for it to SAMPLES in "
                    f"tests/ops/test_op_table.py")
    runs = 0
    for k, case in enumerate(SAMPLES[name]):
        for mesh in (MESH_1D, MESH_2D):
            runs += _run_case(name, case, mesh, k)
    assert runs >= 2 * len(SAMPLES[name])


def test_every_op_has_a_case():
    assert not [n for n, cases in SAMPLES.items() if not cases], "ops whose cases were all filtered out"


def test_samples_name_only_ops_of_the_table():
    assert not sorted(set(SAMPLES) - set(TABLE)), "SAMPLES names ops that are not in the op table"


def test_tensor_attributes_come_from_the_table():
    # every attribute an op declares is bound on dtorch.Tensor, to that op's function or value
    for op in TABLE.values():
        for m in op.methods:
            attr, value = (m, op.fn) if isinstance(m, str) else m
            assert dtorch.Tensor.__dict__[attr] is value, f"Tensor.{attr} is not op {op.name!r}'s"
    # and each torch function routes to an op that declares it (the first one: F.tanh is tanh's and also
    # declared by nobody else)
    declared: dict = {}
    for op in TABLE.values():
        for tf in op.torch_fns:
            f_, target = tf if isinstance(tf, tuple) else (tf, op.fn)
            declared.setdefault(f_, []).append(target)
    assert all(TORCH_FUNCTIONS[f_] is targets[0] for f_, targets in declared.items())
    # nothing else is routed from outside the table but autograd's entry points (dtorch/__init__), not ops
    assert set(TORCH_FUNCTIONS) - set(declared) == {torch.autograd.backward, torch.autograd.grad}


def test_install_refuses_an_attribute_defined_twice():
    from dtorch.ops import TENSOR_HOOKS
    from dtorch.ops.table import Op

    def fn(x):
        return x

    for table in ({"probe": Op("probe", fn, methods=("to",))},  # tensor.py's own Tensor.to
                  {"probe": Op("probe", fn, methods=("__add__",))}):  # op add's
        with pytest.raises(RuntimeError, match="Tensor"):
            dtorch.Tensor._install_ops(table, **TENSOR_HOOKS)
    assert dtorch.Tensor.to is not fn and dtorch.Tensor.__add__ is TABLE["add"].methods[1][1]
