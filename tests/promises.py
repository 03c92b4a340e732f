"""The output placements each op rule promises, restated from the rule tables in the ops' docstrings and
written without reading (or importing) the rule code, so a sweep can check them (``run_sweep(placements=...)``).

A tensor is abstracted to a ``Lay`` (global shape, placements). An oracle takes the mesh and the operands'
Lays and returns the output's Lay; composite calls compose oracles (``x * 2 + 1`` is
``add(mesh, scale(mesh, x))``). A placement of ``None`` means the rule picks that mesh dim by cost (matmul
when every strategy needs communication): nothing is promised there, and the sweep does not check it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dtorch import Partial, Replicate, Shard

R = Replicate()


@dataclass(frozen=True)
class Lay:
    shape: tuple
    placements: tuple

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _linear_partial(p) -> bool:
    return isinstance(p, Partial) and p.reduce_op in ("sum", "avg")


# -- element-wise (ops/pointwise.py) -----------------------------------------------------------------
#   S(d) with anything -> S(d)  (a shard on a non-broadcast output dim; the largest operand's when several)
#   P + P, P - P, -P   -> P;  P + R -> P;  P * R, P / R, P * c -> P;  P otherwise -> R;  R with R -> R


def elementwise(mesh, *ops: Lay, partial: str | None = None, scalar: bool = False, first: int = 0) -> Lay:
    """``partial``: how the op treats Partial(sum|avg) operands: "add" (add/sub/neg: linear in every operand,
    no scalar operand), "mul" (linear in one operand), "div" (linear in the numerator only: operand
    ``first``, the first argument), None (nonlinear: reduce first). ``scalar``: a Python number is an operand."""
    out_shape = tuple(torch.broadcast_shapes(*[o.shape for o in ops]))
    n = len(out_shape)
    out = []
    for i in range(mesh.ndim):
        shard = None  # (numel, out dim) of the largest operand sharded on a non-broadcast dim
        for o in ops:
            p = o.placements[i]
            if isinstance(p, Shard) and o.shape[p.dim] == out_shape[p.dim + n - o.ndim]:
                numel = _numel(o.shape)
                if shard is None or numel > shard[0]:
                    shard = (numel, p.dim + n - o.ndim)
        if shard is not None:
            out.append(Shard(shard[1]))
            continue
        partials = [j for j, o in enumerate(ops) if isinstance(o.placements[i], Partial)]
        reduce_ops = {ops[j].placements[i].reduce_op for j in partials}
        keep = (len(reduce_ops) == 1 and all(_linear_partial(ops[j].placements[i]) for j in partials)
                and ((partial == "add" and not scalar)
                     or (partial == "mul" and len(partials) == 1)
                     or (partial == "div" and partials == [first])))
        out.append(ops[partials[0]].placements[i] if partials and keep else R)
    return Lay(out_shape, tuple(out))


def add(mesh, *ops, scalar=False):
    return elementwise(mesh, *ops, partial="add", scalar=scalar)


def mul(mesh, *ops):
    return elementwise(mesh, *ops, partial="mul")


def nonlinear(mesh, *ops):
    return elementwise(mesh, *ops)


# -- reductions, scans, softmax (ops/reduce.py) ------------------------------------------------------
#   S(d), d kept -> S(d'); S(d), d reduced: sum/mean -> P(sum), amax -> P(max), amin -> P(min),
#   all -> P(min), any -> P(max), other -> R (gathered); P(sum|avg) under sum/mean -> P; P(max) under
#   amax -> P(max), P(min) under amin -> P(min); P otherwise -> R; R -> R.
#   norm and var over a sharded dim are built from those pieces: norm_p = (P(sum) of |x|^p)^(1/p), so
#   norm_1 and norm_0 (a count) are P(sum), norm_inf = P(max) of |x|, norm_-inf = P(min) of |x|;
#   var = P(sum) of (x - mean)^2 / (N - c); any other p, std (a root) -> R.

_SHARD_REDUCED = {"sum": Partial("sum"), "mean": Partial("sum"), "amax": Partial("max"), "amin": Partial("min"),
                  "all": Partial("min"), "any": Partial("max"), "norm1": Partial("sum"), "norm0": Partial("sum"),
                  "norminf": Partial("max"), "norm-inf": Partial("min"), "var": Partial("sum")}


def reduction(mesh, x: Lay, kind: str, dims=None, keepdim: bool = False) -> Lay:
    dims = tuple(range(x.ndim)) if dims is None else tuple(d % max(x.ndim, 1) for d in _tuple(dims))
    out_shape = tuple(1 if d in dims else s for d, s in enumerate(x.shape) if keepdim or d not in dims)
    out = []
    for p in x.placements:
        if isinstance(p, Shard) and p.dim not in dims:
            out.append(Shard(p.dim if keepdim else p.dim - sum(d < p.dim for d in dims)))
        elif isinstance(p, Shard):
            out.append(_SHARD_REDUCED.get(kind, R))
        elif isinstance(p, Partial) and ((kind in ("sum", "mean") and _linear_partial(p))
                                         or (kind == "amax" and p.reduce_op == "max")
                                         or (kind == "amin" and p.reduce_op == "min")):
            out.append(p)
        else:
            out.append(R)
    return Lay(out_shape, tuple(out))


def along(mesh, x: Lay, dim: int, linear: bool) -> Lay:
    """cumsum (``linear``), softmax, log_softmax: the dim ``dim`` whole (mesh dims sharding it gathered),
    other shards kept; a Partial(sum|avg) stays for a linear scan, else is reduced first."""
    dim %= max(x.ndim, 1)
    out = [R if isinstance(p, Shard) and p.dim == dim else
           p if isinstance(p, Shard) or (linear and _linear_partial(p)) else R
           for p in x.placements]
    return Lay(x.shape, tuple(out))


# -- contractions (ops/matrix.py): per mesh dim the cheapest of the strategies --------------------------
#   R: R, R -> R;  S(L), L kept: S(L)/R -> S(L);  S(L), L contracted: S(L)/R -> P(sum);
#   P: one operand P(sum|avg), others R -> P.  Cost: the bytes moved (R -> S and R -> P are free), ties
#   broken by the number of operand placements that change. A size-1 dim broadcast against a larger one
#   cannot be sharded. The rule is only pinned down here where a free strategy exists (no bytes move):
#   among those, the one changing fewest placements, when that is unique.


def contract(mesh, equation: str, *ops: Lay, bias: Lay | None = None) -> Lay:
    """``equation``: einsum labels of the operands and the output (no ellipsis: spell the batch dims).
    ``bias``: a bias over the output's last dim (linear), which follows the output."""
    lhs, out_labels = equation.split("->")
    labels = lhs.split(",")
    assert len(labels) == len(ops), (equation, len(ops))
    size = {}
    for lab, o in zip(labels, ops):
        for c, s in zip(lab, o.shape):
            size[c] = max(size.get(c, 1), s)
    out_shape = tuple(size[c] for c in out_labels)
    all_ops = list(ops) + ([bias] if bias is not None else [])
    out = []
    for i in range(mesh.ndim):
        now = [o.placements[i] for o in all_ops]
        strategies = [(R, [R] * len(all_ops))]
        for c in sorted(size):
            if any(lab.count(c) > 1 for lab in labels):
                continue  # a diagonal: not a strategy
            result = Shard(out_labels.index(c)) if c in out_labels else Partial("sum")
            need = [Shard(lab.index(c)) if c in lab and o.shape[lab.index(c)] == size[c] else R
                    for lab, o in zip(labels, ops)]
            strategies.append((result, need + _bias_need(bias, result, out_labels)))
        for j, p in enumerate(now[: len(ops)]):
            if _linear_partial(p):
                need = [p if k == j else R for k in range(len(ops))]
                strategies.append((p, need + _bias_need(bias, p, out_labels)))
        free = [(sum(a != b for a, b in zip(now, need)), result) for result, need in strategies
                if all(a == b or a == R for a, b in zip(now, need))]
        fewest = min((c for c, _ in free), default=None)
        picks = {r for c, r in free if c == fewest}
        out.append(picks.pop() if len(picks) == 1 else None)
    return Lay(out_shape, tuple(out))


