"""The layer rules of docs/internals.md, checked on the source: imports only point down the stack.

Every ``import`` in ``src/dtorch`` counts, including those inside functions: an import moved into a
function to dodge a cycle is still an arrow from one file to another. ``STACK`` below is the picture of
docs/internals.md, top first (``test_the_picture_is_the_stack`` holds the two together); every module of
src/dtorch belongs to one of its layers, may import its own layer and those below, and never one above.
Besides the stack: no import circle between files, and no file over 600 lines.
"""
from __future__ import annotations

import ast
import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "dtorch"
MAX_LINES = 600

# the bottom of the stack: pure metadata, and leaves importing nothing of dtorch (CommLog's recorder, the
# future of an asynchronous read, the bounded LRU of the plan caches)
BASE = ("dtorch.errors", "dtorch.placement", "dtorch.mesh", "dtorch.spec", "dtorch.context", "dtorch.distributed_spec",
        "dtorch.commlog", "dtorch.future", "dtorch._lru", "dtorch._collector",
        "dtorch.capture")

# docs/internals.md's picture, top first: (the label that starts its line in the picture, the modules of the layer)
STACK = (
    ("dtorch.cli", ("dtorch.cli",)),
    ("dtorch.rl, dtorch.plan", ("dtorch.rl", "dtorch.plan")),
    ("dtorch.models", ("dtorch.models",)),
    ("dtorch/__init__", ("dtorch",)),  # the package itself (the public API), not its modules: see _layer
    ("dtorch.nn, dtorch.optim", ("dtorch.nn", "dtorch.optim", "dtorch.pipeline", "dtorch.testing", "dtorch.visualize",
                                 "dtorch.compile", "dtorch.recovery")),
    ("ops/", ("dtorch.ops",)),
    ("autograd/", ("dtorch.autograd",)),
    ("tensor.py", ("dtorch.tensor",)),
    ("redistribute/", ("dtorch.redistribute",)),
    ("graph.py", ("dtorch.graph",)),
    ("runtime/", ("dtorch.runtime",)),
    ("context.py", BASE),
)
LABELS = [label for label, _ in STACK]

# what code above runtime/ may import from it: the interface, kernel registration, the backend registry
# and device configuration; everything else under runtime/ is a backend's own business
RUNTIME_SURFACE = {"dtorch.runtime", "dtorch.runtime.interface", "dtorch.runtime.kernels",
                   "dtorch.runtime.registry", "dtorch.runtime.devices"}
PROCESS_BACKEND = ("dtorch.runtime.process", "dtorch.runtime.process_plan", "dtorch.runtime.process_pool",
                   "dtorch.runtime.process_ops", "dtorch.runtime.transport", "dtorch.runtime.protocol",
                   "dtorch.runtime.worker", "dtorch.runtime.worker_loop", "dtorch.runtime.worker_comm",
                   "dtorch.runtime.ray_backend", "dtorch.runtime.ray_worker",
                   "dtorch.runtime.process_recovery", "dtorch.runtime.process_program")
OTHER_BACKENDS = ("dtorch.runtime.inprocess", "dtorch.runtime.reference") + PROCESS_BACKEND



def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _known_module(name: str) -> str | None:
    """The longest prefix of ``name`` that is a module or package of dtorch (``x.fn`` -> x)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        p = SRC.parent.joinpath(*parts[:n])
        if p.with_suffix(".py").exists() or (p / "__init__.py").exists():
            return ".".join(parts[:n])
    return None


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dtorch module) for every import anywhere in ``path`` (function bodies too): ``from .x import y``
    is the module x.y when y is one, else x (importing a submodule runs its package's ``__init__``, but that is
    Python's doing, not an arrow the file draws)."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                full = f"{target}.{a.name}"
                names.append((node.lineno, full if _known_module(full) == full else target))
    out = []
    for line, name in names:
        if name == "dtorch" or name.startswith("dtorch."):
            dst = _known_module(name)
            if dst is not None:
                out.append((line, dst))
    return out


def _under(name: str, prefixes) -> bool:
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _layer(name: str) -> int | None:
    """The index in STACK of ``name``'s layer (0: the top)."""
    for n, (_, prefixes) in enumerate(STACK):
        if any(name == p or (p != "dtorch" and name.startswith(p + ".")) for p in prefixes):
            return n
    return None


