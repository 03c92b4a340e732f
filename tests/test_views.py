"""Views share storage with their base, as torch's do (ops/views.py, ops/view_writes.py): a write through any
view shows in the base and in every live view, a write into the base shows in its views, in every layout;
autograd through such writes and torch's version-counter errors; ``.data``, ``detach()``, ``select``,
``diagonal``, 0-d index tensors, ``Tensor.view([placements])``; which writes communicate (CommLog). Each
dtorch tensor is compared with its torch twin, to which the same was done."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtorch
from dtorch import CommLog, Partial, Replicate, Shard
from dtorch.ops.views import View, ViewError
from sweep import distribute

DP = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["dp"])
M3 = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["a"])
M22 = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["a", "b"])
M23 = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "tp"])
X = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))  # 5 rows: uneven over 2 and 3 devices
Y = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))

LAYOUTS = [(DP, [Shard(0)]), (DP, [Shard(1)]), (DP, [Replicate()]), (DP, [Partial()]), (M3, [Shard(0)]),
           (M22, [Shard(0), Shard(1)]), (M22, [Shard(1), Shard(0)]), (M22, [Shard(0), Shard(0)]),
           (M22, [Replicate(), Partial()]), (M23, [Shard(0), Shard(1)])]

# issue 21, item 1: each was silently lost before (the base unchanged)
EXAMPLES = {
    "x[1:3].zero_()": lambda x, y: x[1:3].zero_(),
    "x[0].fill_(7)": lambda x, y: x[0].fill_(7),
    "x[:, 2].mul_(0)": lambda x, y: x[:, 2].mul_(0),
    "x.view(-1).add_(1)": lambda x, y: x.view(-1).add_(1),
    "x.t().mul_(2)": lambda x, y: x.t().mul_(2),
    "x.narrow(0, 2, 2).copy_(y)": lambda x, y: x.narrow(0, 2, 2).copy_(y),
    "x.unsqueeze(0).sub_(1)": lambda x, y: x.unsqueeze(0).sub_(1),
    "x[:][1].fill_(3)": lambda x, y: x[:][1].fill_(3),
    # and more view kinds and chains
    "x.diagonal().zero_()": lambda x, y: x.diagonal().zero_(),
    "x.diagonal(1).add_(x[0, :3])": lambda x, y: x.diagonal(1).add_(y[0, :3]),
    "x[1:3][0] = 5": lambda x, y: x[1:3].__setitem__(0, 5.0),
    "x.view(2, 10)[1].add_(1)": lambda x, y: x.view(2, 10)[1].add_(1),
    "x[::2, 1:].mul_(y)": lambda x, y: x[::2, 1:].mul_(y[0, :3]),
    "x.select(1, 3).clamp_(0, 0.1)": lambda x, y: x.select(1, 3).clamp_(0, 0.1),
    "x.data.add_(1)": lambda x, y: x.data.add_(1),
    "x.detach()[2].zero_()": lambda x, y: x.detach()[2].zero_(),
    "x.T[1:3, ::2] += 1": lambda x, y: x.T[1:3, ::2].__iadd__(1),
    "x.chunk(2, 1)[1].masked_fill_(m, 9)": lambda x, y: x.chunk(2, 1)[1].masked_fill_(y[:1, :2] > 0, 9.0),
    "x.unbind(1)[2].copy_(x[:, 0])": lambda x, y: x.unbind(1)[2].copy_(x[:, 0]),
    "x.reshape(4, 5).t()[1].sub_(y[0])": lambda x, y: x.reshape(4, 5).t()[1].sub_(y[0]),
}


def _live(x):
    """Views of ``x`` taken (and read) before the write: they must show it too."""
    return [x[1:4], x.t(), x.view(-1), x[:, 1]]


@pytest.mark.parametrize("mesh,pl", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_a_write_through_a_view_shows_in_the_base_and_every_view(name, mesh, pl):
    fn = EXAMPLES[name]
    tx, ty = X.clone(), Y.clone()
    x, y = distribute(X, mesh, pl), dtorch.Tensor(Y, device_mesh=mesh)
    tviews, views = _live(tx), _live(x)
    for v in views:
        v.to_torch()
    fn(tx, ty)
    out = fn(x, y)
    assert out is None or isinstance(out, dtorch.Tensor)
    assert x.placements == pl
    torch.testing.assert_close(x.to_torch(), tx)
    for v, tv in zip(views, tviews):
        torch.testing.assert_close(v.to_torch(), tv)


@pytest.mark.parametrize("mesh,pl", LAYOUTS, ids=lambda v: str(v))
def test_a_write_into_the_base_shows_in_its_views(mesh, pl):
    tx = X.clone()
    x = distribute(X, mesh, pl)
    tviews, views = _live(tx) + [tx.diagonal(), tx.detach()], _live(x) + [x.diagonal(), x.detach()]
    views[0].to_torch()  # one read before, the others first read after the writes
    for op in (lambda t: t.mul_(2), lambda t: t.__setitem__((slice(None), 0), 1.5), lambda t: t.add_(Y[:1])):
        op(tx)
        op(x)
        for v, tv in zip(views, tviews):
            torch.testing.assert_close(v.to_torch(), tv)


def test_the_view_itself_is_the_result_of_the_inplace_op():
    x = distribute(X, DP, [Shard(0)])
    v = x[1:3]
    assert isinstance(v, View) and v.add_(1) is v and (v.__iadd__(1)) is v
    torch.testing.assert_close(x.to_torch()[1:3], X[1:3] + 2)


def test_the_embedding_idiom_under_no_grad():
    for kw in ({}, {"vocab_parallel": True}):
        torch.manual_seed(0)
        emb = dtorch.nn.Embedding(6, 4, device_mesh=dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"]), **kw)
        before = emb.weight.to_torch()
        with torch.no_grad():
            emb.weight[0].zero_()
            emb.weight[2:4].mul_(2)
        expected = before.clone()
        expected[0] = 0
        expected[2:4] *= 2
        torch.testing.assert_close(emb.weight.to_torch(), expected)
        assert emb.weight.is_leaf and emb.weight.requires_grad
        out = emb(torch.tensor([[0, 2, 5]]))
        torch.testing.assert_close(out.to_torch(), expected[[0, 2, 5]].unsqueeze(0))


# ------------------------------------------------------------------------------------------------
# communication


def test_a_view_is_computed_when_first_read_and_memory_stats_do_not_read_it():
    from dtorch.ops.views import _get_h

    with dtorch.Graph(backend="inprocess") as g:
        x = distribute(X, DP, [Shard(0)])
        with CommLog() as log:
            v = x[1:3]  # rows of both devices: its value gathers them, when it is computed
            g.get_memory_stats()
        assert log.counts() == {}
        with pytest.raises(AttributeError):
            _get_h(v)  # not computed yet
        with CommLog() as log:
            v.local_blocks()
        assert log.counts() == {("all_gather", "dp"): 1}



@pytest.mark.parametrize("name", ["x[1:3].zero_()", "x[0].fill_(7)", "x[:, 2].mul_(0)", "x.view(-1).add_(1)",
                                  "x.t().mul_(2)", "x.narrow(0, 2, 2).copy_(y)", "x.unsqueeze(0).sub_(1)",
                                  "x[:][1].fill_(3)", "x[::2, 1:].mul_(y)", "x.data.add_(1)"])
def test_common_writes_through_views_communicate_nothing(name):
    for mesh, pl in [(DP, [Shard(0)]), (DP, [Shard(1)]), (M22, [Shard(0), Shard(1)])]:
        x, y = distribute(X, mesh, pl), dtorch.Tensor(Y, device_mesh=mesh)
        tx = X.clone()
        with CommLog() as log:
            EXAMPLES[name](x, y)
        assert log.counts() == {}, f"{pl}: {log.table()}"
        EXAMPLES[name](tx, Y.clone())
        torch.testing.assert_close(x.to_torch(), tx)


def test_writes_that_need_communication_show_it():
    # a diagonal of a sharded matrix is read whole (gathered) and written back at its coordinates
    x = distribute(X, DP, [Shard(0)])
    with CommLog() as log:
        x.diagonal().mul_(3)
    assert log.counts() == {("all_gather", "dp"): 1}, log.table()
    # a Partial base: the view's value is reduced before it is written back
    x = distribute(X, DP, [Partial()])
    with CommLog() as log:
        x[1:3].mul_(3)
    assert ("all_reduce", "dp") in log.counts(), log.table()
    e = X.clone()
    e[1:3] *= 3
    torch.testing.assert_close(x.to_torch(), e)


# ------------------------------------------------------------------------------------------------
# autograd


def _both(fn, layout=(DP, [Shard(0)])):
    tx = X.double().clone().requires_grad_()
    dx = distribute(X.double(), *layout).requires_grad_()
    fn(tx).backward()
    fn(dx).backward()
    torch.testing.assert_close(dx.grad.to_torch(), tx.grad)


GRADS = {
    "y[0].mul_(3)": lambda x: _chain(x, lambda y: y[0].mul_(3)),
    "y.t()[1:3].mul_(x[:, 0])": lambda x: _chain(x, lambda y: y.t()[1:3].mul_(x[:, 0])),
    "y.view(-1)[3:7].add_(x[1])": lambda x: _chain(x, lambda y: y.view(-1)[3:7].add_(x[1])),
    "y.diagonal().copy_(x[1, :4] * 5)": lambda x: _chain(x, lambda y: y.diagonal().copy_(x[1, :4] * 5)),
    "y[1:3][0] = x[2]": lambda x: _chain(x, lambda y: y[1:3].__setitem__(0, x[2] * 3)),
    "y.data.zero_() (no history)": lambda x: _chain(x, lambda y: y.data[0].zero_()),
}


def _chain(x, write):
    y = x * 2
    w = y[2]  # a live view: recomputed from y's new history when read
    write(y)
    return (y.sin() * 3).sum() + (w * w).sum()


@pytest.mark.parametrize("layout", [(DP, [Shard(0)]), (DP, [Shard(1)]), (M22, [Shard(0), Replicate()]),
                                    (DP, [Replicate()])], ids=str)
@pytest.mark.parametrize("name", list(GRADS))
def test_gradients_through_writes_into_views_match_torch(name, layout):
    _both(GRADS[name], layout)


def test_version_counter_errors_as_torch():
    for x in (X.clone().requires_grad_(), distribute(X, DP, [Shard(0)]).requires_grad_()):
        a = x.sigmoid()  # sigmoid's backward uses its result: writing it (through a view) breaks the backward
        a[0].mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            a.sum().backward()
        y = x * 2
        v = y[1:3]
        v.mul_(y[0])  # the op saved y[0], a view of y, which the write then changed
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        b = x * 1  # the same through views that the backward does not need: fine
        b[0].mul_(2)
        b.t()[1].add_(1)
        b.sum().backward()


def _torch_saves_result(fn) -> bool | None:
    """Whether torch's backward of ``fn`` refuses once its result was written in place (None: not applicable)."""
    for args in ((), (0,)):
        x = (torch.rand(3, 4, dtype=torch.float64) + 0.5).requires_grad_()
        try:
            y = fn(x, *args)
        except Exception:  # noqa: BLE001  (another signature: try the next)
            continue
        if not isinstance(y, torch.Tensor) or y.grad_fn is None:
            return None
        with torch.no_grad():
            y.add_(0)
        try:
            y.sum().backward()
        except RuntimeError as exc:
            return "modified by an inplace operation" in str(exc)
        return False
    return None


