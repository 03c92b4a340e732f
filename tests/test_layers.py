"""The layer rules of docs/internals.md, checked on the source: imports only point down the stack.

Every ``import`` in ``src/dtorch`` counts, including those inside functions: an import moved into a
function to dodge a cycle is still an arrow from one layer to another.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "dtorch"

# the bottom of the stack: pure metadata, importing only each other
BASE = {"dtorch.errors", "dtorch.placement", "dtorch.mesh", "dtorch.spec", "dtorch.context"}
# what code above runtime/ may import from it: the interface, kernel registration, the backend registry
# and device configuration; everything else under runtime/ is a backend's own business
RUNTIME_SURFACE = {"dtorch.runtime", "dtorch.runtime.interface", "dtorch.runtime.kernels",
                   "dtorch.runtime.registry", "dtorch.runtime.devices"}
ABOVE_RUNTIME = ("dtorch.graph", "dtorch.tensor", "dtorch.ops", "dtorch.nn", "dtorch.models", "dtorch.rl", "dtorch.plan",
                 "dtorch.autograd", "dtorch.optim", "dtorch.cli", "dtorch.visualize", "dtorch.redistribute")
# the top of the stack: built from models (dtorch.rl: RL post-training; dtorch.plan: the planner); nothing below
# models imports them
MODELS_LEVEL = ("dtorch.models", "dtorch.rl", "dtorch.plan")
PROCESS_BACKEND = ("dtorch.runtime.process", "dtorch.runtime.process_plan", "dtorch.runtime.process_pool",
                   "dtorch.runtime.process_ops", "dtorch.runtime.transport", "dtorch.runtime.protocol",
                   "dtorch.runtime.worker", "dtorch.runtime.worker_loop", "dtorch.runtime.worker_comm",
                   "dtorch.runtime.ray_backend", "dtorch.runtime.ray_worker")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import in ``path``: ``from .x import y`` counts as x and x.y."""
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node.lineno, target))
            out += [(node.lineno, f"{target}.{a.name}") for a in node.names]
    return [(line, m) for line, m in out if m == "dtorch" or m.startswith("dtorch.")]


def _under(name: str, prefixes) -> bool:
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _known_module(name: str) -> str | None:
    """The longest prefix of ``name`` that is a module or package of dtorch (``from x import fn`` -> x)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        p = SRC.parent.joinpath(*parts[:n])
        if p.with_suffix(".py").exists() or (p / "__init__.py").exists():
            return cand
    return None


def _violation(src: str, dst: str) -> str | None:
    if dst == src or _under(src, "dtorch.testing") or src == "dtorch":
        return None
    if src in BASE and dst not in BASE:
        return "placement/mesh/spec/errors import nothing above them"
    if _under(src, ("dtorch.redistribute.planner", "dtorch.redistribute.steps")) and \
            dst not in BASE | {"dtorch.redistribute.steps"}:
        return "the redistribute planner and its typed steps are pure: specs in, steps out"
    if _under(src, "dtorch.graph") and _under(dst, ("dtorch.tensor", "dtorch.ops", "dtorch.nn") + MODELS_LEVEL):
        return "graph does not import tensor or ops"
    if _under(src, "dtorch.tensor") and _under(dst, ("dtorch.ops", "dtorch.nn") + MODELS_LEVEL):
        return "tensor does not import ops"
    if _under(dst, MODELS_LEVEL) and not _under(src, MODELS_LEVEL + ("dtorch.cli",)):
        return "models and rl sit on top: only they and the command line import them"
    if _under(src, ABOVE_RUNTIME) and _under(dst, "dtorch.runtime") and dst not in RUNTIME_SURFACE:
        return "code above runtime/ sees only the runtime interface (handles are opaque)"
    if _under(src, "dtorch.runtime") and _under(dst, ABOVE_RUNTIME) and not _under(dst, "dtorch.redistribute.steps"):
        return "runtime/ does not import the layers above it"
    if _under(src, "dtorch.runtime.meta") and _under(dst, ("dtorch.runtime.inprocess", "dtorch.runtime.reference")
                                                     + PROCESS_BACKEND):
        return "the meta backend imports no other backend (shared: runtime/blocks.py, grids.py, tapes.py, cow.py)"
    if _under(src, PROCESS_BACKEND) and _under(dst, "dtorch.runtime.inprocess"):
        return "the process backend does not import the in-process backend (shared arithmetic: runtime/blocks.py)"
    return None


def _all_arrows():
    for path in sorted(SRC.rglob("*.py")):
        src = _module_name(path)
        for line, name in _imports(path):
            dst = _known_module(name)
            if dst is not None:
                yield path, line, src, dst


def test_no_import_points_up_the_stack():
    problems = []
    for path, line, src, dst in _all_arrows():
        why = _violation(src, dst)
        if why:
            problems.append(f"{path.relative_to(SRC.parent)}:{line}: {src} -> {dst} ({why})")
    assert not problems, "imports that point up the stack:\n" + "\n".join(sorted(set(problems)))


@pytest.mark.parametrize("src,dst,bad", [
    ("dtorch.mesh", "dtorch.graph", True),
    ("dtorch.graph", "dtorch.tensor", True),
    ("dtorch.tensor", "dtorch.ops.pointwise", True),
    ("dtorch.ops.pointwise", "dtorch.runtime.inprocess", True),
    ("dtorch.runtime.worker", "dtorch.runtime.inprocess", True),
    ("dtorch.runtime.inprocess", "dtorch.tensor", True),
    ("dtorch.ops.pointwise", "dtorch.runtime.kernels", False),
    ("dtorch.tensor", "dtorch.graph", False),
    ("dtorch.runtime.worker", "dtorch.runtime.blocks", False),
    ("dtorch.runtime.worker_comm", "dtorch.runtime.inprocess", True),
    ("dtorch.nn.utils", "dtorch.rl.grpo", True),
    ("dtorch.ops.loss", "dtorch.models.llama", True),
    ("dtorch.rl.grpo", "dtorch.models.forward", False),
    ("dtorch.cli", "dtorch.rl.cli", False),
    ("dtorch.runtime.meta", "dtorch.runtime.inprocess", True),
    ("dtorch.runtime.meta", "dtorch.runtime.grids", False),
    ("dtorch.plan.cost", "dtorch.runtime.meta", True),
    ("dtorch.nn.module", "dtorch.plan.estimate", True),
    ("dtorch.plan.trace", "dtorch.models.llama", False),
])
def test_the_rules_themselves(src, dst, bad):
    assert (_violation(src, dst) is not None) == bad


def test_function_level_imports_are_seen(tmp_path):
    # the parser must see an import hidden inside a function body
    code = "def f():\n    from .graph import Graph\n    return Graph\n"
    tree = ast.parse(code)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))
