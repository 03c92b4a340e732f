"""dtorch.nn modules against torch.nn: registration, state dicts, initialisation, TP layouts and their collectives."""
from __future__ import annotations

import pytest
import torch

import dtorch
from dtorch import CommLog, Partial, Replicate, Shard, nn

TP2 = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
DP_TP = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
DP_TP_CP = dtorch.init_device_mesh("cpu", (2, 3, 2), mesh_dim_names=["dp", "tp", "ring_cp"])
NO_TP = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["dp"])
MESHES = [TP2, DP_TP, DP_TP_CP, NO_TP]


def tp_index(mesh):
    return mesh.dim_name_index("tp")


def placements_with(mesh, tp_placement, **by_name):
    out = [Replicate()] * mesh.ndim
    for name, p in by_name.items():
        if mesh.dim_name_index(name) is not None:
            out[mesh.dim_name_index(name)] = p
    if tp_index(mesh) is not None:
        out[tp_index(mesh)] = tp_placement
    return out


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(5, 7)
        self.norm = nn.LayerNorm(7)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(7, 3, bias=False))
        self.register_buffer("steps", torch.arange(4.0))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(5, 7)
        self.norm = torch.nn.LayerNorm(7)
        self.seq = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(7, 3, bias=False))
        self.register_buffer("steps", torch.arange(4.0))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


# -- registration and traversal ---------------------------------------------------------------------

def test_registration_matches_torch():
    torch.manual_seed(0)
    ours = Block()
    torch.manual_seed(0)
    ref = TorchBlock()
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in ref.named_modules()]
    assert [n for n, _ in ours.named_children()] == [n for n, _ in ref.named_children()]
    assert all(isinstance(p, nn.Parameter) and isinstance(p, dtorch.Tensor) for p in ours.parameters())
    sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)  # the non-persistent buffer is left out of both
    for k in sd:
        assert isinstance(sd[k], torch.Tensor)
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=0, atol=0)  # same init, same seed
    assert all(isinstance(v, dtorch.Tensor) for v in ours.state_dict(keep_vars=True).values())


def test_attribute_rules():
    m = Block()
    with pytest.raises(TypeError, match="parameter 'weight'"):
        m.proj.weight = dtorch.zeros(7, 5)
    m.proj.bias = None
    assert [n for n, _ in m.proj.named_parameters()] == ["weight"]
    m.extra = nn.Identity()
    assert "extra" in dict(m.named_children())
    del m.extra
    assert "extra" not in dict(m.named_children())
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        m.nope
    shared = nn.Linear(2, 2)
    s = nn.Sequential(shared, shared)
    assert len(list(s.parameters())) == 2 and len(list(s.named_parameters(remove_duplicate=False))) == 4


def test_containers():
    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    layers.append(nn.ReLU())
    layers.insert(0, nn.Identity())
    assert len(layers) == 5 and isinstance(layers[0], nn.Identity) and isinstance(layers[-1], nn.ReLU)
    assert len(layers[1:3]) == 2
    del layers[0]
    assert [n for n, _ in layers.named_children()] == ["0", "1", "2", "3"]
    d = nn.ModuleDict({"a": nn.ReLU(), "b": nn.Identity()})
    assert list(d.keys()) == ["a", "b"] and "a" in d and isinstance(d.pop("a"), nn.ReLU) and len(d) == 1
    seq = nn.Sequential(nn.ReLU(), nn.Identity())
    x = dtorch.Tensor(torch.randn(3, 4))
    assert torch.equal(seq(x).to_torch(), torch.relu(x.to_torch()))
    assert isinstance(seq[0], nn.ReLU) and len(seq[1:]) == 1


def test_train_eval_and_dtype():
    m = Block()
    assert m.training and all(c.training for c in m.modules())
    m.eval()
    assert not any(c.training for c in m.modules())
    m.train()
    assert all(c.training for c in m.modules())
    ref = {k: v.clone() for k, v in m.state_dict().items()}
    assert m.to(torch.float64) is m
    assert all(p.dtype == torch.float64 for p in m.parameters())
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, ref[k].double())
    ids = nn.Module()
    ids.register_buffer("ids", torch.arange(3))
    ids.to(torch.float16)
    assert ids.ids.dtype == torch.int64  # like torch, integer buffers keep their dtype


