"""Linear algebra: matmul / @, mm, bmm, linear, einsum, outer, dot.

Every op is described einsum-style: a label per dim of each operand and of the output
(``matmul``: ``...mk,...kn->...mn``; ``linear``: ``...k,nk->...n`` plus a bias ``n``). The rule is
written for one mesh dim and picks, per mesh dim, the cheapest of these strategies:

    strategy            operands (labels carrying L / not)   output     math
    R                   R, R, ...                            R          a @ b
    S(L), L kept        S(L) / R                             S(L)       rows of a @ b = a[rows] @ b
    S(L), L contracted  S(L) / R                             P(sum)     a @ b = sum_dev a[:, k_dev] @ b[k_dev]
    P                   one operand P(sum|avg), others R     P          linear in each operand

Batch dims sharded alike on both inputs pass through; a free dim sharded on one input passes
through while the other input is R; S(k) x S(k) gives P(sum) with no collective. A dim of size 1
broadcast against a larger one cannot be sharded (that operand is R). Cost: the bytes the
redistribution of each operand would move (R -> S and R -> P are local and free), ties broken by
the number of placements that change. A bias follows the output: S(n) where the output is S(n), P
where the output is P (the value on one device, zeros on the others: no communication), else R.
"""
from __future__ import annotations

import functools
import math

import torch

from ..errors import OpError
from ..placement import Partial, Replicate, Shard
from ..runtime.kernels import kernel
from ..spec import DTensorSpec
from ..tensor import Tensor
from .dispatch import OpPlan, dispatch
from .rules import meta_call, spec_like, to_dtensors
from .table import register

# -- kernels: trailing dims are the op's, leading ``lead`` dims are grid dims ---------------------


