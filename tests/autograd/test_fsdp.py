"""FSDP on user modules: ``dtorch.nn.fully_shard`` units, ``dtorch.MixedPrecisionPolicy`` against the same
policy written in plain torch, ``reshard_after_forward=False``, prefetch, and the collectives (CommLog)."""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dtorch
from dtorch import CommLog, MixedPrecisionPolicy, Replicate, Shard
from dtorch.nn import fully_shard

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class Block(dtorch.nn.Module):
    def __init__(self, width: int, mesh):
        super().__init__()
        self.up = dtorch.nn.Linear(width, 2 * width, device_mesh=mesh)
        self.down = dtorch.nn.Linear(2 * width, width, bias=False, device_mesh=mesh)
        self.seen = []  # what the forward found: were the submodules' weights gathered already?

    def forward(self, x):
        self.seen.append(("_unsharded" in self.up.__dict__, "_unsharded" in self.down.__dict__))
        return x + self.down(self.up(x).relu())


class Net(dtorch.nn.Module):
    def __init__(self, width: int, depth: int, mesh):
        super().__init__()
        self.blocks = dtorch.nn.ModuleList([Block(width, mesh) for _ in range(depth)])
        self.head = dtorch.nn.Linear(width, 3, device_mesh=mesh)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class TorchNet(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.ModuleDict({"up": torch.nn.Linear(width, 2 * width),
                                                                "down": torch.nn.Linear(2 * width, width, bias=False)})
                                           for _ in range(depth)])
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        for b in self.blocks:
            x = x + b["down"](b["up"](x).relu())
        return self.head(x)


def _mesh(*dims):
    names, sizes = zip(*dims)
    return dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))


def _pair(mesh, width=8, depth=3, policy=None, reshard=True):
    torch.manual_seed(0)
    ref = TorchNet(width, depth)
    net = Net(width, depth, mesh)
    net.load_state_dict(ref.state_dict())
    for block in net.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(net, mp_policy=policy, reshard_after_forward=reshard)
    return net, ref


def _batch(mesh, rows=6, width=8, seed=1):
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    places = [Shard(0) if n in ("fsdp", "dp") else Replicate() for n in mesh.dim_names]
    return x, dtorch.Tensor(x, device_mesh=mesh, placements=places)


def test_a_unit_gathers_its_subtree_before_its_forward_and_matches_torch():
    mesh = _mesh(("fsdp", 2))
    net, ref = _pair(mesh)
    x, xd = _batch(mesh, rows=5)  # 5 rows over 2 devices: uneven
    out = net(xd)
    assert all(seen == (True, True) for b in net.blocks for seen in b.seen)
    assert all("_unsharded" not in m.__dict__ for m in net.modules())  # let go after the forward
    out.square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(out.to_torch(), ref(x), rtol=1e-5, atol=1e-5)
    refs = dict(ref.named_parameters())
    for name, p in net.named_parameters():
        assert p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.to_torch(), refs[name].grad, rtol=1e-5, atol=1e-5, msg=name)


def _comm_by_phase(net, xd, steps=2):
    """CommLog of the forward and of the backward, for each of ``steps`` steps."""
    phases = []
    for _ in range(steps):
        with CommLog() as fwd:
            loss = net(xd).square().sum()
        with CommLog() as bwd:
            loss.backward()
        net.zero_grad()
        phases.append((fwd, bwd))
    return phases


@pytest.mark.parametrize("policy", [None, BF16], ids=["float32", "bf16"])
def test_each_weight_is_gathered_once_per_pass_and_each_gradient_reduce_scattered_once(policy):
    mesh = _mesh(("fsdp", 2))
    net, _ = _pair(mesh, policy=policy)
    _, xd = _batch(mesh)
    n = len(list(net.parameters()))
    compute = policy.param_dtype if policy else torch.float32
    for step, (fwd, bwd) in enumerate(_comm_by_phase(net, xd)):  # step 1: the next unit's gather is prefetched
        assert fwd.counts() == {("all_gather", "fsdp"): n}, (step, fwd.table())
        assert bwd.counts() == {("all_gather", "fsdp"): n, ("reduce_scatter", "fsdp"): n}, (step, bwd.table())
        assert {r.dtype for r in fwd.records} == {compute}
        assert {r.dtype for r in bwd.records if r.kind == "all_gather"} == {compute}
        assert {r.dtype for r in bwd.records if r.kind == "reduce_scatter"} == {torch.float32}  # reduce_dtype


