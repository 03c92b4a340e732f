"""visualize_sharding: the picture names the devices that hold each block."""
from __future__ import annotations

import re

import pytest
import torch

import dtorch
from dtorch import DeviceMesh, Partial, Replicate, Shard

MESH_1D = DeviceMesh("cpu", [4, 5, 6], mesh_dim_names=["tp"])
MESH_2D = DeviceMesh("cpu", [[3, 1, 2], [0, 5, 4]], mesh_dim_names=["dp", "tp"])


def _ids(label: str) -> list[int]:
    out = []
    for part in label.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return out


def _edges(text: str) -> list[tuple[int, int]]:
    return [(int(a), int(b) - int(a)) for a, b in re.findall(r"(\d+):(\d+)", text)]


def parse_grid(text: str, ndim: int) -> dict:
    """{(row box, col box): device ids} from the drawn grid and its footer."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    cells = [[_ids(c.strip()[len("dev "):]) for c in r.strip("|").split("|")] for r in rows]
    footer = next(line for line in text.splitlines() if line.startswith(("rows", "elements")))
    if ndim == 1:
        row_edges, col_edges = [None], _edges(footer[len("elements"):])
    else:
        r, c = footer.split(";")
        row_edges, col_edges = _edges(r), _edges(c)
    assert len(cells) == len(row_edges) and all(len(c) == len(col_edges) for c in cells), text
    return {(re_, ce): cells[i][j] for i, re_ in enumerate(row_edges) for j, ce in enumerate(col_edges)}


CASES = [
    ((7,), MESH_1D, [Shard(0)]),
    ((7,), MESH_1D, [Replicate()]),
    ((2,), MESH_1D, [Shard(0)]),  # fewer elements than devices: one empty block
    ((6, 5), MESH_1D, [Shard(1)]),
    ((6, 5), MESH_1D, [Shard(0)]),
    ((6, 5), MESH_2D, [Shard(0), Shard(1)]),
    ((6, 5), MESH_2D, [Shard(1), Shard(0)]),
    ((6, 5), MESH_2D, [Replicate(), Shard(0)]),
    ((6, 5), MESH_2D, [Shard(1), Replicate()]),
    ((7, 2), MESH_2D, [Shard(0), Shard(0)]),  # nested shards of one dim
    ((9,), MESH_2D, [Shard(0), Shard(0)]),
    ((4,), MESH_2D, [Shard(0), Shard(0)]),  # nested and uneven: devices 2 and 4 hold nothing
    ((3, 3), MESH_2D, [Partial(), Shard(1)]),
]


@pytest.mark.parametrize("shape,mesh,placements", CASES, ids=lambda v: str(v))
def test_grid_names_the_right_devices(shape, mesh, placements, capsys):
    x = dtorch.zeros(*shape, device_mesh=mesh, placements=placements)
    text = dtorch.visualize_sharding(x)
    assert capsys.readouterr().out.strip() == text.strip()  # printed by default
    assert text.splitlines()[0] == f"{list(shape)} on {mesh} placements [{', '.join(map(str, placements))}]"
    grid = parse_grid(text, len(shape))
    spec = x.spec
    expected: dict = {}
    for dev, coord in zip(mesh.device_ids, mesh.coordinates()):
        box = spec.local_box(coord)
        if all(n > 0 for _, n in box):
            key = (box[0], box[1]) if len(shape) == 2 else (None, box[0])
            expected.setdefault(key, []).append(dev)
    assert {k: sorted(v) for k, v in grid.items()} == {k: sorted(v) for k, v in expected.items()}
    empty = sorted(d for d, c in zip(mesh.device_ids, mesh.coordinates()) if 0 in spec.local_shape(c))
    if empty:
        assert f"empty blocks on dev {','.join(map(str, empty))}" in text
    else:
        assert "empty" not in text
    partial = [mesh.dim_label(i) for i, p in enumerate(placements) if p.is_partial()]
    for label in partial:
        assert f"mesh dim {label}: P(sum) (each device holds a term)" in text


def test_print_output_false(capsys):
    x = dtorch.zeros(4, device_mesh=MESH_1D, placements=[Shard(0)])
    text = dtorch.visualize_sharding(x, print_output=False)
    assert capsys.readouterr().out == "" and "dev 4" in text


def test_3d_tensor_summary_lists_each_device_range():
    x = dtorch.zeros(2, 3, 5, device_mesh=MESH_2D, placements=[Shard(0), Shard(2)])
    text = dtorch.visualize_sharding(x, print_output=False)
    lines = text.splitlines()[1:]
    for dev, coord in zip(MESH_2D.device_ids, MESH_2D.coordinates()):
        ranges = ", ".join(f"[{o}:{o + n}]" for o, n in x.spec.local_box(coord))
        assert f"  devices {dev}: {ranges}" in lines, (dev, text)


def test_3d_tensor_replicas_share_a_line():
    x = dtorch.zeros(4, 2, 2, device_mesh=MESH_2D, placements=[Replicate(), Shard(0)])
    text = dtorch.visualize_sharding(x, print_output=False)
    assert "  devices 0,3: [0:2], [0:2], [0:2]" in text
    assert "  devices 1,5: [2:4], [0:2], [0:2]" in text
    assert "  devices 2,4: [4:4], [0:2], [0:2]" in text


def test_scalar_and_empty_tensors():
    s = dtorch.Tensor(torch.tensor(2.0), device_mesh=MESH_1D)
    assert "devices 4,5,6: the whole 0-d value" in dtorch.visualize_sharding(s, print_output=False)
    e = dtorch.zeros(0, 3, device_mesh=MESH_2D, placements=[Shard(0), Replicate()])
    text = dtorch.visualize_sharding(e, print_output=False)
    assert "devices 0-5: [0:0], [0:3]" in text


def test_large_mesh_labels_stay_short():
    mesh = dtorch.init_device_mesh("cpu", (4, 108))
    x = dtorch.zeros(8, 8, device_mesh=mesh, placements=[Shard(0), Replicate()])
    text = dtorch.visualize_sharding(x, print_output=False)
    assert "dev 0-107" in text and "dev 324-431" in text
    assert max(len(line) for line in text.splitlines()) < 80
