"""dtorch.Tensor (API.md section 3): construction, factories, attributes, values, redistribution API."""
from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib
import re

import numpy as np
import pytest
import torch

import dtorch
from dtorch.ops.table import PUBLIC
from dtorch import DeviceMesh, Partial, PlacementError, Replicate, Shard, TensorFuture
from sweep import canonical

MESH = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["dp", "tp"])
MESHES = [DeviceMesh("cpu"), dtorch.init_device_mesh("cpu", 3), MESH,
          dtorch.init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=["dp", "pp", "tp"])]
ALL_PLACEMENTS = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max"), Partial("min")]


def layouts(ndim: int = 2):
    """(mesh, placements) pairs covering shards of each dim, nested shards and every partial op."""
    out = []
    for mesh in MESHES:
        for p in ALL_PLACEMENTS[:ndim] + ALL_PLACEMENTS[2:]:
            out.append((mesh, [p] + [Replicate()] * (mesh.ndim - 1)))
        if mesh.ndim > 1:
            out.append((mesh, [Shard(0)] * mesh.ndim))
            out.append((mesh, [Partial("max"), Shard(ndim - 1)] + [Partial()] * (mesh.ndim - 2)))
    return out


def ids(case):
    mesh, pl = case
    return f"{mesh}-{'/'.join(map(str, pl))}"


def assert_blocks(x: dtorch.Tensor, full: torch.Tensor):
    """Blocks of a tensor without Partial dims are exactly the slices spec.local_box defines."""
    for coord, b in zip(x.device_mesh.coordinates(), x.local_blocks()):
        box = x.spec.local_box(coord)
        assert tuple(b.shape) == tuple(n for _, n in box)
        if not x.spec.partial_dims():
            assert torch.equal(b, full[tuple(slice(o, o + n) for o, n in box)])


# -- construction ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", layouts(), ids=ids)
@pytest.mark.parametrize("build", [dtorch.Tensor, dtorch.tensor, dtorch.from_torch])
def test_from_torch_every_layout(build, case):
    mesh, pl = case
    full = torch.randint(-5, 6, (5, 7)).float()
    keep = full.clone()
    x = build(full, device_mesh=mesh, placements=pl)
    assert isinstance(x, dtorch.Tensor)
    assert x.placements == list(canonical(mesh, pl)) and x.device_mesh == mesh
    torch.testing.assert_close(x.to_torch(), full, rtol=0, atol=1e-6)  # Partial terms reduce to the value
    assert_blocks(x, full)
    full.add_(1)  # the tensor owns a copy
    torch.testing.assert_close(x.to_torch(), keep, rtol=0, atol=1e-6)


@pytest.mark.parametrize("data,expected", [
    (3, torch.tensor(3)),
    (2.5, torch.tensor(2.5)),
    (True, torch.tensor(True)),
    ([[1, 2], [3, 4]], torch.tensor([[1, 2], [3, 4]])),
    ([1, 2.5], torch.tensor([1, 2.5])),
    ((1, 2, 3), torch.tensor([1, 2, 3])),
    (np.arange(6, dtype=np.int32).reshape(2, 3), torch.arange(6, dtype=torch.int32).reshape(2, 3)),
    (np.float32(1.5), torch.tensor(1.5)),
])
def test_from_python_and_numpy(data, expected):
    x = dtorch.Tensor(data)
    assert x.dtype == expected.dtype and x.shape == expected.shape
    assert torch.equal(x.to_torch(), expected)
    assert x.device_mesh == dtorch.default_graph().default_device_mesh
    assert x.placements == [Replicate()]


