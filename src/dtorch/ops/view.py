"""Shape and view ops: view/reshape, flatten/unflatten, transpose/permute, (un)squeeze, expand, repeat,
repeat_interleave, indexing, narrow/chunk/split/unbind, tril/triu.

Each single-input op is described by a dim map (ops/dim_map.py: where each output dim's data comes from),
and its placements follow the data. tril/triu keep every shard and give each block its global row/column
offsets. cat/stack: ops/cat.py; argument checks shared with the other families: ops/args.py.
"""
from __future__ import annotations

import operator
from functools import lru_cache

import torch

from .._lru import LRU
from ..autograd.dispatched import SHAPE_ONLY_KERNELS
from ..errors import OpError
from ..runtime.kernels import kernel, per_device
from ..spec import DTensorSpec, block_offsets
from ..tensor import Tensor
from .args import IndexOutOfRangeError, UnsupportedIndexError, _dim, _kw, _sizes, _tensor
from .dim_map import (Broadcast, InputDim, Interleave, NewDim, Repeat, Singleton, Slice, _prod, follow, map_plan,
                      view_map)
from .dispatch import OpPlan, dispatch
from .rules import meta_call, spec_like
from .table import register
from .views import STEP_META, View, is_placements, reinterpret, reshape_is_view, view_op


# ------------------------------------------------------------------------------------------------
# kernels: ``lead`` grid dims in front, local output shapes derived from the local input


# (id(dim_map), local input shape) -> (dim_map, local output shape); the stored map guards against id reuse
_LOCAL_OUT = LRU("ops.view.local_out_shapes", 4096)


def _local_out_shape(dim_map, local) -> tuple:
    """The block's output shape under ``dim_map``; memoised: the per-call walk of the map costs more
    than the reshape itself (dim maps live in cached plans)."""
    key = (id(dim_map), tuple(local))
    hit = _LOCAL_OUT.get(key)
    if hit is None or hit[0] is not dim_map:
        hit = _LOCAL_OUT[key] = (dim_map, tuple(ds.size(local) for ds in dim_map))
    return hit[1]


# Kernel.bind: the kernel for one plan's arguments and one layout of the blocks, as a C-level callable
# (sizes as varargs: torch parses those faster than a tuple)

def _bind_reshape(kw: dict, lead: int, out_shapes):
    (shape,) = out_shapes
    return operator.methodcaller("reshape", *shape)


@kernel("view.reshape", bind=_bind_reshape)
def _reshape_kernel(x, *, dim_map, shape=None, lead=0):
    # ``shape``: every block's output shape, when the output spec is even (all blocks alike)
    if shape is None:
        shape = _local_out_shape(dim_map, x.shape[lead:])
    return x.reshape(x.shape[:lead] + shape)


def _full_perm(perm: tuple, lead: int) -> tuple:
    return tuple(range(lead)) + tuple(lead + p for p in perm)


def _bind_permute(kw: dict, lead: int, out_shapes):
    return operator.methodcaller("permute", *_full_perm(kw["perm"], lead))


@kernel("view.permute", bind=_bind_permute)
def _permute_kernel(x, *, perm, lead=0):
    return x.permute(_full_perm(perm, lead))


@kernel("view.expand")
def _expand_kernel(x, *, dim_map, new, lead=0):
    local = x.shape[lead:]
    x = x.reshape(tuple(x.shape[:lead]) + (1,) * new + tuple(local))
    return x.expand(tuple(x.shape[:lead]) + _local_out_shape(dim_map, local))


@kernel("view.repeat")
def _repeat_kernel(x, *, reps, lead=0):
    x = x.reshape(tuple(x.shape[:lead]) + (1,) * (len(reps) - (x.ndim - lead)) + tuple(x.shape[lead:]))
    return x.repeat((1,) * lead + tuple(reps))


@kernel("view.repeat_interleave")
def _interleave_kernel(x, *, repeats, dim, lead=0):
    return torch.repeat_interleave(x, repeats, dim=lead + dim)


def _bind_index(kw: dict, lead: int, out_shapes):
    return operator.itemgetter((slice(None),) * lead + _as_index(kw["items"]))


@kernel("view.index", bind=_bind_index)
def _index_kernel(x, *, items, lead=0):
    return x[(slice(None),) * lead + _as_index(items)]


