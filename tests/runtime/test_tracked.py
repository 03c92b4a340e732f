"""runtime/inprocess_tracked.py: a kept local graph's run and VJP, whose layouts come from the specs once per
executable (``_tracked_shapes``, ``_vjp_plan``), give what torch gives, whatever the call site."""
from __future__ import annotations

import torch

import dtorch
from dtorch import Partial, Replicate, Shard
from dtorch.runtime.inprocess import InProcessRuntime
from dtorch.runtime.kernels import kernel
from dtorch.runtime.tapes import RELEASE_NUMEL, drop_values
from dtorch.spec import DTensorSpec


@kernel("test_tracked_scale_rows", align=True)
def _scale_rows(x, w):
    return x * w


@kernel("test_tracked_shift")
def _shift(x, offset):
    return x * 2 + offset.reshape(offset.shape + (1,) * (x.ndim - offset.ndim))


MESH = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])


def _spec(placements, shape):
    return DTensorSpec(MESH, tuple(placements), shape, torch.float64)


def test_one_executable_gives_each_call_site_its_gradient_layout():
    # one executable, called from sites whose cotangent and gradient layouts differ (a weight's gradient as
    # Partial terms, or folded into its sum: Replicate): each gets its own, also when the lists come again
    rt = InProcessRuntime()
    x_spec, w_spec = _spec((Shard(0), Replicate()), (6, 4)), _spec((Replicate(), Replicate()), (4,))
    ex = rt.executable(_scale_rows, (x_spec, w_spec), (x_spec,))
    g = torch.Generator().manual_seed(0)
    x, w, ct = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((6, 4), (4,), (6, 4)))
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    want_x, want_w = torch.autograd.grad(xl * wl, (xl, wl), ct)
    ct_specs = [x_spec]
    sites = [[x_spec, w_spec.with_placements((Partial(), Replicate()))], [x_spec, w_spec]]
    for grad_specs in sites + sites:
        out, tape = ex.run_tracked([rt.from_global(x, x_spec), rt.from_global(w, w_spec)], {}, None, (True, True))
        assert torch.equal(rt.to_global(out[0], x_spec), x * w)
        gx, gw = ex.vjp_tracked(tape, [rt.from_global(ct, x_spec)], ct_specs, (True,), grad_specs)
        assert torch.equal(rt.to_global(gx, grad_specs[0]), want_x)
        assert gw.grid.shape[:2] == grad_specs[1].grid_shape()  # (Partial: a term per dp device)
        torch.testing.assert_close(rt.to_global(gw, grad_specs[1]), want_w, rtol=1e-12, atol=0)


def test_per_device_values_span_the_grid_they_vary_on():
    # a per-device value (an offset per dp row) makes a replicated input's gradient terms per dp device
    rt = InProcessRuntime()
    spec = _spec((Replicate(), Replicate()), (3,))
    partial = spec.with_placements((Partial(), Replicate()))
    ex = rt.executable(_shift, (spec,), (partial,))
    x = torch.arange(3.0, dtype=torch.float64)
    for offsets in ([[1.0, 1.0], [2.0, 2.0]], [[1.0, 1.0], [1.0, 1.0]]):
        out, tape = ex.run_tracked([rt.from_global(x, spec)], {}, {"offset": offsets}, (True,))
        assert torch.equal(rt.to_global(out[0], partial), 4 * x + sum(r[0] for r in offsets))
        (gx,) = ex.vjp_tracked(tape, [rt.from_global(torch.ones(3, dtype=torch.float64), spec)], [spec], (True,),
                               [partial])
        # where the values vary, torch summed both dp devices' gradients (terms: the sum on dp device 0, zeros
        # on 1); where they do not, the one replicated computation's gradient is each device's term
        terms = [4.0, 0.0] if offsets[0] != offsets[1] else [2.0, 2.0]
        assert torch.equal(gx.grid[:, 0], torch.tensor(terms, dtype=torch.float64)[:, None].expand(2, 3))
        assert torch.equal(rt.to_global(gx, partial), torch.full((3,), 4.0, dtype=torch.float64))


def test_dropped_tensors_of_one_shape_stay_apart():
    a, b = torch.randn(RELEASE_NUMEL), torch.randn(RELEASE_NUMEL)
    drop_values(a)
    drop_values(b)
    assert a.shape == b.shape == (RELEASE_NUMEL,) and a.untyped_storage().nbytes() == 4
    a.data = torch.ones(RELEASE_NUMEL)  # (one tensor given new values: the other is not)
    assert b.untyped_storage().nbytes() == 4 and bool((a == 1).all()) and bool((b == 0).all())


def test_a_gradient_handed_out_as_a_view_is_written_in_place_unless_its_base_is_held():
    """A weight's gradient comes out of torch's graph as a view of the GEMM's result (reshaped to its grid):
    ``grids.unbased`` makes it a tensor of its own on the same storage, so the next micro-batch's accumulation
    writes it in place (copy-on-write copied it before); a base someone still holds keeps it copied."""
    from dtorch.runtime.cow import writable
    from dtorch.runtime.grids import unbased

    def grad_as_view(held=None):
        base = torch.randn(6, 4, dtype=torch.float64)
        if held is not None:
            held.append(base)
        return base.view(1, 6, 4)

    # (results taken outside ``assert``: pytest's rewriting holds what an assert reads, a reference more)
    g = grad_as_view()
    view_writable = writable(g)
    own = unbased(grad_as_view())
    own_writable = writable(own)
    assert not view_writable  # what copy-on-write saw before: a copy at the first accumulation
    assert own_writable and own._base is None and own.shape == (1, 6, 4)
    held = []
    shared = unbased(grad_as_view(held))
    shared_writable = writable(shared)
    assert not shared_writable  # the base is held: a write copies first
    torch.testing.assert_close(shared[0], held[0], rtol=0, atol=0)
    plain = own.clone()
    assert unbased(plain) is plain