def test_the_next_unit_is_gathered_ahead_once_the_order_is_known():
    mesh = _mesh(("fsdp", 2))
    net, _ = _pair(mesh, depth=3)
    _, xd = _batch(mesh)
    gathers_before = []  # all-gathers recorded when each block's forward starts

    for block in net.blocks:
        def wrapped(x, forward=block.forward):
            gathers_before.append(sum(r.kind == "all_gather" for r in log.records))
            return forward(x)
        block.forward = wrapped
    for step in range(2):  # the first forward learns the order, the second prefetches
        gathers_before.clear()
        with CommLog() as log:
            loss = net(xd).square().sum()
        loss.backward()
    # the root unit (the head: 2 weights) runs first and gathers block 0's 3 ahead; block i gathers block i+1's
    assert gathers_before == [2 + 3 + 3, 2 + 3 + 3 + 3, 2 + 3 + 3 + 3], gathers_before


def test_reshard_after_forward_false_keeps_the_gathered_weights_for_the_backward():
    mesh = _mesh(("fsdp", 2))
    net, ref = _pair(mesh, reshard=False)
    x, xd = _batch(mesh)
    n = len(list(net.parameters()))
    (fwd, bwd), = _comm_by_phase(net, xd, steps=1)
    assert fwd.counts() == {("all_gather", "fsdp"): n}
    assert bwd.counts() == {("reduce_scatter", "fsdp"): n}  # nothing gathered again: ZeRO-2
    net(xd).square().sum().backward()
    ref(x).square().sum().backward()
    refs = dict(ref.named_parameters())
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad.to_torch(), refs[name].grad, rtol=1e-5, atol=1e-5, msg=name)


def _plain_torch_policy(ref, x, steps, lr):
    """The policy in plain torch: a bf16 copy of the float32 master weights computes; its gradients are
    cast to float32 onto the master, which AdamW updates; the loss is float32."""
    master = ref
    work = copy.deepcopy(ref).to(torch.bfloat16)
    opt = torch.optim.AdamW(master.parameters(), lr=lr, foreach=False)
    losses = []
    for _ in range(steps):
        work.load_state_dict(master.state_dict())
        loss = work(x.to(torch.bfloat16)).float().square().mean()
        loss.backward()
        for pm, pw in zip(master.parameters(), work.parameters()):
            pm.grad, pw.grad = pw.grad.float(), None
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_mixed_precision_tracks_the_same_policy_in_plain_torch_over_ten_adamw_steps():
    mesh = _mesh(("fsdp", 4))
    net, ref = _pair(mesh, width=16, policy=BF16)
    x, xd = _batch(mesh, rows=8, width=16)
    opt = dtorch.optim.AdamW(net.parameters(), lr=1e-2)
    got = []
    for _ in range(10):
        out = net(xd)
        assert out.dtype == torch.bfloat16  # computed in param_dtype
        loss = out.float().square().mean()
        loss.backward()
        assert all(p.grad.dtype == torch.float32 and p.dtype == torch.float32 for p in net.parameters())
        opt.step()
        opt.zero_grad()
        got.append(loss.item())
    assert all(st["exp_avg"].dtype == torch.float32 for st in opt.state.values())
    want = _plain_torch_policy(ref, x, 10, 1e-2)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)
    assert want[-1] < 0.5 * want[0]  # it trains
    net32, _ = _pair(mesh, width=16)  # (and bf16 is what ran: float32 gives another first loss)
    assert abs(net32(xd).square().mean().item() - got[0]) > 1e-4 * abs(got[0])