def test_the_ops_whose_result_torch_saves_are_torchs():
    from dtorch.autograd.dispatched import SAVES_RESULT
    from dtorch.ops.table import TABLE

    found = set()
    for name, op in TABLE.items():
        for tf in op.torch_fns[:1]:
            if _torch_saves_result(tf[0] if isinstance(tf, tuple) else tf):
                found.add(name)
    # max, min and median save it in their whole-tensor form only (their dim forms return indices): left out
    assert found - {"max", "min", "median"} == SAVES_RESULT


def test_torchs_refusals_of_writes_through_views():
    for x in (X.clone().requires_grad_(), distribute(X, DP, [Shard(0)]).requires_grad_()):
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
            x[0].mul_(2)
        with torch.no_grad():
            x[0].mul_(2)  # as optimizers and initializers do
        y = x * 2
        with torch.no_grad():
            v = y[0]
        with pytest.raises(RuntimeError, match="created in no_grad mode"):
            v.mul_(2)
        e = y.detach().expand(2, 5, 4)
        with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
            e.add_(1)
        with pytest.raises(RuntimeError, match="Can't detach views in-place"):
            y[0].detach_()
    # the refused writes changed nothing
    x = distribute(X, DP, [Shard(0)]).requires_grad_()
    with pytest.raises(RuntimeError):
        x[1:3].zero_()
    torch.testing.assert_close(x.to_torch(), X)


