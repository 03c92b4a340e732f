"""The reference backend (runtime/reference.py): its checks, copy-on-write, and a quick sweep on it.

The full redistribution and op sweeps run on it with ``pytest --backend reference tests/test_redistribute.py
tests/ops`` (a CI step, .ci/run).
"""
from __future__ import annotations

import itertools
import os

import pytest
import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.errors import RuntimeBackendError
from dtorch.runtime.kernels import kernel
from dtorch.runtime.reference import ReferenceRuntime
from dtorch.spec import DTensorSpec


@kernel("test_reference_add_one_inplace")
def _add_one_(x):
    x.add_(1)


@kernel("test_reference_drop_a_row")
def _drop_a_row(x):
    return x[1:]


@kernel("test_reference_device_value")
def _device_value(x, value):
    return x + value


MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])


def test_the_chosen_backend_is_every_default_graphs(pytestconfig):
    want = pytestconfig.getoption("--backend") or os.environ.get("DTORCH_BACKEND") or "inprocess"
    assert dtorch.Graph().backend == want


def test_blocks_are_checked_against_local_box():
    rt = ReferenceRuntime()
    spec = DTensorSpec(MESH, (Shard(0), Replicate()), (5, 3), torch.float32)
    h = rt.from_global(torch.arange(15.0).reshape(5, 3), spec)
    assert [tuple(b.shape) for b in rt.local_blocks(h, spec)] == [(3, 3), (3, 3), (2, 3), (2, 3)]
    with pytest.raises(RuntimeBackendError) as err:
        rt.executable(_drop_a_row, [spec], [spec]).run([h], {})
    msg = str(err.value)
    assert "kernel test_reference_drop_a_row output #0" in msg and "device 0 (coordinate (0, 0)) holds [2, 3]" in msg
    assert "puts a [3, 3] torch.float32 block" in msg and "local_box ((0, 3), (0, 3))" in msg


def test_replicas_must_hold_equal_values():
    rt = ReferenceRuntime()
    spec = DTensorSpec(MESH, (Shard(0), Replicate()), (4,), torch.float32)
    same = [torch.tensor([0.0, float("nan")])] * 2 + [torch.tensor([2.0, 3.0])] * 2
    assert torch.equal(rt.to_global(rt.from_blocks(same, spec), spec)[2:], torch.tensor([2.0, 3.0]))
    with pytest.raises(RuntimeBackendError, match=r"replicas differ: device 1 \(coordinate \(0, 1\)\) and device 0"):
        rt.from_blocks([torch.zeros(2), torch.ones(2), torch.zeros(2), torch.zeros(2)], spec)
    # per-device kernel arguments that break a replica are caught where they happen
    h = rt.from_global(torch.zeros(4), spec)
    with pytest.raises(RuntimeBackendError, match="kernel test_reference_device_value output #0: replicas differ"):
        rt.executable(_device_value, [spec], [spec]).run([h], {}, {"value": [[0.0, 1.0], [0.0, 0.0]]})


def test_write_copies_only_when_another_handle_shares_the_storage():
    rt = ReferenceRuntime()
    spec = DTensorSpec(MESH, (Shard(0), Partial()), (4, 2), torch.float32)
    full = torch.arange(8.0).reshape(4, 2)
    h = rt.from_global(full, spec)
    other = rt.alias(h, spec)
    out = rt.write(_add_one_, h, spec, [], [], {})
    assert out is not h  # shared with `other`: written into a copy
    assert torch.equal(rt.to_global(other, spec), full) and torch.equal(rt.to_global(h, spec), full)
    assert torch.equal(rt.to_global(out, spec), full + 2)  # +1 on each of the two sum terms
    assert rt.write(_add_one_, out, spec, [], [], {}) is out  # nobody else sees `out`: in place
    del other
    assert rt.write(_add_one_, h, spec, [], [], {}) is h
    assert torch.equal(rt.to_global(h, spec), full + 2)


def test_to_global_and_local_blocks_are_copies():
    rt = ReferenceRuntime()
    spec = DTensorSpec(MESH, (Replicate(), Replicate()), (3,), torch.float32)
    h = rt.from_global(torch.zeros(3), spec)
    rt.to_global(h, spec).add_(1)
    rt.local_blocks(h, spec)[0].add_(1)
    assert torch.equal(rt.to_global(h, spec), torch.zeros(3))


PLACEMENTS = [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("max")]


def test_every_placement_pair_on_the_reference_backend():
    """A quick redistribution sweep (the full one: --backend reference): every pair on a 2x2 mesh, uneven shape,
    and moves to a mesh of another shape."""
    full = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    other = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["pp"])
    with dtorch.Graph(backend="reference"):
        for src in itertools.product(PLACEMENTS, repeat=2):
            x = dtorch.Tensor(full, device_mesh=MESH, placements=list(src))
            for dst in itertools.product(PLACEMENTS, repeat=2):
                y = x.redistribute(MESH, list(dst))
                torch.testing.assert_close(y.to_torch(), full, msg=lambda m: f"{src} -> {dst}: {m}")
            moved = x.redistribute(other, [Shard(1)])
            torch.testing.assert_close(moved.to_torch(), full, msg=lambda m: f"{src} -> pp S(1): {m}")
