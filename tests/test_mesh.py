"""DeviceMesh and its helpers (API.md section 1)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import dtorch
from dtorch import DeviceMesh, MeshError, Replicate, Shard


@pytest.mark.parametrize("ids", [
    [[0, 1, 2], [3, 4, 5]],
    ((0, 1, 2), (3, 4, 5)),
    np.arange(6).reshape(2, 3),
    torch.arange(6).reshape(2, 3),
    np.arange(6, dtype=np.int32).reshape(2, 3),
])
def test_ids_from_any_array_like(ids):
    m = DeviceMesh("cpu", ids, mesh_dim_names=["dp", "tp"])
    assert m.device_type == "cpu"
    assert m.shape == (2, 3) and isinstance(m.shape, tuple)
    assert m.ndim == 2
    assert m.size() == 6 and m.size(0) == 2 and m.size(1) == 3 and m.size("tp") == 3 and m.size(-1) == 3
    assert m.dim_names == ["dp", "tp"]
    assert m.device_ids == [0, 1, 2, 3, 4, 5]
    # torch's (and the original DTorch's) DeviceMesh.mesh: an int64 torch tensor
    assert isinstance(m.mesh, torch.Tensor) and m.mesh.dtype == torch.int64
    assert m.mesh.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert m == DeviceMesh("cpu", [[0, 1, 2], [3, 4, 5]], mesh_dim_names=("dp", "tp"))


def test_one_device_defaults_and_scalars():
    m = DeviceMesh("cpu")
    assert m.shape == (1,) and m.device_ids == [0] and m.dim_names is None and m.size() == 1
    assert DeviceMesh("cpu", 5).device_ids == [5]
    assert DeviceMesh("cuda").device_type == "cuda"  # metadata only: no GPU needed to describe one


def test_device_ids_follow_the_array_not_sorted():
    m = DeviceMesh("cpu", [[7, 3], [5, 1]])
    assert m.device_ids == [7, 3, 5, 1]
    assert m.coordinates() == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_writing_into_mesh_never_changes_the_mesh():
    m = DeviceMesh("cpu", [0, 1])
    ids = m.mesh
    ids[0] = 5
    assert m.device_ids == [0, 1] and m.mesh.tolist() == [0, 1] and m == DeviceMesh("cpu", [0, 1])
    assert DeviceMesh("cpu", m.mesh) == m  # the tensor builds the same mesh again


def test_equality_and_hash_by_type_ids_and_names():
    a = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"])
    same = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    assert a == same and hash(a) == hash(same) and len({a, same}) == 1
    others = [
        DeviceMesh("cuda", [[0, 1], [2, 3]], mesh_dim_names=["dp", "tp"]),  # device type
        DeviceMesh("cpu", [[0, 1], [3, 2]], mesh_dim_names=["dp", "tp"]),  # ids
        DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=["tp", "dp"]),  # names
        DeviceMesh("cpu", [[0, 1], [2, 3]]),  # no names
        DeviceMesh("cpu", [0, 1, 2, 3]),  # shape
    ]
    for o in others:
        assert a != o
    assert len({a, *others}) == 1 + len(others)
    assert a != "cpu" and a != [[0, 1], [2, 3]]


def test_init_device_mesh_int_and_tuple():
    assert dtorch.init_device_mesh("cpu", 4).device_ids == [0, 1, 2, 3]
    assert dtorch.init_device_mesh("cpu", 4).shape == (4,)
    m = dtorch.init_device_mesh("cpu", (2, 3, 2), mesh_dim_names=["dp", "tp", "pp"])
    assert m.shape == (2, 3, 2) and m.device_ids == list(range(12))
    assert m.mesh[1, 2, 0] == 1 * 6 + 2 * 2 + 0  # row-major
    assert dtorch.init_device_mesh("cpu", [3]).shape == (3,)


def test_size_one_dims_are_legal_everywhere():
    m = dtorch.init_device_mesh("cpu", (1, 3, 1), mesh_dim_names=["dp", "tp", "pp"])
    x = dtorch.Tensor(torch.arange(10.0), device_mesh=m, placements=[Shard(0), Shard(0), Shard(0)])
    torch.testing.assert_close(x.to_torch(), torch.arange(10.0))
    torch.testing.assert_close((x * 2).to_torch(), torch.arange(10.0) * 2)
    assert [len(s.device_ids) for s in m.unbind("dp")] == [3]
    assert [s.shape for s in m.unbind("tp")] == [(1, 1)] * 3


def test_unbind():
    m = dtorch.init_device_mesh("cpu", (2, 3), mesh_dim_names=["pp", "tp"])
    stages = m.unbind("pp")
    assert stages == [DeviceMesh("cpu", [0, 1, 2], mesh_dim_names=["tp"]),
                      DeviceMesh("cpu", [3, 4, 5], mesh_dim_names=["tp"])]
    cols = m.unbind("tp")
    assert [c.device_ids for c in cols] == [[0, 3], [1, 4], [2, 5]]
    assert all(c.dim_names == ["pp"] for c in cols)
    m3 = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["dp", "pp", "tp"])
    subs = m3.unbind("pp")
    assert [s.dim_names for s in subs] == [["dp", "tp"]] * 2
    assert [s.mesh.tolist() for s in subs] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_unbind_without_the_dim_returns_the_mesh():
    m = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    assert m.unbind("pp") == [m]
    unnamed = dtorch.init_device_mesh("cpu", (2, 2))
    assert unnamed.unbind("pp") == [unnamed]


def test_unbind_last_dim_leaves_one_device_meshes():
    m = dtorch.init_device_mesh("cpu", 3, mesh_dim_names=["pp"])
    assert [s.device_ids for s in m.unbind("pp")] == [[0], [1], [2]]
    assert all(s.ndim == 1 for s in m.unbind("pp"))


def test_dim_name_index():
    m = dtorch.init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=["dp", "tp", "ulysess_cp"])
    assert [m.dim_name_index(n) for n in ("dp", "tp", "ulysess_cp", "pp")] == [0, 1, 2, None]
    assert m.dim_name_index("ulysses_cp") == 2  # the corrected spelling is an alias
    assert dtorch.init_device_mesh("cpu", 2).dim_name_index("dp") is None


def test_check_all_dim_names_in_set():
    m = dtorch.init_device_mesh("cpu", (1, 2, 1, 1), mesh_dim_names=["dp", "tp", "ep", "sp"])
    m.check_all_dim_names_in_set({"dp", "tp", "ep", "sp", "pp"})
    with pytest.raises(ValueError) as err:
        m.check_all_dim_names_in_set(["dp", "tp"])
    msg = str(err.value)
    assert "'ep'" in msg and "'sp'" in msg and "'dp'" in msg and "'tp'" in msg
    assert "Rename or remove" in msg
    dtorch.init_device_mesh("cpu", 2).check_all_dim_names_in_set([])  # no names: nothing unsupported


@pytest.mark.parametrize("layers,stages,expected", [
    (4, 2, [0, 0, 1, 1]),
    (5, 2, [0, 0, 0, 1, 1]),
    (7, 3, [0, 0, 0, 1, 1, 2, 2]),
    (3, 3, [0, 1, 2]),
    (3, 1, [0, 0, 0]),
])
def test_assign_layers_to_stages(layers, stages, expected):
    assert dtorch.assign_layers_to_stages(layers, stages) == expected


def test_assign_layers_to_stages_errors():
    with pytest.raises(ValueError, match="use fewer pipeline stages"):
        dtorch.assign_layers_to_stages(2, 3)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        dtorch.assign_layers_to_stages(2, 0)


def test_get_default_device_mesh():
    m = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
    assert dtorch.get_default_device_mesh(m) is m
    assert dtorch.get_default_device_mesh() == dtorch.default_graph().default_device_mesh == DeviceMesh("cpu")
    with dtorch.default_graph().device_mesh_guard(m):
        assert dtorch.get_default_device_mesh() is m


def test_432_virtual_cpu_devices_run_real_ops():
    m = dtorch.init_device_mesh("cpu", (12, 36), mesh_dim_names=["dp", "tp"])
    assert m.size() == 432
    full = torch.randn(24, 73, generator=torch.Generator().manual_seed(0))
    x = dtorch.Tensor(full, device_mesh=m, placements=[Shard(0), Shard(1)])  # 73 over 36: uneven
    y = (x * 3 + 1).redistribute(m, [Replicate(), Replicate()])
    torch.testing.assert_close(y.to_torch(), full * 3 + 1)
    flat = dtorch.init_device_mesh("cpu", 432)
    z = dtorch.Tensor(torch.arange(1000.0), device_mesh=flat, placements=[Shard(0)])
    assert len(z.local_blocks()) == 432
    torch.testing.assert_close((z + 1).to_torch(), torch.arange(1000.0) + 1)


def test_str_and_repr():
    m = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    assert str(m) == "cpu[dp=2, tp=2]"
    assert repr(m) == "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=['dp', 'tp'])"
    assert str(dtorch.init_device_mesh("cpu", (2, 3))) == "cpu[2x3]"


# -- bad input: the message says what to change ----------------------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    (dict(mesh=[[0, 1], [2, 3]], mesh_dim_names=["dp"]), ["1 names", "2 dims", "one name per mesh dim"]),
    (dict(mesh=[0, 1], mesh_dim_names="tp"), ["list of names", "['tp']"]),
    (dict(mesh=[[0, 1], [2, 3]], mesh_dim_names=["tp", "tp"]), ["unique", "'tp'"]),
    (dict(mesh=[0, 1, 1, 2, 2]), ["unique", "repeated: [1, 2]"]),
    (dict(mesh=[0, -1, -3]), ["non-negative", "[-3, -1]"]),
    (dict(mesh=[[0, 1], [2]]), ["rectangular"]),
    (dict(mesh=[0.5, 1]), ["integer device ids", "[[0, 1], [2, 3]]"]),
    (dict(mesh=[]), ["at least one device"]),
])
def test_bad_mesh_errors(kwargs, words):
    with pytest.raises(MeshError) as err:
        DeviceMesh("cpu", **kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_bad_device_type_and_shape():
    with pytest.raises(MeshError, match=r"device_type must be one of \('cpu', 'cuda'\), got 'gpu'"):
        DeviceMesh("gpu", [0])
    with pytest.raises(MeshError, match="positive ints"):
        dtorch.init_device_mesh("cpu", (2, 0))
    with pytest.raises(MeshError, match="1 names"):
        dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp"])


def test_unknown_dim_names():
    m = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["dp", "tp"])
    with pytest.raises(MeshError, match=r"no dim named 'pp'; its dims are \['dp', 'tp'\]"):
        m.size("pp")
    with pytest.raises(MeshError, match="out of range for a 2-D mesh"):
        m.size(2)
    with pytest.raises(MeshError, match=r"no dim names.*mesh_dim_names=\[\.\.\.\]"):
        dtorch.init_device_mesh("cpu", (2, 2)).size("tp")


def test_unbind_dims_keyword_int_and_list():
    m = dtorch.init_device_mesh("cpu", (2, 3, 2), mesh_dim_names=["dp", "tp", "pp"])
    assert m.unbind(dims=2) == m.unbind("pp") == m.unbind(-1) == m.unbind(dims=["pp"])
    assert [s.device_ids for s in m.unbind(dims=1)] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    # a list: the sub-meshes in the row-major order of the unbound dims' coordinates, the dims in mesh order
    # whatever the list's order (dp outer, pp inner here), each the remaining dims' block of ids
    want = [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    for dims in (["dp", "pp"], ["pp", "dp"], [0, 2], [2, "dp"]):
        subs = m.unbind(dims=dims)
        assert [s.device_ids for s in subs] == want, dims
        assert all(s.dim_names == ["tp"] for s in subs)
    assert [s.device_ids for s in m.unbind([0, 1, 2])] == [[i] for i in range(12)]
    unnamed = dtorch.init_device_mesh("cpu", (2, 2))
    assert [s.device_ids for s in unnamed.unbind(0)] == [[0, 1], [2, 3]] and unnamed.unbind(0)[0].dim_names is None
    with pytest.raises(MeshError, match="out of range"):
        m.unbind(3)


def test_unbind_siblings_log_the_dim_they_differ_on():
    m = dtorch.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=["dp", "pp", "tp"])
    subs = m.unbind(["dp", "pp"])  # coordinates (0, 0), (0, 1), (1, 0), (1, 1)
    assert subs[0].parent_dim_between(subs[1]) == "pp" and subs[0].parent_dim_between(subs[2]) == "dp"
    assert subs[0].parent_dim_between(subs[3]) is None
    s0, s1 = m.unbind("pp")
    assert s0.parent_dim_between(s1) == "pp" and s0.parent_dim_between(subs[1]) is None
