"""Every kernel goes through the one dispatch path or the kernel entry (issue 23).

A kernel run is a runtime call (``run_local``, ``executable(...).run``, ``write``) and the dtorch tensors made
of its handles (``Tensor._make``), recorded for autograd (``record_kernel``). Front-end code does these in
ops/dispatch.py (``dispatch``, ``local_map``) and autograd/kernel_entry.py (``run_blocks``, ``wrap``,
``write_local``) only; the source is grepped for them anywhere else. ``_make`` also wraps handles that no
kernel made (a factory's ``from_global``, an ``alias``, a redistribution): those modules are listed with the
reason, so a new one has to say why.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

import dtorch
from dtorch.autograd.kernel_entry import run_blocks, wrap, write_local
from dtorch.ops.dispatch import local_map
from dtorch.runtime.kernels import kernel

SRC = Path(__file__).resolve().parents[2] / "src" / "dtorch"

ENTRY = {"ops/dispatch.py", "autograd/kernel_entry.py"}
# the recording half of dispatch: KernelNode runs its VJP kernel and keeps laid-out copies of its inputs
RECORDING = {"autograd/dispatched.py"}
# the step capture (dtorch.compile): while it traces, the Graph's runtime is its recorder, which hands every call
# on to the real runtime; a replay runs the recorded calls again and wraps the outputs
CAPTURE = {"compile/record.py", "compile/trace.py"}
# modules whose ``_make`` wraps a handle that no kernel made
WRAPS_NON_KERNEL_HANDLES = {
    "tensor.py": "defines _make; Tensor(torch_tensor) lays a value out (from_blocks)",
    "ops/factory.py": "factories: runtime.from_global",
    "ops/rules.py": "to_dtensors: a torch operand laid out Replicate (from_global)",
    "ops/random.py": "random values drawn on the controller (from_global)",
    "ops/views.py": "views: an alias of the root's storage, a view's value as a plain tensor",
    "ops/view_writes.py": "a view's own handle seen as a plain tensor",
    "ops/inplace.py": "the target's handle before an in-place write (dispatch_inplace)",
    "nn/_layout.py": "parameters made by runtime.zeros",
    "redistribute/__init__.py": "relayout: the executor's collectives",
    "models/_checkpoint.py": "parameters read from files (runtime.from_files)",
    "autograd/engine.py": "zero gradients (from_global)",
    "autograd/fsdp.py": "a gathered parameter's handle as a plain tensor",
    "autograd/tensor_methods.py": "detach: an alias",
}
PATTERNS = {
    "run_local": (re.compile(r"\brun_local\("), CAPTURE),
    "record_kernel": (re.compile(r"\brecord_kernel\("), {"ops/dispatch.py"} | RECORDING),
    "Executable.run": (re.compile(r"\.executable\([^)]*\)\s*\.run\(|\bex\.run\(|\.vjp_tracked\(|\.run_tracked\("),
                       ENTRY | RECORDING | CAPTURE),
    "Runtime.write": (re.compile(r"\b(?:rt|runtime)\.write\("), ENTRY | {"ops/inplace.py"}),
    "Tensor._make": (re.compile(r"\._make\("), ENTRY | RECORDING | CAPTURE | set(WRAPS_NON_KERNEL_HANDLES)),
}


def _code_lines(path: Path):
    """(line number, line) of ``path`` outside comments and docstrings (a crude but sufficient cut: lines
    whose text before any '#' is code)."""
    in_doc = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""')
        if in_doc:
            in_doc = quotes % 2 == 0
            continue
        if stripped.startswith('"""'):
            in_doc = quotes == 1
            continue
        yield n, line.split("#", 1)[0]


def _uses(pattern) -> dict:
    found: dict = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("runtime/"):  # the runtime defines these and runs them on its own handles
            continue
        for n, code in _code_lines(path):
            if pattern.search(code):
                found.setdefault(rel, []).append(n)
    return found


def test_kernels_run_only_through_dispatch_or_the_kernel_entry():
    problems = []
    for what, (pattern, allowed) in PATTERNS.items():
        for rel, lines in _uses(pattern).items():
            if rel not in allowed:
                problems.append(f"src/dtorch/{rel}:{lines}: {what} outside the kernel entry; run kernels with "
                                "dtorch.ops.dispatch.local_map (or autograd.kernel_entry.run_blocks/wrap/write_local)")
    assert not problems, "\n".join(problems)


