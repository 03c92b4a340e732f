"""Which torch device a mesh device id runs on, in this process.

"cpu" ids are virtual: every id is the CPU. "cuda" ids are ``cuda:i``, or, under
``DTORCH_DTENSOR_IN_SAME_DEVICE=1``, all one device (the CPU when the machine has no GPU) simulating
``DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE`` GPUs (default 8).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..errors import DeviceUnavailableError, MeshError
from ..mesh import DeviceMesh

log = logging.getLogger("dtorch")

SAME_DEVICE_VAR = "DTORCH_DTENSOR_IN_SAME_DEVICE"
NUM_GPU_VAR = "DTORCH_NUM_GPU_WHEN_ENABLE_DTENSOR_IN_SAME_DEVICE"


@dataclass(frozen=True)
class DeviceConfig:
    same_device: bool
    num_simulated_gpus: int


def _parse_bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("", "0", "false", "no", "off"):
        return False
    raise MeshError(f"{name}={raw!r} is not understood; set it to 1/true or 0/false")


def read_device_config() -> DeviceConfig:
    same = _parse_bool(SAME_DEVICE_VAR, os.environ.get(SAME_DEVICE_VAR, "0"))
    raw = os.environ.get(NUM_GPU_VAR, "8")
    try:
        n = int(raw)
    except ValueError:
        raise MeshError(f"{NUM_GPU_VAR}={raw!r} is not an integer; set it to the number of GPUs to simulate, e.g. 8") from None
    if n < 1:
        raise MeshError(f"{NUM_GPU_VAR}={n} must be at least 1")
    return DeviceConfig(same, n)


_warned_cpu_fallback = False


def simulation_device() -> torch.device:
    global _warned_cpu_fallback
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if not _warned_cpu_fallback:
        log.warning("dtorch: %s=1 but this machine has no GPU; the simulated GPUs run on the CPU", SAME_DEVICE_VAR)
        _warned_cpu_fallback = True
    return torch.device("cpu")


def mesh_problems(mesh: DeviceMesh, config: DeviceConfig) -> str | None:
    """Why this machine cannot run ``mesh`` (None when it can)."""
    if mesh.device_type == "cpu":
        return None
    top = max(mesh.device_ids)
    if config.same_device:
        if top >= config.num_simulated_gpus:
            return (f"mesh {mesh} uses cuda device id {top} but {NUM_GPU_VAR}={config.num_simulated_gpus} "
                    f"simulated GPUs exist; raise {NUM_GPU_VAR} to at least {top + 1} or use a smaller mesh")
        return None
    have = torch.cuda.device_count()
    if top >= have:
        return (f"mesh {mesh} uses cuda device id {top} but this machine has {have} GPU(s); use a smaller mesh, "
                f"a 'cpu' mesh, or set {SAME_DEVICE_VAR}=1 to simulate GPUs on one device")
    return None


@lru_cache(maxsize=4096)
def torch_devices(mesh: DeviceMesh, config: DeviceConfig) -> tuple[torch.device, ...]:
    """The torch device of every mesh device, in mesh order; raises if the machine lacks them."""
    problem = mesh_problems(mesh, config)
    if problem:
        raise DeviceUnavailableError(problem)
    if mesh.device_type == "cpu":
        return (torch.device("cpu"),) * mesh.size()
    if config.same_device:
        return (simulation_device(),) * mesh.size()
    return tuple(torch.device("cuda", i) for i in mesh.device_ids)