def test_mesh_guard_and_first_param_mesh():
    with dtorch.default_graph().device_mesh_guard(DP_TP):
        lin = nn.ColumnParallelLinear(4, 6)
        act = nn.SiLU()
    assert lin.first_param_device_mesh() == DP_TP
    assert lin.weight.placements == [Replicate(), Shard(0)]
    assert act.first_param_device_mesh() is None
    assert nn.Linear(2, 3).first_param_device_mesh() == dtorch.default_graph().default_device_mesh
    with pytest.raises(dtorch.MeshError, match="either device_mesh or device"):
        nn.Linear(2, 3, device="cpu", device_mesh=TP2)


def test_call_runs_the_hooks_in_order():
    calls = []

    class Hooked(nn.Module):
        def redistribute_input(self, x, scale=1):
            calls.append("in")
            return (x * 2,), {"scale": scale}

        def forward(self, x, scale):
            calls.append("forward")
            return x * scale

        def redistribute_output(self, y):
            calls.append("out")
            return y.redistribute_by_dict(placements_dict={"tp": Replicate()})

    x = dtorch.Tensor(torch.arange(6.0), device_mesh=TP2, placements=[Shard(0)])
    y = Hooked()(x, scale=3)
    assert calls == ["in", "forward", "out"]
    assert y.placements == [Replicate()] and torch.equal(y.to_torch(), torch.arange(6.0) * 6)


# -- initialisation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_init_matches_torch(mesh):
    cases = [
        (lambda: nn.RowParallelLinear(6, 5, device_mesh=mesh), lambda: torch.nn.Linear(6, 5)),
        (lambda: nn.Embedding(11, 6, padding_idx=2, device_mesh=mesh), lambda: torch.nn.Embedding(11, 6, padding_idx=2)),
        (lambda: nn.RMSNorm(6, device_mesh=mesh), lambda: torch.nn.RMSNorm(6)),
        (lambda: nn.LayerNorm((3, 4), device_mesh=mesh), lambda: torch.nn.LayerNorm((3, 4))),
    ]
    for ours_fn, ref_fn in cases:
        torch.manual_seed(7)
        ours = ours_fn()
        torch.manual_seed(7)
        ref = ref_fn()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(ours.state_dict()[k], v, rtol=0, atol=0)


def test_skip_init_draws_nothing():
    torch.manual_seed(3)
    with nn.skip_init():
        nn.Linear(4, 4)
        nn.Embedding(5, 4)
    after = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after, torch.rand(1))