def _matmul_local(a, b, na, nb, lead):
    """torch.matmul of local blocks with ``lead`` leading grid dims (na, nb: the operands' global ranks)."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():  # (torch.compile: it sees the view ops)
        a_ops, b_ops, gemm, out_ops = _local_plan(a.shape, b.shape, na, nb, lead)
        if gemm is torch.bmm and torch.is_grad_enabled():
            gemm = _Bmm.apply
    else:
        a_ops, b_ops, gemm, out_ops = _strided_plan(a.shape, a.stride(), b.shape, b.stride(), na, nb, lead)
    for f, arg in a_ops:
        a = f(a, arg)
    for f, arg in b_ops:
        b = f(b, arg)
    out = gemm(a, b)
    for f, arg in out_ops:
        out = f(out, arg)
    return out


class _Bmm(torch.autograd.Function):
    """``torch.bmm`` whose operands' gradients are laid out as the operands (torch's mm derivative does so for a
    column-major operand, bmm's makes them contiguous). A stacked linear's bmm runs over a batch of tp blocks: a
    row-parallel weight enters it transposed, and its input is a view of a column-parallel output (rows
    ``[dp, b, s]``, then tp); contiguous gradients of those came out column-major for the weight (AdamW's
    element-wise kernels over it and its row-major parameter ran ~4x slower) and tp-major for the input (the
    column-parallel GEMM's backward then copied it back to its own layout)."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)  # (as torch's BmmBackward saves them)
        return torch.bmm(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga = _bmm_like(g, b.transpose(1, 2), a) if ctx.needs_input_grad[0] else None
        gb = _bmm_like(a.transpose(1, 2), g, b) if ctx.needs_input_grad[1] else None
        return ga, gb


def _bmm_like(x, y, like):
    """``torch.bmm(x, y)`` written into a tensor laid out as ``like`` (``empty_like``: its strides where it is
    dense; the GEMM writes there directly, the same values)."""
    if torch.is_grad_enabled():  # (a double backward: out= is not differentiable)
        return torch.bmm(x, y)
    return torch.bmm(x, y, out=torch.empty_like(like))


@functools.lru_cache(maxsize=4096)
def _local_plan(a_shape, b_shape, na, nb, lead):
    """The view ops and the GEMM of ``_matmul_local`` on blocks of these shapes, worked out once per shape (a
    decode step runs every GEMM on the same shapes each token): (ops on a, ops on b, the GEMM, ops on its
    output), each op ``(function, argument)``, as ``_fold`` makes them less identity permutes and squeezes of
    dims > 1 (the same tensors, so the GEMM sees the same layouts and gives the same bits)."""
    a, b = _Planned(a_shape), _Planned(b_shape)
    if na == 1:
        a = a.unsqueeze(-2)
    if nb == 1:
        b = b.unsqueeze(-1)
    r = max(a.ndim, b.ndim)
    a = a.reshape(a.shape[:lead] + (1,) * (r - a.ndim) + a.shape[lead:])
    b = b.reshape(b.shape[:lead] + (1,) * (r - b.ndim) + b.shape[lead:])
    out = _fold(a, b, _Planned)
    if na == 1:
        out = out.squeeze(-2)
    if nb == 1:
        out = out.squeeze(-1)
    return tuple(a.ops), tuple(b.ops), out.gemm, tuple(out.ops)


@functools.lru_cache(maxsize=4096)
def _strided_plan(a_shape, a_stride, b_shape, b_stride, na, nb, lead):
    """``_local_plan`` for blocks of these strides with each run of view ops made one ``as_strided`` to the
    same sizes and strides (so the GEMM sees the same tensors and gives the same bits): a stacked linear's
    dozen view ops per call become three, which a decode step (29 linears per token) feels. Only without
    autograd (an ``as_strided``'s backward is general and slow); a run whose views would copy stays as it is."""
    a_ops, b_ops, gemm, out_ops = _local_plan(a_shape, b_shape, na, nb, lead)
    if gemm is not torch.mm and gemm is not torch.bmm:  # (matmul's output strides are its own business)
        return a_ops, b_ops, gemm, out_ops
    a, a_ops = _as_one_view(torch.empty_strided(a_shape, a_stride, device="meta"), a_ops)
    b, b_ops = _as_one_view(torch.empty_strided(b_shape, b_stride, device="meta"), b_ops)
    _, out_ops = _as_one_view(gemm(a, b), out_ops)  # (mm and bmm give a contiguous output, on meta as on cpu)
    return a_ops, b_ops, gemm, out_ops


def _as_one_view(x, ops):
    """(``x`` through ``ops``, the ops as one ``as_strided`` where they are views of ``x``, else ``ops``)."""
    y = x
    for f, arg in ops:
        y = f(y, arg)
    if len(ops) < 2 or y._base is not x:  # (nothing to gain, or a reshape copied)
        return y, ops
    return y, ((_as_strided, (tuple(y.shape), y.stride())),)


def _as_strided(x, size_stride):
    return x.as_strided(*size_stride)  # (at x's own storage offset: the view ops never move it)


class _Planned:
    """A block's shape through the view ops of ``_local_plan``, recording them (no tensor is touched). The
    GEMM starts the output's record (``_Planned.mm`` / ``bmm`` / ``matmul``)."""

    def __init__(self, shape, ops=None, gemm=None):
        self.shape, self.ops, self.gemm = tuple(shape), [] if ops is None else ops, gemm

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _then(self, f, arg, shape):
        self.ops.append((f, arg))
        return _Planned(shape, self.ops, self.gemm)

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else tuple(shape)
        if math.prod(shape) != math.prod(self.shape):
            raise RuntimeError(f"matmul plan: cannot reshape {self.shape} to {shape}")
        return self._then(torch.Tensor.reshape, shape, shape)

    def permute(self, dims):
        dims = tuple(dims)
        if dims == tuple(range(self.ndim)):  # (no op; a reshape to its own shape is one: it may restride)
            return self
        return self._then(torch.Tensor.permute, dims, tuple(self.shape[d] for d in dims))

    def unsqueeze(self, d):
        d = d % (self.ndim + 1)
        return self._then(torch.Tensor.unsqueeze, d, self.shape[:d] + (1,) + self.shape[d:])

    def squeeze(self, d):
        d = d % self.ndim
        if self.shape[d] != 1:
            return self
        return self._then(torch.Tensor.squeeze, d, self.shape[:d] + self.shape[d + 1:])

    @staticmethod
    def mm(a, b):
        return _Planned((a.shape[0], b.shape[1]), gemm=torch.mm)

    @staticmethod
    def bmm(a, b):
        return _Planned((a.shape[0], a.shape[1], b.shape[2]), gemm=torch.bmm)

    @staticmethod
    def matmul(a, b):
        return _Planned(tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])) + (a.shape[-2], b.shape[-1]),
                        gemm=torch.matmul)


