"""A recorded step as one straight-line Python function: the replay.

The recorder's entries become source lines, one call each, with every slot a local variable and every constant
(an executable, a kernel's kwargs, a spec) a global of the function. The host entries (torch ops on the step's
torch inputs, and the guards on values Python read from them) come first: a guard that fails raises ``Miss``
before any device work, so nothing has changed when the step is traced again. A slot is deleted right after its
last use, so a replay holds no value longer than eager did (an activation dies with its last reader, a local
autograd graph with its backward).
"""
from __future__ import annotations

from .. import commlog
from .host import same
from .record import Entry, Slot, leaves


class Miss(Exception):
    """A guard of the replay failed (a value Python read is not what the trace read): trace again."""


class Unreplayable(Exception):
    """The recorded program cannot be replayed (the reason, in the user's terms)."""


def _slots(x, out: list) -> list:
    """The slot numbers in template ``x`` (appended to ``out``)."""
    out += [s.k for s in leaves(x, _is_slot, [])]
    return out


def _is_slot(x) -> bool:
    return type(x) is Slot


class _Source:
    def __init__(self):
        self.lines: list[str] = []
        self.consts: dict = {}
        self._ids: dict = {}

    def const(self, obj) -> str:
        name = self._ids.get(id(obj))
        if name is None:
            name = self._ids[id(obj)] = f"c{len(self.consts)}"
            self.consts[name] = obj
        return name

    def expr(self, x) -> str:
        t = type(x)
        if t is Slot:
            return f"s{x.k}"
        if not _slots(x, []):
            return self.const(x)
        if t is list:
            return "[" + ", ".join(self.expr(v) for v in x) + "]"
        if t is tuple:
            return "(" + "".join(self.expr(v) + ", " for v in x) + ")"
        return "{" + ", ".join(f"{self.const(k)}: {self.expr(v)}" for k, v in x.items()) + "}"

    def target(self, out) -> str:
        if out is None:
            return "_"
        if type(out) is Slot:
            return f"s{out.k}"
        return "[" + "".join(self.target(v) + ", " for v in out) + "]"

    def call(self, e: Entry) -> str:
        f = self.const(e.target) + ("" if e.method is None else f".{e.method}")
        args = ", ".join([self.expr(a) for a in e.args] + [f"**{self.expr(e.kwargs)}"] if e.kwargs else
                         [self.expr(a) for a in e.args])
        return f"{f}({args})"


def ordered(entries: list[Entry], inputs: list[Slot], results: list[Slot]) -> list[Entry]:
    """The entries in replay order: host entries that need only the inputs and each other first (their guards
    before any device work); those that read a live value (a KV cache's slot order) stay where they were, after
    the live entry."""
    early = {s.k for s in inputs}
    host, rest = [], []
    for e in entries:
        if e.kind in ("host", "guard") and set(_slots((e.args, e.kwargs), [])) <= early:
            host.append(e)
            early.update(_slots(e.out, []) if e.kind == "host" else [])
        elif e.kind == "guard":
            raise Unreplayable("Python reads a value of host torch code that depends on a live value (a guard a "
                               "replay could only check after it changed state)")
        else:
            rest.append(e)
    return _live_host(host, rest, results) + rest