def test_data_and_detach_share_storage_without_history():
    p = dtorch.nn.Parameter(distribute(X, DP, [Shard(0)]))
    tp = torch.nn.Parameter(X.clone())
    for t in (p, tp):
        d = t.data
        d[0].add_(1)  # no error, no history, and not counted in t's _version (torch's .data)
        t.detach()[1].mul_(0)  # counted (detach shares the counter)
        assert not d.requires_grad and t.is_leaf and t.requires_grad
    assert p._version == tp._version == 1
    torch.testing.assert_close(p.to_torch(), tp.detach())
    (p * p).sum().backward()
    (tp * tp).sum().backward()
    torch.testing.assert_close(p.grad.to_torch(), tp.grad)


VIEWS_OF_A_LEAF = {
    "reshape": lambda t: t.reshape(2, 10), "view": lambda t: t.view(-1), "t": lambda t: t.t(),
    "slice": lambda t: t[1:, 2:], "unsqueeze": lambda t: t.unsqueeze(0), "chain": lambda t: t.t()[1:].reshape(-1),
    "split": lambda t: t.split(3, dim=0)[1], "select": lambda t: t[2],
}


@pytest.mark.parametrize("mesh, placements", LAYOUTS[:3] + LAYOUTS[4:6], ids=lambda v: str(v))
@pytest.mark.parametrize("make", ["detach", "no_grad view"])
def test_a_view_of_a_leaf_made_from_a_view_carries_its_gradient(mesh, placements, make):
    """``w.detach().requires_grad_()`` (and a view made under no_grad, then requires_grad_) is a leaf of its own,
    as in torch: its views have history to it, their gradients reach its ``.grad`` (they were silently lost)."""
    x, tx = distribute(X, mesh, placements), X.clone()
    weights = torch.randn(20, generator=torch.Generator().manual_seed(2))
    for name, view_of in VIEWS_OF_A_LEAF.items():
        leaves = []
        for t in (x, tx):
            if make == "detach":
                leaf = t.detach().requires_grad_()
            else:
                with (dtorch.no_grad() if t is x else torch.no_grad()):
                    leaf = t[:].requires_grad_(False)
                leaf.requires_grad_()
            v = view_of(leaf)
            assert v.requires_grad and not v.is_leaf, name
            w = weights[:v.numel()].reshape(tuple(v.shape))
            (v * v * (w if t is tx else distribute(w, mesh, [Replicate()] * mesh.ndim))).sum().backward()
            leaves.append(leaf)
        torch.testing.assert_close(leaves[0].grad.to_torch(), leaves[1].grad, msg=name)
    torch.testing.assert_close(x.to_torch(), X)


