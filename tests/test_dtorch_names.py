"""The original DTorch names (API.md section 13), each used the way code written for it uses them; plus
the torch constructor forms of dtorch.Tensor and the canonical placements (a Shard on a size-1 mesh dim
is Replicate())."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

import dtorch
from dtorch import Replicate, Shard
from dtorch.distributed_spec import DeviceMesh


def test_default_graph_object_and_call():
    mesh = DeviceMesh("cpu", [0, 1])
    assert dtorch.default_graph.satisfy(mesh)
    dtorch.default_graph.empty_cache()
    dtorch.default_graph.sync()
    g = dtorch.default_graph()
    assert isinstance(g, dtorch.Graph) and g is dtorch.Graph.default_graph()
    assert dtorch.default_graph.backend == g.backend and dtorch.default_graph == g
    other = dtorch.Graph()
    with other:  # the object follows the current default
        assert dtorch.default_graph() is other and dtorch.default_graph.name == other.name
    assert dtorch.default_graph() is g


def test_graph_keyword_on_constructors_and_factories():
    g = dtorch.Graph()
    mesh = DeviceMesh("cpu", [0, 1])
    for t in (dtorch.Tensor([1.0, 2.0], graph=g), dtorch.tensor([1, 2], graph=g), dtorch.zeros(2, 3, graph=g),
              dtorch.ones(3, graph=g, device_mesh=mesh), dtorch.full((2,), 1.5, graph=g), dtorch.arange(4, graph=g),
              dtorch.randn(2, graph=g), dtorch.randint(0, 5, (3,), graph=g), dtorch.from_torch(torch.ones(2), graph=g)):
        assert t.graph is g
    x = dtorch.Tensor(torch.arange(6.0), device_mesh=mesh, placements=[Shard(0)])
    y = dtorch.Tensor(x, graph=g)  # another Graph: the value is copied over in x's layout
    assert y.graph is g and y.placements == [Shard(0)] and torch.equal(y.to_torch(), x.to_torch())
    assert dtorch.Tensor([1.0], graph=dtorch.default_graph).graph is dtorch.default_graph()
    with pytest.raises(TypeError, match="graph= must be a dtorch.Graph"):
        dtorch.zeros(2, graph="main")


def test_sync_future_is_a_void_future():
    fut = dtorch.default_graph.sync_future()
    assert isinstance(fut, dtorch.VoidFutureCollect)
    fut.wait()
    assert fut.is_ready() and fut.get() is None

    async def main():
        return await dtorch.default_graph().sync_future()

    assert asyncio.run(main()) is None


def test_graph_option_defaults_to_none():
    option = dtorch.graph.GraphOption()
    assert option.per_device_per_process is None and repr(option) == "GraphOption(per_device_per_process=None)"
    assert dtorch.Graph(option).backend == dtorch.Graph().backend  # None: the default backend


def test_graph_option():
    g = dtorch.Graph(dtorch.graph.GraphOption(per_device_per_process=False))
    assert g.backend == dtorch.Graph().backend  # the default backend
    assert repr(dtorch.graph.GraphOption(per_device_per_process=True)) == "GraphOption(per_device_per_process=True)"
    assert dtorch.graph.GraphOption(True).backend == "process"
    g = dtorch.Graph(dtorch.graph.GraphOption(per_device_per_process=True))
    try:
        assert g.backend == "process"
        with g:
            mesh = DeviceMesh("cpu", [0, 1])
            x = dtorch.Tensor(torch.arange(5.0), device_mesh=mesh, placements=[Shard(0)])
            assert torch.equal((x * 2).to_torch(), torch.arange(5.0) * 2)
    finally:
        g.runtime.close() if hasattr(g.runtime, "close") else None


def test_shard_get_shard_index():
    assert Shard(1).get_shard_index() == 1
    x = dtorch.Tensor(torch.randn(4, 6), device_mesh=DeviceMesh("cpu", [0, 1]), placements=[Shard(-1)])
    assert x.placements[0].get_shard_index() == 1


def test_unbind_list_of_names():
    mesh = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["dp", "tp", "pp"])
    subs = mesh.unbind(["dp", "pp"])
    assert [m.device_ids for m in subs] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert all(m.dim_names == ["tp"] for m in subs)
    assert mesh.unbind(["pp"]) == mesh.unbind("pp")
    assert mesh.unbind(["cp"]) == [mesh] and mesh.unbind([]) == [mesh]
    # DTorch's order: row-major over the unbound dims in the mesh's order, whatever the list's order
    assert [m.device_ids for m in mesh.unbind(["pp", "dp"])] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.unbind(dims=["pp", "dp"]) == subs and mesh.unbind(dims=1)[1].device_ids == [2, 3, 6, 7]


def test_device_mesh_guard_of_a_device_type():
    with dtorch.default_graph.device_mesh_guard("cpu"):
        x = dtorch.ones(3)
        assert x.device_mesh == DeviceMesh("cpu") and x.device_mesh.size() == 1
    with dtorch.Graph.default_graph().device_mesh_guard("cuda") as mesh:
        assert mesh == DeviceMesh("cuda", [0]) and dtorch.get_default_device_mesh() == mesh


def test_nn_parameter_module():
    from dtorch.nn.parameter import Buffer, Parameter

    assert Parameter is dtorch.nn.Parameter

    class Model(dtorch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = Parameter(dtorch.randn(3, 4))
            self.stats = Buffer(dtorch.zeros(4))
            self.scratch = Buffer(dtorch.ones(2), persistent=False)
            self.torch_buf = torch.nn.Buffer(torch.full((2,), 3.0))

    m = Model()
    assert [n for n, _ in m.named_parameters()] == ["w"]
    assert sorted(n for n, _ in m.named_buffers()) == ["scratch", "stats", "torch_buf"]
    assert sorted(m.state_dict()) == ["stats", "torch_buf", "w"]
    assert torch.equal(m.torch_buf.to_torch(), torch.full((2,), 3.0))
    assert Buffer().shape == (0,) and Buffer().persistent


def test_torch_names_reexported():
    assert dtorch.float16 is torch.float16 and dtorch.bfloat16 is torch.bfloat16 and dtorch.int64 is torch.int64
    assert dtorch.finfo(dtorch.float16).max == torch.finfo(torch.float16).max
    assert dtorch.Size((2, 3)) == torch.Size((2, 3))
    a = np.arange(4.0)
    x = dtorch.Tensor(dtorch.from_numpy(a))
    assert torch.equal(x.to_torch(), torch.from_numpy(a))
    assert dtorch.Tensor is dtorch.DTensor and dtorch.clone is not torch.clone


def test_comparison_names_and_methods():
    xt, yt = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([3.0, 2.0, 1.0, 4.0, 0.0])
    mesh = DeviceMesh("cpu", [0, 1])
    x = dtorch.Tensor(xt, device_mesh=mesh, placements=[Shard(0)])
    y = dtorch.Tensor(yt, device_mesh=mesh)
    for name in ("greater", "greater_equal", "less", "less_equal", "not_equal"):
        want = getattr(torch, name)(xt, yt)
        for got in (getattr(dtorch, name)(x, y), getattr(x, name)(y), getattr(torch, name)(x, y)):
            assert got.placements == [Shard(0)] and torch.equal(got.to_torch(), want), name
        assert torch.equal(getattr(x, name)(2.0).to_torch(), getattr(xt, name)(2.0))
    assert dtorch.equal(x, dtorch.Tensor(xt, device_mesh=mesh)) and x.equal(x) and not dtorch.equal(x, y)
    c = dtorch.clone(x)
    assert c is not x and c.placements == x.placements and torch.equal(x.clone().to_torch(), xt)
    if "nonzero" in dtorch.ops.TABLE:  # (H7's op: dtorch.nonzero and Tensor.nonzero)
        assert torch.equal(dtorch.nonzero(x > 2).to_torch(), torch.nonzero(xt > 2))
        assert torch.equal((x > 2).nonzero().to_torch(), (xt > 2).nonzero())


# -- constructors -----------------------------------------------------------------------------------

def test_tensor_constructor_size_forms():
    for args, want in (((torch.Size((1, 2)),), torch.Tensor(torch.Size((1, 2)))), ((), torch.Tensor()),
                       ((2, 3), torch.Tensor(2, 3)), ((torch.Size(()),), torch.Tensor(torch.Size(())))):
        x = dtorch.Tensor(*args)
        assert x.shape == want.shape and x.dtype == want.dtype == torch.float32, args
    assert dtorch.Tensor(2, 3, dtype=torch.float64).dtype == torch.float64
    with dtorch.default_graph.dtype_guard(torch.bfloat16):
        assert dtorch.Tensor(2, 3).dtype == torch.bfloat16
    mesh = DeviceMesh("cpu", [0, 1, 2])
    x = dtorch.Tensor(7, 2, device_mesh=mesh, placements=[Shard(0)])
    assert x.shape == (7, 2) and x.placements == [Shard(0)] and [b.shape[0] for b in x.local_blocks()] == [3, 3, 1]
    # data forms are unchanged: one number, lists, tuples, tensors
    assert dtorch.Tensor(5).shape == () and dtorch.Tensor(5).item() == 5
    assert dtorch.Tensor([2, 3]).tolist() == [2, 3] and dtorch.Tensor((2, 3)).tolist() == [2, 3]
    assert torch.equal(dtorch.Tensor(torch.arange(3)).to_torch(), torch.arange(3))
    with pytest.raises(TypeError, match="one data argument"):
        dtorch.Tensor(2, "3")
    with pytest.raises(ValueError, match="non-negative"):
        dtorch.Tensor(2, -1)


# -- canonical placements ---------------------------------------------------------------------------

def test_shard_on_a_size_one_mesh_dim_is_replicate():
    mesh = dtorch.init_device_mesh("cpu", (2, 1), mesh_dim_names=["dp", "tp"])
    full = torch.randn(5, 4)
    want = [Shard(0), Replicate()]
    made = [
        dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(0), Shard(1)]),
        dtorch.tensor(full, device_mesh=mesh, placements=[Shard(0), Shard(0)]),
        dtorch.Tensor(full, device_mesh=mesh).redistribute(placements=[Shard(0), Shard(-1)]),
        dtorch.zeros(5, 4, device_mesh=mesh, placements=[Shard(0), Shard(1)]),
        dtorch.Tensor.from_blocks([full[:3], full[3:]], device_mesh=mesh, placements=[Shard(0), Shard(1)], shape=(5, 4)),
        dtorch.nn.Parameter(dtorch.Tensor(full, device_mesh=mesh, placements=[Shard(0), Shard(1)])),
        dtorch.nn.Parameter(full, device_mesh=mesh, placements=[Shard(0), Shard(1)]),
    ]
    ref = dtorch.Tensor(full, device_mesh=mesh, placements=want)
    for t in made:
        assert t.placements == want and t.spec.placements == ref.spec.placements
        assert "placements=[S(0), R]" in repr(t)
    assert made[0].spec == ref.spec
    one = DeviceMesh("cpu")
    assert dtorch.Tensor(full, device_mesh=one, placements=[Shard(1)]).placements == [Replicate()]
    lin = dtorch.nn.Linear(4, 3, device_mesh=mesh)
    assert all(all(not p.is_shard() or mesh.shape[i] > 1 for i, p in enumerate(q.placements))
               for q in lin.parameters())


# -- the nn names ------------------------------------------------------------------------------------

@pytest.mark.parametrize("placements", [[Shard(0), Shard(1)], [Shard(2), Shard(3)], [Replicate(), Shard(2)]], ids=str)
def test_global_avg_pool2d(placements):
    # [N, C, H, W] -> [N, C, 1, 1] (AdaptiveAvgPool2d(1)); uneven shards: 5 rows over 2, 7 columns over 2
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "sp"])
    x = torch.randn(3, 4, 5, 7, generator=torch.Generator().manual_seed(0))
    pool = dtorch.nn.GlobalAvgPool2d()
    out = pool(dtorch.Tensor(x, device_mesh=mesh, placements=placements))
    torch.testing.assert_close(out.to_torch(), torch.nn.AdaptiveAvgPool2d(1)(x))
    assert out.shape == (3, 4, 1, 1) and pool(dtorch.Tensor(x[0], device_mesh=mesh)).shape == (4, 1, 1)
    assert "GlobalAvgPool2d" in dtorch.nn.__all__ and list(pool.parameters()) == []


def test_functional_function_names():
    names = dtorch.nn.functional._function_names
    assert isinstance(names, list) and names == sorted(names)
    for name in ("linear", "relu", "softmax", "cross_entropy", "scaled_dot_product_attention", "conv2d",
                 "max_pool2d", "layer_norm", "embedding", "dropout"):
        assert name in names, name
    assert all(callable(getattr(dtorch.nn.functional, n)) for n in names)