def test_from_list_and_numpy_with_placements():
    x = dtorch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], device_mesh=MESH, placements=[Partial("max"), Shard(1)])
    assert torch.equal(x.to_torch(), torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    arr = np.arange(12.0).reshape(3, 4)
    y = dtorch.from_torch(arr, device_mesh=MESH, placements=[Shard(0), Partial()], dtype=torch.float32)
    assert y.dtype == torch.float32 and torch.equal(y.to_torch(), torch.from_numpy(arr).float())
    arr[0, 0] = 100.0
    assert y.to_torch()[0, 0] == 0.0


def test_from_dtorch_tensor():
    full = torch.arange(12.0).reshape(3, 4)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0), Shard(1)])
    same = dtorch.Tensor(x)
    assert same.placements == x.placements and same.device_mesh == MESH
    other = dtorch.tensor(x, placements=[Partial(), Replicate()])
    assert other.placements == [Partial(), Replicate()] and torch.equal(other.to_torch(), full)
    moved = dtorch.Tensor(x, device_mesh=DeviceMesh("cpu", [9]))
    assert moved.placements == [Replicate()] and torch.equal(moved.to_torch(), full)
    cast = dtorch.from_torch(x, dtype=torch.float64)
    assert cast.dtype == torch.float64 and torch.equal(cast.to_torch(), full.double())
    assert x.placements == [Shard(0), Shard(1)] and torch.equal(x.to_torch(), full)


def test_default_mesh_and_dtype_come_from_the_graph():
    g = dtorch.default_graph()
    with g.device_mesh_guard(MESH), g.dtype_guard(torch.float64):
        x = dtorch.Tensor([1.5, 2.5])
        assert x.device_mesh == MESH and x.placements == [Replicate(), Replicate()] and x.dtype == torch.float64
        assert dtorch.Tensor(torch.ones(2)).dtype == torch.float32  # a torch tensor keeps its dtype
        assert dtorch.Tensor([1, 2]).dtype == torch.int64


# -- factories ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in layouts() if not any(p.is_partial() for p in c[1])], ids=ids)
def test_factories_on_every_mesh(case):
    mesh, pl = case
    kw = dict(device_mesh=mesh, placements=pl)
    for name, x, want in [
        ("zeros", dtorch.zeros(5, 7, **kw), torch.zeros(5, 7)),
        ("ones", dtorch.ones((5, 7), **kw), torch.ones(5, 7)),
        ("full", dtorch.full((5, 7), 2.5, **kw), torch.full((5, 7), 2.5)),
        ("full-int", dtorch.full((5, 7), 3, **kw), torch.full((5, 7), 3)),
        ("arange", dtorch.arange(35, device_mesh=mesh, placements=[Shard(0) if p.is_shard() else p for p in pl]),
         torch.arange(35)),
        ("arange-float", dtorch.arange(0.5, 4.0, 0.25, device_mesh=mesh,
                                       placements=[Shard(0) if p.is_shard() else p for p in pl]),
         torch.arange(0.5, 4.0, 0.25)),
    ]:
        assert x.dtype == want.dtype and x.shape == want.shape, name
        assert torch.equal(x.to_torch(), want), name
        assert_blocks(x, want)
    e = dtorch.empty(5, 7, **kw)
    assert e.shape == (5, 7) and e.dtype == torch.float32 and e.placements == list(canonical(mesh, pl))


@pytest.mark.parametrize("case", layouts(), ids=ids)
def test_random_factories_equal_torch_whatever_the_mesh(case):
    mesh, pl = case
    kw = dict(device_mesh=mesh, placements=pl)
    for make, want in [
        (lambda g: dtorch.rand(5, 7, generator=g, **kw), lambda g: torch.rand(5, 7, generator=g)),
        (lambda g: dtorch.randn((5, 7), generator=g, **kw), lambda g: torch.randn(5, 7, generator=g)),
        (lambda g: dtorch.randn(5, 7, generator=g, dtype=torch.float64, **kw),
         lambda g: torch.randn(5, 7, generator=g, dtype=torch.float64)),
        (lambda g: dtorch.randint(-4, 9, (5, 7), generator=g, dtype=torch.float32, **kw),
         lambda g: torch.randint(-4, 9, (5, 7), generator=g, dtype=torch.float32)),
    ]:
        got, ref = make(torch.Generator().manual_seed(7)), want(torch.Generator().manual_seed(7))
        assert got.dtype == ref.dtype
        torch.testing.assert_close(got.to_torch(), ref, rtol=0, atol=1e-6)
    torch.manual_seed(3)
    a = dtorch.randn(4, 7, device_mesh=mesh)
    torch.manual_seed(3)
    assert torch.equal(a.to_torch(), torch.randn(4, 7))  # the global generator too


