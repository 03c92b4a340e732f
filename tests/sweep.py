"""Shared machinery for placement sweeps: run an op on every input placement and compare with torch."""
from __future__ import annotations

import itertools
import random

import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from promises import check_placements, lays

MESH_1D = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["a"])
MESH_2D = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["a", "b"])
MESH_3D = dtorch.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=["a", "b", "c"])
MESHES = [MESH_1D, MESH_2D, MESH_3D]


PARTIALS = [Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]


def placement_options(tensor_ndim: int, partial: bool = True) -> list:
    opts = [Replicate()] + [Shard(d) for d in range(tensor_ndim)]
    return opts + PARTIALS if partial else opts


def placement_cases(tensor_ndim: int, mesh, partial: bool = True, limit: int = 40, seed: int = 0) -> list[tuple]:
    """Every placement tuple for a tensor on ``mesh`` (a fixed random subset when there are more than ``limit``)."""
    cases = list(itertools.product(placement_options(tensor_ndim, partial), repeat=mesh.ndim))
    if len(cases) > limit:
        rnd = random.Random(seed)
        singles = [c for c in cases if sum(not isinstance(p, Replicate) for p in c) <= 1]
        rest = [c for c in cases if c not in singles]
        cases = singles + rnd.sample(rest, max(0, limit - len(singles)))
    return cases


def distribute(x: torch.Tensor, mesh, placements, seed: int = 0) -> "dtorch.Tensor":
    """``x`` laid out with ``placements``; partial mesh dims get genuinely different terms on every
    device (random, reducing to ``x``), so an op that wrongly keeps a partial cannot pass by luck."""
    placements = list(placements)
    partial_dims = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    ops = {placements[i].reduce_op for i in partial_dims}
    if not partial_dims or len(ops) != 1 or not x.is_floating_point():
        return dtorch.Tensor(x, device_mesh=mesh, placements=placements)
    return dtorch.Tensor.from_blocks(_partial_blocks(x, mesh, placements, partial_dims, ops.pop(), seed),
                                     device_mesh=mesh, placements=placements, shape=x.shape)


def _partial_blocks(x, mesh, placements, partial_dims, op, seed):
    g = torch.Generator().manual_seed(seed)
    combos = list(itertools.product(*[range(mesh.shape[i]) for i in partial_dims]))
    k = len(combos)
    if op in ("sum", "avg"):
        noise = torch.randn((k,) + tuple(x.shape), generator=g, dtype=torch.float64)
        noise = noise - noise.mean(0, keepdim=True)  # terms differ, their sum (mean) is untouched
        terms = (x.double() / (k if op == "sum" else 1)) + noise
    else:
        gap = torch.rand((k,) + tuple(x.shape), generator=g, dtype=torch.float64) + 0.1
        exact = torch.randint(k, (1,) + tuple(x.shape), generator=g)
        gap = gap.scatter(0, exact, 0.0)  # one term per element holds the value, the others lie below/above it
        terms = x.double() - gap if op == "max" else x.double() + gap
    terms = terms.to(x.dtype)
    spec = dtorch.DTensorSpec(mesh, tuple(placements), tuple(x.shape), x.dtype)
    blocks = []
    for coord in mesh.coordinates():
        term = terms[combos.index(tuple(coord[i] for i in partial_dims))]
        blocks.append(term[tuple(slice(o, o + n) for o, n in spec.local_box(coord))].clone())
    return blocks


def canonical(mesh, placements) -> tuple:
    """``placements`` as dtorch stores them: a Shard on a mesh dim of size 1 is Replicate()."""
    return tuple(Replicate() if isinstance(p, Shard) and mesh.shape[i] == 1 else p for i, p in enumerate(placements))


def check(dt_out, expected, rtol=1e-4, atol=1e-5):
    if isinstance(expected, (tuple, list)):
        assert isinstance(dt_out, (tuple, list)) and len(dt_out) == len(expected)
        for a, e in zip(dt_out, expected):
            check(a, e, rtol, atol)
        return
    if isinstance(expected, torch.Tensor):
        assert isinstance(dt_out, dtorch.Tensor), f"expected a dtorch.Tensor, got {type(dt_out)}"
        got = dt_out.to_torch()
        assert got.dtype == expected.dtype, f"dtype {got.dtype} != torch's {expected.dtype}"
        assert tuple(got.shape) == tuple(expected.shape), f"shape {tuple(got.shape)} != torch's {tuple(expected.shape)}"
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    else:
        assert dt_out == expected


def run_sweep(dt_fn, torch_fn, inputs: list[torch.Tensor], meshes=MESHES, partial=True, limit=40,
              rtol=1e-4, atol=1e-5, vary=None, placements=None):
    """For each mesh and each placement of the inputs listed in ``vary`` (default: all), the dtorch op
    equals the torch op and leaves its inputs unchanged. ``placements(mesh, *lays)``: the output Lay(s) the
    op's rule promises (tests/promises.py), asserted on every case; a sweep given one fails unless it
    checked some mesh dim. Returns the number of cases run."""
    expected = torch_fn(*inputs)
    vary = list(range(len(inputs))) if vary is None else vary
    n = checked = 0
    for mesh in meshes:
        per_input = [placement_cases(inputs[j].ndim, mesh, partial=partial and inputs[j].is_floating_point(),
                                     limit=limit, seed=j) if j in vary else [(Replicate(),) * mesh.ndim]
                     for j in range(len(inputs))]
        combos = list(itertools.product(*per_input))
        if len(combos) > limit:
            combos = random.Random(len(combos)).sample(combos, limit)
        for combo in combos:
            dts = [distribute(x, mesh, p) for x, p in zip(inputs, combo)]
            out = dt_fn(*dts)
            try:
                check(out, expected, rtol, atol)
                if placements is not None:
                    checked += check_placements(mesh, out, placements(mesh, *lays(mesh, inputs, combo)))
            except AssertionError as exc:
                raise AssertionError(f"mesh {mesh}, placements {[list(map(str, p)) for p in combo]}: {exc}") from None
            for d, x, p in zip(dts, inputs, combo):
                assert tuple(d.placements) == canonical(mesh, p), "input placements changed"
                torch.testing.assert_close(d.to_torch(), x, rtol=1e-6, atol=1e-6, msg="input value changed")
            n += 1
    assert placements is None or checked > 0, "the promised placements pinned no mesh dim of any case"
    return n