def test_summed_terms_reduce_and_add_as_their_terms_do():
    """A gradient torch summed over a grid dim (SummedShards): its reduction, the add of two of them and its terms
    once read are bit for bit those of the terms made at once (kernels.as_terms), as before the shortcut."""
    from dtorch.runtime.blocks import reduce_dim
    from dtorch.runtime.kernels import as_terms
    from dtorch.runtime.shards import SummedShards

    rt = InProcessRuntime()
    spec = _spec((Shard(0), Partial()), (6, 5))
    after = _spec((Shard(0), Replicate()), (6, 5))
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(2, 1, 3, 5, generator=g, dtype=torch.float64) for _ in range(2))
    ta, tb = as_terms(a, (2, 2), 2), as_terms(b, (2, 2), 2)
    assert SummedShards(a, (2, 2)).summed == (1,)
    add = rt.executable(dtorch.ops.pointwise._pointwise_kernel, (spec, spec), (spec,))
    kw = {"fn": "torch.add", "template": None, "kwargs": ()}
    for _ in range(3):  # (the executable binds itself after two runs with one kwargs dict)
        s = add.run([SummedShards(a, (2, 2)), SummedShards(b, (2, 2))], kw)[0]
        assert type(s) is SummedShards
        reduced = rt.all_reduce(s, spec, after, 1).grid
        assert torch.equal(reduced, reduce_dim("sum", ta + tb, 1))
    assert torch.equal(SummedShards(a, (2, 2)).grid, ta)
    c = torch.randn(2, 1, 3, 4, generator=g, dtype=torch.float64)  # (an even scatter: grid form)
    part, scatter = _spec((Shard(0), Partial()), (6, 4)), _spec((Shard(0), Shard(1)), (6, 4))
    scattered = rt.reduce_scatter(SummedShards(c, (2, 2)), part, scatter, 1)
    assert torch.equal(scattered.grid, rt.reduce_scatter(_shards(as_terms(c, (2, 2), 2)), part, scatter, 1).grid)
    read = SummedShards(a, (2, 2))
    terms = read.grid  # read as terms: from now on the handle is its terms (they may be written in place)
    assert read.value is None and torch.equal(rt.all_reduce(read, spec, after, 1).grid, reduce_dim("sum", terms, 1))
    mixed = add.run([SummedShards(a, (2, 2)), _shards(tb)], kw)[0]  # one of them as terms: the terms' add
    assert torch.equal(mixed.grid, ta + tb)


def _shards(grid):
    from dtorch.runtime.shards import Shards
    return Shards(grid=grid)


def test_input_gradients_torch_summed_over_tp_match_torch_even_and_uneven(monkeypatch):
    """Column-parallel matmuls of one replicated activation (torch's autograd sums its gradient over tp; a leaf's
    would be folded into Replicate at once), two of them so their gradients are added before the reduction: the
    gradients are torch's, on an even batch (grid form, the sums taken as they are) and an uneven one (blocks
    form); the tp reduction still shows in CommLog."""
    from dtorch.runtime.shards import SummedShards

    taken = []
    all_reduce = InProcessRuntime.all_reduce

    def spy(self, h, *args):  # (a sum reaching its reduction: a SummedShards whose terms nothing read)
        taken.append(type(h) is SummedShards and h.value is not None)
        return all_reduce(self, h, *args)

    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    for rows in (6, 7):
        g = torch.Generator().manual_seed(rows)
        x, w1, w2 = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((rows, 5), (5, 6), (5, 4)))
        xl, w1l, w2l = (t.clone().requires_grad_() for t in (x, w1, w2))
        h = xl * 1.5
        ((h @ w1l).square().sum() + (h @ w2l).sin().sum()).backward()
        dx = dtorch.from_torch(x, device_mesh=mesh, placements=[Shard(0), Replicate()]).requires_grad_()
        dw1, dw2 = (dtorch.from_torch(w, device_mesh=mesh, placements=[Replicate(), Shard(1)]).requires_grad_()
                    for w in (w1, w2))
        taken.clear()
        with monkeypatch.context() as m, dtorch.CommLog() as log:
            m.setattr(InProcessRuntime, "all_reduce", spy)
            h = dx * 1.5
            ((h @ dw1).square().sum() + (h @ dw2).sin().sum()).backward()
        assert any(taken) == (rows == 6)  # the even batch's gradient reached its reduction as its sum
        assert log.counts().get(("all_reduce", "tp"), 0) >= 1
        for d, t in ((dx, xl), (dw1, w1l), (dw2, w2l)):
            torch.testing.assert_close(d.grad.to_torch(), t.grad, rtol=1e-12, atol=1e-12)