def test_factory_arguments():
    assert dtorch.randint(10, (3,)).dtype == torch.int64
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(dtorch.randint(10, (6,), generator=g1).to_torch(), torch.randint(10, (6,), generator=g2))
    assert torch.equal(dtorch.arange(1, 4, 0.5).to_torch(), torch.arange(1, 4, 0.5))
    assert dtorch.zeros(2, 3, dtype=torch.int32).dtype == torch.int32
    assert dtorch.zeros(torch.Size([2, 3])).shape == (2, 3) and dtorch.ones(()).shape == ()
    x = dtorch.zeros(3, device="cpu")
    assert x.device_mesh == DeviceMesh("cpu") and x.placements == [Replicate()]
    with dtorch.default_graph().dtype_guard(torch.float64):
        assert dtorch.ones(2).dtype == torch.float64 and dtorch.full((2,), 1.5).dtype == torch.float64
    with pytest.raises(dtorch.MeshError, match="either device_mesh or device, not both"):
        dtorch.zeros(3, device="cpu", device_mesh=MESH)


def test_like_factories():
    x = dtorch.Tensor(torch.randn(5, 7), device_mesh=MESH, placements=[Shard(1), Shard(0)])
    for name in ("zeros_like", "ones_like", "empty_like", "rand_like", "randn_like"):
        y = getattr(dtorch, name)(x)
        assert (y.shape, y.dtype, y.device_mesh, y.placements) == (x.shape, x.dtype, MESH, x.placements), name
    assert torch.equal(dtorch.zeros_like(x).to_torch(), torch.zeros(5, 7))
    assert torch.equal(dtorch.ones_like(x, dtype=torch.int32).to_torch(), torch.ones(5, 7, dtype=torch.int32))
    assert torch.equal(dtorch.full_like(x, 4.0).to_torch(), torch.full((5, 7), 4.0))
    g = torch.Generator().manual_seed(5)
    assert torch.equal(dtorch.rand_like(x, generator=g).to_torch(), torch.rand(5, 7, generator=torch.Generator().manual_seed(5)))
    r = dtorch.randint_like(x, 2, 9, generator=torch.Generator().manual_seed(2))
    assert r.dtype == x.dtype and torch.equal(r.to_torch(), torch.randint(2, 9, (5, 7), generator=torch.Generator().manual_seed(2)).float())
    assert int(dtorch.randint_like(x, 3).to_torch().max()) < 3
    other = dtorch.init_device_mesh("cpu", 4)
    moved = dtorch.zeros_like(x, device_mesh=other)
    assert moved.device_mesh == other and moved.placements == [Replicate()]
    placed = dtorch.ones_like(x, placements=[Replicate(), Shard(0)])
    assert placed.placements == [Replicate(), Shard(0)]
    for name in ("zeros_like", "ones_like", "empty_like", "rand_like", "randn_like"):
        assert getattr(dtorch, name)(x, device="cpu").device_mesh == DeviceMesh("cpu"), name
    assert dtorch.full_like(x, 1.0, device="cpu").device_mesh == DeviceMesh("cpu")
    assert dtorch.randint_like(x, 3, device="cpu").device_mesh == DeviceMesh("cpu")


# -- attributes and values --------------------------------------------------------------------------------
def test_attributes():
    x = dtorch.Tensor(torch.ones(5, 7, dtype=torch.float16), device_mesh=MESH, placements=[Shard(0), Partial()])
    assert x.shape == torch.Size([5, 7]) and isinstance(x.shape, torch.Size)
    assert x.size() == torch.Size([5, 7]) and x.size(1) == 7 and x.size(-2) == 5
    assert x.dim() == 2 and x.ndim == 2 and x.numel() == 35 and len(x) == 5
    assert x.dtype == torch.float16 and x.device_mesh is MESH
    assert x.placements == [Shard(0), Partial()] and isinstance(x.placements, list)
    assert x.graph is dtorch.default_graph()
    assert x.spec.shape == (5, 7) and x.spec.dtype == torch.float16
    s = dtorch.Tensor(3.0)
    assert s.shape == () and s.ndim == 0 and s.numel() == 1 and s.item() == 3.0


