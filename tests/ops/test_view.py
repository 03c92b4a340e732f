"""Shape/view ops: every input placement on 1-D/2-D/3-D meshes equals torch; shards follow the data."""
import itertools

import pytest
import torch

import dtorch
from dtorch import DTorchError, OpError, Partial, Replicate, Shard
from dtorch.ops import view as V
from dtorch.spec import DTensorSpec, shard_range
from promises import concatenation, follows
from sweep import MESH_1D, MESH_2D, MESH_3D, MESHES, check, distribute, run_sweep

torch.manual_seed(0)
A = torch.randn(5, 6, 7)        # uneven on every mesh
A2 = torch.randn(5, 3, 7)       # cat partner of A on dim 1
B = torch.randn(6, 4)
E = torch.randn(4, 6, 8)        # even on MESH_2D / MESH_3D: exercises the stacked-grid kernels
S1 = torch.randn(5, 1, 6, 1)    # size-1 dims to squeeze / expand
C1 = torch.randn(5, 1, 7)
INTS = torch.arange(30).reshape(5, 6)


def same(f):
    return f, f


# (id, dtorch fn, torch fn, inputs): each runs on every placement of every input, on every mesh
CASES = [
    # view / reshape: merges, splits, regroups, -1, torch.Size, every spelling
    ("view_merge_inner", *same(lambda t: t.view(5, 42)), [A]),
    ("view_merge_outer", *same(lambda t: t.view(30, 7)), [A]),
    ("view_split", *same(lambda t: t.view(5, 2, 3, 7)), [A]),
    ("view_minus1", *same(lambda t: t.view(-1, 7)), [A]),
    ("view_size", *same(lambda t: t.view(torch.Size([2, 3, 4]))), [B]),
    ("view_regroup", *same(lambda t: t.view(4, 6)), [B]),
    ("view_regroup_3d", *same(lambda t: t.reshape(3, 8)), [B]),
    ("view_even", *same(lambda t: t.view(4, 48)), [E]),
    ("view_even_split", *same(lambda t: t.view(2, 2, 3, 2, 8)), [E]),
    ("view_singletons", *same(lambda t: t.view(5, 6, 1, 7, 1)), [A]),
    ("view_as", *same(lambda t: t.view_as(torch.empty(30, 7))), [A]),
    ("reshape_tuple", *same(lambda t: t.reshape((6, 35))), [A]),
    ("reshape_as", *same(lambda t: t.reshape_as(torch.empty(2, 12))), [B]),
    ("torch.reshape", lambda t: torch.reshape(t, (3, 2, 4)), lambda t: torch.reshape(t, (3, 2, 4)), [B]),
    ("dtorch.reshape", lambda t: dtorch.reshape(t, (24,)), lambda t: torch.reshape(t, (24,)), [B]),
    ("flatten", *same(lambda t: t.flatten()), [A]),
    ("flatten_1", *same(lambda t: t.flatten(1)), [A]),
    ("torch.flatten", *same(lambda t: torch.flatten(t, 0, 1)), [A]),
    ("unflatten", *same(lambda t: t.unflatten(1, (2, -1))), [A]),
    ("torch.unflatten", *same(lambda t: torch.unflatten(t, -1, (2, 2))), [B]),
    ("squeeze_all", *same(lambda t: t.squeeze()), [S1]),
    ("squeeze_dim", *same(lambda t: t.squeeze(1)), [S1]),
    ("squeeze_tuple", *same(lambda t: torch.squeeze(t, (1, -1))), [S1]),
    ("squeeze_noop", *same(lambda t: t.squeeze(0)), [S1]),
    ("unsqueeze", *same(lambda t: t.unsqueeze(1)), [A]),
    ("torch.unsqueeze", *same(lambda t: torch.unsqueeze(t, -1)), [A]),
    ("contiguous", *same(lambda t: t.contiguous()), [A]),
    # permutations
    ("transpose", *same(lambda t: t.transpose(0, 2)), [A]),
    ("torch.transpose", *same(lambda t: torch.transpose(t, -1, -2)), [A]),
    ("swapaxes", *same(lambda t: t.swapaxes(0, 1)), [A]),
    ("t", *same(lambda t: t.t()), [B]),
    ("torch.t", *same(lambda t: torch.t(t)), [B]),
    ("T", *same(lambda t: t.T), [B]),
    ("mT", *same(lambda t: t.mT), [A]),
    ("permute", *same(lambda t: t.permute(2, 0, 1)), [A]),
    ("torch.permute", *same(lambda t: torch.permute(t, (1, 2, 0))), [A]),
    ("movedim", *same(lambda t: torch.movedim(t, 0, -1)), [A]),
    # expand / repeat / repeat_interleave
    ("expand", *same(lambda t: t.expand(5, 3, 7)), [C1]),
    ("expand_new_dims", *same(lambda t: t.expand(2, -1, 4, -1)), [C1]),
    ("expand_as", *same(lambda t: t.expand_as(torch.empty(5, 2, 7))), [C1]),
    ("broadcast_to", *same(lambda t: torch.broadcast_to(t, (5, 6, 7))), [C1]),
    ("repeat", *same(lambda t: t.repeat(2, 1, 3)), [A]),
    ("repeat_new_dim", *same(lambda t: t.repeat(2, 1, 1)), [B]),
    ("repeat_interleave", *same(lambda t: t.repeat_interleave(2, dim=1)), [A]),
    ("torch.repeat_interleave", *same(lambda t: torch.repeat_interleave(t, 3, -1)), [B]),
    ("repeat_interleave_flat", *same(lambda t: t.repeat_interleave(2)), [B]),
    # indexing, narrow, chunk, split, unbind
    ("getitem_int", *same(lambda t: t[1]), [A]),
    ("getitem_neg_int", *same(lambda t: t[-1, :, -3]), [A]),
    ("getitem_slice", *same(lambda t: t[1:4]), [A]),
    ("getitem_step", *same(lambda t: t[:, ::2, 1::3]), [A]),
    ("getitem_none", *same(lambda t: t[None, :, None]), [A]),
    ("getitem_ellipsis", *same(lambda t: t[..., 2]), [A]),
    ("getitem_mixed", *same(lambda t: t[1:, None, ..., -2]), [A]),
    ("getitem_empty_slice", *same(lambda t: t[:, 5:2]), [A]),
    ("getitem_full", *same(lambda t: t[:, :]), [A]),
    ("narrow", *same(lambda t: t.narrow(1, 1, 3)), [A]),
    ("torch.narrow_neg", *same(lambda t: torch.narrow(t, -1, -3, 2)), [A]),
    ("chunk", *same(lambda t: t.chunk(3, 1)), [A]),
    ("torch.chunk", *same(lambda t: torch.chunk(t, 4, -1)), [A]),
    ("split_int", *same(lambda t: t.split(2)), [A]),
    ("split_list", *same(lambda t: torch.split(t, [1, 4, 2], dim=2)), [A]),
    ("unbind", *same(lambda t: t.unbind(1)), [B]),
    ("torch.unbind", *same(lambda t: torch.unbind(t, -1)), [A[:, :, :3]]),
    ("iterate", lambda t: tuple(t), lambda t: tuple(t), [B]),
    # cat / stack
    ("cat", *same(lambda x, y: torch.cat([x, y], 1)), [A, A2]),
    ("dtorch.cat", lambda x, y: dtorch.cat((x, y), dim=-2), lambda x, y: torch.cat((x, y), -2), [A, A2]),
    ("concat", *same(lambda x, y: torch.concat([y, x], 1)), [A, A2]),
    ("cat_dim0", *same(lambda x, y: torch.cat([x, y, x], 0)), [B, B[:2]]),
    ("stack", *same(lambda x, y: torch.stack([x, y])), [A, A * 2]),
    ("dtorch.stack", lambda x, y: dtorch.stack([x, y], -1), lambda x, y: torch.stack([x, y], -1), [B, B + 1]),
    # tril / triu
    ("tril", *same(lambda t: t.tril()), [B]),
    ("triu_diag", *same(lambda t: t.triu(1)), [B]),
    ("torch.tril_batched", *same(lambda t: torch.tril(t, -2)), [A]),
    ("torch.triu_batched", *same(lambda t: torch.triu(t, 2)), [A]),
    ("tril_even", *same(lambda t: t.tril(1)), [E]),
    ("triu_even", *same(lambda t: t.triu(-1)), [E]),
]


