"""Reading Hugging Face checkpoint directories (config.json + *.safetensors) shard by shard."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..graph import Graph
from ..nn.module import Parameter, StateDictError
from ..runtime.interface import FileBlock
from ..tensor import Tensor


def load_config(path: Path):
    """The checkpoint's ``LlamaConfig``; raises CheckpointError, before anything is built, when ``path``
    holds no readable config.json or another model type (transformers would quietly fill in a default
    7B Llama config for those, and building it exhausts memory)."""
    cfg_file = path / "config.json"
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(f"{path} {what}; pass a Hugging Face Llama checkpoint directory (config.json + "
                              "*.safetensors, as written by save_pretrained())")
    if not cfg_file.is_file():
        raise CheckpointError(f"{path} has no config.json; pass a directory written by save_pretrained()")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {cfg_file}: {exc}; it must be the JSON config save_pretrained() "
                              "writes") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type != "llama":
        got = f"model_type {model_type}" if model_type else "config.json names no model_type"
        raise CheckpointError(f"{path} is not a Llama checkpoint ({got}); dtorch supports model_type llama")
    from transformers import LlamaConfig

    return LlamaConfig.from_pretrained(str(path))


def load_generation_config(path: Path):
    """transformers' ``GenerationConfig`` of the checkpoint, as its ``from_pretrained`` loads it: the
    directory's generation_config.json, else one made from config.json (Hugging Face's fallback)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(path))
    except OSError:  # no generation_config.json
        return GenerationConfig.from_pretrained(str(path), config_file_name="config.json", _from_model_config=True)


def generation_config_from_model_config(config):
    """The ``GenerationConfig`` transformers gives a model built from ``config`` (its bos/eos/pad ids); a
    config that is not a transformers one (an object with the same fields) gives those ids alone."""
    from transformers import GenerationConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return GenerationConfig.from_model_config(config)
    ids = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")
           if getattr(config, k, None) is not None}
    return GenerationConfig(**ids)


def _weight_files(path: Path) -> dict:
    """parameter name -> safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors files; save the model with save_pretrained(safe_serialization=True)")
    from safetensors import safe_open

    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def read_sharded(model, path: Path, progress=None) -> None:
    """Fill every parameter and persistent buffer of ``model`` from the checkpoint: each device reads its
    own block (``Runtime.from_files``: the in-process backend reads here, once per distinct block; the
    process backend's workers read their blocks themselves, so no weight byte passes through this
    process), and no full tensor is ever assembled. Every key and shape is checked (file headers only)
    before anything is loaded: on error the model is unchanged."""
    from safetensors import safe_open

    where = _weight_files(path)
    tied = getattr(model.config, "tie_word_embeddings", False)
    entries = list(model._state_entries())
    missing = [k for k, *_ in entries if k not in where and not (tied and k == "lm_head.weight")]
    if missing:
        raise StateDictError(f"checkpoint {path} lacks parameters {missing}; is it a Llama checkpoint of this config?")
    handles = {}
    try:
        sources = []
        for key, mod, name, t in entries:
            src = "model.embed_tokens.weight" if key not in where else key
            f = where[src]
            if f not in handles:
                handles[f] = safe_open(str(f), framework="pt").__enter__()
            sl = handles[f].get_slice(src)
            saved_rows = sl.get_shape()[0] if sl.get_shape() else 0
            form = mod._saved_form(name)
            if form is not None:  # held with repeated rows (kv heads replicated over tp): read in that layout
                sl = form.held_slice(sl)
            shape = tuple(sl.get_shape())
            if shape != tuple(t.shape):
                raise StateDictError(f"size mismatch for {key}: the checkpoint has shape {list(shape)}, the model "
                                     f"expects {list(t.shape)}")
            # held row -> saved row (the held layout's own map, applied to the row numbers)
            row_map = None if form is None else form.load(torch.arange(saved_rows)).tolist()
            sources.append((str(f.resolve()), src, row_map))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    graph = Graph.default_graph()
    for n, ((key, mod, name, t), source) in enumerate(zip(entries, sources)):
        spec = t.spec
        value = Tensor._make(spec, graph.runtime.from_files(_file_blocks(spec, *source), spec), graph)
        if isinstance(t, Parameter):
            t._set(value)
        else:
            mod._buffers[name] = value
        if progress:
            progress(n + 1, len(entries), key)


def _file_blocks(spec, path: str, key: str, row_map) -> list:
    """Each device's ``FileBlock`` (mesh order): its box, or for a held layout the saved rows it repeats."""
    out = []
    for coord in spec.mesh.coordinates():
        box = spec.local_box(coord)
        if row_map is None or not box or box[0][1] == 0:
            out.append(FileBlock(path, key, tuple(box)))
            continue
        (start, length), rest = box[0], tuple(box[1:])
        rows = row_map[start:start + length]
        lo, hi = min(rows), max(rows) + 1
        if rows == list(range(lo, hi)):  # contiguous saved rows: a plain box
            out.append(FileBlock(path, key, ((lo, hi - lo),) + rest))
        else:
            out.append(FileBlock(path, key, ((lo, hi - lo),) + rest, tuple(r - lo for r in rows)))
    return out