def _fold(a, b, ops):
    """``torch.matmul(a, b)`` for equal-rank ``a [..., m, k]``, ``b [..., k, n]`` with broadcasting batch dims,
    the GEMM from ``ops`` (torch, or ``_Planned`` to record the plan on shapes).

    torch would expand both operands to the common batch shape (copies) and run one small GEMM per
    entry. Here batch dims only ``a`` varies over become rows, dims only ``b`` varies over become
    columns, and only dims both vary over stay a batch: for stacked simulated devices (activations
    vary over dp/cp, weights over tp) that is one large GEMM, as on one device.
    """
    nbatch = a.ndim - 2
    both, a_only, b_only = [], [], []
    for d in range(nbatch):
        sa, sb = a.shape[d], b.shape[d]
        if sa == sb and sa != 1:
            both.append(d)
        elif sb == 1 and sa != 1:
            a_only.append(d)
        elif sa == 1 and sb != 1:
            b_only.append(d)
        elif sa != sb:
            raise RuntimeError(f"matmul batch dims do not broadcast: {tuple(a.shape)} @ {tuple(b.shape)}")
    if not a_only and not b_only:
        return ops.matmul(a, b)
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    size = lambda t, dims: math.prod([t.shape[d] for d in dims])  # noqa: E731  (a list: torch.compile traces it)
    ones_a = [d for d in range(nbatch) if d not in both and d not in a_only]
    ones_b = [d for d in range(nbatch) if d not in both and d not in b_only]
    tb, ma, nb_ = size(a, both), size(a, a_only), size(b, b_only)
    a2 = a.permute(both + a_only + [nbatch] + ones_a + [nbatch + 1]).reshape(tb, ma * m, k)
    b2 = b.permute(both + [nbatch] + b_only + [nbatch + 1] + ones_b).reshape(tb, k, nb_ * n)
    # (squeeze, not [0]: under autograd a select's backward writes its gradient into a zeroed full copy)
    c = ops.mm(a2.squeeze(0), b2.squeeze(0)).unsqueeze(0) if tb == 1 else ops.bmm(a2, b2)
    labels = both + a_only + ["m"] + b_only + ["n"]
    c = c.reshape([a.shape[d] for d in both] + [a.shape[d] for d in a_only] + [m] + [b.shape[d] for d in b_only] + [n])
    target = [d for d in range(nbatch) if d in both or d in a_only or d in b_only] + ["m", "n"]
    c = c.permute([labels.index(x) for x in target])
    return c.reshape([a.shape[d] if b.shape[d] == 1 else b.shape[d] for d in range(nbatch)] + [m, n])


def whole(xs, lead):
    """``xs`` without their ``lead`` grid dims when every grid dim is 1 (one device, or every operand
    replicated), else None. Then the kernel makes torch's own call on the whole tensors, so the result
    is torch's bit for bit (a folded or batched GEMM may sum in another order)."""
    if not lead:
        return xs
    if any(d != 1 for x in xs for d in x.shape[:lead]):
        return None
    return [x.reshape(x.shape[lead:]) for x in xs]


@kernel("matmul")
def _matmul_kernel(a, b, *, na, nb, lead=0):
    ab = whole((a, b), lead)
    if ab is not None:
        out = torch.matmul(*ab)
        return out.reshape((1,) * lead + tuple(out.shape)) if lead else out
    return _matmul_local(a, b, na, nb, lead)


