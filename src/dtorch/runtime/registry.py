"""The backends dtorch knows: name -> "module:Class" of a ``Runtime`` subclass.

Adding a backend is one entry here (and the class, which implements ``runtime/interface.py``). The
module is imported only when a Graph asks for that backend, so a backend's dependencies (the process
backend's torch.distributed, a GPU library) cost nothing to users of another one.
"""
from __future__ import annotations

import importlib

from .interface import Runtime

BACKENDS: dict[str, str] = {
    # every device of a mesh in this process; even layouts stacked into one tensor (the default)
    "inprocess": "dtorch.runtime.inprocess:InProcessRuntime",
    # one worker process per device, torch.distributed between them
    "process": "dtorch.runtime.process:ProcessRuntime",
    # plain per-device blocks in a loop, every block checked against its spec: the seam's reference
    "reference": "dtorch.runtime.reference:ReferenceRuntime",
    # one Ray actor per device (a Ray cluster's nodes and GPUs), torch.distributed between them
    "ray": "dtorch.runtime.ray_backend:RayRuntime",
    # shapes and dtypes only, at any size: plans, CommLog and memory accounting of a real run (dtorch plan)
    "meta": "dtorch.runtime.meta:MetaRuntime",
}

# command-line entry points that belong to a backend: `dtorch NAME ARGS` -> "module:function", called with
# the remaining arguments, returning the exit code (the process backend's `dtorch worker`)
COMMANDS: dict[str, str] = {
    "worker": "dtorch.runtime.worker:main",
}


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def check_backend(name: str, hint: str = "") -> None:
    """Raise ValueError naming every registered backend when ``name`` is not one of them."""
    if name not in BACKENDS:
        raise ValueError(f"unknown dtorch backend {name!r}; choose one of {', '.join(map(repr, BACKENDS))}{hint}")


def runtime_class(name: str) -> type[Runtime]:
    check_backend(name)
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_runtime(name: str, **kwargs) -> Runtime:
    """A new runtime of backend ``name`` (its module is imported now, the first time)."""
    return runtime_class(name)(**kwargs)


def run_command(name: str, argv) -> int:
    """Run the backend command ``name`` (a key of COMMANDS) with the arguments ``argv``; its exit code."""
    module, _, fn = COMMANDS[name].partition(":")
    return getattr(importlib.import_module(module), fn)(argv)
