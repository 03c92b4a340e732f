"""Running local kernels over dtorch tensors without a plan: the unrecorded half of the kernel entry.

Every kernel a front-end module runs goes through one of two doors: ``dispatch`` (an op with a rule: plan,
lay out, run, record; ops/dispatch.py) or ``local_map`` (ops/dispatch.py: these kernels over these tensors
with these output specs, recorded for autograd), which code that knows its layouts calls (an attention
algorithm running several kernels in a row, the KV cache). Both end here or in a runtime ``Executable``:

    run_blocks(name, kernel, graph, handles, in_specs, out_specs, kwargs, device_args)
        handles in, handles out, nothing recorded: the steps of a loop that pass blocks between devices (a
        ring), inside an op whose own node records it, and the kernels of a backward (autograd nodes, which
        sit below ops/ and so cannot call ``local_map``)
    wrap(spec, handle, graph)
        the dtorch tensor of such a handle
    write_local(name, kernel, target, inputs, kwargs, device_args)
        an in-place kernel on ``target``'s own blocks (``Runtime.write``, copy-on-write)

Inputs are taken as they are laid out (``in_specs``): lay them out first (``relayout``: the executor records
the collectives in CommLog). tests/ops/test_kernel_entry.py fails on a runtime kernel call anywhere else, so a
step capture, a trace or a new backend has these two modules to look at.
"""
from __future__ import annotations

from ..errors import DTorchError, OpError
from ..runtime.kernels import Kernel
from ..spec import DTensorSpec
from ..tensor import Tensor

_make = Tensor._make


def describe(specs) -> str:
    """Input specs as errors name them: ``#0: <spec>; #1: <spec>``."""
    return "; ".join(f"#{n}: {s}" for n, s in enumerate(specs))


def run_blocks(name: str, kernel: Kernel, graph, handles, in_specs, out_specs, kwargs: dict | None = None,
               device_args: dict | None = None) -> list:
    """Run ``kernel`` on every device's blocks (``handles`` of ``graph``'s runtime, laid out as ``in_specs``)
    -> one handle per output spec. Nothing is recorded: the caller's own node covers the kernel (or no
    gradient is wanted). A failure names the op and its inputs."""
    try:
        return graph.runtime.executable(kernel, in_specs, out_specs).run(handles, kwargs or {}, device_args)
    except DTorchError:
        raise
    except Exception as exc:
        raise OpError(f"dtorch.{name} failed on inputs {describe(in_specs)}: {type(exc).__name__}: {exc}") from exc


def wrap(spec: DTensorSpec, handle, graph) -> Tensor:
    """The dtorch tensor of a handle ``run_blocks`` made (or a ring shift of one)."""
    return _make(spec, handle, graph)


def write_local(name: str, kernel: Kernel, target: Tensor, inputs, kwargs: dict | None = None,
                device_args: dict | None = None) -> None:
    """Run the in-place ``kernel(target_block, *input_blocks, **kwargs)`` on every device (``Runtime.write``:
    copy-on-write when ``target``'s storage is shared); ``target`` holds the result. Not recorded."""
    try:
        h = target._graph.runtime.write(kernel, target._h, target._spec, [x._h for x in inputs],
                                        [x._spec for x in inputs], kwargs or {}, device_args)
    except DTorchError:
        raise
    except Exception as exc:
        raise OpError(f"dtorch.{name} failed on inputs {describe([target._spec] + [x._spec for x in inputs])}: "
                      f"{type(exc).__name__}: {exc}") from exc
    target._written(h)