ID = {0: 0, 1: 1, 2: 2}
# where each case's input dims go: follows({input dim: output dim kept 1:1}, dims not pinned down); any
# other sharded dim is gathered (sliced, indexed, inner in a flatten, broadcast, repeated)
PROMISES = {
    "view_merge_inner": follows({0: 0}, (1,)), "view_merge_outer": follows({2: 1}, (0,)),
    "view_split": follows({0: 0, 2: 3}, (1,)), "view_minus1": follows({2: 1}, (0,)),
    "view_size": follows({1: 2}, (0,)), "view_regroup": follows({}, (0,)), "view_regroup_3d": follows({}, (0,)),
    "view_even": follows({0: 0}, (1,)), "view_even_split": follows({2: 4}, (0, 1)),
    "view_singletons": follows({0: 0, 1: 1, 2: 3}), "view_as": follows({2: 1}, (0,)),
    "reshape_tuple": follows({}, (0,)), "reshape_as": follows({}, (0,)), "torch.reshape": follows({1: 2}, (0,)),
    "dtorch.reshape": follows({}, (0,)), "flatten": follows({}, (0,)), "flatten_1": follows({0: 0}, (1,)),
    "torch.flatten": follows({2: 1}, (0,)), "unflatten": follows({0: 0, 2: 3}, (1,)),
    "torch.unflatten": follows({0: 0}, (1,)),
    "squeeze_all": follows({0: 0, 2: 1}, (1, 3)), "squeeze_dim": follows({0: 0, 2: 1, 3: 2}, (1,)),
    "squeeze_tuple": follows({0: 0, 2: 1}, (1, 3)), "squeeze_noop": follows({0: 0, 1: 1, 2: 2, 3: 3}),
    "unsqueeze": follows({0: 0, 1: 2, 2: 3}), "torch.unsqueeze": follows(ID), "contiguous": follows(ID),
    "transpose": follows({0: 2, 1: 1, 2: 0}), "torch.transpose": follows({0: 0, 1: 2, 2: 1}),
    "swapaxes": follows({0: 1, 1: 0, 2: 2}), "t": follows({0: 1, 1: 0}), "torch.t": follows({0: 1, 1: 0}),
    "T": follows({0: 1, 1: 0}), "mT": follows({0: 0, 1: 2, 2: 1}), "permute": follows({0: 1, 1: 2, 2: 0}),
    "torch.permute": follows({0: 2, 1: 0, 2: 1}), "movedim": follows({0: 2, 1: 0, 2: 1}),
    "expand": follows({0: 0, 2: 2}), "expand_new_dims": follows({0: 1, 2: 3}), "expand_as": follows({0: 0, 2: 2}),
    "broadcast_to": follows({0: 0, 2: 2}), "repeat": follows({1: 1}), "repeat_new_dim": follows({0: 1, 1: 2}),
    # an interleaved dim keeps its shard where the block boundaries line up (the table says "repeated -> R")
    "repeat_interleave": follows({0: 0, 2: 2}, (1,)), "torch.repeat_interleave": follows({0: 0}, (1,)),
    "repeat_interleave_flat": follows({}, (0,)),
    "getitem_int": follows({1: 0, 2: 1}), "getitem_neg_int": follows({1: 0}), "getitem_slice": follows({1: 1, 2: 2}),
    "getitem_step": follows({0: 0}), "getitem_none": follows({0: 1, 1: 3, 2: 4}),
    "getitem_ellipsis": follows({0: 0, 1: 1}), "getitem_mixed": follows({1: 2}),
    "getitem_empty_slice": follows({0: 0, 2: 2}), "getitem_full": follows(ID),
    "narrow": follows({0: 0, 2: 2}), "torch.narrow_neg": follows({0: 0, 1: 1}),
    "chunk": follows({0: 0, 2: 2}), "torch.chunk": follows({0: 0, 1: 1}), "split_int": follows({1: 1, 2: 2}),
    "split_list": follows({0: 0, 1: 1}), "unbind": follows({0: 0}), "torch.unbind": follows({0: 0, 1: 1}),
    "iterate": follows({1: 0}),
    "cat": lambda m, x, y: concatenation(m, 1, x, y), "dtorch.cat": lambda m, x, y: concatenation(m, -2, x, y),
    "concat": lambda m, x, y: concatenation(m, 1, y, x), "cat_dim0": lambda m, x, y: concatenation(m, 0, x, y, x),
    "stack": lambda m, x, y: concatenation(m, 0, x, y, new=True),
    "dtorch.stack": lambda m, x, y: concatenation(m, -1, x, y, new=True),
    # tril/triu keep every shard (a partial: not stated)
    **{name: follows({0: 0, 1: 1, 2: 2}) for name in ("tril", "triu_diag", "torch.tril_batched",
                                                       "torch.triu_batched", "tril_even", "triu_even")},
}


