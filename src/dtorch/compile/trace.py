"""One trace of a step: where its inputs come from, what it does to Python objects, its guards, its replay.

``settle`` turns a finished recording into a ``Trace``: every external handle bound to the tensor it was found on
(an argument's, an object's, a parameter's ``.grad``), the Python effects eager had (compile/state.py), the outputs
and the guards. It refuses (``TraceError``) what a replay could not reproduce, in the user's terms.
"""
from __future__ import annotations

from ..tensor import Tensor
from .record import Recorder, Slot
from .program import on_workers
from .replay import build
from .state import Found, at, roots, walk, writes

_make = Tensor._make


class TraceError(Exception):
    """A recorded step a replay cannot reproduce; the message says why."""


def _reader(bindings, suffixes):
    """``read((args, kwargs))``: the list of what each binding names, with its suffix applied ("._h": its handle),
    as one generated expression (a replay resolves ~250 bindings per step: a loop of ``_resolve`` took ~10% of the
    controller's CPU). Paths with keys other than ints and strings take the loop."""
    consts, exprs = {}, []
    for n, ((kind, where), suffix) in enumerate(zip(bindings, suffixes)):
        if kind in ("obj", "grad"):
            consts[f"o{n}"] = where
            expr = f"o{n}._ag.grad" if kind == "grad" else f"o{n}"
        elif all(type(k) in (int, str) for k in where):
            expr = "B" + "".join(f"[{k!r}]" for k in where)
        else:
            return lambda B: [_resolve(b, B)._h if x else _resolve(b, B) for b, x in zip(bindings, suffixes)]
        exprs.append(expr + suffix)
    exec(compile(f"def read(B):\n    return [{', '.join(exprs)}]\n", "<dtorch.compile bindings>", "exec"), consts)
    return consts.pop("read")  # (not left in its own globals: a cycle would keep the tensors until a collection)


def _resolve(binding, args):
    """The tensor (or torch tensor) a binding names in this call."""
    kind, where = binding
    if kind == "obj":
        return where
    if kind == "grad":
        return where._ag.grad
    return at(args, where)  # "arg" and "torch": by path in (args, kwargs)


class Trace:
    """A settled recording (module doc). ``eager_reason``: set when the step must run eagerly instead."""

    def __init__(self):
        self.eager_reason = None
        self.program = None
        self.on_workers = None  # the replay as worker programs (compile/program.py), where the backend has them
        self.inputs: list[Slot] = []
        self.bindings: list = []  # per input: ("arg" | "torch", path) | ("obj", tensor) | ("grad", owner)
        self.results: list[Slot] = []
        self.effects: list = []  # (kind, target binding, detail)
        self.outputs = None
        self.spec_guards: list = []  # (binding, spec)
        self.grad_guards: list = []  # (tensor, grad was None)
        self.modules: list = []  # the modules found (their guard: ``_modules_hold``)
        self._modules_hold = None  # () -> whether each keeps its training flag, parameters, buffers and children
        self.optimizers: list = []  # (optimizer, fingerprint)
        self.scalars: list = []  # (read(), value)
        self.counts = {}
        self.entries = None  # the recorder's entries, until the program is built again (``replay``)
        self.fuse = None  # backend="inductor": ``fuse(order, results)`` cuts the rebuilt replay into compiled segments
        self.replays = 0
        self._read = None  # (the spec guards' tensors, the inputs, the effects' targets) of a call: ``_readers``

    @classmethod
    def eager(cls, reason: str) -> "Trace":
        t = cls()
        t.eager_reason = reason
        return t

    # -- guards ----------------------------------------------------------------------------------------
    def _readers(self):
        guarded = [b for b, _ in self.spec_guards]
        effects = [b for _, b, _ in self.effects]
        self._read = (_reader(guarded, [""] * len(guarded)),
                      _reader(self.bindings, ["" if kind == "torch" else "._h" for kind, _ in self.bindings]),
                      _reader(effects, [""] * len(effects)))
        return self._read

    def holds(self, args, kwargs) -> bool:
        read = self._read or self._readers()
        for t, (_, spec) in zip(read[0]((args, kwargs)), self.spec_guards):
            if t is None or (t._spec is not spec and t._spec != spec):
                return False
        for t, was_none in self.grad_guards:
            if (t._ag.grad is None) is not was_none:
                return False
        if self._modules_hold is not None and not self._modules_hold():
            return False
        for opt, fp in self.optimizers:
            if _fingerprint(opt) != fp:
                return False
        return all(read() == value for read, value in self.scalars)

    # -- replay ------------------------------------------------------------------------------------------
    def replay(self, graph, args, kwargs):
        if self.replays == 1 and self.entries is not None:
            # built again once the executables have seen their kwargs twice (trace, first replay) and bound their
            # kernels: the bound ones then run as bare calls on grids (replay.build)
            self.program = build(self.entries, self.inputs, self.results, fuse=self.fuse)
            self.on_workers = on_workers(graph.runtime, self.entries, self.inputs, self.results, self.bindings)
            self.entries = None
        self.replays += 1
        both = (args, kwargs)
        _, inputs, effects = self._read or self._readers()
        xs = inputs(both)
        targets = effects(both)
        res = self.program(xs) if self.on_workers is None else self.on_workers.run(self.program, xs)
        del xs
        index = self._index
        for (kind, _, detail), t in zip(self.effects, targets):
            if kind == "handle":
                h = res[index[detail.k]]
                if h is not t._h:
                    graph._rehandle(t, h)
            elif kind == "writes":
                dw, dq = detail
                t._writes = getattr(t, "_writes", 0) + dw
                t._quiet = getattr(t, "_quiet", 0) + dq
            elif detail is None:  # kind "grad": dropped
                t._ag.grad = None
            else:  # a new gradient tensor
                spec, s, (w, q) = detail
                g = _make(spec, res[index[s.k]], graph)
                if w or q:
                    g._writes, g._quiet = w, q
                t._ag.grad = g
        return self._build(self.outputs, res, both, graph)

    def _build(self, tpl, res, both, graph):
        kind = tpl[0]
        if kind == "new":
            return _make(tpl[1], res[self._index[tpl[2].k]], graph)
        if kind == "same":
            return _resolve(tpl[1], both)
        if kind == "none":
            return None
        if kind == "dict":
            return {k: self._build(v, res, both, graph) for k, v in tpl[1].items()}
        items = [self._build(v, res, both, graph) for v in tpl[1]]
        return items if kind == "list" else tuple(items)

    def describe(self) -> str:
        if self.eager_reason is not None:
            return f"dtorch.compile: runs eagerly (graph break): {self.eager_reason}"
        c = self.counts
        lines = [f"dtorch.compile: replayable: {c.get('device', 0)} runtime calls, {c.get('host', 0)} host torch ops, "
                 f"{c.get('effect', 0) + c.get('live', 0)} optimizer/Python updates, {len(self.inputs)} inputs",
                 "guards:",
                 "  the arguments: dtorch tensors by spec, torch tensors by shape and dtype, scalars by value, "
                 "other objects by identity; grad mode; the Graph",
                 f"  {len(self.spec_guards)} tensor specs, {len(self.grad_guards)} .grad states (None or not), "
                 f"{len(self.modules)} modules' training flags, {len(self.optimizers)} optimizers' options",
                 f"  {len(self.scalars)} Python scalars of the closure and globals, {c.get('guard', 0)} values read "
                 "from the torch inputs"]
        return "\n".join(lines)


