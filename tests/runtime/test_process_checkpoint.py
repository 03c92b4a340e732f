"""Workers read their own blocks of a checkpoint: ``from_pretrained`` on the process backend sends each
worker read instructions (file, key, region), never weight bytes, and gives the in-process backend's
logits; ``Runtime.from_files`` itself on both backends, repeated-row reads included."""
from __future__ import annotations

import tracemalloc

import pytest
import torch
import transformers

import dtorch
from dtorch import Shard
from dtorch.models.llama import LlamaForCausalLM
from dtorch.runtime.interface import FileBlock
from dtorch.spec import DTensorSpec
from tests.llama_models import hf_model, make_config
from tests.models.test_llama import ATOL, RTOL

from .conftest import process_graph, using


def _controller_bytes(graph) -> int:
    s = graph.runtime.stats
    return s["bytes_pushed"] + s["bytes_put"]


def _load(graph, path, dims):
    names, sizes = zip(*dims)
    with using(graph):
        mesh = dtorch.init_device_mesh("cpu", sizes, mesh_dim_names=list(names))
        return LlamaForCausalLM.from_pretrained(path, device_mesh=mesh)


def test_workers_read_their_own_weights(proc, ref, tmp_path):
    # ~10 MB of float32 weights; the controller may send only read instructions (a few KB per parameter)
    torch.manual_seed(0)
    cfg = make_config("base", hidden_size=256, intermediate_size=704, vocab_size=4096)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert weights > 8e6
    dims = (("tp", 2), ("pp", 2))
    before = _controller_bytes(proc)
    tracemalloc.start()
    try:
        model = _load(proc, tmp_path, dims)
        proc.sync()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    sent = _controller_bytes(proc) - before
    assert sent < weights / 50, f"the controller sent {sent} bytes while loading {weights} bytes of weights"
    assert peak < weights / 10, f"the controller's Python heap peaked at {peak} bytes while loading {weights}"
    ids = torch.randint(0, cfg.vocab_size, (3, 7))
    with using(proc):
        got = model(ids)
    want = _load(ref, tmp_path, dims)(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(got, hf(ids).logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("dims, config", [((("tp", 4),), "gqa"), ((("tp", 2), ("dp", 2)), "mqa")], ids=str)
def test_repeated_kv_rows_load_on_workers(proc, ref, tmp_path, dims, config):
    """kv heads replicated over tp (RepeatedRows): each worker reads the saved rows its heads repeat."""
    hf = hf_model(config)
    hf.save_pretrained(tmp_path)
    ids = torch.randint(0, hf.config.vocab_size, (2, 5))
    model = _load(proc, tmp_path, dims)
    with using(proc):
        got = model(ids)
    torch.testing.assert_close(got, _load(ref, tmp_path, dims)(ids), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(got, hf(ids).logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("backend", ["proc", "ref"])
def test_from_files_reads_boxes_and_rows(request, tmp_path, backend):
    """7 rows over 3 devices (one block empty) and a read that takes saved rows in a given order."""
    from safetensors.torch import save_file

    graph = request.getfixturevalue(backend)
    full = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5)
    f = tmp_path / "w.safetensors"
    save_file({"w": full}, str(f))
    with using(graph):
        mesh = dtorch.init_device_mesh("cpu", (3,), mesh_dim_names=["tp"])
        spec = DTensorSpec(mesh, (Shard(0),), (7, 5), torch.float32)
        boxes = [spec.local_box(c) for c in mesh.coordinates()]
        x = dtorch.Tensor._make(spec, graph.runtime.from_files([FileBlock(str(f), "w", b) for b in boxes], spec), graph)
        torch.testing.assert_close(x.to_torch(), full.float())
        # rows 4, 3, 3 (of the saved rows 3..4), columns 1..3; device 2 reads nothing (its block is 7 // 3 rows
        # by torch.chunk: 3, 3, 1 -> take 1 row there)
        spec2 = DTensorSpec(mesh, (Shard(0),), (7, 3), torch.float32)
        reads = [FileBlock(str(f), "w", ((3, 2), (1, 3)), (1, 0, 0)), FileBlock(str(f), "w", ((0, 3), (1, 3))),
                 FileBlock(str(f), "w", ((6, 1), (1, 3)))]
        y = dtorch.Tensor._make(spec2, graph.runtime.from_files(reads, spec2), graph)
        want = torch.cat([full[[4, 3, 3], 1:4], full[0:3, 1:4], full[6:7, 1:4]]).float()
        torch.testing.assert_close(y.to_torch(), want)


def test_a_file_a_worker_cannot_read_is_named(tmp_path):
    from dtorch.runtime.process import WorkerError

    g = process_graph(workers=2)
    try:
        with using(g):
            mesh = dtorch.init_device_mesh("cpu", (2,), mesh_dim_names=["tp"])
            spec = DTensorSpec(mesh, (Shard(0),), (4, 2), torch.float32)
            missing = str(tmp_path / "absent.safetensors")
            x = dtorch.Tensor._make(spec, g.runtime.from_files([FileBlock(missing, "w", ((0, 2), (0, 2)))] * 2, spec), g)
            with pytest.raises(WorkerError, match=r"worker 0 failed running reading from files \[4, 2\] float32(.|\n)*absent"):
                x.to_torch()
    finally:
        g.runtime.shutdown()