def test_identity_views_are_new_tensors_as_in_torch():
    """``x[:]``, ``x[...]``, ``x.permute(0, 1)`` are views, not ``x``: a leaf made of one is not ``x``."""
    x, tx = distribute(X, DP, [Shard(0)]), X.clone()
    for make in (lambda t: t[:], lambda t: t[...], lambda t: t[:, :], lambda t: t.permute(0, 1)):
        v, tv = make(x), make(tx)
        assert (v is x) == (tv is tx) == False  # noqa: E712
        with dtorch.no_grad():
            v[0].add_(1)
        with torch.no_grad():
            tv[0].add_(1)
    torch.testing.assert_close(x.to_torch(), tx)
    leaf = x[:].requires_grad_()
    assert leaf.requires_grad and not x.requires_grad


def test_an_in_place_write_into_a_view_of_such_a_leaf_is_refused_as_torch_does():
    x = distribute(X, DP, [Shard(0)])
    leaf, tleaf = x.detach().requires_grad_(), X.clone().detach().requires_grad_()
    with pytest.raises(RuntimeError, match="view of a leaf Variable that requires grad"):
        tleaf.reshape(2, 10).mul_(2)
    with pytest.raises(RuntimeError, match="view of a leaf Variable that requires grad"):
        leaf.reshape(2, 10).mul_(2)
    torch.testing.assert_close(x.to_torch(), X)
    with dtorch.no_grad():
        leaf.view(-1)[:3].fill_(7.0)  # the write reaches the storage it shares with x
    expected = X.clone()
    expected.view(-1)[:3] = 7.0
    torch.testing.assert_close(x.to_torch(), expected)


