"""The sweeps' placement check can fail: a rule that replicates everything still gives torch's values,
and only the placements the rule promises (tests/promises.py) catch it."""
import dataclasses

import pytest
import torch

import dtorch
from dtorch import Replicate
from dtorch._lru import _ALL
from dtorch.spec import DTensorSpec
from promises import contract, mul, nonlinear, reduction
from sweep import run_sweep


def _clear_plans():
    for cache in list(_ALL):
        if cache.name == "ops.plans":
            cache.clear()


@pytest.fixture
def replicate_rule(monkeypatch):
    """``replicate_rule(module, name)``: the rule ``module.name`` now gathers every operand and replicates its
    outputs (same kernel, same values); no plan made before or during the test is reused."""

    def patch(module, name):
        rule = getattr(module, name)

        def replicating(specs, *static):
            plan = rule(specs, *static)
            return dataclasses.replace(plan, in_specs=tuple(map(_replicated, plan.in_specs)),
                                       out_specs=tuple(map(_replicated, plan.out_specs)))

        monkeypatch.setattr(module, name, replicating)
        _clear_plans()

    yield patch
    _clear_plans()


def _replicated(spec):
    return DTensorSpec(spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape, spec.dtype)


X = torch.randn(5, 6, 7)
M, N = torch.randn(5, 7), torch.randn(7, 3)


@pytest.mark.parametrize("dt_fn, torch_fn, inputs, promise, rule", [
    (dtorch.exp, torch.exp, [X], nonlinear, ("pointwise", "_pointwise_rule")),
    (lambda x: dtorch.mul(x, 2.0), lambda x: x * 2.0, [X], mul, ("pointwise", "_pointwise_rule")),
    (lambda x: x.sum(1), lambda x: x.sum(1), [X], lambda m, x: reduction(m, x, "sum", 1), ("reduce", "_reduce_rule")),
    (dtorch.matmul, torch.matmul, [M, N], lambda m, a, b: contract(m, "mk,kn->mn", a, b), ("matrix", "_matmul_rule")),
], ids=["exp", "mul", "sum", "matmul"])
def test_a_replicating_rule_passes_on_values_and_fails_on_placements(replicate_rule, dt_fn, torch_fn, inputs,
                                                                     promise, rule):
    run_sweep(dt_fn, torch_fn, inputs, placements=promise)  # the real rule keeps its promise
    replicate_rule(getattr(dtorch.ops, rule[0]), rule[1])
    run_sweep(dt_fn, torch_fn, inputs)  # the values alone cannot tell
    with pytest.raises(AssertionError, match="the rule promises"):
        run_sweep(dt_fn, torch_fn, inputs, placements=promise)


def test_the_promises_say_what_the_rule_tables_say():
    # a few rows of the tables in the ops' docstrings, read off the promises (tests/promises.py)
    from dtorch import Partial, Shard
    from promises import Lay, add, elementwise, embedding
    from sweep import MESH_1D as m

    R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial("sum")
    x = Lay((5, 6), (S1,))
    assert nonlinear(m, x).placements == (S1,)                                   # S(d) -> S(d)
    assert add(m, Lay((5, 6), (P,)), Lay((6,), (R,))).placements == (P,)         # P + R -> P
    assert add(m, Lay((5, 6), (P,)), scalar=True).placements == (R,)             # P + scalar -> R
    assert elementwise(m, Lay((6,), (R,)), Lay((5, 6), (P,)), partial="div").placements == (R,)  # R / P -> R
    assert reduction(m, Lay((5, 6), (S0,)), "sum", 0).placements == (P,)         # sum over a shard -> P(sum)
    assert reduction(m, Lay((5, 6), (S1,)), "amax", 0).placements == (Shard(0),)  # kept dims renumbered
    assert contract(m, "mk,kn->mn", Lay((5, 7), (S0,)), Lay((7, 3), (R,))).placements == (S0,)
    assert contract(m, "mk,kn->mn", Lay((5, 7), (S1,)), Lay((7, 3), (S0,))).placements == (P,)
    assert contract(m, "mk,kn->mn", Lay((5, 7), (S0,)), Lay((7, 3), (S0,))).placements == (None,)  # by cost
    assert embedding(m, Lay((2, 3), (R,)), Lay((7, 4), (S0,))).placements == (P,)