class _Casts(TorchDispatchMode):
    """The elements cast from float32 to bfloat16 inside it."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32
                and kwargs.get("dtype") == torch.bfloat16):
            self.numel += args[0].numel()
        return func(*args, **kwargs)


@pytest.mark.parametrize("width", [8, 7], ids=["even", "uneven"])
def test_mixed_precision_casts_each_weight_once_per_step(width):
    """The plain-torch policy casts each master weight to bf16 once per step: the forward casts the shards
    (and the input), the backward gathers those bf16 shards again and casts only the float32 loss's gradient
    back to the bf16 output, not the weights a second time. The bf16 shards kept for that go with the
    backward."""
    graph = dtorch.Graph()
    with graph:
        mesh = _mesh(("fsdp", 2))
        net, _ = _pair(mesh, width=width, policy=BF16)
        x, xd = _batch(mesh, width=width)
        n = sum(p.numel() for p in net.parameters())
        held = []  # activations held after each tracked step
        for step in range(4):  # (the first step plans, the later ones prefetch)
            graph.track_memory(step >= 2)
            with _Casts() as fwd:
                out = net(xd)
            loss = out.float().square().sum()
            with CommLog() as comm, _Casts() as bwd:
                loss.backward()
            net.zero_grad()
            assert {r.dtype for r in comm.records if r.kind == "all_gather"} == {torch.bfloat16}
            if step:
                assert fwd.numel == n + x.numel()
                assert bwd.numel == out.numel()
            if step >= 2:
                del out, loss
                kinds = graph.get_memory_breakdown(mesh)[("cpu", 0)]
                assert kinds["gathered"]["allocated"] == 0, kinds
                held.append(kinds["activations"]["allocated"])
        graph.track_memory(False)
        assert held[0] == held[1], held  # (a step's kept bf16 shards would add up)


def test_mixed_precision_backward_uses_the_forwards_bf16_weights_after_a_master_write():
    """As in the plain-torch policy, whose backward uses the bf16 working copy the forward used: writing the
    float32 master between the forward and the backward changes no gradient (float32 compute saves the
    master itself, and torch refuses that write)."""
    mesh = _mesh(("fsdp", 2))
    _, xd = _batch(mesh)
    grads = []
    for write in (False, True):
        net, _ = _pair(mesh, policy=BF16)
        out = net(xd)
        if write:
            with torch.no_grad():
                net.head.weight.mul_(2)
        out.float().square().sum().backward()
        grads.append({name: p.grad.to_torch() for name, p in net.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)
    net32, _ = _pair(mesh)
    out = net32(xd)
    with torch.no_grad():
        net32.head.weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.square().sum().backward()


def test_output_dtype_and_input_casts():
    mesh = _mesh(("fsdp", 2))
    lin = dtorch.nn.Linear(4, 4, device_mesh=mesh)
    fully_shard(lin, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    x = dtorch.Tensor(torch.randn(2, 4), device_mesh=mesh)
    assert lin(x).dtype == torch.float32  # input cast to bf16, output cast back
    keep = dtorch.nn.Linear(4, 4, device_mesh=mesh)
    fully_shard(keep, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    with pytest.raises(dtorch.OpError, match="same dtype"):  # float32 input, bf16 weight: torch refuses it too
        keep(x)


def test_fully_shard_moves_a_module_onto_an_fsdp_mesh():
    torch.manual_seed(0)
    one = dtorch.DeviceMesh("cpu")
    with dtorch.default_graph().device_mesh_guard(one):
        lin = dtorch.nn.Linear(6, 4)
    ref = torch.nn.Linear(6, 4)
    ref.load_state_dict(lin.state_dict())
    mesh = _mesh(("dp", 1), ("fsdp", 2))
    fully_shard(lin, mesh=mesh)
    assert lin.weight.device_mesh == mesh and lin.weight.placements == [Replicate(), Shard(0)]
    x, xd = _batch(mesh, width=6)
    torch.testing.assert_close(lin(xd).to_torch(), ref(x), rtol=1e-5, atol=1e-5)


def test_bad_arguments_say_what_to_change():
    with pytest.raises(TypeError, match="floating-point torch dtype"):
        MixedPrecisionPolicy(param_dtype="bf16")
    mesh = _mesh(("fsdp", 2))
    lin = dtorch.nn.Linear(2, 2, device_mesh=mesh)
    with pytest.raises(TypeError, match="dtorch.nn.Module"):
        fully_shard(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="MixedPrecisionPolicy"):
        fully_shard(lin, mp_policy=torch.bfloat16)
    with pytest.raises(dtorch.MeshError, match="named 'fsdp'"):
        fully_shard(lin, mesh=_mesh(("dp", 2)))


class ViewsItsWeight(dtorch.nn.Module):
    """Uses its weight through a view and a cast, as hand-written code does (``x @ w.t()``)."""

    def __init__(self, mesh):
        super().__init__()
        self.weight = dtorch.nn.Parameter(dtorch.Tensor(torch.randn(6, 4, generator=torch.Generator().manual_seed(2)),
                                                        device_mesh=mesh, placements=[Shard(0)]))

    def forward(self, x):
        return (x @ self.weight.t().to(torch.float32)).tanh()


def test_a_view_of_a_gathered_weight_is_made_again_in_the_backward_not_kept():
    graph = dtorch.Graph()
    with graph:
        mesh = _mesh(("fsdp", 2))
        mod = ViewsItsWeight(mesh)
        w = mod.weight.to_torch().requires_grad_()
        x, xd = _batch(mesh, rows=4, width=4)
        graph.track_memory()
        out = mod(xd)
        kinds = graph.get_memory_breakdown(mesh)[("cpu", 0)]
        assert kinds["gathered"]["allocated"] == 0  # neither the copy nor its transpose outlives the forward
        with CommLog() as bwd:
            out.sum().backward()
        graph.track_memory(False)
        assert bwd.counts() == {("all_gather", "fsdp"): 1, ("reduce_scatter", "fsdp"): 1}, bwd.table()
        (x @ w.t()).tanh().sum().backward()
        torch.testing.assert_close(mod.weight.grad.to_torch(), w.grad, rtol=1e-5, atol=1e-5)


class TPBlock(dtorch.nn.Module):
    """A tp-sharded MLP: tp shards ``up``'s dim 0 and ``down``'s dim 1, so fsdp shards the other dim (where the
    fsdp shards of a tp block are not adjacent in a contiguous grid)."""

    def __init__(self, width: int, hidden: int, mesh):
        super().__init__()
        self.up = dtorch.nn.Linear(width, hidden, device_mesh=mesh, tp_shard_type="col")
        self.down = dtorch.nn.Linear(hidden, width, device_mesh=mesh, tp_shard_type="row")

    def forward(self, x):
        return self.down(self.up(x).relu())


class TorchTPBlock(torch.nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(self.up(x).relu())


@pytest.mark.parametrize("width", [8, 7], ids=["even", "uneven"])
def test_gathered_weights_are_views_of_the_shards_through_training_and_keep_their_values(width):
    """On the in-process backend an fsdp all-gather of a parameter is a view of its storage, not a copy: the
    grid keeps the full tensor's layout through init, load_state_dict and AdamW's in-place update. A gathered
    copy taken before an update keeps its values (copy-on-write), counts as gathered memory, and training
    matches torch."""
    from dtorch.autograd.fsdp import fsdp_sharded, unshard

    graph = dtorch.Graph()
    with graph:
        mesh = _mesh(("fsdp", 2), ("tp", 2))
        torch.manual_seed(0)
        ref = TorchTPBlock(width, 12)
        net = TPBlock(width, 12, mesh)
        grids = graph.backend == "inprocess" and width % 2 == 0  # (uneven shards are per-device blocks)
        if grids:  # as built (init), before anything is loaded
            assert all(_storage(unshard(p)) == _storage(p) for p in net.parameters())
        net.load_state_dict(ref.state_dict())
        opt = dtorch.optim.AdamW(net.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
        x, xd = _batch(mesh, rows=4, width=width)
        kept_params = [p for p in net.parameters() if fsdp_sharded(p)]
        for _ in range(2):
            graph.track_memory()
            kept = {name: unshard(p) for name, p in net.named_parameters() if fsdp_sharded(p)}
            gathered = graph.get_memory_breakdown(mesh)[("cpu", 0)]["gathered"]["allocated"]
            graph.track_memory(False)
            # per device: each fsdp-sharded parameter whole on fsdp, its tp block on tp (the colwise bias, tp-sharded
            # on its one dim, is not sharded on fsdp: it stays as it is)
            per_device = sum(p.numel() // (2 if isinstance(p.placements[1], Shard) else 1)
                             for p in net.parameters() if fsdp_sharded(p))
            assert gathered == 4 * per_device, (gathered, per_device)
            values = {name: g.to_torch() for name, g in kept.items()}
            for name, p in net.named_parameters():
                if name not in kept:
                    continue
                torch.testing.assert_close(values[name], p.to_torch(), rtol=0, atol=0)
                if grids:
                    assert _storage(kept[name]) == _storage(p), name
            net(xd).square().sum().backward()
            ref(x).square().sum().backward()
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            for name in kept:  # the in-place update did not reach the copies gathered before it
                torch.testing.assert_close(kept[name].to_torch(), values[name], rtol=0, atol=0, msg=name)
            del kept
            refs = dict(ref.named_parameters())
            for name, p in net.named_parameters():
                torch.testing.assert_close(p.to_torch(), refs[name].detach(), rtol=1e-5, atol=1e-5, msg=name)
                torch.testing.assert_close(unshard(p).to_torch(), refs[name].detach(), rtol=1e-5, atol=1e-5)
                if grids:
                    assert _storage(unshard(p)) == _storage(p), name
            if grids:  # the mixed-precision cast keeps the layout: casts, then a view
                for p in kept_params:  # (the first call plans)
                    unshard(p, torch.bfloat16)
                with _AtenOps() as ops:
                    for p in kept_params:
                        unshard(p, torch.bfloat16)
                assert ops.counts["_to_copy"] == len(kept_params) and not {"clone", "copy_"} & set(ops.counts), ops.counts


def _storage(t) -> int:
    return t._h.grid.untyped_storage().data_ptr()


class _AtenOps(TorchDispatchMode):
    """Counts the aten ops run inside it, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