# -- state dicts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_load_state_dict_shards_into_placements(mesh):
    with dtorch.default_graph().device_mesh_guard(mesh):
        ours = nn.Sequential(nn.ColumnParallelLinear(5, 7), nn.RowParallelLinear(7, 3), nn.Embedding(9, 4))
    before = [p.placements for p in ours.parameters()]
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3), torch.nn.Embedding(9, 4))
    result = ours.load_state_dict(ref.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert [p.placements for p in ours.parameters()] == before
    assert all(p.device_mesh == mesh for p in ours.parameters())
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(v, ref.state_dict()[k], rtol=0, atol=0)


def test_load_state_dict_casts_and_accepts_dtorch_values():
    lin = nn.ColumnParallelLinear(3, 4, device_mesh=DP_TP)
    w = torch.randn(4, 3, dtype=torch.float64)
    lin.load_state_dict({"weight": w, "bias": dtorch.Tensor(torch.ones(4), device_mesh=NO_TP)})
    assert lin.weight.dtype == torch.float32 and lin.weight.placements == [Replicate(), Shard(0)]
    torch.testing.assert_close(lin.weight.to_torch(), w.float())
    assert lin.bias.device_mesh == DP_TP and torch.equal(lin.bias.to_torch(), torch.ones(4))


def test_load_state_dict_errors_like_torch():
    torch.manual_seed(0)
    ours = Block()
    good = TorchBlock().state_dict()
    snapshot = {k: v.clone() for k, v in ours.state_dict().items()}

    missing = dict(good)
    del missing["norm.bias"]
    with pytest.raises(nn.StateDictError, match=r'Missing key\(s\) in state_dict: "norm.bias"'):
        ours.load_state_dict(missing)
    unexpected = dict(good, extra=torch.zeros(1))
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        ours.load_state_dict(unexpected)
    wrong = dict(good, **{"proj.weight": torch.zeros(5, 7)})
    with pytest.raises(nn.StateDictError, match=r"size mismatch for proj.weight: copying a param with shape "
                                                r"torch.Size\(\[5, 7\]\) from checkpoint, the shape in current "
                                                r"model is torch.Size\(\[7, 5\]\)"):
        ours.load_state_dict(wrong)
    # nothing was loaded by the failed calls
    for k, v in ours.state_dict().items():
        assert torch.equal(v, snapshot[k])
    # strict=False reports instead of raising, but a size mismatch still fails (as in torch)
    result = ours.load_state_dict(dict(missing, extra=torch.zeros(1)), strict=False)
    assert result.missing_keys == ["norm.bias"] and result.unexpected_keys == ["extra"]
    with pytest.raises(nn.StateDictError, match="size mismatch"):
        ours.load_state_dict(wrong, strict=False)


# -- Linear family: values, layouts, communication --------------------------------------------------------

def _x(mesh, shape=(3, 5, 6)):
    x = torch.randn(*shape)
    return x, dtorch.Tensor(x, device_mesh=mesh, placements=placements_with(mesh, Replicate(), dp=Shard(0)))


# preset -> (weight placement on tp, output placement on tp, collectives on tp for a Replicate input)
PRESETS = {
    "ColumnParallelLinear": (Shard(0), Shard(2), {}),
    "ColumnParallelLinearWithReplicateOutput": (Shard(0), Replicate(), {("all_gather", "tp"): 1}),
    "ColumnParallelLinearWithReplicateInputOutput": (Shard(0), Replicate(), {("all_gather", "tp"): 1}),
    "RowParallelLinear": (Shard(1), Partial(), {}),
    "RowParallelLinearWithReplicateOutput": (Shard(1), Replicate(), {("all_reduce", "tp"): 1}),
    "ReplicateParallelLinear": (Replicate(), Replicate(), {}),
}


@pytest.mark.parametrize("mesh", MESHES, ids=str)
@pytest.mark.parametrize("name", list(PRESETS))
def test_linear_presets(mesh, name):
    w_tp, out_tp, comms = PRESETS[name]
    torch.manual_seed(1)
    lin = getattr(nn, name)(6, 7, device_mesh=mesh)
    ref = torch.nn.Linear(6, 7)
    ref.load_state_dict(lin.state_dict())
    x, dx = _x(mesh)
    with CommLog() as log:
        y = lin(dx)
    torch.testing.assert_close(y.to_torch(), ref(x), rtol=1e-5, atol=1e-5)
    has_tp = tp_index(mesh) is not None
    assert lin.weight.placements == placements_with(mesh, w_tp if has_tp else Replicate())
    assert y.placements == placements_with(mesh, out_tp if has_tp else Replicate(), dp=Shard(0))
    assert log.counts() == (comms if has_tp else {})
    assert dx.placements == placements_with(mesh, Replicate(), dp=Shard(0))  # the input is untouched
    torch.testing.assert_close(dx.to_torch(), x, rtol=0, atol=0)


@pytest.mark.parametrize("mesh", [TP2, DP_TP, DP_TP_CP], ids=str)
def test_megatron_mlp_does_one_all_reduce(mesh):
    """Column then row parallel: the column output feeds the row input without communication."""
    torch.manual_seed(2)
    up, down = nn.ColumnParallelLinear(6, 9, device_mesh=mesh), nn.RowParallelLinearWithReplicateOutput(9, 6, device_mesh=mesh)
    ref_up, ref_down = torch.nn.Linear(6, 9), torch.nn.Linear(9, 6)
    ref_up.load_state_dict(up.state_dict())
    ref_down.load_state_dict(down.state_dict())
    x, dx = _x(mesh, (4, 3, 6))
    with CommLog() as log:
        y = down(nn.functional.silu(up(dx)))
    torch.testing.assert_close(y.to_torch(), ref_down(torch.nn.functional.silu(ref_up(x))), rtol=1e-5, atol=1e-5)
    assert log.counts() == {("all_reduce", "tp"): 1}


def test_linear_takes_torch_input_and_rejects_bad_shard_type():
    lin = nn.ColumnParallelLinearWithReplicateOutput(4, 3, device_mesh=DP_TP)
    x = torch.randn(2, 4)
    y = lin(x)
    assert isinstance(y, dtorch.Tensor) and y.device_mesh == DP_TP
    torch.testing.assert_close(y.to_torch(), x @ lin.weight.to_torch().T + lin.bias.to_torch())
    with pytest.raises(ValueError, match="tp_shard_type must be 'col', 'row' or None"):
        nn.Linear(2, 2, tp_shard_type="column")
    custom = nn.Linear(4, 6, device_mesh=DP_TP, tp_dim="dp", tp_shard_type="row")
    assert custom.weight.placements == [Shard(1), Replicate()]


# -- other layers ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_embedding(mesh):
    torch.manual_seed(4)
    ids = torch.randint(0, 11, (3, 5))
    placements = placements_with(mesh, Replicate(), dp=Shard(0), ring_cp=Shard(1))
    dids = dtorch.Tensor(ids, device_mesh=mesh, placements=placements)
    for cls, out_tp in ((nn.Embedding, Shard(2)), (nn.EmbeddingWithReplicateOutput, Replicate())):
        emb = cls(11, 6, device_mesh=mesh)
        ref = torch.nn.Embedding(11, 6)
        ref.load_state_dict(emb.state_dict())
        has_tp = tp_index(mesh) is not None
        assert emb.weight.placements == placements_with(mesh, Shard(1) if has_tp else Replicate())
        with CommLog() as log:
            y = emb(dids)
        torch.testing.assert_close(y.to_torch(), ref(ids), rtol=0, atol=0)
        assert y.placements == placements_with(mesh, out_tp if has_tp else Replicate(), dp=Shard(0), ring_cp=Shard(1))
        gathers = {("all_gather", "tp"): 1} if has_tp and out_tp == Replicate() else {}
        assert log.counts() == gathers


@pytest.mark.parametrize("mesh", MESHES, ids=str)
def test_norms_and_activations(mesh):
    torch.manual_seed(5)
    x, dx = _x(mesh, (3, 5, 6))
    rms, ln = nn.RMSNorm(6, eps=1e-6, device_mesh=mesh), nn.LayerNorm(6, device_mesh=mesh)
    rms.load_state_dict({"weight": torch.rand(6)})
    ln.load_state_dict({"weight": torch.rand(6), "bias": torch.rand(6)})
    ref_rms, ref_ln = torch.nn.RMSNorm(6, eps=1e-6), torch.nn.LayerNorm(6)
    ref_rms.load_state_dict(rms.state_dict())
    ref_ln.load_state_dict(ln.state_dict())
    pairs = [(rms, ref_rms), (ln, ref_ln), (nn.SiLU(), torch.nn.SiLU()), (nn.GELU(), torch.nn.GELU()),
             (nn.GELU("tanh"), torch.nn.GELU("tanh")), (nn.ReLU(), torch.nn.ReLU()), (nn.Identity(), torch.nn.Identity())]
    for ours, ref in pairs:
        with CommLog() as log:
            y = ours(dx)
        torch.testing.assert_close(y.to_torch(), ref(x), rtol=1e-5, atol=1e-5)
        assert y.placements == dx.placements and log.counts() == {}, type(ours).__name__


def test_dropout():
    x = dtorch.Tensor(torch.randn(4, 6), device_mesh=DP_TP, placements=[Shard(0), Replicate()])
    drop = nn.Dropout(0.5)
    drop.eval()
    assert torch.equal(drop(x).to_torch(), x.to_torch())
    drop.train()
    y = drop(x).to_torch()
    kept = y != 0
    torch.testing.assert_close(y[kept], x.to_torch()[kept] * 2)
    assert torch.equal(nn.Dropout(0.0)(x).to_torch(), x.to_torch())
    with pytest.raises(ValueError, match="between 0 and 1"):
        nn.Dropout(1.5)


def test_to_mesh_and_buffer_loading():
    m = Block()
    sd = {k: v + 1 for k, v in TorchBlock().state_dict().items()}
    m.load_state_dict(sd)
    torch.testing.assert_close(m.steps.to_torch(), torch.arange(4.0) + 1)
    m.to(DP_TP)
    assert all(t.device_mesh == DP_TP for t in list(m.parameters()) + list(m.buffers()))
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, sd[k])