@pytest.mark.parametrize("name,dt_fn,torch_fn,inputs", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_on_every_placement(name, dt_fn, torch_fn, inputs):
    assert run_sweep(dt_fn, torch_fn, inputs, limit=30, placements=PROMISES[name]) > 0


def test_every_case_has_a_promise():
    assert set(PROMISES) == {c[0] for c in CASES}


def test_integer_and_bool_dtypes():
    run_sweep(lambda t: t.view(3, 10)[1:, ::3], lambda t: t.view(3, 10)[1:, ::3], [INTS], limit=15)
    run_sweep(lambda t: (t > 10).tril(), lambda t: (t > 10).tril(), [INTS], limit=15)
    run_sweep(lambda x, y: torch.cat([x, y], 1), lambda x, y: torch.cat([x, y], 1), [INTS, B[:5].double()], limit=15)


def test_cat_skips_legacy_empty_1d():
    x = distribute(B, MESH_2D, [Shard(0), Replicate()])
    check(dtorch.cat([x, torch.empty(0)]), torch.cat([B, torch.empty(0)]))


def test_empty_tensors():
    z = torch.randn(0, 6)
    for pl in ([Shard(0)], [Shard(1)], [Partial()]):
        x = distribute(z, MESH_1D, pl)
        check(x.view(3, 0, 2), z.view(3, 0, 2))
        check(x.transpose(0, 1), z.transpose(0, 1))


def test_other_partial_ops_pass_through():
    m = MESH_2D
    for op in ("avg", "max", "min"):
        x = distribute(A, m, [Partial(op), Shard(2)])
        with dtorch.CommLog() as log:
            outs = [x.view(30, 7), x.transpose(0, 1), x[1:3], x.tril(), torch.cat([x, x], 1), x.expand(2, 5, 6, 7)]
            computed(outs)
        assert log.counts() == {}
        for o, e in zip(outs, [A.view(30, 7), A.transpose(0, 1), A[1:3], A.tril(), torch.cat([A, A], 1), A.expand(2, 5, 6, 7)]):
            assert o.placements[0] == Partial(op)
            check(o, e)


# ------------------------------------------------------------------------------------------------
# communication: shards follow the data; the minimum is gathered when they cannot


def computed(out):
    """``out`` with its value computed: a view's is computed (and communicates) when first read."""
    for t in out if isinstance(out, (list, tuple)) else (out,):
        t.local_blocks()
    return out

FREE = [
    # (input, mesh, placements, op, output placements): no collective at all
    (A, MESH_2D, [Shard(0), Shard(2)], lambda t: t.transpose(0, 2), [Shard(2), Shard(0)]),
    (A, MESH_3D, [Shard(1), Partial(), Shard(2)], lambda t: t.permute(2, 0, 1), [Shard(2), Partial(), Shard(0)]),
    (A, MESH_2D, [Shard(1), Shard(2)], lambda t: t.unsqueeze(0), [Shard(2), Shard(3)]),
    (A, MESH_2D, [Shard(0), Shard(1)], lambda t: t.view(5, 6, 1, 7), [Shard(0), Shard(1)]),
    (A, MESH_2D, [Shard(0), Partial()], lambda t: t.view(5, 42), [Shard(0), Partial()]),  # shard on a whole dim
    (torch.randn(4, 6), MESH_2D, [Shard(0), Replicate()], lambda t: t.flatten(), [Shard(0), Replicate()]),
    (torch.randn(8, 3), MESH_2D, [Shard(0), Shard(0)], lambda t: t.view(24), [Shard(0), Shard(0)]),
    (torch.randn(24), MESH_2D, [Shard(0), Replicate()], lambda t: t.view(6, 4), [Shard(0), Replicate()]),
    (torch.randn(2, 12, 5), MESH_1D, [Shard(1)], lambda t: t.view(2, 3, 4, 5), [Shard(1)]),  # heads split
    (torch.randn(2, 3, 4, 5), MESH_1D, [Shard(1)], lambda t: t.reshape(2, 12, 5), [Shard(1)]),  # heads merged
    (A, MESH_1D, [Shard(1)], lambda t: t.repeat_interleave(2, 1), [Shard(1)]),
    (C1, MESH_2D, [Shard(0), Shard(2)], lambda t: t.expand(3, 5, 4, 7), [Shard(1), Shard(3)]),
    (A, MESH_2D, [Shard(0), Shard(2)], lambda t: t.tril(1), [Shard(0), Shard(2)]),
    (E, MESH_2D, [Shard(1), Shard(2)], lambda t: t.triu(-1), [Shard(1), Shard(2)]),
    (A, MESH_2D, [Shard(0), Partial()], lambda t: t[:, 1:5:2, None, 3], [Shard(0), Partial()]),
    (A, MESH_2D, [Partial(), Shard(2)], lambda t: t.narrow(0, 1, 3), [Partial(), Shard(2)]),
    (A, MESH_1D, [Shard(2)], lambda t: t.chunk(2, 1)[1], [Shard(2)]),
    (A, MESH_1D, [Shard(0)], lambda t: t.unbind(2)[3], [Shard(0)]),
    (A, MESH_2D, [Shard(0), Shard(2)], lambda t: torch.cat([t, t * 1], 1), [Shard(0), Shard(2)]),
    (A, MESH_2D, [Shard(0), Partial()], lambda t: torch.stack([t, t], 1), [Shard(0), Partial()]),
]


@pytest.mark.parametrize("x,mesh,pl,fn,out_pl", FREE)
def test_communication_free_when_shards_follow(x, mesh, pl, fn, out_pl):
    d = distribute(x, mesh, pl)
    with dtorch.CommLog() as log:
        out = computed(fn(d))
    assert log.counts() == {}, log.table()
    assert out.placements == out_pl
    check(out, fn(x))


GATHER = [
    # (input, mesh, placements, op, expected collectives, output placements)
    (torch.randn(5, 6), MESH_1D, [Shard(0)], lambda t: t.view(30),  # 5 rows over 3: blocks of 2 rows != 10 elements
     {("all_gather", "a"): 1}, [Replicate()]),
    (torch.randn(4, 6), MESH_2D, [Replicate(), Shard(1)], lambda t: t.flatten(),  # shard on the inner flattened dim
     {("all_gather", "b"): 1}, [Replicate(), Replicate()]),
    (torch.randn(6), MESH_1D, [Shard(0)], lambda t: t.view(2, 3),  # blocks of 2 do not fall on rows of 3
     {("all_gather", "a"): 1}, [Replicate()]),
    (torch.randn(6, 4), MESH_2D, [Shard(0), Shard(0)], lambda t: t.view(24),  # the outer level stays, the inner goes
     {("all_gather", "b"): 1}, [Shard(0), Replicate()]),
    (A, MESH_2D, [Shard(1), Partial()], lambda t: t.narrow(1, 1, 3), {("all_gather", "a"): 1}, [Replicate(), Partial()]),
    (A, MESH_2D, [Shard(0), Shard(1)], lambda t: t[2], {("all_gather", "a"): 1}, [Replicate(), Shard(0)]),
    (A, MESH_2D, [Shard(1), Shard(2)], lambda t: torch.cat([t, t], 1), {("all_gather", "a"): 2}, [Replicate(), Shard(2)]),
    (A, MESH_1D, [Shard(1)], lambda t: t.repeat(1, 2, 1), {("all_gather", "a"): 1}, [Replicate()]),
]


@pytest.mark.parametrize("x,mesh,pl,fn,comms,out_pl", GATHER)
def test_only_the_needed_collective_when_layout_breaks(x, mesh, pl, fn, comms, out_pl):
    d = distribute(x, mesh, pl)
    with dtorch.CommLog() as log:
        out = computed(fn(d))
    assert log.counts() == comms, log.table()
    assert out.placements == out_pl
    check(out, fn(x))


def test_cat_aligns_inputs_on_a_common_placement():
    x = distribute(A, MESH_2D, [Shard(0), Replicate()])
    y = distribute(A2, MESH_2D, [Replicate(), Shard(2)])
    with dtorch.CommLog() as log:
        out = torch.cat([x, y], 1)
    assert log.counts() == {}  # replicated sides are sliced locally to meet the other input's shards
    assert out.placements == [Shard(0), Shard(2)]
    check(out, torch.cat([A, A2], 1))


# ------------------------------------------------------------------------------------------------
# the layout arithmetic against its definition (spec.local_box-style nested torch.chunk ranges)


def _flat_blocks(n, unit, mesh_sizes):
    """Each device's flat element range for a dim of n elements of ``unit`` flat elements, nested shards."""
    out = []
    for coord in itertools.product(*[range(m) for m in mesh_sizes]):
        off, size = 0, n
        for m, c in zip(mesh_sizes, coord):
            o, size = shard_range(size, m, c)
            off += o
        out.append((off * unit, size * unit))
    return out


def test_levels_kept_is_exact():
    for n, rin, rout, ms in itertools.product(range(1, 9), (1, 2, 3), (1, 2, 4), [(2,), (3,), (2, 2), (3, 2), (2, 3)]):
        total = n * rin
        if total % rout:
            continue
        kept = V._levels_kept(n, rin, rout, ms)
        for k in range(min(kept + 1, len(ms)) + 1):  # the kept levels agree; one more level would not
            agree = _flat_blocks(n, rin, ms[:k]) == _flat_blocks(total // rout, rout, ms[:k])
            assert agree == (k <= kept), (n, rin, rout, ms, k, kept)


def test_view_map_vocabulary():
    I, F, Sp = V.InputDim, V.Flatten, V.Split
    assert V.view_map((5, 6, 7), (5, 42)) == (I(0), F((I(1), I(2))))
    assert V.view_map((6, 4), (2, 3, 4)) == (Sp(I(0), (2, 3), 0), Sp(I(0), (2, 3), 1), I(1))
    assert V.view_map((6, 4), (4, 6)) == tuple(Sp(F((I(0), I(1))), (4, 6), k) for k in range(2))
    assert V.view_map((5, 1, 6), (5, 6, 1)) == (I(0), I(2), V.Singleton())


# ------------------------------------------------------------------------------------------------
# errors: typed, and saying what to change


def test_unsupported_indexing_raises_typed_error():
    # (tensor, list and mask indexing: tests/ops/test_indexing.py)
    x = distribute(A, MESH_1D, [Shard(0)])
    for bad in (1.5, "a", False):
        with pytest.raises(V.UnsupportedIndexError) as info:
            x[bad]
        assert isinstance(info.value, NotImplementedError) and isinstance(info.value, DTorchError)


def test_bad_indices_and_dims():
    x = distribute(A, MESH_1D, [Shard(0)])
    with pytest.raises(IndexError, match="out of bounds for dim 1 with size 6"):
        x[0, 6]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0, 0]
    assert torch.equal(x[..., 0, ...].to_torch(), A[..., 0, ...])  # torch: later ellipses take no dims
    with pytest.raises(OpError, match="step must be greater than zero"):
        x[::-1]
    with pytest.raises(IndexError, match=r"use a dim in \[-3, 2\]"):
        x.transpose(0, 3)
    with pytest.raises(IndexError, match=r"use a dim in \[-4, 3\]"):
        x.unsqueeze(5)
    with pytest.raises(IndexError, match="exceeds dim 1's size 6"):
        x.narrow(1, 4, 3)


def test_bad_arguments():
    x = distribute(A, MESH_2D, [Shard(0), Partial()])
    checks = [
        (lambda: x.view(4, 50), "invalid for input of size 210"),
        (lambda: x.permute(0, 0, 1), "not a permutation"),
        (lambda: x.flatten(2, 1), "start_dim"),
        (lambda: x.unflatten(1, (4, 2)), "do not multiply"),
        (lambda: x.t(), "at most 2 dims"),
        (lambda: x.view(torch.float16), "use .to"),
        (lambda: x.expand(5, 3, 7), "expand"),
        (lambda: x.repeat(2, 2), "repeat"),
        (lambda: x[0, 0].tril(), "at least 2 dims"),
        (lambda: torch.cat([x, distribute(B, MESH_2D, [Replicate(), Replicate()])], 1), "cat"),
        (lambda: torch.cat([x, distribute(A, MESH_1D, [Replicate()])]), "different meshes"),
        (lambda: x.split([2, 2], 1), "split"),
        (lambda: x.repeat_interleave(torch.tensor([1, 2, 3, 1, 1])), "int number of repeats"),
    ]
    for fn, msg in checks:
        with pytest.raises(OpError, match=msg):
            fn()
    check(x, A)  # the failed calls left the input usable


def test_every_spelling_is_registered():
    for name in ("reshape", "flatten", "unflatten", "transpose", "permute", "unsqueeze", "squeeze", "repeat_interleave",
                 "narrow", "chunk", "split", "tensor_split", "unbind", "cat", "concat", "stack", "tril", "triu", "t",
                 "movedim"):
        assert callable(getattr(dtorch, name)), name
    for meth in ("view", "reshape", "flatten", "unflatten", "transpose", "t", "permute", "contiguous", "unsqueeze",
                 "squeeze", "expand", "expand_as", "repeat", "repeat_interleave", "narrow", "chunk", "split",
                 "tensor_split", "unbind", "tril", "triu", "view_as", "reshape_as", "swapaxes", "movedim"):
        assert callable(getattr(dtorch.Tensor, meth)), meth


# -- chunk / split / tensor_split / unbind: every piece count and size, every layout -----------------

MESH_4 = dtorch.init_device_mesh("cpu", (4,), mesh_dim_names=["a"])
MESH_23 = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["a", "b"])