def _bias_need(bias, result, out_labels) -> list:
    if bias is None:
        return []
    if isinstance(result, Shard):
        return [Shard(0) if result.dim == len(out_labels) - 1 else R]
    return [result]


# -- nn (ops/nn.py) ------------------------------------------------------------------------------------
#   embedding: weight S(0) -> P(sum); weight S(1) -> S(-1); weight P -> P; weight R, ids S(k) -> S(k);
#   else R (a weight shard wins over an ids shard). Norms: the normalized dims whole, other shards kept,
#   partials reduced first.


def embedding(mesh, ids: Lay, weight: Lay) -> Lay:
    out_shape = ids.shape + weight.shape[1:]
    out = []
    for pi, pw in zip(ids.placements, weight.placements):
        if isinstance(pw, Shard):
            out.append(Partial("sum") if pw.dim == 0 else Shard(len(out_shape) - 1))
        elif isinstance(pw, Partial):
            out.append(pw)
        else:
            out.append(pi if isinstance(pi, Shard) else R)
    return Lay(out_shape, tuple(out))


def normalization(mesh, x: Lay, normalized: int) -> Lay:
    first = x.ndim - normalized
    return Lay(x.shape, tuple(p if isinstance(p, Shard) and p.dim < first else R for p in x.placements))