def test_data_set_replaces_the_value_keeping_the_object():
    p = dtorch.nn.Parameter(distribute(X, DP, [Shard(0)]))
    ident, ag = id(p), p._ag
    old_view = p[1:3]
    old_view.to_torch()  # read: it keeps this value when p's storage is replaced (as torch's)
    new = distribute(torch.ones(3, 2), DP, [Replicate()])
    p.data = new
    assert id(p) == ident and p._ag is ag and p.requires_grad and p.shape == (3, 2) and p.placements == [Replicate()]
    torch.testing.assert_close(p.to_torch(), torch.ones(3, 2))
    torch.testing.assert_close(old_view.to_torch(), X[1:3])
    new.add_(1)  # p took a handle of its own on new's blocks
    torch.testing.assert_close(p.to_torch(), torch.ones(3, 2))
    lazy = p[0]  # taken but never read: its storage is gone after the next replacement
    p.data = torch.zeros(3, 2)
    with pytest.raises(ViewError, match="storage replaced"):
        lazy.to_torch()
    with pytest.raises(ViewError):
        p[0].data = torch.zeros(2)


# ------------------------------------------------------------------------------------------------
# what is a view, as torch decides


def _value(t):
    return t.to_torch() if isinstance(t, dtorch.Tensor) else t


def test_view_reshape_and_contiguous_follow_torch():
    for x in (X.clone(), distribute(X, DP, [Shard(0)])):
        t = x.t()
        with pytest.raises(RuntimeError, match="view size is not compatible"):
            t.view(20)
        t.reshape(20).zero_()  # torch copies here (no view of x)
        t.contiguous().zero_()  # and here
        torch.testing.assert_close(_value(x), X)
        v = x[1:3]
        assert v.contiguous() is v and x.contiguous() is x
        assert v.is_contiguous() and x.is_contiguous() and not t.is_contiguous() and not x[:, 1].is_contiguous()
        x[1:3].reshape(-1).fill_(4)  # rows 1-2 lie in one piece: a view
        assert float(x[1:3].sum()) == 32


def test_select_and_diagonal_are_views():
    for x, tx in ((distribute(X, M22, [Shard(0), Shard(1)]), X.clone()),):
        for fn in (lambda t: t.select(0, -2), lambda t: torch.select(t, 1, 2), lambda t: t.diagonal(-1),
                   lambda t: torch.diagonal(t, 0, 1, 0)):
            v, tv = fn(x), fn(tx)
            torch.testing.assert_close(v.to_torch(), tv)
            v.add_(1)
            tv.add_(1)
            torch.testing.assert_close(x.to_torch(), tx)
    with pytest.raises(IndexError, match="out of range"):
        distribute(X, DP, [Shard(0)]).select(0, 5)


# ------------------------------------------------------------------------------------------------
# 0-d integer index tensors index like ints (issue 21, item 9)


@pytest.mark.parametrize("make", [lambda m: torch.tensor(2), lambda m: dtorch.Tensor(torch.tensor(2), device_mesh=m),
                                  lambda m: dtorch.Tensor(torch.tensor([0.0, 1, 5, 2]), device_mesh=m).argmax(),
                                  lambda m: torch.tensor(2, dtype=torch.int32)],
                         ids=["torch", "dtorch", "argmax", "int32"])
