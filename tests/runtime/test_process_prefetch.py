"""FSDP's prefetch on the process backend: a gather issued ahead is posted by the workers and waited on only
where its block is first read, so the kernels queued before that read run while it moves; values equal
torch's."""
from __future__ import annotations

import pytest
import torch

from tests.autograd.test_fsdp import _batch, _mesh, _pair

from .conftest import process_graph, using


@pytest.fixture
def wire(monkeypatch):
    """Workers whose collectives take torch.distributed (as between hosts): no shared-memory slots."""
    monkeypatch.setenv("DTORCH_PROCESS_SHM", "0")
    g = process_graph(workers=2)
    yield g
    g.runtime.shutdown()


def _overlapped(g) -> int:
    return sum(s["collectives"].get("overlapped", 0) for s in g.runtime.worker_stats(collectives=True).values())


def test_prefetched_gathers_move_behind_the_previous_layers_kernels(wire):
    with using(wire):
        mesh = _mesh(("fsdp", 2))
        net, ref = _pair(mesh, depth=3)
        x, xd = _batch(mesh, rows=5)
        counts = []
        for step in range(2):  # the first forward learns the order, the second prefetches
            before = _overlapped(wire)
            out = net(xd)
            out.square().sum().backward()
            counts.append(_overlapped(wire) - before)
            if step == 0:
                first = {n: p.grad.to_torch() for n, p in net.named_parameters()}
                net.zero_grad()
        ref(x).square().sum().backward()
        torch.testing.assert_close(out.to_torch(), ref(x), rtol=1e-5, atol=1e-5)
        refs = dict(ref.named_parameters())
        for name, p in net.named_parameters():
            torch.testing.assert_close(first[name], refs[name].grad, rtol=1e-5, atol=1e-5, msg=name)
            torch.testing.assert_close(p.grad.to_torch(), refs[name].grad, rtol=1e-5, atol=1e-5, msg=name)
    # step 2, each of the 2 workers: the 3 blocks' gathers (3 weights each) were issued while the unit before
    # computed. Step 1 knows no order yet: only the gathers a unit's own earlier kernels ran behind count
    # (its down weight behind its up projection), and the backward's (measured: 10 and 18)
    assert counts[1] >= 2 * 3 * 3, counts
    assert counts[1] > counts[0], counts
