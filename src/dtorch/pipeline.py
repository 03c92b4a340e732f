"""Pipeline training steps: micro-batches through pipeline stages in 1F1B order, gradients accumulated.

``train_step(model, micro_batches)`` runs the forward of every micro-batch and the backward of its loss
scaled by 1/m, so the parameters' ``.grad`` receive the gradient of the mean loss over the
micro-batches (the full-batch mean-loss gradient when the micro-batches are equal-size slices of one
batch and the loss is a mean over them). It returns that mean loss as a dtorch 0-d tensor (fetching it
would make the controller wait: call ``.item()`` when you need the number).

Stages are found from the recorded graph, not from the model: every cross-mesh move of a computed
activation (``h.redistribute(next_stage_mesh, ...)``, as Llama's pipeline hand-off does) is a stage
boundary. The helper cuts the backward graph there, so each stage's part of a micro-batch's backward is
its own call, issued when the schedule says: the last stage's backward stops at its input boundary,
keeping the gradient of the hand-off (already moved back to the previous stage's devices); the previous
stage's backward starts from that gradient later.

The order (``schedule="1f1b"``, Megatron's non-interleaved one): stage s (of p) runs ``p - 1 - s``
warm-up forwards, then alternates one forward and one backward, then the remaining backwards. A
micro-batch's forward is issued for all stages at once (the model's forward is one call); the per-stage
orders are merged into one issue order that every stage's queue sees in its own 1F1B order. At most p
micro-batches are between forward and backward on any stage, so activation memory is bounded by the stage
count, not by m. ``schedule="gpipe"`` issues all forwards, then all backwards (memory grows with m).

On the process backend the controller issues every op without waiting and each stage's workers run
their own queue, so stage 1 computes micro-batch i while stage 0 computes micro-batch i + 1
(bench/pipeline_overlap.py). On the in-process backend the same order runs op by op.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._collector import collector_paused
from .autograd.redistribute import MoveNode
from .autograd.engine import _reachable, run_backward
from .autograd.mode import enable_grad, no_grad
from .autograd.node import AutogradMeta, requires_grad
from .tensor import Tensor

__all__ = ["train_step", "one_f_one_b", "issue_order", "split_micro_batches"]

SCHEDULES = ("1f1b", "gpipe")


def split_micro_batches(*tensors, chunks: int) -> list[tuple]:
    """Cut torch tensors along dim 0 into ``chunks`` micro-batches: ``[(ids_0, labels_0), ...]``.

    Every micro-batch gets the same number of rows, so their mean losses average to the full batch's."""
    if not tensors:
        raise ValueError("split_micro_batches needs at least one tensor, e.g. split_micro_batches(ids, labels, chunks=4)")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    rows = tensors[0].shape[0]
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"split_micro_batches cuts torch tensors, got {type(t).__name__}")
        if t.shape[0] != rows:
            raise ValueError(f"every tensor needs the same batch size; got {[x.shape[0] for x in tensors]}")
    if rows % chunks:
        raise ValueError(f"the batch of {rows} rows does not split into {chunks} equal micro-batches; pick a "
                         f"divisor of {rows} (micro-batches of unequal size would weight their losses unequally)")
    return list(zip(*(t.chunk(chunks) for t in tensors)))