@kernel("view.split")
def _split_kernel(x, *, dim, sizes, squeeze, lead=0):
    if squeeze:
        return tuple(x.unbind(lead + dim))
    if len(sizes) == 1:  # one piece is the whole dim, which may stay sharded: the block itself (global sizes)
        return (x,)
    return tuple(torch.split(x, list(sizes), dim=lead + dim))


@kernel("view.tri")
def _tri_kernel(x, *, upper, diagonal, roff=0, coff=0, lead=0):
    if not isinstance(roff, torch.Tensor):
        k = diagonal + roff - coff  # local (i, j) is global (i + roff, j + coff)
        return torch.triu(x, k) if upper else torch.tril(x, k)
    rows = torch.arange(x.shape[-2], device=x.device).unsqueeze(-1) + per_device(roff, x, lead)
    cols = torch.arange(x.shape[-1], device=x.device) + per_device(coff, x, lead)
    keep = (cols - rows >= diagonal) if upper else (cols - rows <= diagonal)
    return torch.where(keep, x, x.new_zeros(()))


def _as_index(items) -> tuple:
    out = []
    for it in items:
        kind = it[0]
        out.append(None if kind == "new" else slice(None) if kind == "all" else it[1] if kind == "int"
                   else slice(*it[1:]))
    return tuple(out)


# ------------------------------------------------------------------------------------------------
# rules (pure functions of specs and static arguments; cached by the dispatcher)


def _reshape_rule(specs, shape):
    spec = specs[0]
    out_shape = tuple(meta_call(lambda t: t.reshape(shape), specs).shape)
    dim_map = view_map(spec.shape, out_shape)
    plan = map_plan(spec, dim_map, _reshape_kernel, dim_map=dim_map)
    if plan.out_specs[0].is_even():
        plan.kwargs["shape"] = plan.out_specs[0].even_local_shape()
    return plan


def _permute_rule(specs, perm):
    return map_plan(specs[0], tuple(InputDim(p) for p in perm), _permute_kernel, perm=perm)


def _expand_rule(specs, sizes):
    spec = specs[0]
    out_shape = tuple(meta_call(lambda t: t.expand(sizes), specs).shape)
    new = len(out_shape) - spec.ndim
    dim_map = tuple(NewDim(n) for n in out_shape[:new]) + tuple(
        InputDim(d) if spec.shape[d] == n else Broadcast(InputDim(d), n) for d, n in enumerate(out_shape[new:]))
    return map_plan(spec, dim_map, _expand_kernel, dim_map=dim_map, new=new)


def _repeat_rule(specs, reps):
    spec = specs[0]
    if len(reps) < spec.ndim or any(r < 0 for r in reps):
        meta_call(lambda t: t.repeat(reps), specs)  # raises, with torch's message (the meta run is slow only once)
    new = len(reps) - spec.ndim
    dim_map = tuple(NewDim(r) for r in reps[:new]) + tuple(
        InputDim(d) if r == 1 else Repeat(InputDim(d), r) for d, r in enumerate(reps[new:]))
    return map_plan(spec, dim_map, _repeat_kernel, reps=reps)


def _interleave_rule(specs, repeats, dim):
    spec = specs[0]
    dim_map = tuple((Interleave(InputDim(d), repeats) if repeats else Slice(InputDim(d), 0)) if d == dim
                    else InputDim(d) for d in range(spec.ndim))
    return map_plan(spec, dim_map, _interleave_kernel, repeats=repeats, dim=dim)


def _index_rule(specs, items):
    dim_map, d = [], 0
    for it in items:
        if it[0] == "new":
            dim_map.append(Singleton())
            continue
        if it[0] == "all":
            dim_map.append(InputDim(d))
        elif it[0] == "slice":
            dim_map.append(Slice(InputDim(d), len(range(*it[1:]))))
        d += 1
    return map_plan(specs[0], tuple(dim_map), _index_kernel, items=items)