def _fingerprint(opt) -> tuple:
    """What an optimizer's step depends on besides its lr (a live value): its state count, other options,
    which parameters it holds, and which state dicts (a replay's effects count steps in the dicts of the trace:
    a restored snapshot puts new ones in their place)."""
    groups = tuple(tuple(sorted((k, v) for k, v in g.items() if k not in ("params", "lr", "initial_lr")
                                and isinstance(v, (int, float, bool, tuple, type(None)))))
                   + (tuple(map(id, g["params"])),) for g in opt.param_groups)
    return len(opt.state), groups, tuple(map(id, opt.state.values()))


_MODULE_DICTS = ("_parameters", "_buffers", "_modules")


def _modules_guard(modules: list):
    """``hold()``: whether each module still has the training flag it had and, by identity, the dicts of
    parameters, buffers and children, with the same names holding the same objects (one replaced since the trace
    would be silently skipped by a replay). One generated expression: rebuilding a fingerprint of each module per
    call took ~0.18 ms of a decode step (55 modules). The trace holds the objects (a parameter it binds it holds
    anyway), so an identity here is never a reused id."""
    consts, terms = {}, []
    for n, m in enumerate(modules):
        consts[f"m{n}"], consts[f"t{n}"] = m, m.training
        terms.append(f"m{n}.training == t{n}")
        for j, name in enumerate(_MODULE_DICTS):
            d = getattr(m, name)
            dn = f"d{n}_{j}"
            consts[dn] = d
            terms += [f"m{n}.{name} is {dn}", f"len({dn}) == {len(d)}"]
            for i, (key, value) in enumerate(d.items()):
                consts[f"{dn}_k{i}"], consts[f"{dn}_v{i}"] = key, value
                terms.append(f"{dn}[{dn}_k{i}] is {dn}_v{i}")
    src = "def hold():\n    try:\n        return " + (" and ".join(terms) or "True") + \
          "\n    except KeyError:  # a name replaced by another\n        return False\n"
    exec(compile(src, "<dtorch.compile module guards>", "exec"), consts)
    return consts.pop("hold")


def _scalar_guards(fn) -> list:
    """(read, value) for the closure cells and globals of ``fn`` that hold Python scalars."""
    out = []
    self = getattr(fn, "__self__", None)
    f = getattr(fn.__func__ if self is not None else fn, "__wrapped__", fn.__func__ if self is not None else fn)
    for cell in getattr(f, "__closure__", None) or ():
        try:
            v = cell.cell_contents
        except ValueError:
            continue
        if isinstance(v, (bool, int, float, str)):
            out.append((lambda c=cell: c.cell_contents, v))
    code, glob = getattr(f, "__code__", None), getattr(f, "__globals__", {})
    for name in (code.co_names if code is not None else ()):
        v = glob.get(name)
        if isinstance(v, (bool, int, float, str)):
            out.append((lambda g=glob, n=name: g.get(n), v))
    return out