def test_the_grep_sees_what_it_looks_for():
    # the scan finds the entry's own calls (so an empty result above means something), and a listed module
    # that stopped wrapping handles is dropped from the list
    assert "ops/dispatch.py" in _uses(PATTERNS["record_kernel"][0])
    assert "autograd/kernel_entry.py" in _uses(PATTERNS["Runtime.write"][0])
    makes = _uses(PATTERNS["Tensor._make"][0])
    assert set(WRAPS_NON_KERNEL_HANDLES) <= set(makes), set(WRAPS_NON_KERNEL_HANDLES) - set(makes)


@kernel("test.kernel_entry.scale_and_shift")
def _scale_and_shift(x, y, *, scale):
    return x * scale + y, x - y


def test_local_map_runs_records_and_names_failures():
    mesh = dtorch.init_device_mesh("cpu", (2,))
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    x = dtorch.Tensor(a, device_mesh=mesh, placements=[dtorch.Shard(0)]).requires_grad_()
    y = dtorch.Tensor(b, device_mesh=mesh, placements=[dtorch.Shard(0)])
    out, diff = local_map("scale_and_shift", _scale_and_shift, [x, y], [x._spec, x._spec], {"scale": 3.0})
    torch.testing.assert_close(out.to_torch(), a * 3 + b)
    torch.testing.assert_close(diff.to_torch(), a - b)
    (out.sum() + diff.sum()).backward()  # recorded: the VJP is torch's autograd on the blocks
    torch.testing.assert_close(x.grad.to_torch(), torch.full_like(a, 4.0))
    with dtorch.no_grad():
        assert local_map("scale_and_shift", _scale_and_shift, [x, y], [x._spec, x._spec], {"scale": 1.0})[0]._ag is None
    try:
        local_map("scale_and_shift", _scale_and_shift, [x, y], [x._spec, x._spec], {})  # no scale
    except dtorch.OpError as exc:
        assert "dtorch.scale_and_shift failed on inputs #0:" in str(exc)
    else:
        raise AssertionError("a failing kernel must raise OpError")


@kernel("test.kernel_entry.add_into")
def _add_into(target, x):
    target.add_(x)


def test_run_blocks_wrap_and_write_local():
    mesh = dtorch.init_device_mesh("cpu", (2,))
    a = torch.arange(6.0).reshape(2, 3)
    x = dtorch.Tensor(a, device_mesh=mesh, placements=[dtorch.Shard(0)])
    h = run_blocks("scale_and_shift", _scale_and_shift, x._graph, [x._h, x._h], [x._spec, x._spec],
                   [x._spec, x._spec], {"scale": 2.0})
    torch.testing.assert_close(wrap(x._spec, h[0], x._graph).to_torch(), a * 3)
    t = dtorch.Tensor(torch.ones(2, 3), device_mesh=mesh, placements=[dtorch.Shard(0)])
    write_local("add_into", _add_into, t, [x])
    torch.testing.assert_close(t.to_torch(), a + 1)


def test_element_wise_kernels_find_their_torch_function_registered():
    # kernels carry the torch function's name ('torch.add': it travels to workers and keys plans); the
    # function itself is resolved when the op registers, never by attribute lookup in the kernel
    from dtorch.ops import pointwise

    named = set()
    for path in sorted(SRC.rglob("*.py")):
        named |= set(re.findall(r"""(?:pointwise|elementwise_)\(\s*"[^"]+",\s*"([^"]+)\"""", path.read_text()))
    named |= {fn for _, fn, *_ in pointwise._UNARY + pointwise._BINARY}
    assert named and named <= set(pointwise.TORCH_FNS), named - set(pointwise.TORCH_FNS)
    assert pointwise.TORCH_FNS["torch.add"] is torch.add
    kernel_source = Path(pointwise.__file__).read_text().split("def _bind_pointwise")[1].split("def _full_template")[0]
    assert "getattr(torch" not in kernel_source and "resolve" not in kernel_source