def build(entries: list[Entry], inputs: list[Slot], results: list[Slot], tap=None, fuse=None):
    """The replay function ``run(X) -> results``: ``X`` holds the values of ``inputs`` (bound by the caller).
    ``tap`` (compile/program.py): every placement's handle goes through ``tap.placed`` and every kwargs that
    carries a live value through ``tap.param``, so the records they reach can be found. ``fuse(order, results)``
    (compile/inductor.py) replaces runs of local calls by compiled segments."""
    order = ordered(entries, inputs, results)
    if fuse is not None:
        order = fuse(order, results)
    # each entry lowered to a bare call on grids where it can be: ("run", _grid_call) or ("write", write_call)
    lowering = [_lowering(e, tap) for e in order]
    last: dict = {}  # slot -> index of the entry that reads it last
    last_lowered: dict = {}  # slot -> index of the last lowered call reading it (its grid local dies there)
    for n, (e, low) in enumerate(zip(order, lowering)):
        for k in _slots((e.args, e.kwargs), []):
            last[k] = n
        if low is not None:
            for k in _slots(e.args if low[0] == "run" else e.args[3], []):  # (a write's target: never a grid local)
                last_lowered[k] = n
    keep = {s.k for s in results}
    src = _Source()
    src.consts.update(_Miss=Miss, _same=same, _commlog=commlog, _gridof=_gridof)
    body = ["def run(X):"]
    body += [f"    s{s.k} = X[{n}]" for n, s in enumerate(inputs)]
    body.append("    del X")
    dead_inputs = [s.k for s in inputs if s.k not in last and s.k not in keep]
    if dead_inputs:
        body.append("    del " + ", ".join(f"s{k}" for k in dead_inputs))
    grids = set()  # slots whose local holds a bare grid (the output of a lowered call), not a handle
    grid_of: dict = {}  # slot holding a handle -> the local holding its grid (``g<slot>``)

    def as_handles(ks):
        for k in dict.fromkeys(ks):
            if k in grids:
                body.append(f"    s{k} = _Sh(grid=s{k})")
                grids.discard(k)

    def grid_args(ex, slots, specs) -> str:
        for s, spec in zip(slots, specs):
            if s.k not in grids and s.k not in grid_of:  # a handle's grid, taken once
                grid_of[s.k] = f"g{s.k}"
                body.append(f"    g{s.k} = _gridof(s{s.k}, {src.const(ex)}, {src.const(spec)})")
        return ", ".join(f"s{s.k}" if s.k in grids else grid_of[s.k] for s in slots)

    for n, (e, low) in enumerate(zip(order, lowering)):
        if low is not None:
            if low[0] == "run":
                f, several, handle_of, ex = low[1]
                src.consts["_Sh"] = handle_of  # (one backend per trace)
                args = grid_args(ex, e.args[0], ex.in_specs)
                body.append(f"    {src.target(e.out) if several else f's{e.out[0].k}'} = {src.const(f)}({args})")
                grids.update(_slots(e.out, []))
                inputs_read = e.args[0]
            else:  # an in-place write (its kwargs may be live: a KV cache's slot): the runtime's write, bare
                f, writable, handle_of = low[1]
                kernel, target, target_spec, inputs_read, in_specs, kwargs, _ = e.args
                src.consts["_Sh"] = handle_of
                as_handles([target.k])
                # made writable before any grid of the step is taken: the copy-on-write counts references
                body.append(f"    s{e.out.k} = {src.const(writable)}(s{target.k}, {src.const(target_spec)})")
                ex = e.target.executable(kernel, (target_spec,) + tuple(in_specs), ())
                args = "".join(f"{a}, " for a in [f"s{e.out.k}.grid", grid_args(ex, inputs_read, in_specs)] if a)
                body.append(f"    {src.const(f)}({args}**{src.expr(kwargs)})")
            # a grid local held past its last lowered reader would make an in-place write of that storage copy
            # first (copy-on-write counts references), where eager wrote in place
            done = [grid_of.pop(s.k) for s in inputs_read if last_lowered.get(s.k) == n and s.k in grid_of]
            if done:
                body.append("    del " + ", ".join(dict.fromkeys(done)))
        else:
            as_handles(_slots((e.args, e.kwargs), []))
            if e.kind == "guard":
                body.append(f"    if not _same({src.call(e)}, {src.const(e.out)}): "
                            f"raise _Miss({src.const(_describe(e))})")
            elif e.kind == "log":
                body.append(f"    if _commlog.is_recording(): {src.call(e)}")
            elif tap is not None and tap.placement(e):
                body.append(f"    {src.target(e.out)} = {src.const(tap)}.placed({src.call(e)})")
            elif tap is not None and tap.kwargs_at(e) is not None:
                n = tap.kwargs_at(e)
                args = [src.expr(a) for a in e.args]
                args[n] = f"{src.const(tap)}.param({args[n]})"
                body.append(f"    {src.target(e.out)} = {src.const(e.target)}.{e.method}({', '.join(args)})")
            else:
                body.append(f"    {src.target(e.out)} = {src.call(e)}")
        dead = [k for k in _slots((e.args, e.kwargs), []) if last.get(k) == n and k not in keep]
        dead += [k for k in _slots(e.out, []) if e.kind != "guard" and k not in last and k not in keep]
        if dead:
            body.append("    del " + ", ".join([f"s{k}" for k in dict.fromkeys(dead)] +
                                               [grid_of.pop(k) for k in dict.fromkeys(dead) if k in grid_of]))
            grids.difference_update(dead)
    as_handles([s.k for s in results])
    body.append("    return (" + "".join(f"s{s.k}, " for s in results) + ")")
    source = "\n".join(body)
    namespace = dict(src.consts)
    exec(compile(source, "<dtorch.compile replay>", "exec"), namespace)
    run = namespace.pop("run")  # (its globals are the namespace: kept there too, the two would be a cycle)
    run.source = source
    return run