def _split_rule(specs, dim, sizes, squeeze):
    spec = specs[0]
    keep = tuple(InputDim(e) for e in range(dim)), tuple(InputDim(e) for e in range(dim + 1, spec.ndim))
    piece = (lambda n: ()) if squeeze else (lambda n: (InputDim(dim) if len(sizes) == 1 else Slice(InputDim(dim), n),))
    maps = [keep[0] + piece(n) + keep[1] for n in sizes]
    follows = [follow(spec, m) for m in maps]  # every piece asks the same of the input
    outs = tuple(DTensorSpec(spec.mesh, f[1], tuple(ds.size(spec.shape) for ds in m), spec.dtype)
                 for f, m in zip(follows, maps))
    return OpPlan((spec_like(spec, placements=follows[0][0]),), outs, _split_kernel,
                  {"dim": dim, "sizes": sizes, "squeeze": squeeze}, multi_output=True)


def _tri_rule(specs, upper, diagonal):
    spec = specs[0]
    if spec.ndim < 2:
        raise OpError(f"dtorch.{'triu' if upper else 'tril'}: the input must have at least 2 dims, got shape "
                      f"{list(spec.shape)}")
    r, c = spec.ndim - 2, spec.ndim - 1
    kw = {"upper": upper, "diagonal": diagonal}
    if not (spec.shard_mesh_dims(r) or spec.shard_mesh_dims(c)):
        return OpPlan((spec,), (spec,), _tri_kernel, kw)
    # shards stay: each block masks with its global row/column offsets
    return OpPlan((spec,), (spec,), _tri_kernel, kw,
                  device_args={"roff": block_offsets(spec, r), "coff": block_offsets(spec, c)})


# The view ops return views of their input (ops/views.py): the value is computed when first read, and
# writes through the view reach its base. ``reshape`` of a view torch cannot view copies (a plain tensor).

def _reshape(name, x, shape):
    if type(x) is View and not reshape_is_view(x, name, shape):
        return dispatch(name, _reshape_rule, [x], (shape,))
    return view_op(name, _reshape_rule, x, (shape,))


def _permute(name, x, perm):
    return view_op(name, _permute_rule, x, (perm,))  # (the identity too: torch's is a new view, not x itself)


def _index(name, x, items):
    return view_op(name, _index_rule, x, (items,))  # (x[:] too: torch's is a new view, not x itself)


# ------------------------------------------------------------------------------------------------
# the op set


def _view_as(self, other):
    return _reshape("view", self, tuple(other.shape))


def _reshape_as(self, other):
    return _reshape("reshape", self, tuple(other.shape))


@register(public=False, rule=_reshape_rule, kernel=_reshape_kernel, methods=("view", ("view_as", _view_as)))
def view(input, *shape, **kw):
    """``x.view(*sizes)``; ``x.view([placements])`` reads every device's block as it is under other placements
    (ops/views.py ``reinterpret``: no communication, not a view of x)."""
    shape = shape or (_kw("view", kw, "size"),)
    if len(shape) == 1:
        if is_placements(shape):
            return reinterpret(input, shape[0])
        if isinstance(shape[0], torch.dtype):
            raise OpError("Tensor.view(dtype) (reinterpreting bits) is not supported by dtorch; "
                          "use .to(dtype) to convert values")
    return _reshape("view", input, _sizes(shape, "view"))


@register(rule=_reshape_rule, kernel=_reshape_kernel, methods=("reshape", ("reshape_as", _reshape_as)),
          torch_fns=(torch.reshape,))
def reshape(input, *shape, **kw):
    return _reshape("reshape", _tensor("reshape", input), _sizes(shape or (kw.get("shape", ()),), "reshape"))


@register(rule=_reshape_rule, kernel=_reshape_kernel, methods=("flatten",), torch_fns=(torch.flatten,))
def flatten(input, start_dim=0, end_dim=-1):
    x = _tensor("flatten", input)
    if x.ndim == 0:
        return _reshape("flatten", x, (1,))
    s, e = _dim(start_dim, x.ndim, "flatten"), _dim(end_dim, x.ndim, "flatten")
    if s > e:
        raise OpError(f"dtorch.flatten: start_dim ({start_dim}) must not come after end_dim ({end_dim})")
    shape = tuple(x.shape)
    return _reshape("flatten", x, shape[:s] + (_prod(shape[s:e + 1]),) + shape[e + 1:])


