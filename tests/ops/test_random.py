"""The global-view RNG: random factories, in-place random fills, ``torch.nn.init`` and dropout give, for the
same seed, torch's values on one device bit for bit whatever the layout, and leave torch's generator where
torch leaves it (the next draw agrees)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import dtorch
from dtorch import Partial, Replicate, Shard, nn
from dtorch.ops.random import RandomOpError

MESH3 = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["a"])
MESH22 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["a", "b"])
MESH23 = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "tp"])

# (mesh, placements) for a 2-D tensor of an uneven shape (5 x 7: 5 rows over 3 or 2 devices)
LAYOUTS = [
    (MESH3, [Replicate()]), (MESH3, [Shard(0)]), (MESH3, [Shard(1)]), (MESH3, [Partial()]),
    (MESH22, [Shard(0), Shard(1)]), (MESH22, [Shard(1), Replicate()]), (MESH22, [Replicate(), Partial()]),
    (MESH23, [Shard(0), Shard(0)]), (MESH23, [Replicate(), Shard(1)]),
]
SHAPE = (5, 7)


def _ids(layout):
    mesh, pl = layout
    return f"{'x'.join(map(str, mesh.shape))}-{'/'.join(map(str, pl))}"


def _same(got: dtorch.Tensor, expected: torch.Tensor) -> None:
    value = got.to_torch()
    assert value.dtype == expected.dtype and value.shape == expected.shape
    assert torch.equal(value, expected), f"max difference {(value.double() - expected.double()).abs().max()}"


def _next_draws_agree(seed_state: torch.Tensor) -> None:
    """The global generator is where torch left it: restore ``seed_state`` was torch's state after its call."""
    mine = torch.randn(4)
    torch.set_rng_state(seed_state)
    assert torch.equal(mine, torch.randn(4)), "the generator advanced differently from torch's"


def _zeros(layout, shape=SHAPE, dtype=torch.float32, param=False):
    mesh, pl = layout
    t = dtorch.Tensor(torch.zeros(shape, dtype=dtype), device_mesh=mesh, placements=pl)
    return nn.Parameter(t) if param else t


# -- factories -------------------------------------------------------------------------------------------

NOT_PARTIAL = [lay for lay in LAYOUTS if not any(p.is_partial() for p in lay[1])]


@pytest.mark.parametrize("layout", NOT_PARTIAL, ids=_ids)
@pytest.mark.parametrize("explicit", [False, True], ids=["global generator", "generator="])
def test_random_factories_equal_torch(layout, explicit):
    mesh, pl = layout
    for name, args, kw in (("randn", SHAPE, {}), ("rand", SHAPE, {"dtype": torch.bfloat16}),
                           ("randn", SHAPE, {"dtype": torch.float64}), ("randint", (-3, 9, SHAPE), {})):
        gen = (lambda: torch.Generator().manual_seed(11)) if explicit else (lambda: None)
        torch.manual_seed(3)
        expected = getattr(torch, name)(*args, generator=gen(), **kw)
        after = torch.get_rng_state()
        torch.manual_seed(3)
        got = getattr(dtorch, name)(*args, generator=gen(), device_mesh=mesh, placements=pl, **kw)
        assert got.placements == pl
        _same(got, expected)
        _next_draws_agree(after)


def test_like_factories_follow_the_input_layout():
    x = _zeros((MESH22, [Shard(0), Shard(1)]))
    torch.manual_seed(4)
    expected = torch.randn_like(torch.zeros(SHAPE)), torch.rand_like(torch.zeros(SHAPE))
    torch.manual_seed(4)
    got = torch.randn_like(x), dtorch.rand_like(x)
    for g, e in zip(got, expected):
        assert g.placements == x.placements
        _same(g, e)


# -- in-place random fills -------------------------------------------------------------------------------

