"""visualize_sharding: which device holds which block of a tensor."""
from __future__ import annotations

from .placement import Partial
from .spec import DTensorSpec


def visualize_sharding(tensor, *, print_output: bool = True) -> str:
    """Draw the blocks of a 1-D or 2-D tensor as a grid labelled with the devices holding them.

    Other ranks get a table of each device's index ranges. Returns the text (and prints it).
    """
    spec: DTensorSpec = tensor.spec
    text = _render(spec)
    if print_output:
        print(text)
    return text


def _owners(spec: DTensorSpec) -> dict:
    """box -> device ids holding that block."""
    out: dict = {}
    for dev, coord in zip(spec.mesh.device_ids, spec.mesh.coordinates()):
        out.setdefault(spec.local_box(coord), []).append(dev)
    return out


def _render(spec: DTensorSpec) -> str:
    header = f"{list(spec.shape)} on {spec.mesh} placements [{', '.join(map(str, spec.placements))}]"
    partial = [f"mesh dim {spec.mesh.dim_label(i)}: {p} (each device holds a term)" for i, p in enumerate(spec.placements)
               if isinstance(p, Partial)]
    owners = _owners(spec)
    if spec.ndim == 0:
        body = f"  devices {_devs(spec.mesh.device_ids)}: the whole 0-d value"
    elif spec.ndim in (1, 2) and all(n > 0 for n in spec.shape):
        body = _grid(spec, owners)
        # uneven shards can leave devices with nothing; the grid has no cell for them
        empty = [d for box, ids in owners.items() if any(n == 0 for _, n in box) for d in ids]
        if empty:
            body += f"\nempty blocks on dev {_devs(empty)}"
    else:
        rows = [f"  devices {_devs(ids)}: " + ", ".join(f"[{o}:{o + n}]" for o, n in box) for box, ids in owners.items()]
        body = "\n".join(rows)
    return "\n".join([header] + partial + [body])


def _devs(ids) -> str:
    ids = sorted(ids)
    if len(ids) > 4 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def _grid(spec: DTensorSpec, owners: dict) -> str:
    if spec.ndim == 1:
        boxes = sorted(owners, key=lambda b: b[0][0])
        cells = [[(f"{_devs(owners[b])}", b) for b in boxes if b[0][1] > 0]]
        row_edges = [(0, 1)]
        col_edges = [b[0] for b in boxes if b[0][1] > 0]
        grid = {((0, 1), b[0]): _devs(owners[b]) for b in boxes if b[0][1] > 0}
    else:
        row_edges = sorted({b[0] for b in owners if b[0][1] > 0})
        col_edges = sorted({b[1] for b in owners if b[1][1] > 0})
        grid = {(b[0], b[1]): _devs(ids) for b, ids in owners.items() if b[0][1] > 0 and b[1][1] > 0}
    labels = {k: f"dev {v}" for k, v in grid.items()}
    width = max([len(v) for v in labels.values()] + [6]) + 2
    sep = "+" + "+".join("-" * width for _ in col_edges) + "+"
    lines = [sep]
    for r in row_edges:
        cells = [labels.get((r, c), "?").center(width) for c in col_edges]
        lines.append("|" + "|".join(cells) + "|")
        lines.append(sep)
    if spec.ndim == 2:
        lines.append("rows " + ", ".join(f"{o}:{o + n}" for o, n in row_edges) + "; cols " +
                     ", ".join(f"{o}:{o + n}" for o, n in col_edges))
    else:
        lines.append("elements " + ", ".join(f"{o}:{o + n}" for o, n in col_edges))
    return "\n".join(lines)