def _violation(src: str, dst: str) -> str | None:
    if dst == src:
        return None
    s, d = _layer(src), _layer(dst)
    if s is None or d is None:
        return f"{src if s is None else dst} is in no layer of STACK (add it to the picture and to STACK)"
    if d < s:
        return f"{LABELS[s]} sits below {LABELS[d]}: it must not import it"
    if _under(src, ("dtorch.redistribute.planner", "dtorch.redistribute.steps")) and \
            not _under(dst, BASE + ("dtorch.redistribute.steps",)):
        return "the redistribute planner and its typed steps are pure: specs in, steps out"
    if s < LABELS.index("runtime/") and _under(dst, "dtorch.runtime") and dst not in RUNTIME_SURFACE:
        return "code above runtime/ sees only the runtime interface (handles are opaque)"
    if _under(src, "dtorch.runtime.meta") and _under(dst, OTHER_BACKENDS):
        return "the meta backend imports no other backend (shared: runtime/blocks.py, grids.py, tapes.py, cow.py)"
    if _under(src, PROCESS_BACKEND) and _under(dst, ("dtorch.runtime.inprocess", "dtorch.runtime.reference")):
        return "the process backend imports no other backend (shared arithmetic: runtime/blocks.py)"
    if _under(src, ("dtorch.runtime.inprocess", "dtorch.runtime.reference")) and \
            _under(dst, OTHER_BACKENDS) and not _under(dst, src):
        return "backends don't import each other (shared: runtime/blocks.py, grids.py, tapes.py, cow.py)"
    return None


def _files():
    return sorted(SRC.rglob("*.py"))


def _all_arrows():
    for path in _files():
        src = _module_name(path)
        for line, dst in _imports(path):
            if dst != src:
                yield path, line, src, dst


def test_every_module_is_in_a_layer():
    lost = [_module_name(p) for p in _files() if _layer(_module_name(p)) is None]
    assert not lost, f"modules in no layer of STACK (place them in docs/internals.md's picture and STACK): {lost}"


def test_no_import_points_up_the_stack():
    problems = []
    for path, line, src, dst in _all_arrows():
        why = _violation(src, dst)
        if why:
            problems.append(f"{path.relative_to(SRC.parent)}:{line}: {src} -> {dst} ({why})")
    assert not problems, "imports that break the layers:\n" + "\n".join(sorted(set(problems)))


def _picture() -> list[str]:
    text = (ROOT / "docs" / "internals.md").read_text()
    section = text.split("## The layers", 1)[1]
    return section.split("```", 2)[1].splitlines()


def test_the_picture_is_the_stack():
    """Each layer of STACK starts a line of docs/internals.md's picture, in STACK's order."""
    starts = [line.strip() for line in _picture() if line.startswith("  ") and not line.startswith("   ")]
    at = []
    for label in LABELS:
        where = [n for n, line in enumerate(starts) if line.startswith(label)]
        assert where, f"the picture of docs/internals.md has no line starting with {label!r}"
        at.append(where[0])
    assert at == sorted(at), f"the picture orders the layers otherwise than STACK: {[starts[n] for n in sorted(at)]}"


# a module of each layer, top first: every arrow of the picture, both ways
_SAMPLE = ["dtorch.cli", "dtorch.rl.grpo", "dtorch.models.llama", "dtorch", "dtorch.nn.module", "dtorch.ops.pointwise",
           "dtorch.autograd.engine", "dtorch.tensor", "dtorch.redistribute.executor", "dtorch.graph",
           "dtorch.runtime.interface", "dtorch.spec"]


def test_samples_cover_the_stack():
    assert [_layer(m) for m in _SAMPLE] == list(range(len(STACK)))


@pytest.mark.parametrize("upper,lower", list(itertools.combinations(_SAMPLE, 2)))
def test_arrows_point_down_never_up(upper, lower):
    assert _violation(upper, lower) is None
    assert _violation(lower, upper) is not None