def settle(rec: Recorder, found: Found, before: dict, torch_inputs, out, args, kwargs, fn) -> Trace | None:
    """The trace of a finished recording; None for a warm-up (the step made new state); ``TraceError`` when it
    cannot be replayed (module doc)."""
    if rec.refusals:
        raise TraceError("; ".join(dict.fromkeys(rec.refusals)))
    if found.truncated:
        raise TraceError("the step reaches too many Python objects to find its tensors; pass the model, optimizer "
                         "and inputs as arguments")
    tr = Trace()
    grad_owner = {}
    by_handle = {}
    for tid, (t, h0, _, g0) in before.items():
        by_handle[id(h0)] = tid
        if g0 is not None:
            grad_owner[id(g0)] = t

    def binding(t):
        path = found.tensors[id(t)][1]
        if path is not None:
            return ("arg", path)
        owner = grad_owner.get(id(t))
        return ("grad", owner) if owner is not None else ("obj", t)

    external_of = {}
    for s, h in rec.externals:
        tid = by_handle.get(id(h))
        if tid is None or before[tid][1] is not h:
            raise TraceError("the step uses a dtorch tensor that dtorch.compile does not find through its arguments, "
                             "closure or globals (a tensor of a function it calls?): pass that tensor, or the module "
                             "holding it, as an argument")
        t = before[tid][0]
        tr.inputs.append(s)
        tr.bindings.append(binding(t))
        external_of[id(h)] = s
        if tr.bindings[-1][0] != "arg":
            tr.spec_guards.append((tr.bindings[-1], t._spec))
    for s, path in torch_inputs:
        tr.inputs.append(s)
        tr.bindings.append(("torch", path))

    def slot(h, t) -> Slot:
        s = rec.slot_of(h) or external_of.get(id(h))
        if s is None:
            raise TraceError(f"a tensor of the step ({t._spec}) ends up holding storage made outside it that "
                             "dtorch.compile cannot name (a view's, or one laid out before the trace)")
        return s

    results: dict = {}
    new_grads = set()
    for tid, (t, h0, w0, g0) in before.items():
        written = rec.slot_of(t._h)  # the slot of an in-place write's result, when one wrote it
        if t._h is not h0 or (written is not None and written is not external_of.get(id(h0))):
            # (also when the write was in place here: a replay's write may copy where this one did not, the
            # copy-on-write deciding by who else holds the storage, and the tensor must then take the copy)
            results[slot(t._h, t).k] = s = slot(t._h, t)
            tr.effects.append(("handle", binding(t), s))
        w1 = writes(t)
        if w1 != w0:
            tr.effects.append(("writes", binding(t), (w1[0] - w0[0], w1[1] - w0[1])))
        ag = t._ag
        if ag is None:
            continue
        tr.grad_guards.append((t, g0 is None))
        g1 = ag.grad
        if g1 is g0:
            continue
        if g1 is None:
            tr.effects.append(("grad", binding(t), None))
        elif id(g1) in before:
            raise TraceError("the step sets a .grad to a tensor that existed before it; a replay cannot follow that")
        else:
            new_grads.add(id(g1))
            s = slot(g1._h, g1)
            results[s.k] = s
            tr.effects.append(("grad", binding(t), (g1._spec, s, writes(g1))))
    after = walk((args, kwargs), roots(fn))
    if any(tid not in before and tid not in new_grads for tid in after.tensors):
        return None
    tr.outputs = _outputs(out, before, binding, slot, results)
    tr.results = list(results.values())
    tr._index = {s.k: n for n, s in enumerate(tr.results)}
    tr.modules = list(found.modules)
    tr._modules_hold = _modules_guard(tr.modules) if tr.modules else None
    tr.optimizers = [(o, _fingerprint(o)) for o in found.optimizers]
    tr.scalars = _scalar_guards(fn)
    for e in rec.entries:
        tr.counts[e.kind] = tr.counts.get(e.kind, 0) + 1
    return tr


def _outputs(out, before, binding, slot, results):
    t = type(out)
    if isinstance(out, Tensor):
        if id(out) in before:
            return ("same", binding(out))
        ag = out._ag
        if ag is not None and (ag.requires_grad or (ag.grad_fn is not None and not getattr(ag.grad_fn, "released",
                                                                                            True))):
            raise TraceError("the step returns a tensor with an autograd graph it did not use; a replay gives values "
                             "only: call backward inside the compiled function, or return .detach()")
        s = slot(out._h, out)
        results[s.k] = s
        return ("new", out._spec, s)
    if out is None:
        return ("none",)
    if t in (list, tuple):
        return ("list" if t is list else "tuple", [_outputs(v, before, binding, slot, results) for v in out])
    if t is dict:
        return ("dict", {k: _outputs(v, before, binding, slot, results) for k, v in out.items()})
    raise TraceError(f"the step returns a {type(out).__name__}; a replay computes no Python values: return dtorch "
                     "tensors (and None), in tuples, lists or dicts")
