"""The one dispatch path: the same error warm or cold, scalars as kernel arguments, bounded caches."""
from __future__ import annotations

import gc
import sys
import tracemalloc

import pytest
import torch

import dtorch
from dtorch import OpError, Replicate, Shard
from dtorch._lru import LRU, all_caches
from dtorch.ops import dispatch as op_dispatch

MESH = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["a"])


def _ints(shape, fill=None, seed=0):
    if fill is not None:
        return torch.full(shape, fill, dtype=torch.int64)
    return torch.randint(-20, 20, shape, generator=torch.Generator().manual_seed(seed))


# -- errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["operator", "function", "torch"])
def test_failing_op_raises_the_same_op_error_warm_or_cold(spelling):
    # integer division by zero fails in the kernel. Cold: the first call with these specs (a shape no other
    # test uses per spelling) plans and runs the general path; warm: after successful calls the executable
    # runs the bound torch function straight on the stacked blocks. Both raise dtorch's OpError, naming the op.
    shape = (7, 2 + ["operator", "function", "torch"].index(spelling))
    div = {"operator": lambda a, b: a // b, "function": dtorch.floor_divide, "torch": torch.floor_divide}[spelling]
    x = dtorch.Tensor(_ints(shape), device_mesh=MESH, placements=[Shard(0)])
    zeros = dtorch.Tensor(_ints(shape, 0), device_mesh=MESH, placements=[Shard(0)])
    ones = dtorch.Tensor(_ints(shape, 1), device_mesh=MESH, placements=[Shard(0)])
    with pytest.raises(OpError, match="floor_divide") as cold:
        div(x, zeros)
    for _ in range(3):  # warm: the executable is direct and bound now
        assert torch.equal(div(x, ones).to_torch(), x.to_torch())
    with pytest.raises(OpError, match="floor_divide") as warm:
        div(x, zeros)
    assert str(warm.value) == str(cold.value)
    assert isinstance(cold.value.__cause__, RuntimeError) and isinstance(warm.value.__cause__, RuntimeError)
    assert torch.equal(x.to_torch(), _ints(shape))  # the inputs are still usable


def test_failing_scalar_op_raises_the_same_op_error_warm_or_cold():
    x = dtorch.Tensor(_ints((7, 5)), device_mesh=MESH, placements=[Shard(0)])
    with pytest.raises(OpError, match="floor_divide") as cold:
        x // 0
    for k in (1, 2, 3):
        assert torch.equal((x // k).to_torch(), _ints((7, 5)) // k)
    with pytest.raises(OpError, match="floor_divide") as warm:
        x // 0
    assert str(warm.value) == str(cold.value)


# -- scalars --------------------------------------------------------------------------------------------

def test_scalar_values_are_kernel_arguments_not_plan_keys():
    full = torch.randn(7, 4)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0)])
    cond = dtorch.Tensor(full > 0, device_mesh=MESH, placements=[Shard(0)])
    spellings = [
        (lambda t, c: t * c, lambda t, c: t * c), (lambda t, c: c - t, lambda t, c: c - t),
        (lambda t, c: dtorch.add(t, 1.0, alpha=c), lambda t, c: torch.add(t, 1.0, alpha=c)),
        (lambda t, c: t.clamp(min=-c), lambda t, c: t.clamp(min=-c)),
        (lambda t, c: dtorch.where(cond, t, c), lambda t, c: torch.where(full > 0, t, c)),
        (lambda t, c: t.masked_fill(cond, c), lambda t, c: t.masked_fill(full > 0, c)),
    ]
    for dt_fn, torch_fn in spellings:
        dt_fn(x, 0.5)  # plans once
        misses, plans = op_dispatch.stats["plan_misses"], len(op_dispatch._PLANS)
        for k in range(1000):
            c = k / 7
            out = dt_fn(x, c)
            if k % 97 == 0:  # the value reaches the kernel
                torch.testing.assert_close(out.to_torch(), torch_fn(full, c))
        assert op_dispatch.stats["plan_misses"] == misses and len(op_dispatch._PLANS) == plans
    # the scalar's type is part of the plan: int and float operands give torch's dtypes
    ints = dtorch.Tensor(_ints((7, 4)), device_mesh=MESH, placements=[Shard(0)])
    for c in (3, 2.5, True):
        assert (ints * c).dtype == (_ints((7, 4)) * c).dtype
        assert torch.equal((ints * c).to_torch(), _ints((7, 4)) * c)


