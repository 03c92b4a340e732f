"""The one dispatch path on the process backend: scalar values travel with each kernel record (one plan,
one executable, many values), executables are cached per runtime and bounded.

    .venv/bin/pytest -q tests/runtime/test_process_dispatch.py
"""
from __future__ import annotations

import torch

import dtorch
from dtorch import DeviceMesh, Shard
from dtorch.ops import dispatch as op_dispatch

from .conftest import using

MESH = DeviceMesh("cpu", [1, 0], mesh_dim_names=["a"])  # device ids out of mesh order


def test_scalar_values_reach_the_workers_without_new_plans(proc):
    full = torch.randn(5, 3)
    with using(proc):
        x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0)])
        x * 0.5
        misses, executables = op_dispatch.stats["plan_misses"], len(proc.runtime._executables)
        outs = [(c, x * c, 1.0 - x * c) for c in (k / 3 for k in range(50))]
        assert op_dispatch.stats["plan_misses"] == misses + 1  # ``1.0 - y``: one more plan, whatever c was
        assert len(proc.runtime._executables) == executables  # same kernel and specs: the same executable
        for c, y, z in outs:
            torch.testing.assert_close(y.to_torch(), full * c)
            torch.testing.assert_close(z.to_torch(), 1.0 - full * c)
    assert proc.runtime._executables.maxsize >= 2