def test_zero_dim_index_tensors(make):
    for mesh, pl in [(DP, [Shard(0)]), (M22, [Shard(1), Replicate()])]:
        i = make(mesh)
        x, tx = distribute(X, mesh, pl), X.clone()
        for index in ((i,), (slice(None), i), (i, [0, 3]), ([1, 4], i), (i, i)):
            torch.testing.assert_close(x[index].to_torch(), tx[tuple(int(j) if j is i else j for j in index)])
        x[i] = 7.0
        x[:, i] += 1.0
        tx[2] = 7.0
        tx[:, 2] += 1.0
        ti = torch.tensor(2)
        x.index_fill_(0, i, -1.0)
        tx.index_fill_(0, ti, -1.0)
        x.index_copy_(1, i, torch.ones(5, 1))
        tx.index_copy_(1, ti, torch.ones(5, 1))
        torch.testing.assert_close(x.to_torch(), tx)
        assert isinstance(x[i], View)


# ------------------------------------------------------------------------------------------------
# Tensor.view([placements]): the blocks as they are, under other placements (DTorch's semantics)


def test_view_with_placements_reads_the_blocks_under_new_placements():
    r = dtorch.Tensor(X, device_mesh=DP, placements=[Replicate()])
    with CommLog() as log:
        p = r.view([Partial()])  # each device's replica becomes a term: the value doubles
        s = distribute(torch.arange(8.0).reshape(4, 2), DP, [Shard(0)]).view((Shard(1),))  # [2,2] blocks side by side
        both = dtorch.Tensor(X, device_mesh=M22, placements=[Replicate(), Replicate()]).view([Shard(0), Partial()])
        p.local_blocks(), s.local_blocks(), both.local_blocks()
    assert log.counts() == {}
    torch.testing.assert_close(p.to_torch(), 2 * X)
    assert p.placements == [Partial()] and p.shape == X.shape
    torch.testing.assert_close(s.to_torch(), torch.tensor([[0.0, 1, 4, 5], [2, 3, 6, 7]]))
    assert both.shape == (10, 4)
    torch.testing.assert_close(both.to_torch(), 2 * torch.cat([X, X]))
    s2 = distribute(X, DP, [Shard(0)])
    with pytest.raises(dtorch.PlacementError, match="cannot form"):
        s2.view([Replicate()])  # blocks of 3 and 2 rows: no replicated tensor has those
    twice = distribute(torch.cat([X[:2], X[:2]]), DP, [Shard(0)])  # equal blocks: replicas
    torch.testing.assert_close(twice.view([Replicate()]).to_torch(), X[:2])


# ------------------------------------------------------------------------------------------------
# the property: random chains of views of random layouts, random writes through random members; after
# every step every live tensor equals its torch twin. In-process, reference and process backends.