FILLS = [("normal_", (0.5, 2.0), {}), ("normal_", (), {"mean": -1.0, "std": 0.1}), ("uniform_", (-2.0, 3.0), {}),
         ("uniform_", (), {}), ("bernoulli_", (0.3,), {}), ("random_", (0, 100), {}), ("random_", (), {"to": 5}),
         ("exponential_", (2.0,), {}), ("geometric_", (0.3,), {}), ("cauchy_", (), {}), ("log_normal_", (0.0, 0.5), {})]


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
def test_inplace_fills_equal_torch_and_keep_the_object(layout):
    for dtype in (torch.float32, torch.bfloat16):
        for name, args, kw in FILLS:
            ref = torch.zeros(SHAPE, dtype=dtype)
            torch.manual_seed(9)
            getattr(ref, name)(*args, **kw)
            after = torch.get_rng_state()
            x = _zeros(layout, dtype=dtype)
            before = x.clone()
            placements = x.placements
            torch.manual_seed(9)
            assert getattr(x, name)(*args, **kw) is x
            assert x.placements == placements
            _same(x, ref)
            _same(before, torch.zeros(SHAPE, dtype=dtype))  # a copy taken before does not see the write
            _next_draws_agree(after)


@pytest.mark.parametrize("layout", LAYOUTS[:5], ids=_ids)
def test_fills_with_an_explicit_generator_leave_the_global_one_alone(layout):
    ref = torch.zeros(SHAPE)
    ref.normal_(generator=torch.Generator().manual_seed(5))
    ref.uniform_(0, 2, generator=torch.Generator().manual_seed(6))
    x = _zeros(layout)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    x.normal_(generator=torch.Generator().manual_seed(5))
    x.uniform_(0, 2, generator=torch.Generator().manual_seed(6))
    _same(x, ref)
    assert torch.equal(torch.get_rng_state(), state)


def test_bernoulli_with_a_probability_tensor():
    p = torch.rand(SHAPE, generator=torch.Generator().manual_seed(2))
    for mesh, pl in LAYOUTS[:4]:
        ref = torch.zeros(SHAPE)
        torch.manual_seed(8)
        ref.bernoulli_(p)
        x = _zeros((mesh, pl))
        torch.manual_seed(8)
        x.bernoulli_(dtorch.Tensor(p, device_mesh=mesh, placements=[Shard(1)] * mesh.ndim))
        _same(x, ref)


def test_int_tensors_take_random_and_refuse_normal():
    x = dtorch.Tensor(torch.zeros(SHAPE, dtype=torch.int64), device_mesh=MESH3, placements=[Shard(0)])
    ref = torch.zeros(SHAPE, dtype=torch.int64)
    torch.manual_seed(2)
    ref.random_(-5, 5)
    torch.manual_seed(2)
    x.random_(-5, 5)
    _same(x, ref)
    with pytest.raises(RandomOpError, match="normal_"):
        x.normal_()
    _same(x, ref)  # left unchanged
    with pytest.raises(RuntimeError, match="std"):
        _zeros(LAYOUTS[1]).normal_(0.0, -1.0)


def test_a_leaf_that_requires_grad_is_written_only_without_grad():
    p = _zeros(LAYOUTS[1], param=True)
    with pytest.raises(RuntimeError, match="leaf"):
        p.normal_()
    torch.manual_seed(0)
    with torch.no_grad():
        p.normal_()
    torch.manual_seed(0)
    _same(p, torch.zeros(SHAPE).normal_())
    assert p.requires_grad and p.grad_fn is None


def test_a_fill_overwrites_a_value_with_history_and_its_gradient_is_zero():
    w = dtorch.Tensor(torch.ones(SHAPE), device_mesh=MESH3, placements=[Shard(0)]).requires_grad_()
    y = w * 2
    y.uniform_()
    y.sum().backward()
    _same(w.grad, torch.zeros(SHAPE))


# -- torch.nn.init ---------------------------------------------------------------------------------------