@kernel("linear")
def _linear_kernel(x, w, *bias, nx, lead=0):
    xs = whole((x, w) + bias, lead)
    if xs is not None:  # (F.linear adds the bias inside the GEMM: addmm)
        out = torch.nn.functional.linear(*xs)
        return out.reshape((1,) * lead + tuple(out.shape)) if lead else out
    out = _matmul_local(x, w.transpose(-1, -2), nx, 2, lead)  # [..., k] @ [k, n] -> [..., n]
    if bias:
        (b,) = bias
        out = out + b.reshape(b.shape[:lead] + (1,) * (out.ndim - b.ndim) + b.shape[lead:])
    return out


@kernel("einsum")
def _einsum_kernel(*xs, equation):
    return torch.einsum(equation, *xs)


@kernel("outer")
def _outer_kernel(a, b):
    return a.unsqueeze(-1) * b.unsqueeze(-2)


# -- the rule --------------------------------------------------------------------------------------

_COMM = {  # (src kind, dst kind) -> bytes moved, in units of the operand's per-device size
    ("S", "R"): 1.0, ("S", "S"): 0.5, ("S", "P"): 1.0,
    ("P", "R"): 2.0, ("P", "S"): 1.0, ("P", "P"): 2.0,
}


def _kind(p) -> str:
    return "S" if isinstance(p, Shard) else "P" if isinstance(p, Partial) else "R"


def _cost(specs, placements, i, targets):
    comm = changes = 0.0
    for s, p, t in zip(specs, placements, targets):
        if p == t:
            continue
        changes += 1
        if not isinstance(p, Replicate):
            size = math.prod(s.shape) * s.dtype.itemsize
            for j, q in enumerate(s.placements):
                if j != i and isinstance(q, Shard):
                    size /= s.mesh.shape[j]
            comm += _COMM[(_kind(p), _kind(t))] * size
    return comm, changes


def contract_rule(specs, labels, out_labels, n_factors, kern, kwargs, meta) -> OpPlan:
    """Placements for an einsum-like op. ``labels[j]``: a label per dim of operand j; operands past
    ``n_factors`` are addends (a bias) added to the product."""
    mesh = specs[0].mesh
    sizes: dict = {}
    for s, ls in zip(specs, labels):
        for n, lab in zip(s.shape, ls):
            sizes[lab] = max(sizes.get(lab, 1), n)
    # where each label can be sharded in each operand (not broadcast from size 1, not a diagonal)
    pos = [{lab: d for d, lab in enumerate(ls) if s.shape[d] == sizes[lab] and ls.count(lab) == 1}
           for s, ls in zip(specs, labels)]
    shardable = sorted({lab for ps in pos[:n_factors] for lab in ps}, key=str)
    out_pos = {lab: d for d, lab in enumerate(out_labels)}

    def candidates(i):
        r = Replicate()
        yield [r] * len(specs), r
        for lab in shardable:
            out = Shard(out_pos[lab]) if lab in out_pos else Partial("sum")
            ins = [Shard(pos[j][lab]) if lab in pos[j] else r for j in range(n_factors)]
            yield ins + [_addend(out, lab, pos[j], r) for j in range(n_factors, len(specs))], out
        for j in range(n_factors):
            p = specs[j].placements[i]
            if isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
                ins = [p if k == j else r for k in range(n_factors)]
                yield ins + [p] * (len(specs) - n_factors), p

    in_pl = [list(s.placements) for s in specs]
    out_pl = []
    for i in range(mesh.ndim):
        cur = [s.placements[i] for s in specs]
        best = min(candidates(i), key=lambda c: _cost(specs, cur, i, c[0]))
        for j, p in enumerate(best[0]):
            in_pl[j][i] = p
        out_pl.append(best[1])
    out = DTensorSpec(mesh, tuple(out_pl), tuple(meta.shape), meta.dtype)
    in_specs = tuple(spec_like(s, placements=p) for s, p in zip(specs, in_pl))
    return OpPlan(in_specs, (out,), kern, dict(kwargs))