def test_to_torch_is_a_fresh_tensor():
    x = dtorch.Tensor(torch.zeros(6), device_mesh=dtorch.init_device_mesh("cpu", 2), placements=[Replicate()])
    a = x.to_torch()
    a.add_(1)
    assert torch.equal(x.to_torch(), torch.zeros(6))
    assert x.to_torch().data_ptr() != x.to_torch().data_ptr()


@pytest.mark.parametrize("case", layouts()[:12], ids=ids)
def test_to_torch_async(case):
    mesh, pl = case
    full = torch.randn(5, 7)
    x = dtorch.Tensor(full, device_mesh=mesh, placements=pl)
    fut = x.to_torch_async()
    assert isinstance(fut, TensorFuture)
    assert fut.wait_for(1000) is True and fut.is_ready()
    fut.wait()
    torch.testing.assert_close(fut.get(), full)

    async def fetch():
        return await x.to_torch_async()

    torch.testing.assert_close(asyncio.run(fetch()), full)


def test_tensor_future_pending_then_ready():
    raw: concurrent.futures.Future = concurrent.futures.Future()
    fut = TensorFuture(raw, "block of x")
    assert not fut.is_ready() and fut.wait_for(5) is False
    with pytest.raises(TimeoutError, match="block of x was not ready after 0.01 s"):
        fut.get(timeout=0.01)
    raw.set_result(torch.ones(2))
    assert fut.is_ready() and fut.wait_for(0) and torch.equal(fut.get(), torch.ones(2))


def test_repr_shows_values_mesh_and_placements():
    x = dtorch.Tensor(torch.tensor([[1.5, 2.0], [3.0, 4.0]]), device_mesh=MESH, placements=[Shard(0), Partial()])
    r = repr(x)
    body = repr(torch.tensor([[1.5, 2.0], [3.0, 4.0]]))[len("tensor("):-1]
    assert r.startswith("dtorch.Tensor(") and body in r
    assert "DeviceMesh('cpu', [[0, 1, 2], [3, 4, 5]], mesh_dim_names=['dp', 'tp'])" in r
    assert "placements=[S(0), P(sum)]" in r
    assert "dtype=torch.int32" in repr(dtorch.Tensor(torch.arange(3, dtype=torch.int32)))


# -- .to, redistribute variants -----------------------------------------------------------------------------
def test_to_mesh_and_dtype():
    full = torch.randn(5, 7)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0), Partial()])
    assert x.to(torch.float32) is x and x.to(MESH) is x
    h = x.to(torch.float64)
    assert h.dtype == torch.float64 and h.device_mesh == MESH
    torch.testing.assert_close(h.to_torch(), full.double())
    other = dtorch.init_device_mesh("cpu", (3, 2), mesh_dim_names=["a", "b"])
    y = x.to(other)
    assert y.device_mesh == other and y.placements == [Shard(0), Partial()]  # same rank: placements kept
    torch.testing.assert_close(y.to_torch(), full)
    z = x.to(DeviceMesh("cpu", [7]))  # other rank: replicated
    assert z.placements == [Replicate()]
    torch.testing.assert_close(z.to_torch(), full)
    both = x.to(other, torch.float16)
    assert both.device_mesh == other and both.dtype == torch.float16
    assert x.to("cpu") is x  # already on cpu devices: like torch, nothing changes
    assert x.placements == [Shard(0), Partial()] and x.dtype == torch.float32
    with pytest.raises(TypeError, match="DeviceMesh, a torch.dtype, a device or a tensor"):
        x.to(3)


