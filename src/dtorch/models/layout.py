"""The Llama's layout by mesh dim name: the one place models read the names of mesh dims, and the check that a
config fits a mesh (a leaf: it imports no other module of models/).

    dp, fsdp      the batch: activations and the KV cache Shard(0)
    tp            heads (attention) and the MLP's hidden dim; the KV cache's kv heads Shard(1)
    pp            pipeline stages (the mesh is unbound along it)
    ulysess_cp,   the sequence: activations Shard(1), the KV cache's slots Shard(2); attention runs
    ulysses_cp    Ulysses context parallelism on this dim
    ring_cp       the sequence likewise; attention runs Ring context parallelism on it

Attention itself reads no names: the model passes ``context_parallel(mesh)`` to it.
"""
from __future__ import annotations

from ..errors import DTorchError
from ..mesh import DeviceMesh
from ..ops.attention import ContextParallel
from ..placement import Replicate, Shard

ULYSSES_DIMS = ("ulysess_cp", "ulysses_cp")  # (the original spelling, and the corrected one)
RING_DIMS = ("ring_cp",)
CP_DIMS = ULYSSES_DIMS + RING_DIMS  # mesh dims that split the sequence
BATCH_DIMS = ("dp", "fsdp")  # mesh dims that split the batch
SUPPORTED_MESH_DIMS = ("dp", "tp", "pp") + CP_DIMS + ("fsdp",)


def dim_size(mesh: DeviceMesh, name: str) -> int:
    idx = mesh.dim_name_index(name)
    return 1 if idx is None else mesh.shape[idx]


def _names(mesh: DeviceMesh) -> list:
    return list(mesh.dim_names or [None] * mesh.ndim)


def cp_size(mesh: DeviceMesh) -> int:
    """How many blocks the cp dims cut the sequence into."""
    n = 1
    for name, size in zip(mesh.dim_names or (), mesh.shape):
        n *= size if name in CP_DIMS else 1
    return n


def context_parallel(mesh: DeviceMesh) -> ContextParallel | None:
    """The attention's context parallelism on ``mesh``: Ulysses and Ring on the dims of those names (None:
    no cp dim of size > 1, the plain attention)."""
    names = _names(mesh)

    def find(candidates):
        return next((i for i, n in enumerate(names) if n in candidates and mesh.shape[i] > 1), None)

    u, r = find(ULYSSES_DIMS), find(RING_DIMS)
    return None if u is None and r is None else ContextParallel(ulysses=u, ring=r)


def activation_placements(mesh: DeviceMesh, batch_dim: int | None = 0, seq_dim: int = 1) -> list:
    """Batch over dp (``batch_dim=None``: no batch dim), sequence over the cp dims, Replicate elsewhere."""
    return [Shard(batch_dim) if name in BATCH_DIMS and batch_dim is not None else Shard(seq_dim) if name in CP_DIMS
            else Replicate() for name in _names(mesh)]


def cache_placements(mesh: DeviceMesh) -> tuple:
    """The KV cache [B, kv_heads, slots, d]: batch over dp, kv heads over tp, slots over the cp dims."""
    return tuple(Shard(0) if name in BATCH_DIMS else Shard(1) if name == "tp" else Shard(2) if name in CP_DIMS
                 else Replicate() for name in _names(mesh))


def decode_placements(mesh: DeviceMesh, ndim: int = 2) -> list:
    """Activations of a decode step: batch over dp, replicated everywhere else (the cp devices each hold
    their block of the cache, not of the new tokens)."""
    return [Shard(0) if name in BATCH_DIMS and ndim else Replicate() for name in _names(mesh)]


def heads_last_placements(mesh: DeviceMesh) -> list:
    """A projection's output [B, L, heads * d] in a decode step: batch over dp, heads over tp (its last dim)."""
    return [Shard(0) if name in BATCH_DIMS else Shard(2) if name == "tp" else Replicate() for name in _names(mesh)]


def mask_placements(mesh: DeviceMesh, slots_split: bool) -> list:
    """An attention mask [B, 1, L, S]: batch over dp; ``slots_split``: S (the cache's slots) over the cp dims."""
    return [Shard(0) if name in BATCH_DIMS else Shard(3) if slots_split and name in CP_DIMS else Replicate()
            for name in _names(mesh)]


class LlamaLayoutError(DTorchError, ValueError):
    """The config and the mesh do not fit together (head counts, layer counts, mesh dim names)."""


def check_layout(config, mesh: DeviceMesh) -> None:
    """Raise one error naming every way ``mesh`` cannot serve ``config``."""
    if mesh.dim_names is None and mesh.size() > 1:
        raise LlamaLayoutError(f"the mesh {mesh!r} has unnamed dims; name them with mesh_dim_names from "
                               f"{list(SUPPORTED_MESH_DIMS[:3]) + ['ulysess_cp', 'ring_cp', 'fsdp']}")
    mesh.check_all_dim_names_in_set(SUPPORTED_MESH_DIMS)
    nh, nkv = config.num_attention_heads, _num_kv_heads(config)
    tp, ulysses, pp = dim_size(mesh, "tp"), dim_size(mesh, "ulysess_cp"), dim_size(mesh, "pp")
    problems = []
    if nh % nkv:
        problems.append(f"num_attention_heads ({nh}) is not a multiple of num_key_value_heads ({nkv})")
    if nh % tp:
        problems.append(f"num_attention_heads ({nh}) is not divisible by tp ({tp})")
    if (nkv % tp if nkv >= tp else tp % nkv):
        problems.append(f"num_key_value_heads ({nkv}) and tp ({tp}) do not divide one another (kv heads are split "
                        f"over tp, or, when fewer than tp, each is replicated on the tp / num_key_value_heads devices "
                        f"whose query heads use it)")
    if nh % tp == 0 and (nh // tp) % ulysses:
        problems.append(f"the {nh // tp} query heads per tp shard (num_attention_heads {nh} / tp {tp}) are not "
                        f"divisible by ulysess_cp ({ulysses})")
    if config.num_hidden_layers < pp:
        problems.append(f"num_hidden_layers ({config.num_hidden_layers}) is smaller than pp ({pp}); every stage needs a layer")
    if problems:
        raise LlamaLayoutError(f"mesh {mesh} cannot serve this Llama config: " + "; ".join(problems)
                               + ". Choose tp / ulysess_cp / pp sizes that divide these counts.")


def _num_kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