def _addend(out, lab, pos, r):
    if isinstance(out, Partial):
        return out  # the bias is added once: on one device, zeros on the others
    return Shard(pos[lab]) if lab in pos else r


# -- labels per op -----------------------------------------------------------------------------------

def _labeled_shape(specs, labels, out_labels):
    """The output shape the labels give (a label's size: its one size other than 1), for ``meta_call``;
    None where operands disagree, so that torch's own check reports it."""
    sizes: dict = {}
    for s, ls in zip(specs, labels):
        if len(ls) != s.ndim:
            return None
        for n, lab in zip(s.shape, ls):
            if sizes.get(lab, 1) == 1:
                sizes[lab] = n
            elif n not in (1, sizes[lab]):
                return None
    return tuple(sizes[lab] for lab in out_labels)


def _matmul_labels(sa, sb):
    na, nb = len(sa), len(sb)
    if na == 0 or nb == 0:
        raise OpError(f"dtorch.matmul: both arguments need at least 1 dim, got shapes {list(sa)} and {list(sb)}")
    ba, bb = max(na - 2, 0), max(nb - 2, 0)
    nbatch = max(ba, bb)
    batch = tuple(f"b{d}" for d in range(nbatch))
    la = (batch[nbatch - ba:] + ("m",) if na > 1 else ()) + ("k",)
    lb = batch[nbatch - bb:] + ("k",) + (("n",) if nb > 1 else ())
    lo = batch + (("m",) if na > 1 else ()) + (("n",) if nb > 1 else ())
    return la, lb, lo


def _matmul_rule(specs, name):
    a, b = specs
    la, lb, lo = _matmul_labels(a.shape, b.shape)
    meta = meta_call(getattr(torch, name), specs, out_shape=_labeled_shape(specs, (la, lb), lo))
    return contract_rule(specs, (la, lb), lo, 2, _matmul_kernel, {"na": a.ndim, "nb": b.ndim}, meta)


def _linear_rule(specs):
    x, w = specs[:2]
    if w.ndim != 2:
        raise OpError(f"weight must be 2-D [out_features, in_features], got shape {list(w.shape)}")
    lx = tuple(f"b{d}" for d in range(x.ndim - 1)) + ("k",)
    lo = lx[:-1] + ("n",)
    labels = (lx, ("n", "k"))
    if len(specs) == 3:
        if specs[2].ndim > 1:
            raise OpError(f"bias must be 1-D [out_features], got shape {list(specs[2].shape)}")
        labels += (("n",) * specs[2].ndim,)
    meta = meta_call(torch.nn.functional.linear, specs, out_shape=_labeled_shape(specs, labels, lo))
    return contract_rule(specs, labels, lo, 2, _linear_kernel, {"nx": x.ndim}, meta)


def _outer_rule(specs):
    labels, out = (("i",), ("j",)), ("i", "j")
    meta = meta_call(torch.outer, specs, out_shape=_labeled_shape(specs, labels, out))
    return contract_rule(specs, labels, out, 2, _outer_kernel, {}, meta)


def _einsum_rule(specs, equation):
    labels, out = _parse_einsum(equation, [s.ndim for s in specs])
    meta = meta_call(lambda *xs: torch.einsum(equation, *xs), specs, out_shape=_labeled_shape(specs, labels, out))
    letters = {lab: chr(ord("a") + n) if n < 26 else chr(ord("A") + n - 26)
               for n, lab in enumerate(sorted({lab for ls in labels for lab in ls}, key=str))}
    local = ",".join("..." + "".join(letters[lab] for lab in ls) for ls in labels)
    local += "->..." + "".join(letters[lab] for lab in out)
    return contract_rule(specs, labels, out, len(specs), _einsum_kernel, {"equation": local}, meta)