def test_redistribute_by_dict_modes():
    full = torch.randn(4, 6)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0), Shard(1)])
    keep = x.redistribute_by_dict(placements_dict={"tp": Replicate()})
    assert keep.placements == [Shard(0), Replicate()]
    rep = x.redistribute_by_dict(placements_dict={"tp": Shard(0)}, default_placement_mode="replicate")
    assert rep.placements == [Replicate(), Shard(0)]
    full_dict = x.redistribute_by_dict(placements_dict={"dp": Partial(), "tp": Shard(0)},
                                       default_placement_mode="raise_error")
    assert full_dict.placements == [Partial(), Shard(0)]
    ignored = x.redistribute_by_dict(placements_dict={"pp": Shard(1), "tp": Replicate()})
    assert ignored.placements == [Shard(0), Replicate()]
    for y in (keep, rep, full_dict, ignored):
        torch.testing.assert_close(y.to_torch(), full)
    assert x.placements == [Shard(0), Shard(1)]
    with pytest.raises(PlacementError) as err:
        x.redistribute_by_dict(placements_dict={"tp": Replicate(), "pp": Shard(0)}, default_placement_mode="raise_error")
    assert "['dp']" in str(err.value) and "add them to placements_dict" in str(err.value)
    with pytest.raises(ValueError, match="one of"):
        x.redistribute_by_dict(placements_dict={}, default_placement_mode="copy")


def test_redistribute_by_dict_onto_another_mesh():
    full = torch.randn(4, 6)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0), Shard(1)])
    other = dtorch.init_device_mesh("cpu", (3, 2), mesh_dim_names=["tp", "pp"])
    y = x.redistribute_by_dict(other, {"pp": Shard(0), "dp": Partial()})
    assert y.device_mesh == other and y.placements == [Shard(1), Shard(0)]  # tp kept by name, dp ignored
    z = x.redistribute_by_dict(other, {"pp": Shard(0)}, default_placement_mode="replicate")
    assert z.placements == [Replicate(), Shard(0)]
    for t in (y, z):
        torch.testing.assert_close(t.to_torch(), full)


def test_redistribute_by_dict_raise_error_on_unnamed_mesh():
    x = dtorch.Tensor(torch.ones(4, 6), device_mesh=dtorch.init_device_mesh("cpu", (2, 3)))
    with pytest.raises(PlacementError) as err:
        x.redistribute_by_dict(placements_dict={"tp": Shard(0)}, default_placement_mode="raise_error")
    msg = str(err.value)
    assert "[0, 1]" in msg and "no dim names" in msg and "mesh_dim_names" in msg
    by_index = x.redistribute_by_dict(placements_dict={0: Shard(0), 1: Shard(1)}, default_placement_mode="raise_error")
    assert by_index.placements == [Shard(0), Shard(1)]


def test_redistribute_like_and_check_placement():
    full = torch.randn(5, 3)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0), Replicate()])
    other_mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    other = dtorch.zeros(5, 3, device_mesh=other_mesh, placements=[Shard(1)])
    y = x.redistribute_like(other)
    assert y.device_mesh == other_mesh and y.placements == [Shard(1)]
    torch.testing.assert_close(y.to_torch(), full)
    assert x.check_placement(0, Shard(0)) and x.check_placement("dp", Shard(-2))
    assert x.check_placement("tp", Replicate()) and not x.check_placement("tp", Shard(0))
    assert not x.check_placement(-2, Partial())
    with pytest.raises(dtorch.MeshError, match="no dim named 'pp'"):
        x.check_placement("pp", Replicate())


def test_redistribute_defaults():
    x = dtorch.Tensor(torch.randn(4, 6), device_mesh=MESH, placements=[Shard(0), Shard(1)])
    assert x.redistribute() is x
    same_rank = dtorch.init_device_mesh("cpu", (3, 2))
    assert x.redistribute(same_rank).placements == [Shard(0), Shard(1)]
    assert x.redistribute(dtorch.init_device_mesh("cpu", 2)).placements == [Replicate()]
    assert x.redistribute(placements=[Replicate(), Shard(0)]).device_mesh == MESH