INITS = [
    ("normal_", lambda t: torch.nn.init.normal_(t, std=0.02)),
    ("uniform_", lambda t: torch.nn.init.uniform_(t, -0.1, 0.3)),
    ("zeros_", torch.nn.init.zeros_),
    ("ones_", torch.nn.init.ones_),
    ("constant_", lambda t: torch.nn.init.constant_(t, 0.7)),
    ("xavier_uniform_", lambda t: torch.nn.init.xavier_uniform_(t, gain=2.0)),
    ("xavier_normal_", torch.nn.init.xavier_normal_),
    ("kaiming_uniform_", lambda t: torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))),
    ("kaiming_uniform_ fan_out relu", lambda t: torch.nn.init.kaiming_uniform_(t, mode="fan_out", nonlinearity="relu")),
    ("kaiming_normal_", torch.nn.init.kaiming_normal_),
    ("trunc_normal_", lambda t: torch.nn.init.trunc_normal_(t, std=1.5)),  # redraws values beyond [-2, 2]
    ("trunc_normal_ narrow", lambda t: torch.nn.init.trunc_normal_(t, mean=0.1, std=1.0, a=-0.2, b=0.3)),
    ("sparse_", lambda t: torch.nn.init.sparse_(t, 0.4)),
    ("generator=", lambda t: torch.nn.init.normal_(t, 1.0, 3.0, generator=torch.Generator().manual_seed(4))),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids)
@pytest.mark.parametrize("name,init", INITS, ids=[n for n, _ in INITS])
def test_nn_init_on_parameters_equals_torch(layout, name, init):
    ref = torch.nn.Parameter(torch.zeros(SHAPE))
    torch.manual_seed(21)
    assert init(ref) is ref
    after = torch.get_rng_state()
    p = _zeros(layout, param=True)
    placements = p.placements
    torch.manual_seed(21)
    assert init(p) is p
    assert p.placements == placements and p.requires_grad and p.grad_fn is None
    _same(p, ref.detach())
    _next_draws_agree(after)


def test_a_sequence_of_inits_consumes_the_generator_as_torch_does():
    shapes = [(6, 4), (6,), (3, 2, 5), (7, 7)]
    layouts = [(MESH22, [Shard(0), Replicate()]), (MESH3, [Shard(0)]), (MESH23, [Shard(2), Shard(1)]),
               (MESH3, [Shard(1)])]

    def run(tensors):
        torch.nn.init.kaiming_uniform_(tensors[0], a=math.sqrt(5))
        torch.nn.init.uniform_(tensors[1], -0.5, 0.5)
        torch.nn.init.xavier_normal_(tensors[2])
        torch.nn.init.trunc_normal_(tensors[3], std=0.02)
        torch.nn.init.normal_(tensors[0], std=0.02)
        torch.nn.init.dirac_(tensors[2])

    refs = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    torch.manual_seed(13)
    run(refs)
    after = torch.randn(5)
    ours = [nn.Parameter(dtorch.Tensor(torch.zeros(s), device_mesh=m, placements=pl))
            for s, (m, pl) in zip(shapes, layouts)]
    torch.manual_seed(13)
    run(ours)
    for p, r in zip(ours, refs):
        _same(p, r.detach())
    assert torch.equal(torch.randn(5), after)


def test_init_of_an_empty_tensor_warns_like_torch_and_draws_nothing():
    p = nn.Parameter(dtorch.Tensor(torch.zeros(0, 3), device_mesh=MESH3))
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.nn.init.kaiming_uniform_(p)
    assert any("zero-element" in str(w.message) for w in caught)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(after, torch.rand(3))


# -- dropout ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", NOT_PARTIAL, ids=_ids)
def test_dropout_mask_equals_torch(layout):
    mesh, pl = layout
    for dtype, p in ((torch.float32, 0.3), (torch.bfloat16, 0.5), (torch.float64, 0.9)):
        x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(dtype)
        torch.manual_seed(6)
        expected = (F.dropout(x, p), torch.dropout(x, p, True), torch.nn.Dropout(p)(x))
        after = torch.get_rng_state()
        dx = dtorch.Tensor(x, device_mesh=mesh, placements=pl)
        torch.manual_seed(6)
        got = (F.dropout(dx, p), torch.dropout(dx, p, True), nn.Dropout(p)(dx))
        for g, e in zip(got, expected):
            assert g.placements == pl
            _same(g, e)
        _next_draws_agree(after)