def test_repeated_and_changing_scalars_give_torch_results():
    # a loop repeating its scalar gets the kernel bound to that value; a new value must never see the old one
    full = torch.randn(7, 4)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0)])
    values = [0.5] * 4 + [2.0] * 4 + [0.5, 2.0] * 3 + [-1.0] * 3
    same = [lambda t, c: t * c, lambda t, c: c - t, lambda t, c: t.abs() ** c,
            lambda t, c: torch.nn.functional.leaky_relu(t, c)]  # (F.leaky_relu: no Tensor method to bind)
    spellings = [(fn, fn) for fn in same] + [(lambda t, c: dtorch.xlogy(t.abs(), c), lambda t, c: torch.xlogy(t.abs(), c))]
    for dt_fn, torch_fn in spellings:
        for c in values:
            torch.testing.assert_close(dt_fn(x, c).to_torch(), torch_fn(full, c), equal_nan=True)


# -- bounded caches ---------------------------------------------------------------------------------------

def test_lru_keeps_what_was_used_lately_and_never_more_than_maxsize():
    cache = LRU("test.lru", 8)
    for k in range(8):
        cache[k] = k
    for _ in range(3):  # key 0 used again and again while new keys arrive
        assert cache.get(0) == 0
    for k in range(8, 40):
        cache[k] = k
        assert cache.get(0) == 0  # used at least once per maxsize // 2 insertions: never dropped
        assert len(cache) <= 8
    assert cache.get(1) is None and 1 not in cache  # not used since: dropped
    assert cache.fast_get(39) == 39 and cache.get(39) == 39
    assert sorted(k for k, _ in cache.items()) == sorted(set(k for k, _ in cache.items()))
    cache.clear()
    assert len(cache) == 0 and cache.fast_get(39) is None
    with pytest.raises(ValueError):
        LRU("test.too_small", 1)


def _process_global_caches():
    """Every bounded cache of dtorch: the LRUs and the functools.lru_caches of its modules."""
    lrus = all_caches()
    fcaches = {id(f): f for name, mod in list(sys.modules.items()) if name.startswith("dtorch") and mod
               for f in vars(mod).values() if hasattr(f, "cache_info") and hasattr(f, "cache_clear")}
    return lrus, list(fcaches.values())


def test_every_process_global_cache_is_bounded():
    # an in-process runtime alive: its executable cache is one of them, whatever backend --backend chose
    inprocess = dtorch.Graph(backend="inprocess")  # noqa: F841
    lrus, fcaches = _process_global_caches()
    names = {c.name for c in lrus}
    assert {"ops.plans", "ops.view.local_out_shapes", "inprocess.executables"} <= names
    for c in lrus:
        assert len(c) <= c.maxsize, c
    for f in fcaches:
        info = f.cache_info()
        assert info.maxsize is not None and info.currsize <= info.maxsize, f


def _decode_step(kv, row):
    kv = dtorch.cat([kv, row])  # one more row every step: new shapes, new plans
    return kv, (kv * 0.5).sum(0)


def test_decode_loop_keeps_caches_bounded_and_memory_flat(monkeypatch):
    # 2000 steps of a tensor growing by one row: every step plans new ops. The plan and executable caches
    # (bounds lowered to 64 here, so the test fills them) stay within their bounds, and the Python memory
    # dtorch holds stops growing once they are full (functools caches, bounded at tens of thousands of
    # entries, are emptied before each measurement).
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    row_full = torch.randn(1, 8)
    with dtorch.Graph(backend="inprocess"):  # that backend's executable cache, whatever --backend runs
        row = dtorch.Tensor(row_full, device_mesh=mesh, placements=[Shard(1)])
    kv = row
    runtime = kv.graph.runtime
    small = [op_dispatch._PLANS, runtime._exec_cache]
    for cache in small:
        cache.clear()
        monkeypatch.setattr(cache, "maxsize", 64)
    _, fcaches = _process_global_caches()

    def held_bytes():
        for f in fcaches:
            f.cache_clear()
        gc.collect()
        return tracemalloc.get_traced_memory()[0]

    marks = {}
    misses = op_dispatch.stats["plan_misses"]
    try:
        for step in range(2000):
            if step == 900:  # (traced from here on: what the second half keeps is what counts)
                tracemalloc.start()
            kv, out = _decode_step(kv, row)
            for cache in small:
                assert len(cache) <= 64
            if step in (999, 1999):
                marks[step] = held_bytes()
    finally:
        tracemalloc.stop()
    ref_kv = row_full.expand(2001, 8)
    torch.testing.assert_close(out.to_torch(), (ref_kv * 0.5).sum(0))
    assert tuple(kv.shape) == (2001, 8)
    assert op_dispatch.stats["plan_misses"] - misses >= 2000 * 3  # every step planned: the bounds were exercised
    # the second thousand steps left nothing behind (a few KB of slack for interpreter noise)
    assert marks[1999] - marks[999] < 64 * 1024, marks