# -- torch objects given to dtorch modules ----------------------------------------------------------

def test_torch_modules_are_refused_with_the_dtorch_module_to_use():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(nn.ModuleAssignmentError, match=r"torch.nn.modules.linear.Linear as 'proj' of Net.*"
                                                        r"build a dtorch.nn.Linear instead"):
        Net()

    class TorchOnly(torch.nn.Module):
        pass

    m = nn.Module()
    with pytest.raises(TypeError, match=r"dtorch.nn has no TorchOnly: write it as a dtorch.nn.Module subclass"):
        m.block = TorchOnly()
    with pytest.raises(nn.ModuleAssignmentError, match=r"build a dtorch.nn.ReLU instead"):
        nn.ModuleList([nn.SiLU()]).append(torch.nn.ReLU())
    with pytest.raises(nn.ModuleAssignmentError, match=r"build a dtorch.nn.Sequential instead"):
        m.add_module("seq", torch.nn.Sequential())
    assert list(m.named_modules()) == [("", m)] and not hasattr(m, "block")


def test_torch_parameters_are_registered_like_torch():
    class Ours(nn.Module):
        def __init__(self, w, b):
            super().__init__()
            self.scale = torch.nn.Parameter(w)
            self.register_parameter("shift", torch.nn.Parameter(b))

    class Ref(torch.nn.Module):
        def __init__(self, w, b):
            super().__init__()
            self.scale = torch.nn.Parameter(w)
            self.register_parameter("shift", torch.nn.Parameter(b))

    w, b = torch.randn(3, 5), torch.randn(5)
    with dtorch.default_graph().device_mesh_guard(DP_TP):
        ours = Ours(w, b)
    ref = Ref(w, b)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert all(isinstance(p, nn.Parameter) and p.device_mesh == DP_TP for p in ours.parameters())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v)


