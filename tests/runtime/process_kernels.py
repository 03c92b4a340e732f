"""Kernels only the process-backend tests use (workers import this module by name to find them)."""
from __future__ import annotations

import time

from dtorch.runtime.kernels import get_kernel, kernel  # noqa: F401


@kernel("test_sleep")
def sleep_then_copy(x, *, seconds: float):
    time.sleep(seconds)
    return x.clone()


@kernel("test_raise")
def always_raise(x, *, message: str):
    raise ValueError(message)


@kernel("test_add_rank")
def add_device_value(x, *, value, lead):
    return x + value


@kernel("test_add_const")
def add_const(x, *, const):
    return x + const[: x.shape[-1]]


def run(graph, name_kernel, t, device_args=None, **kwargs):
    """Run one of these kernels on ``t`` through the runtime (out spec = in spec) and wrap the result."""
    h = graph.runtime.run_local(name_kernel, [t._h], [t.spec], [t.spec], kwargs, device_args)[0]
    return type(t)._make(t.spec, h, graph)


@kernel("test_no_room_in_dev_shm")
def no_room_in_dev_shm(x):
    """From now on this worker's /dev/shm writes fail as on a full /dev/shm (a container's is often 64 MB)."""
    from dtorch.runtime import process_plan as pp

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    pp.shm_write = pp.shm_write_at = full
    return x.clone()


@kernel("test_num_threads")
def num_threads(x):
    """The worker's torch thread count, in every element (a forked worker must have set its own)."""
    import torch

    return torch.full_like(x, torch.get_num_threads())