def _cuts(n):
    """Every piece count / size torch takes for a dim of size ``n`` (one piece, more pieces than elements,
    uneven pieces, empty pieces, indices out of order and out of range)."""
    out = []
    for k in range(1, n + 2):
        out += [lambda t, d, k=k: t.chunk(k, d), lambda t, d, k=k: t.split(k, d),
                lambda t, d, k=k: torch.tensor_split(t, k, d)]
    for sizes in ([n], [1, n - 1] if n else [0, 0], [0, n], [n // 2, 0, n - n // 2]):
        out.append(lambda t, d, s=sizes: torch.split(t, s, d))
    for idx in ([1, 3], [3, 1], [-2], [n + 2], [], [0, n]):
        out.append(lambda t, d, i=idx: t.tensor_split(i, d))
    out.append(lambda t, d: torch.tensor_split(t, torch.tensor([1, 2]), d))
    out += [lambda t, d: torch.chunk(t, 1, d), lambda t, d: torch.unbind(t, d)]
    return out


@pytest.mark.parametrize("shape", [(8,), (2,), (7,), (5, 3), (0, 2)], ids=str)
def test_chunk_split_tensor_split_unbind_every_piece_count_and_layout(shape):
    # a single piece along a sharded dim used to fail ("split_with_sizes expects ...")
    full = torch.randn(shape)
    layouts = [(MESH_4, [Replicate()]), (MESH_4, [Partial()]), (MESH_4, [Partial("max")]),
               (MESH_2D, [Shard(0), Shard(0)]), (MESH_23, [Partial(), Shard(0)])]
    layouts += [(MESH_4, [Shard(d)]) for d in range(len(shape))]
    layouts += [(MESH_23, [Shard(len(shape) - 1), Partial("avg")]), (MESH_23, [Shard(0), Shard(len(shape) - 1)])]
    n = 0
    for mesh, pl in layouts:
        x = distribute(full, mesh, pl)
        for d in range(len(shape)):
            for cut in _cuts(shape[d]):
                try:
                    check(cut(x, d), cut(full, d))
                except AssertionError as exc:
                    raise AssertionError(f"{mesh} {pl} dim {d}: {exc}") from None
                n += 1
        check(x, full)  # the input is untouched
    assert n > 100