def test_dropout_of_a_partial_input_keeps_torch_mask():
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(6)
    expected = F.dropout(x, 0.4)
    torch.manual_seed(6)
    got = F.dropout(dtorch.Tensor(x, device_mesh=MESH3, placements=[Partial()]), 0.4)
    torch.testing.assert_close(got.to_torch(), expected)
    assert torch.equal(got.to_torch() == 0, expected == 0)


# -- modules built from scratch initialise like torch's ----------------------------------------------------

TP_MESHES = [dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["tp"]), MESH23,
             dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["fsdp", "tp"])]

MODULES = [
    (lambda m: nn.Linear(7, 5, device_mesh=m), lambda: torch.nn.Linear(7, 5)),
    (lambda m: nn.ColumnParallelLinear(7, 5, device_mesh=m), lambda: torch.nn.Linear(7, 5)),
    (lambda m: nn.RowParallelLinear(7, 5, bias=False, device_mesh=m), lambda: torch.nn.Linear(7, 5, bias=False)),
    (lambda m: nn.Embedding(11, 5, padding_idx=4, device_mesh=m), lambda: torch.nn.Embedding(11, 5, padding_idx=4)),
    (lambda m: nn.Embedding(11, 5, vocab_parallel=True, device_mesh=m), lambda: torch.nn.Embedding(11, 5)),
    (lambda m: nn.Conv2d(3, 5, 3, device_mesh=m), lambda: torch.nn.Conv2d(3, 5, 3)),
    (lambda m: nn.Conv1d(4, 6, 2, groups=2, device_mesh=m), lambda: torch.nn.Conv1d(4, 6, 2, groups=2)),
    (lambda m: nn.LayerNorm(5, device_mesh=m), lambda: torch.nn.LayerNorm(5)),
    (lambda m: nn.RMSNorm(5, device_mesh=m), lambda: torch.nn.RMSNorm(5)),
]


@pytest.mark.parametrize("mesh", TP_MESHES, ids=str)
def test_modules_initialise_like_torch_in_sequence(mesh):
    torch.manual_seed(17)
    refs = [make() for _, make in MODULES]
    after = torch.randn(3)
    torch.manual_seed(17)
    ours = [make(mesh) for make, _ in MODULES]
    for o, r in zip(ours, refs):
        for k, v in r.state_dict().items():
            assert torch.equal(o.state_dict()[k], v), f"{type(o).__name__}.{k}"
    assert torch.equal(torch.randn(3), after)


def test_bad_arguments_raise_torchs_errors_and_leave_the_target():
    p = nn.Parameter(dtorch.Tensor(torch.ones(5), device_mesh=MESH3, placements=[Shard(0)]))
    with pytest.raises(ValueError, match="Fan in and fan out"):
        torch.nn.init.xavier_uniform_(p)  # (torch's own check, before any draw)
    with pytest.raises(ValueError, match="Fan in and fan out"):
        torch.nn.init.kaiming_uniform_(p)
    with pytest.raises(TypeError):
        p.detach().uniform_("a")
    _same(p.detach(), torch.ones(5))


def test_new_tensor_methods():
    x = _zeros((MESH22, [Shard(0), Shard(1)]), dtype=torch.bfloat16)
    for got, want in ((x.new_zeros(2, 3), torch.zeros(2, 3, dtype=torch.bfloat16)),
                      (x.new_ones((4,), dtype=torch.int32), torch.ones(4, dtype=torch.int32)),
                      (x.new_full((2,), 7), torch.full((2,), 7, dtype=torch.bfloat16)),
                      (x.new_tensor([[1, 2]]), torch.tensor([[1, 2]], dtype=torch.bfloat16))):
        assert got.device_mesh == MESH22 and got.placements == [Replicate(), Replicate()]
        _same(got, want)
    assert x.new_empty(3).shape == (3,) and x.new_tensor(2.5, device="cpu").item() == 2.5
    assert x.ndimension() == 2 and not x.is_meta