def _view_ops(shape):
    """(name, fn) view ops valid on a tensor of ``shape`` (fn applies to torch and dtorch alike)."""
    nd, ops = len(shape), [("detach", lambda t: t.detach()), ("data", lambda t: t.data),
                           ("unsqueeze", lambda t: t.unsqueeze(nd // 2))]
    for d, n in enumerate(shape):
        ops += [(f"[{d}:int]", lambda t, d=d, n=n: t[(slice(None),) * d + (n - 1,)]),
                (f"[{d}:slice]", lambda t, d=d, n=n: t[(slice(None),) * d + (slice(n // 2, n, 2),)]),
                (f"narrow{d}", lambda t, d=d, n=n: t.narrow(d, min(1, n), max(0, n - 2))),
                (f"select{d}", lambda t, d=d: t.select(d, 0)),
                (f"chunk{d}", lambda t, d=d: t.chunk(2, d)[-1])]
        if n == 1:
            ops.append((f"squeeze{d}", lambda t, d=d: t.squeeze(d)))
            ops.append((f"expand{d}", lambda t, d=d: t.expand(*shape[:d], 3, *shape[d + 1:])))
    if nd:
        ops += [("view(-1)", lambda t: t.view(-1)), ("reshape(-1)", lambda t: t.reshape(-1)),
                ("flatten", lambda t: t.flatten())]
    if nd >= 2:
        ops += [("t", lambda t: t.transpose(0, -1)), ("permute", lambda t: t.permute(*range(nd - 1, -1, -1))),
                ("diagonal", lambda t: t.diagonal()), ("diagonal(1)", lambda t: t.diagonal(1, -1, 0)),
                ("merge", lambda t: t.reshape(*shape[:-2], shape[-2] * shape[-1]))]
    if nd and shape[0] % 2 == 0 and shape[0]:
        ops.append(("split0", lambda t: t.view(2, shape[0] // 2, *shape[1:])))
    return ops


def _writes(shape, dtype_float=True):
    v = torch.arange(1.0, 1.0 + _numel(shape)).reshape(shape)
    ops = [("add_", lambda t: t.add_(1.5)), ("mul_", lambda t: t.mul_(-2)), ("fill_", lambda t: t.fill_(0.25)),
           ("zero_", lambda t: t.zero_()), ("copy_", lambda t: t.copy_(v)), ("clamp_", lambda t: t.clamp_(-1, 2)),
           ("iadd", lambda t: t.__iadd__(v))]
    if shape:
        ops += [("setitem0", lambda t: t.__setitem__(0, -7.0)),
                ("setitem:", lambda t: t.__setitem__((Ellipsis, slice(0, None, 2)), 5.0))]
    return ops


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _apply(fn, dt, tt):
    """The op on both; torch refusing means dtorch must refuse too (and neither changed)."""
    try:
        expected = fn(tt)
    except (RuntimeError, IndexError) as exc:
        with pytest.raises((RuntimeError, IndexError, ValueError), match=None) as info:
            fn(dt)
        assert isinstance(info.value, type(exc)) or isinstance(info.value, dtorch.DTorchError), info.value
        return None
    return fn(dt), expected


@st.composite
def _layout(draw, meshes):
    mesh = draw(st.sampled_from(meshes))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    pl = [draw(st.sampled_from([Replicate(), Partial()] + [Shard(d) for d in range(len(shape))]))
          for _ in range(mesh.ndim)]
    return mesh, shape, pl


def _property(data, meshes, steps):
    mesh, shape, pl = data.draw(_layout(meshes))
    full = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    live = [(distribute(full, mesh, pl), full.clone(), "root")]
    for _ in range(steps):
        k = data.draw(st.integers(0, len(live) - 1))
        dt, tt, what = live[k]
        if data.draw(st.booleans()):
            name, fn = data.draw(st.sampled_from(_view_ops(tuple(tt.shape))), label=f"view of {what}")
            out = _apply(fn, dt, tt)
            if out is not None:
                live.append((out[0], out[1], f"{what}.{name}"))
        else:
            name, fn = data.draw(st.sampled_from(_writes(tuple(tt.shape))), label=f"write into {what}")
            _apply(fn, dt, tt)
        for dt, tt, what in data.draw(st.lists(st.sampled_from(live), max_size=3), label="read"):
            torch.testing.assert_close(dt.to_torch(), tt, msg=lambda m, w=what: f"{w}: {m}")
    for dt, tt, what in live:
        torch.testing.assert_close(dt.to_torch(), tt, msg=lambda m, w=what: f"{w}: {m}")


@pytest.fixture(scope="module")
def process_graph():
    from dtorch.runtime.process import ProcessRuntime

    g = dtorch.Graph(backend="process")
    g.runtime = ProcessRuntime(workers=4, timeout=60)
    yield g
    g.runtime.shutdown()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_random_views_and_writes_in_process(data):
    with dtorch.Graph(backend="inprocess"):
        _property(data, [DP, M3, M22], steps=8)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_random_views_and_writes_reference(data):
    with dtorch.Graph(backend="reference"):
        _property(data, [DP, M3, M22], steps=8)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.data())
def test_property_random_views_and_writes_process(process_graph, data):
    with process_graph:
        _property(data, [DP, M22], steps=6)