def _parse_einsum(equation: str, ranks):
    """Per-operand labels and output labels; '...' becomes one label per broadcast dim (right-aligned)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise OpError(f"dtorch.einsum: equation {equation!r} names {len(terms)} operands, got {len(ranks)}")
    n_ell = 0
    labels = []
    for t, r in zip(terms, ranks):
        explicit = t.replace("...", "")
        if not explicit.isalpha() and explicit:
            raise OpError(f"dtorch.einsum: subscripts must be letters, got {t!r} in {equation!r}")
        k = r - len(explicit) if "..." in t else 0
        if k < 0 or ("..." not in t and len(explicit) != r):
            raise OpError(f"dtorch.einsum: term {t!r} of {equation!r} does not match an operand with {r} dims")
        n_ell = max(n_ell, k)
        head, _, tail = t.partition("...")
        labels.append(tuple(head) + tuple(f"...{j}" for j in range(k - 1, -1, -1)) + tuple(tail))
    ell = tuple(f"...{j}" for j in range(n_ell - 1, -1, -1))
    if arrow:
        head, _, tail = rhs.partition("...")
        out = tuple(head) + (ell if "..." in rhs else ()) + tuple(tail)
    else:  # implicit output: broadcast dims, then the letters used once, sorted
        flat = [c for ls in labels for c in ls if not c.startswith("...")]
        out = ell + tuple(sorted(c for c in set(flat) if flat.count(c) == 1))
    return tuple(labels), out


# -- public ops --------------------------------------------------------------------------------------

def _tensors(name, *args):
    ts = to_dtensors(name, args)
    for t in ts:
        if not isinstance(t, Tensor):
            raise OpError(f"dtorch.{name} expects tensors, got {type(t).__name__}")
    return ts


def _rmatmul(self, other):
    return matmul(other, self)


@register(rule=_matmul_rule, kernel=_matmul_kernel, methods=("matmul", "__matmul__", ("__rmatmul__", _rmatmul)),
          torch_fns=(torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__))
def matmul(input, other):
    """``torch.matmul`` with torch's broadcasting; see the module docstring for the placement rules."""
    return dispatch("matmul", _matmul_rule, _tensors("matmul", input, other), ("matmul",))


@register(rule=_matmul_rule, kernel=_matmul_kernel, methods=("mm",), torch_fns=(torch.mm,))
def mm(input, mat2):
    return dispatch("mm", _matmul_rule, _tensors("mm", input, mat2), ("mm",))


@register(rule=_matmul_rule, kernel=_matmul_kernel, methods=("bmm",), torch_fns=(torch.bmm,))
def bmm(input, mat2):
    return dispatch("bmm", _matmul_rule, _tensors("bmm", input, mat2), ("bmm",))


@register(rule=_matmul_rule, kernel=_matmul_kernel, methods=("dot",), torch_fns=(torch.dot,))
def dot(input, tensor):
    return dispatch("dot", _matmul_rule, _tensors("dot", input, tensor), ("dot",))


@register(rule=_outer_rule, kernel=_outer_kernel, methods=("outer",), torch_fns=(torch.outer,))
def outer(input, vec2):
    return dispatch("outer", _outer_rule, _tensors("outer", input, vec2))


@register(rule=_linear_rule, kernel=_linear_kernel, torch_fns=(torch.nn.functional.linear,), functional=True)
def linear(input, weight, bias=None):
    """``F.linear``: ``input @ weight.T + bias`` with weight ``[out, in]``. Column parallel (weight S(0))
    gives S(-1); row parallel (input S(-1), weight S(1)) gives P(sum), the bias added on one device."""
    args = (input, weight) if bias is None else (input, weight, bias)
    return dispatch("linear", _linear_rule, _tensors("linear", *args))


@register(rule=_einsum_rule, kernel=_einsum_kernel, torch_fns=(torch.einsum,))
def einsum(equation, *operands):
    """``torch.einsum`` with an equation string (``'...'`` and implicit output supported)."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not isinstance(equation, str):
        raise OpError("dtorch.einsum takes an equation string first; the sublist format is not supported")
    return dispatch("einsum", _einsum_rule, _tensors("einsum", *operands), (equation,))
