"""Every ```python block of README.md and docs/*.md runs as written, imports included, so the docs cannot rot.

Commands that cannot run here (several nodes, long runs) are written in other fences (```bash, ```)
or indented, and are not run.
"""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import dtorch

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def snippets():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 2  # the snippet's first line, 1-based
            yield pytest.param(path, line, m.group(1), id=f"{path.relative_to(ROOT)}:{line}")


def test_the_docs_have_snippets():
    names = {p.values[0].name for p in snippets()}
    assert {"README.md", "nn.md", "llama.md", "dtensor.md"} <= names


@pytest.mark.parametrize("path, line, code", list(snippets()))
def test_snippet_runs(path, line, code):
    # a fresh namespace: the snippet's own imports must be there; its prints stay out of the test output
    compiled = compile("\n" * (line - 1) + code, str(path), "exec")  # tracebacks name the doc's own lines
    with dtorch.Graph(), contextlib.redirect_stdout(io.StringIO()):  # a fresh default graph per snippet
        exec(compiled, {"__name__": "__doc_snippet__"})