# -- bad input ---------------------------------------------------------------------------------------
def test_bad_input_errors():
    with pytest.raises(PlacementError, match=r"Shard\(2\) on mesh dim 1 is out of range for a 2-D tensor; shard a dim in \[-2, 1\]"):
        dtorch.Tensor(torch.ones(2, 3), device_mesh=MESH, placements=[Replicate(), Shard(2)])
    with pytest.raises(PlacementError, match="got 1 placements .* give exactly one placement per mesh dim"):
        dtorch.Tensor(torch.ones(2, 3), device_mesh=MESH, placements=[Shard(0)])
    with pytest.raises(PlacementError, match="0-D tensor cannot be sharded; use Replicate"):
        dtorch.Tensor(torch.tensor(1.0), device_mesh=MESH, placements=[Shard(0), Replicate()])
    x = dtorch.ones(2, 3, device_mesh=MESH)
    with pytest.raises(PlacementError, match="give exactly one placement per mesh dim"):
        x.redistribute(MESH, [Replicate()])
    with pytest.raises(PlacementError, match="out of range"):
        x.redistribute(MESH, [Shard(0), Shard(-3)])
    with pytest.raises(dtorch.MeshError, match="device_mesh must be a DeviceMesh, got list"):
        dtorch.Tensor(torch.ones(2), device_mesh=[0, 1])
    with pytest.raises(dtorch.MeshError, match="device_mesh must be a DeviceMesh, got str"):
        x.redistribute("cpu", [Replicate(), Replicate()])


@pytest.mark.parametrize("data,words", [
    ("abc", ["from str", "torch.Tensor", "nested list"]),
    ({"a": 1}, ["from dict", "numpy array"]),
    (None, ["from NoneType"]),
    ([[1, 2], [3]], ["from list data"]),
    (np.array(["a", "b"]), ["numpy array of dtype <U1", "astype"]),
    (np.array([object()]), ["dtype object", "astype"]),
])
def test_unsupported_data_types(data, words):
    with pytest.raises(TypeError) as err:
        dtorch.Tensor(data)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# -- the user docs' snippets run ------------------------------------------------------------------------
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


@pytest.mark.parametrize("page", ["mesh.md", "placements.md", "redistribute.md", "dtensor.md"])
def test_doc_snippets_run(page, capsys):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
    assert blocks, page
    for code in blocks:
        exec(compile(code, f"{page} snippet", "exec"), {"__name__": "__doc_snippet__"})


# -- from_blocks: one block per device ------------------------------------------------------------------
def test_from_blocks_builds_sharded_and_partial_tensors():
    mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    full = torch.randn(5, 4)
    rows = torch.tensor_split(full, [3])  # torch.chunk sizes for 5 rows over 2: 3 + 2
    terms = [torch.randn(2, 4) for _ in range(2)]
    blocks = [rows[0], rows[0], rows[1], rows[1]]  # S(0) on dp, R on tp
    x = dtorch.Tensor.from_blocks(blocks, device_mesh=mesh, placements=[Shard(0), Replicate()], shape=(5, 4))
    assert torch.equal(x.to_torch(), full)
    p = dtorch.Tensor.from_blocks([terms[0], terms[1], terms[0], terms[1]], device_mesh=mesh,
                                  placements=[Replicate(), Partial()], shape=(2, 4))
    torch.testing.assert_close(p.to_torch(), terms[0] + terms[1])
    assert [torch.equal(a, b) for a, b in zip(p.local_blocks(), [terms[0], terms[1]] * 2)] == [True] * 4


def test_from_blocks_rejects_wrong_block_shapes_and_counts():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    with pytest.raises(dtorch.PlacementError, match=r"block 0 \(device 0, coordinate \(0,\)\) has shape \[2, 4\].* puts a \[3, 4\]"):
        dtorch.Tensor.from_blocks([torch.zeros(2, 4), torch.zeros(2, 4)], device_mesh=mesh, placements=[Shard(0)], shape=(5, 4))
    with pytest.raises(dtorch.PlacementError, match="3 blocks for the 2 devices"):
        dtorch.Tensor.from_blocks([torch.zeros(1)] * 3, device_mesh=mesh, placements=[Replicate()], shape=(1,))


def test_factories_take_size_keyword_and_torch_like_spellings():
    mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    z = dtorch.zeros(size=(5, 7), device_mesh=mesh, placements=[Shard(1)])
    assert z.shape == (5, 7) and z.placements == [Shard(1)]
    like = torch.ones_like(z)
    assert like.placements == [Shard(1)] and torch.equal(like.to_torch(), torch.ones(5, 7))
    with pytest.raises(TypeError, match="both positionally and as size="):
        dtorch.zeros(3, size=(5,))