@pytest.mark.parametrize("src,dst,bad", [
    ("dtorch.mesh", "dtorch.graph", True),
    ("dtorch.graph", "dtorch.tensor", True),
    ("dtorch.tensor", "dtorch.ops.pointwise", True),
    ("dtorch.tensor", "dtorch.autograd.node", True),
    ("dtorch.tensor", "dtorch.redistribute", False),
    ("dtorch.autograd.dispatched", "dtorch.tensor", False),
    ("dtorch.autograd.engine", "dtorch.ops.dispatch", True),
    ("dtorch.redistribute", "dtorch.autograd.dispatched", True),
    ("dtorch.redistribute", "dtorch.autograd.mode", True),
    ("dtorch.redistribute", "dtorch.tensor", True),
    ("dtorch.redistribute.planner", "dtorch.redistribute.executor", True),
    ("dtorch.redistribute.planner", "dtorch.redistribute.steps", False),
    ("dtorch.redistribute.executor", "dtorch.commlog", False),
    ("dtorch.ops.copy_tensors", "dtorch.redistribute.executor", False),
    ("dtorch.ops.pointwise", "dtorch.runtime.inprocess", True),
    ("dtorch.ops.pointwise", "dtorch.runtime.kernels", False),
    ("dtorch.runtime.worker", "dtorch.runtime.inprocess", True),
    ("dtorch.runtime.worker", "dtorch.runtime.blocks", False),
    ("dtorch.runtime.ray_backend", "dtorch.runtime.process", False),
    ("dtorch.runtime.worker_comm", "dtorch.runtime.inprocess", True),
    ("dtorch.runtime.inprocess", "dtorch.tensor", True),
    ("dtorch.runtime.inprocess", "dtorch.runtime.reference", True),
    ("dtorch.runtime.inprocess", "dtorch.future", False),
    ("dtorch.runtime.meta", "dtorch.runtime.inprocess", True),
    ("dtorch.runtime.meta", "dtorch.runtime.grids", False),
    ("dtorch.nn.utils", "dtorch.rl.grpo", True),
    ("dtorch.nn.parameter", "dtorch.nn.module", False),
    ("dtorch.ops.loss", "dtorch.models.llama", True),
    ("dtorch.ops.views", "dtorch.nn.module", True),
    ("dtorch.rl.grpo", "dtorch.models.forward", False),
    ("dtorch.cli", "dtorch.rl.cli", False),
    ("dtorch.plan.cost", "dtorch.runtime.meta", True),
    ("dtorch.nn.module", "dtorch.plan.estimate", True),
    ("dtorch.plan.trace", "dtorch.models.llama", False),
    ("dtorch.models.llama", "dtorch.cli", True),
    ("dtorch.models.llama", "dtorch", False),
    ("dtorch.nn.module", "dtorch", True),
    ("dtorch", "dtorch.nn", False),
    ("dtorch", "dtorch.models", True),
    ("dtorch.testing", "dtorch.tensor", False),
    ("dtorch.pipeline", "dtorch.autograd.engine", False),
])
def test_the_rules_themselves(src, dst, bad):
    assert (_violation(src, dst) is not None) == bad


def test_function_level_imports_are_seen(tmp_path, monkeypatch):
    # an import hidden inside a function body (relative, two levels up) is an arrow like any other
    pkg = tmp_path / "dtorch" / "ops"
    pkg.mkdir(parents=True)
    (tmp_path / "dtorch" / "__init__.py").write_text("")
    (tmp_path / "dtorch" / "graph.py").write_text("")
    (pkg / "__init__.py").write_text("")
    f = pkg / "x.py"
    f.write_text("def f():\n    if True:\n        from ..graph import Graph\n    return Graph\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path / "dtorch")
    assert _imports(f) == [(3, "dtorch.graph")]


# -- no import circle between files ------------------------------------------------------------------------

def _file_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for _, _, src, dst in _all_arrows():
        graph.setdefault(src, set()).add(dst)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = itertools.count()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = next(counter)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = next(counter)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def _describe(graph, comp) -> str:
    arrows = [f"{a} -> {b}" for a in comp for b in sorted(graph.get(a, ())) if b in comp]
    return "circle: " + ", ".join(arrows)


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}, "f": {"g"}, "g": {"f"}}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["f", "g"]]
    assert _circles({"a": {"b"}, "b": {"c"}}) == []


def test_no_import_circle_between_files():
    graph = _file_graph()
    found = [_describe(graph, c) for c in _circles(graph)]
    assert not found, "import circles (lazy imports count):\n" + "\n".join(found)


# -- file length -----------------------------------------------------------------------------------------

def _long_files() -> dict[str, int]:
    out = {}
    for path in _files():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            out[path.relative_to(SRC).as_posix()] = n
    return out


def test_no_file_over_600_lines():
    long = _long_files()
    assert not long, f"files over {MAX_LINES} lines (split them by idea): {long}"