# -- dtype casts, shared parameters, parameters held in another layout -------------------------------

def test_to_dtype_keeps_float32_buffers():
    class Rope(nn.Module):
        _float32_buffers = ("inv_freq",)

        def __init__(self):
            super().__init__()
            self.register_buffer("inv_freq", torch.rand(4), persistent=False)
            self.register_buffer("table", torch.rand(4))
            self.weight = nn.Parameter(dtorch.Tensor(torch.rand(4)))

    m = Rope().to(torch.bfloat16)
    assert (m.inv_freq.dtype, m.table.dtype, m.weight.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3, bias=False)
        self.b = nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight


class TorchTied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(3, 3, bias=False)
        self.b = torch.nn.Linear(3, 3, bias=False)
        self.b.weight = self.a.weight


def test_shared_parameters():
    ours, ref = Tied(), TorchTied()
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["a.weight", "b.weight"]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()] == ["a.weight"]
    # either name alone loads the shared parameter (torch would report the other one missing)
    for key in ("a.weight", "b.weight"):
        w = torch.randn(3, 3)
        assert ours.load_state_dict({key: w}) == ([], [])
        assert ours.a.weight is ours.b.weight
        torch.testing.assert_close(ours.b.weight.to_torch(), w)
    ours.to(torch.float16)
    assert ours.a.weight is ours.b.weight and ours.b.weight.dtype == torch.float16
    with pytest.raises(nn.StateDictError, match=r'Missing key\(s\) in state_dict: "a.weight", "b.weight"'):
        ours.load_state_dict({})


def test_repeated_rows_state_and_checkpoint_slices():
    """A parameter held with each 2-row block repeated 3 times saves and loads one copy of each block; a
    checkpoint slice read through held_slice gives any box of the held tensor."""
    from dtorch.nn.module import RepeatedRows

    form = RepeatedRows(block=2, repeats=3)
    saved = torch.arange(4 * 5.0).reshape(4, 5)  # two blocks of 2 rows
    held = form.load(saved)
    assert torch.equal(held, saved.reshape(2, 1, 2, 5).expand(2, 3, 2, 5).reshape(12, 5))
    assert torch.equal(form.save(held), saved) and form.saved_shape(held.shape) == (4, 5)

    class TorchSlice:  # safetensors' get_slice interface over a torch tensor
        def get_shape(self):
            return list(saved.shape)

        def __getitem__(self, index):
            return saved[index]

    sl = form.held_slice(TorchSlice())
    assert sl.get_shape() == [12, 5]
    for rows in [(0, 12), (3, 4), (5, 9), (11, 1), (4, 0)]:
        box = (slice(rows[0], rows[0] + rows[1]), slice(1, 4))
        assert torch.equal(sl[box], held[box])

    m = nn.Linear(5, 12, bias=False, device_mesh=TP2, tp_shard_type="col")
    m.load_state_dict({"weight": held})
    m._saved_forms["weight"] = form
    assert torch.equal(m.state_dict()["weight"], saved)
    m.load_state_dict({"weight": saved + 1})
    assert torch.equal(m.weight.to_torch(), held + 1)
    assert torch.equal(m.state_dict(keep_vars=True)["weight"].to_torch(), held + 1)


def test_a_torch_parameter_replacing_a_sharded_one_keeps_its_layout():
    lin = nn.ColumnParallelLinear(4, 6, device_mesh=DP_TP)
    w = torch.randn(6, 4)
    lin.weight = torch.nn.Parameter(w)
    assert isinstance(lin.weight, nn.Parameter) and lin.weight.placements == [Replicate(), Shard(0)]
    torch.testing.assert_close(lin.weight.to_torch(), w)
    x = torch.randn(3, 4)
    torch.testing.assert_close(lin(dtorch.Tensor(x, device_mesh=DP_TP)).to_torch(),
                               torch.nn.functional.linear(x, w, lin.bias.to_torch()))