@register(rule=_reshape_rule, kernel=_reshape_kernel, methods=("unflatten",), torch_fns=(torch.unflatten,))
def unflatten(input, dim, sizes):
    x = _tensor("unflatten", input)
    d = _dim(dim, x.ndim, "unflatten")
    sizes = _sizes((sizes,), "unflatten")
    if sizes.count(-1) > 1 or (-1 not in sizes and _prod(sizes) != x.shape[d]):
        raise OpError(f"dtorch.unflatten: sizes {list(sizes)} do not multiply to dim {dim}'s size {x.shape[d]}; "
                      "give sizes whose product matches (at most one -1)")
    shape = tuple(x.shape)
    return _reshape("unflatten", x, shape[:d] + sizes + shape[d + 1:])


@register(rule=_reshape_rule, kernel=_reshape_kernel, methods=("squeeze",), torch_fns=(torch.squeeze,))
def squeeze(input, dim=None):
    x = _tensor("squeeze", input)
    shape = tuple(x.shape)
    if dim is None:
        dims = set(range(x.ndim))
    else:
        dims = {_dim(d, x.ndim, "squeeze") for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    new = tuple(n for d, n in enumerate(shape) if not (d in dims and n == 1))
    return x if new == shape else _reshape("squeeze", x, new)


@register(rule=_reshape_rule, kernel=_reshape_kernel, methods=("unsqueeze",), torch_fns=(torch.unsqueeze,))
def unsqueeze(input, dim):
    x = _tensor("unsqueeze", input)
    d = _dim(dim, x.ndim, "unsqueeze", extra=1)
    shape = tuple(x.shape)
    return _reshape("unsqueeze", x, shape[:d] + (1,) + shape[d:])


def _T(self):
    return _permute("T", self, tuple(reversed(range(self.ndim))))


def _mT(self):
    if self.ndim < 2:
        raise OpError(f"dtorch: .mT needs a tensor with at least 2 dims, got shape {list(self.shape)}")
    return transpose(self, -2, -1)


@register(rule=_permute_rule, kernel=_permute_kernel,
          methods=("transpose", "swapaxes", "swapdims", ("mT", property(_mT))),
          torch_fns=(torch.transpose, torch.swapaxes, torch.swapdims))
def transpose(input, dim0, dim1):
    x = _tensor("transpose", input)
    n = len(x._spec.shape)
    # (int dims in range: checked inline, the per-call cost of a view is the point of this function)
    a = dim0 % n if type(dim0) is int and -n <= dim0 < n else _dim(dim0, n, "transpose")
    b = dim1 % n if type(dim1) is int and -n <= dim1 < n else _dim(dim1, n, "transpose")
    if a == b:
        return x
    return view_op("transpose", _permute_rule, x, (_swap(n, a, b),))


@lru_cache(maxsize=1024)
def _swap(n: int, a: int, b: int) -> tuple:
    """The permutation of ``n`` dims that swaps dims ``a`` and ``b``."""
    perm = list(range(n))
    perm[a], perm[b] = b, a
    return tuple(perm)


@register(rule=_permute_rule, kernel=_permute_kernel, methods=("t",), torch_fns=(torch.t,))
def t(input):
    x = _tensor("t", input)
    if x.ndim > 2:
        raise OpError(f"dtorch.t expects a tensor with at most 2 dims, got shape {list(x.shape)}; "
                      "use transpose(dim0, dim1) or .mT")
    return _permute("t", x, (1, 0)) if x.ndim == 2 else x


@register(rule=_permute_rule, kernel=_permute_kernel, methods=("permute", ("T", property(_T))),
          torch_fns=(torch.permute,))
def permute(input, *dims, **kw):
    dims = dims or (_kw("permute", kw, "dims"),)
    x = _tensor("permute", input)
    perm = tuple(_dim(d, x.ndim, "permute") for d in _sizes(dims, "permute"))
    if sorted(perm) != list(range(x.ndim)):
        raise OpError(f"dtorch.permute: dims {list(_sizes(dims, 'permute'))} are not a permutation of the "
                      f"{x.ndim} dims of a tensor of shape {list(x.shape)}")
    return _permute("permute", x, perm)


@register(rule=_permute_rule, kernel=_permute_kernel, methods=("movedim", "moveaxis"),
          torch_fns=(torch.movedim, torch.moveaxis))
def movedim(input, source, destination):
    x = _tensor("movedim", input)
    src = [_dim(d, x.ndim, "movedim") for d in (source if isinstance(source, (tuple, list)) else (source,))]
    dst = [_dim(d, x.ndim, "movedim") for d in (destination if isinstance(destination, (tuple, list)) else (destination,))]
    if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
        raise OpError(f"dtorch.movedim: source {source} and destination {destination} must be the same number "
                      "of distinct dims")
    rest = iter(d for d in range(x.ndim) if d not in src)
    where = dict(zip(dst, src))
    return _permute("movedim", x, tuple(where[o] if o in where else next(rest) for o in range(x.ndim)))


def _expand_as(self, other):
    return expand(self, tuple(other.shape))


@register(public=False, rule=_expand_rule, kernel=_expand_kernel, methods=("expand", ("expand_as", _expand_as)))
def expand(input, *sizes, **kw):
    sizes = sizes or (_kw("expand", kw, "size"),)
    return view_op("expand", _expand_rule, _tensor("expand", input), (_sizes(sizes, "expand"),))


@register(rule=_expand_rule, kernel=_expand_kernel, torch_fns=(torch.broadcast_to,))
def broadcast_to(input, size):
    return expand(_tensor("broadcast_to", input), size)


@register(public=False, rule=_repeat_rule, kernel=_repeat_kernel, methods=("repeat",))
def repeat(input, *sizes, **kw):
    sizes = sizes or (_kw("repeat", kw, "repeats"),)
    return dispatch("repeat", _repeat_rule, [input], (_sizes(sizes, "repeat"),))


@register(rule=_interleave_rule, kernel=_interleave_kernel, methods=("repeat_interleave",),
          torch_fns=(torch.repeat_interleave,))
def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    x = _tensor("repeat_interleave", input)
    if isinstance(repeats, (Tensor, torch.Tensor)) and repeats.numel() != 1 or repeats is None:
        raise UnsupportedIndexError("dtorch.repeat_interleave takes an int number of repeats; per-element "
                                    "repeats (a tensor) are not implemented")
    r = int(repeats.item()) if isinstance(repeats, (Tensor, torch.Tensor)) else operator.index(repeats)
    if r < 0:
        raise OpError(f"dtorch.repeat_interleave: repeats must be non-negative, got {r}")
    if dim is None:
        x, d = flatten(x), 0
    else:
        d = _dim(dim, x.ndim, "repeat_interleave")
    if output_size is not None and output_size != x.shape[d] * r:
        raise OpError(f"dtorch.repeat_interleave: output_size {output_size} != {x.shape[d]} * {r}")
    return dispatch("repeat_interleave", _interleave_rule, [x], (r, d))


@register(rule=_index_rule, kernel=_index_kernel, methods=("narrow",), torch_fns=(torch.narrow,))
def narrow(input, dim, start, length):
    x = _tensor("narrow", input)
    d = _dim(dim, x.ndim, "narrow")
    n, start, length = x.shape[d], operator.index(start), operator.index(length)
    start = start + n if start < 0 else start
    if not (0 <= start <= n and 0 <= length <= n - start):
        raise IndexOutOfRangeError(f"dtorch.narrow: start {start} + length {length} exceeds dim {dim}'s size {n}")
    item = ("all",) if (start, length) == (0, n) else ("slice", start, start + length, 1)
    return _index("narrow", x, (("all",),) * d + (item,) + (("all",),) * (x.ndim - d - 1))


def _split(name, x, dim, sizes, squeeze=False):
    return view_op(name, _split_rule, x, (dim, tuple(sizes), squeeze), n_out=len(sizes))


def _cut(name, x, d, cut):
    """The pieces torch's ``cut`` (chunk / split / tensor_split of a 1-D tensor) makes of dim ``d`` of ``x``.

    torch decides the pieces on a meta tensor of the dim's length (its messages, its edge cases); each
    piece's start is its storage offset there. Pieces that tile the dim in order are one split op; others
    (tensor_split with indices out of order) are narrowed one by one.
    """
    try:
        pieces = [(p.storage_offset(), p.shape[0]) for p in cut(torch.empty(x.shape[d], device="meta"))]
    except (RuntimeError, TypeError, ValueError) as exc:
        raise OpError(f"dtorch.{name} on dim {d} of shape {list(x.shape)}: {exc}") from None
    sizes = [n for _, n in pieces]
    if sum(sizes) == x.shape[d] and all(start == sum(sizes[:k]) for k, (start, _) in enumerate(pieces)):
        return _split(name, x, d, sizes)
    return tuple(narrow(x, d, start, n) for start, n in pieces)


@register(rule=_split_rule, kernel=_split_kernel, methods=("chunk",), torch_fns=(torch.chunk,))
def chunk(input, chunks, dim=0):
    x = _tensor("chunk", input)
    d = _dim(dim, x.ndim, "chunk")
    return _cut("chunk", x, d, lambda m: torch.chunk(m, chunks))


@register(rule=_split_rule, kernel=_split_kernel, methods=("split",), torch_fns=(torch.split,))
def split(tensor, split_size_or_sections, dim=0):
    x = _tensor("split", tensor)
    d = _dim(dim, x.ndim, "split")
    arg = split_size_or_sections
    arg = list(_sizes((arg,), "split")) if isinstance(arg, (tuple, list, torch.Size)) else operator.index(arg)
    return _cut("split", x, d, lambda m: torch.split(m, arg))


@register(rule=_split_rule, kernel=_split_kernel, methods=("tensor_split",), torch_fns=(torch.tensor_split,))
def tensor_split(input, indices_or_sections, dim=0):
    x = _tensor("tensor_split", input)
    d = _dim(dim, x.ndim, "tensor_split")
    arg = indices_or_sections
    if isinstance(arg, (Tensor, torch.Tensor)):  # like torch: a 0-d tensor counts sections, a 1-d one holds indices
        if arg.dtype != torch.int64 or arg.ndim > 1:
            raise OpError(f"dtorch.tensor_split: a tensor indices_or_sections must be a 0-d or 1-d int64 tensor, got "
                          f"a {arg.ndim}-d {arg.dtype} tensor")
        arg = arg.tolist()
    arg = list(_sizes((arg,), "tensor_split")) if isinstance(arg, (tuple, list)) else operator.index(arg)
    return _cut("tensor_split", x, d, lambda m: torch.tensor_split(m, arg))


def _iter(self):
    if self.ndim == 0:
        raise TypeError("iteration over a 0-d tensor")
    return iter(unbind(self, 0))


@register(rule=_split_rule, kernel=_split_kernel, methods=("unbind", ("__iter__", _iter)), torch_fns=(torch.unbind,))
def unbind(input, dim=0):
    x = _tensor("unbind", input)
    d = _dim(dim, x.ndim, "unbind")
    if x.ndim == 0 or x.shape[d] == 0:
        if x.ndim == 0:
            raise OpError("dtorch.unbind: a 0-D tensor has no dim to unbind")
        return ()
    return _split("unbind", x, d, (1,) * x.shape[d], squeeze=True)


@register(rule=_tri_rule, kernel=_tri_kernel, methods=("tril",), torch_fns=(torch.tril,))
def tril(input, diagonal=0):
    return dispatch("tril", _tri_rule, [_tensor("tril", input)], (False, operator.index(diagonal)))


@register(rule=_tri_rule, kernel=_tri_kernel, methods=("triu",), torch_fns=(torch.triu,))
def triu(input, diagonal=0):
    return dispatch("triu", _tri_rule, [_tensor("triu", input)], (True, operator.index(diagonal)))



# where each view op's result lies in its input (torch on meta tensors: views.geometry)
STEP_META.update({
    _reshape_rule: lambda m, shape: m.view(shape),
    _permute_rule: lambda m, perm: m.permute(perm),
    _index_rule: lambda m, items: m[_as_index(items)],
    _expand_rule: lambda m, sizes: m.expand(sizes),
    _split_rule: lambda m, dim, sizes, squeeze: m.unbind(dim) if squeeze else torch.split(m, list(sizes), dim),
})
# their backward needs no values of their input (autograd keeps no version check on it, as torch's views)
SHAPE_ONLY_KERNELS.update({_reshape_kernel.name, _permute_kernel.name, _index_kernel.name, _expand_kernel.name,
                           _split_kernel.name})