def issue_order(stages: int, micro_batches: int, kind: str = "1f1b") -> list[tuple]:
    """The issue order: ``("F", i)`` is micro-batch i's forward (every stage), ``("B", i, s)`` is stage s's
    part of its backward. Each stage's projection of the order is that stage's own schedule."""
    if kind not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {kind!r}")
    p, m = stages, micro_batches
    orders = []
    for s in range(p):
        if kind == "gpipe":
            orders.append([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            continue
        warm = min(p - 1 - s, m)
        order = [("F", i) for i in range(warm)]
        for k in range(m - warm):
            order += [("F", warm + k), ("B", k)]
        order += [("B", i) for i in range(m - warm, m)]
        orders.append(order)
    out, pos, done = [], [0] * p, set()
    while any(pos[s] < len(orders[s]) for s in range(p)):
        nxt = [orders[s][pos[s]] if pos[s] < len(orders[s]) else None for s in range(p)]
        # a backward first (it frees activations); stage s needs the gradient stage s + 1 sends back
        for s in reversed(range(p)):
            ev = nxt[s]
            if ev is not None and ev[0] == "B" and (s == p - 1 or (ev[1], s + 1) in done):
                out.append(("B", ev[1], s))
                done.add((ev[1], s))
                pos[s] += 1
                break
        else:
            # a forward is one call through every stage: it must be next on all of them
            if nxt[0] is None or nxt[0][0] != "F" or any(ev != nxt[0] for ev in nxt):
                raise AssertionError(f"no stage can proceed in schedule {kind!r} at {nxt}")  # a bug here, not user error
            out.append(nxt[0])
            pos = [x + 1 for x in pos]
    return out


class _GradSink:
    """Stands for the activation a stage hands on: the cut backward accumulates the hand-off's gradient
    here (the engine treats it as a leaf), already moved back to the sending stage's devices."""

    __slots__ = ("_ag", "_spec")

    def __init__(self, spec):
        self._ag = AutogradMeta(requires_grad=True)
        self._spec = spec


class _MicroBatch:
    """One micro-batch between its forward and its last backward: the loss, and per stage (below the
    last) the cut hand-offs it sends on: ``[(producer node, output_nr, sink), ...]``."""

    def __init__(self, loss, boundaries: dict):
        self.loss = loss
        self.boundaries = boundaries


def _cut(loss) -> tuple[dict, list]:
    """Cut ``loss``'s graph at every cross-mesh move of a computed tensor; returns {source mesh: [(producer,
    output_nr, sink), ...]} and the source meshes ordered by where their hand-off was computed."""
    cuts: dict = {}
    first: dict = {}
    for node in _reachable([loss._ag.grad_fn]):
        if not isinstance(node, MoveNode):
            continue
        producer, nr, _ = node.edges[0]
        if producer is None:  # a leaf's copy on another mesh (a tied weight): its gradient goes straight home
            continue
        sink = _GradSink(node.src)
        node.edges = ((None, 0, sink),)
        mesh = node.src.mesh
        cuts.setdefault(mesh, []).append((producer, nr, sink))
        first[mesh] = min(first.get(mesh, producer.seq), producer.seq)
    order = sorted(first, key=first.get)
    if loss.device_mesh in cuts:
        raise NotImplementedError(
            f"the loss lives on {loss.device_mesh}, which also hands activations to another mesh: train_step runs "
            "pipelines whose stages form a chain (each stage's mesh sends to later stages only)")
    return cuts, order


def _loss_of(model, mb, loss_fn):
    if loss_fn is not None:
        return loss_fn(model, mb)
    if isinstance(mb, dict):
        return model(**mb).loss
    if isinstance(mb, (tuple, list)) and len(mb) == 2:
        return model(mb[0], labels=mb[1]).loss
    raise TypeError("without loss_fn, each micro-batch must be (input_ids, labels) or a dict of model keyword "
                    f"arguments (model(**mb).loss); got {type(mb).__name__}. Pass loss_fn(model, micro_batch) -> loss")


@collector_paused
def train_step(model, micro_batches: Sequence, loss_fn: Callable | None = None, *,
               schedule: str = "1f1b") -> Tensor:
    """Forward and backward of every micro-batch in pipeline order; ``.grad`` accumulates the gradient of
    the mean loss. Returns the mean loss (a detached dtorch 0-d tensor on the last stage; no wait).

    ``micro_batches``: a sequence of ``(input_ids, labels)`` pairs (``model(ids, labels=labels).loss``), or
    of dicts (``model(**mb).loss``), or anything ``loss_fn(model, micro_batch)`` turns into a scalar loss.
    ``schedule``: ``"1f1b"`` (activation memory bounded by the stage count) or ``"gpipe"`` (all forwards,
    then all backwards). Call ``optimizer.zero_grad()`` before, as with ``loss.backward()``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    mbs = list(micro_batches)
    m = len(mbs)
    if m == 0:
        raise ValueError("train_step needs at least one micro-batch")
    live: dict[int, _MicroBatch] = {}
    stages = None  # source meshes of the hand-offs, first stage first (learnt from micro-batch 0)
    total = None

    def forward(i):
        nonlocal stages, total
        with enable_grad():
            loss = _loss_of(model, mbs[i], loss_fn)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise TypeError(f"the loss of micro-batch {i} must be a dtorch tensor with one element, got "
                                f"{type(loss).__name__} of shape {list(getattr(loss, 'shape', []))}")
            if not requires_grad(loss):
                raise RuntimeError(f"the loss of micro-batch {i} does not require grad: no parameter reached it "
                                   "(is the forward under no_grad?)")
            scaled = loss / m
        cuts, order = _cut(scaled)
        if stages is None:
            stages = order
        elif order != stages or loss.device_mesh != total.device_mesh:
            raise RuntimeError(f"micro-batch {i} crosses meshes {order} to a loss on {loss.device_mesh}; micro-batch 0 "
                               f"crossed {stages} to {total.device_mesh}: every micro-batch must take the same "
                               "pipeline stages")
        with no_grad():
            total = loss.detach() if total is None else total + loss
        live[i] = _MicroBatch(scaled, cuts)

    def backward(i, s):
        mb = live[i]
        if s == len(stages):  # the last stage: from the loss
            run_backward([mb.loss], [None])
            mb.loss = None
        else:
            roots, grads = [], []
            for producer, nr, sink in mb.boundaries.pop(stages[s]):
                g = sink._ag.grad
                if g is None:
                    continue  # no gradient came back through this hand-off
                root = g.detach()  # the gradient's value, standing for the producer's output in the engine
                root._ag = AutogradMeta(grad_fn=producer, output_nr=nr)
                roots.append(root)
                grads.append(g)
            if roots:
                run_backward(roots, grads)
        if mb.loss is None and not mb.boundaries:
            del live[i]  # its activations die with the nodes that saved them

    forward(0)
    p = len(stages) + 1
    order = issue_order(p, m, schedule)
    assert order[0] == ("F", 0)
    for ev in order[1:]:
        if ev[0] == "F":
            forward(ev[1])
        else:
            # stage numbers in the schedule count from the first stage; the last is the loss's
            backward(ev[1], ev[2])
    assert not live
    with no_grad():
        return total / m


def one_f_one_b(model, micro_batches: Sequence, loss_fn: Callable | None = None) -> Tensor:
    """``train_step`` with the 1F1B schedule."""
    return train_step(model, micro_batches, loss_fn, schedule="1f1b")