def _grid_call(e: Entry):
    """``(f, several outputs, handle of a grid, executable)`` when ``e`` is an executable's run the runtime can hand over as one bare
    call on grids (the in-process backend's bound kernels: ``grid_call``), else None."""
    if e.kind != "device" or e.method != "run" or not hasattr(e.target, "grid_call"):
        return None
    handles, kwargs, device_args = e.args
    if _slots(kwargs, []) or any(type(h) is not Slot for h in handles):
        return None
    got = e.target.grid_call(kwargs, device_args)
    return None if got is None else (got[0], got[1], got[2], e.target)


def write_call(e: Entry):
    """``(f, writable, handle of a grid)`` when ``e`` is an in-place write the runtime can make one call
    ``f(target grid, *input grids, **kwargs)`` (``write_grid_call``: no per-device arguments), after
    ``writable(target handle, spec)``; else None. Its kwargs may be a live value (a KV cache's slot)."""
    if e.kind != "device" or e.method != "write" or not hasattr(e.target, "write_grid_call"):
        return None
    kernel, target, target_spec, inputs, in_specs, kwargs, device_args = e.args
    if type(target) is not Slot or type(e.out) is not Slot or any(type(s) is not Slot for s in inputs) \
            or device_args:
        return None
    if type(kwargs) is not Slot and (type(kwargs) is not dict or _slots(kwargs, [])):
        return None  # (a live value inside a constant dict: not a form the library makes)
    return e.target.write_grid_call(kernel, target_spec, in_specs, device_args)


def _lowering(e: Entry, tap):
    """``("run", _grid_call(e))``, ``("write", write_call(e))`` or None (``tap``: a recording for worker
    programs, which must see a write's kwargs where they are: no write lowered)."""
    got = _grid_call(e)
    if got is not None:
        return "run", got
    got = write_call(e) if tap is None else None
    return None if got is None else ("write", got)


def _gridof(h, ex, spec):
    g = h.grid
    return g if g is not None else ex.runtime().as_grid(h, spec)


# host ops with an effect besides their output: a draw advances the generator even when its value goes unused
_DRAWS = {"normal_", "uniform_", "bernoulli_", "bernoulli", "random_", "exponential_", "geometric_", "cauchy_",
          "log_normal_", "rand", "randn", "randint", "randperm", "multinomial", "rand_like", "randn_like",
          "randint_like", "poisson", "dropout"}


def _live_host(host: list, rest: list, results: list) -> list:
    """The host entries a replay needs: those whose values reach the devices, a guard or a result, the guards,
    and the random draws (the rules' own scratch tensors of the first call are dropped)."""
    needed = {k for e in rest for k in _slots((e.args, e.kwargs), [])} | {s.k for s in results}
    keep = []
    for e in reversed(host):
        if e.kind == "guard" or getattr(e.target, "__name__", "") in _DRAWS or set(_slots(e.out, [])) & needed:
            keep.append(e)
            needed |= set(_slots((e.args, e.kwargs), []))
    return keep[::-1]


def _describe(e: Entry) -> str:
    name = getattr(e.target, "__name__", repr(e.target))
    return f"a value Python read from the step's torch inputs ({name}) changed"