def test_clone_and_detach_are_new_objects_with_the_same_value():
    full = torch.randn(5, 4)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0), Partial()])
    for y in (x.clone(), x.detach(), torch.clone(x), torch.detach(x), dtorch.clone(x),
              x.clone(memory_format=torch.contiguous_format)):
        assert isinstance(y, dtorch.Tensor) and y is not x
        assert y.placements == x.placements and y.device_mesh == x.device_mesh
        torch.testing.assert_close(y.to_torch(), full)
    y = x.clone()
    z = y + 1  # ops make new values: neither y nor the x it shares blocks with changes
    torch.testing.assert_close(z.to_torch(), full + 1)
    torch.testing.assert_close(x.to_torch(), full)
    torch.testing.assert_close(y.to_torch(), full)


def test_missing_tensor_attributes_say_what_exists():
    x = dtorch.Tensor(torch.randn(4, 3), device_mesh=MESH, placements=[Shard(0), Replicate()])
    with pytest.raises(AttributeError, match=r"^'Tensor' object has no attribute 'no_such_thing'$"):
        x.no_such_thing
    assert getattr(x, "_no_such_slot", None) is None  # private lookups still fail plainly
    missing = sorted(n for n in dir(torch.Tensor) if not n.startswith("_") and not hasattr(dtorch.Tensor, n))
    assert "kron" in missing and "histc" in missing
    for name in missing:
        with pytest.raises(AttributeError) as info:
            getattr(x, name)
        msg = str(info.value)
        assert f"torch.Tensor.{name} is not supported on dtorch tensors" in msg
        assert "same name" not in msg
        if name in PUBLIC:  # suggest a dtorch operator only where one exists (not a re-exported dtype)
            assert f"dtorch.{name}(" in msg, msg
        else:
            assert f"dtorch.{name}(" not in msg and ".to_torch()" in msg, msg


@pytest.mark.parametrize("call,spelling", [
    (lambda x: torch.kron(x, x), "torch.kron"),
    (lambda x: torch.histc(x), "torch.histc"),
    (lambda x: torch.diff(x), "torch.diff"),
    (lambda x: torch.searchsorted(x, x), "torch.searchsorted"),
    (lambda x: torch.nn.functional.fold(x.unsqueeze(0), (2, 2), 1), "torch.nn.functional.fold"),
    (lambda x: torch.nn.functional.pixel_shuffle(x.unsqueeze(0), 1), "torch.nn.functional.pixel_shuffle"),
    (lambda x: torch.nn.functional.lp_pool1d(x.unsqueeze(0), 2, 2), "torch.nn.functional.lp_pool1d"),
    (lambda x: torch.Tensor.unique(x), "torch.Tensor.unique"),
])
def test_unsupported_torch_functions_are_named_by_their_public_name(call, spelling):
    x = dtorch.Tensor(torch.randn(4, 3), device_mesh=MESH, placements=[Shard(0), Replicate()])
    with pytest.raises(NotImplementedError) as info:
        call(x)
    msg = str(info.value)
    assert msg.startswith(f"{spelling} is not supported on dtorch tensors yet")
    assert "same name" not in msg and "<locals>" not in msg and "_VariableFunctions" not in msg
    assert f"apply {spelling} to the torch tensor" in msg and ".to_torch()" in msg
    assert isinstance(info.value, dtorch.OpError)


def test_torch_spellings_that_dtorch_has_route_or_name_the_dtorch_operator():
    full = torch.randn(4, 6)
    x = dtorch.Tensor(full, device_mesh=MESH, placements=[Shard(0), Shard(1)])
    pieces = torch.Tensor.split(x, 3)  # torch.Tensor.<method>(x): dtorch's own method
    assert [tuple(p.shape) for p in pieces] == [(3, 6), (1, 6)]
    torch.testing.assert_close(torch.cat([p.to_torch() for p in pieces]), full)
    torch.testing.assert_close(torch.selu(x).to_torch(), torch.selu(full))
    with pytest.raises(NotImplementedError, match=r"torch\.Tensor\.masked_fill .*call dtorch\.masked_fill\(\.\.\.\)"):
        full.masked_fill(x > 0, 1.0)  # a torch tensor as self