# -- views (ops/view.py): placements follow the data ------------------------------------------------------
#   S(d), d kept 1:1 -> S(out); S(d) outermost in a flatten/split -> S(out) when the block boundaries
#   line up, else R (not pinned down here); S(d) inner in a flatten, sliced, indexed, broadcast or
#   repeated -> R; P -> P; R -> R. cat/stack: the cat dim whole, inputs on a common placement.


def follows(keep: dict, unpinned=()):
    """The promise of a one-input view whose input dim ``d`` is output dim ``keep[d]`` (1:1); dims in
    ``unpinned`` (outermost in a flatten or split, squeezed) are not pinned down; any other sharded dim is
    gathered. A multi-output view (chunk, split, unbind) promises the same of every output."""

    def promise(mesh, x: Lay) -> Lay:
        out = [Shard(keep[p.dim]) if isinstance(p, Shard) and p.dim in keep else
               None if isinstance(p, Shard) and p.dim in unpinned else R if isinstance(p, Shard) else p
               for p in x.placements]
        return Lay(None, tuple(out))

    return promise


def concatenation(mesh, dim: int, *xs: Lay, new: bool = False) -> Lay:
    """cat (``new``: stack, a new dim ``dim``): a mesh dim where every input holds the same shard of
    another dim keeps it; where none is sharded off the cat dim (all R, or the cat dim sharded) -> R."""
    out = []
    for i in range(mesh.ndim):
        ps = {x.placements[i] for x in xs}
        shards = {p for p in ps if isinstance(p, Shard) and (new or p.dim != dim % xs[0].ndim)}
        if len(ps) == 1 and shards:
            d = next(iter(shards)).dim
            out.append(Shard(d + 1 if new and d >= dim % (xs[0].ndim + 1) else d))
        elif not shards and all(p == R or isinstance(p, Shard) for p in ps):
            out.append(R)
        else:
            out.append(None)
    return Lay(None, tuple(out))


# -- attention (ops/attention.py, plain) -----------------------------------------------------------------
#   q/k/v S(0) -> S(0); q/k/v S(1) -> S(1) (heads; GQA kv maybe replicated); q S(2), k/v whole -> S(2);
#   v S(3), q/k whole -> S(3); v P, q/k whole -> P; otherwise -> R. Pinned down here where no operand needs
#   communication: each operand either holds the dim's shard or is replicated (sliced locally), mask replicated.


def attention(mesh, q: Lay, k: Lay, v: Lay, mask: Lay | None = None) -> Lay:
    out = []
    for i in range(mesh.ndim):
        pq, pk, pv = q.placements[i], k.placements[i], v.placements[i]
        whole = mask is None or mask.placements[i] == R
        if not whole:
            out.append(None)
        elif pq == pk == pv == R:
            out.append(R)
        elif any(all(p in (Shard(d), R) for p in (pq, pk, pv)) for d in (0, 1)):
            out.append(next(p for p in (pq, pk, pv) if p != R))
        elif pq == Shard(2) and pk == pv == R:
            out.append(pq)
        elif pv in (Shard(3),) or _linear_partial(pv):
            out.append(pv if pq == pk == R else None)
        else:
            out.append(None)
    return Lay(q.shape[:-1] + v.shape[-1:], tuple(out))


def _tuple(d):
    return tuple(d) if isinstance(d, (tuple, list)) else (d,)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def lays(mesh, inputs, combo) -> list[Lay]:
    """The sweep's inputs as Lays: torch tensors ``inputs`` with the placements ``combo`` (canonical: a
    Shard on a mesh dim of size 1 is Replicate)."""
    return [Lay(tuple(x.shape), tuple(R if isinstance(p, Shard) and mesh.shape[i] == 1 else p
                                      for i, p in enumerate(pl)))
            for x, pl in zip(inputs, combo)]


def check_placements(mesh, out, expected) -> int:
    """Assert each output's placements equal the promised ones (mesh dims promised as None skipped);
    returns how many mesh dims were checked."""
    if isinstance(expected, Lay):  # one promise for one output, or for each output of a multi-output view
        expected, out = ([expected] * len(out), out) if isinstance(out, (tuple, list)) else ([expected], [out])
    assert len(out) == len(expected), f"{len(out)} outputs, {len(expected)} promised"
    checked = 0
    for k, (o, e) in enumerate(zip(out, expected)):
        got = tuple(o.placements)
        for i, (g, want) in enumerate(zip(got, e.placements)):
            if want is None:
                continue
            want = R if isinstance(want, Shard) and mesh.shape[i] == 1 else want
            assert g == want, (f"output {k} placements {[str(p) for p in got]}: mesh dim {i} is {g}, the rule "
                               f"promises {want} (promised {[str(p) for p in e.placements]})")
            checked += 1
    return checked


__all__ = ["Lay", "add", "along", "attention", "check_placements", "concatenation", "contract", "elementwise",
           "embedding", "follows", "lays", "mul",
           "nonlinear", "normalization", "reduction"]
