"""Hardware profiles as data: a GPU's published rates, its node's topology and the efficiency factors the cost
model applies (``hardware/*.json``, each naming its sources), or a user's own profile file (JSON or TOML of
the same fields; ``dtorch plan --calibrate`` writes one for this machine)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent / "hardware"
ALIASES = {"h100": "h100-sxm-80gb", "h100-sxm": "h100-sxm-80gb", "h100-80gb": "h100-sxm-80gb",
           "h100-96gb": "h100-sxm-96gb", "gh200": "h100-sxm-96gb", "h100-nvl": "h100-nvl-94gb",
           "h200-sxm": "h200", "a100": "a100-80gb", "a100-sxm-80gb": "a100-80gb"}


class HardwareError(ValueError):
    """A hardware name that is not shipped, or a profile file that cannot be read."""


@dataclass(frozen=True)
class Link:
    name: str
    gbps: float  # GB/s per GPU, one direction
    latency_us: float


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float
    usable_memory_gib: float
    peak_tflops: dict  # dtype name -> dense TFLOPS
    hbm_gbps: float
    gpus_per_node: int
    intra: Link  # within a node
    inter: Link  # across nodes (per GPU)
    # matmul, attention, memory, collective (fractions of peak), kernel_overhead_us (per kernel, on the device),
    # overlap (the fraction of compute that fsdp/dp/ring collectives can hide behind: 1 where they run on their
    # own streams), controller_op_us (the single controller's cost to issue one kernel or collective: a floor
    # on the step of count x cost; 0: not modelled), vjp_recompute (1: the backend keeps no local autograd graphs and recomputes
    # each forward in its backward, as the process backend's workers do), vjp_overhead_us (per such recomputing
    # VJP: its graph built again and autograd's call), eager_kernels (0: kernels fused, a roofline on their blocks,
    # ring attention blocks as flash attention, as the published GPU runs; 1: each kernel's torch ops one by one,
    # as the process backend's workers run them)
    efficiency: dict
    memory_overhead_gib: float  # CUDA context, NCCL and cuBLAS buffers, allocator slack: beyond the tensors
    sources: tuple = field(default_factory=tuple)
    key: str = ""
    collectives: dict = field(default_factory=dict)  # kind -> Link, where a kind moves its own way (calibrated)

    def peak(self, dtype_name: str) -> float:
        """Dense FLOP/s for matmuls in ``dtype_name`` (float32 matmuls run as float32 unless a profile says tf32)."""
        table = self.peak_tflops
        return 1e12 * table.get(dtype_name, table.get("bfloat16"))

    def to_dict(self) -> dict:
        return {"name": self.name, "memory_gib": self.memory_gib, "usable_memory_gib": self.usable_memory_gib,
                "peak_tflops": dict(self.peak_tflops), "hbm_gbps": self.hbm_gbps, "gpus_per_node": self.gpus_per_node,
                "links": {"intra": vars(self.intra), "inter": vars(self.inter)}, "efficiency": dict(self.efficiency),
                "memory_overhead_gib": self.memory_overhead_gib, "sources": list(self.sources),
                **({"collectives": {k: vars(v) for k, v in self.collectives.items()}} if self.collectives else {})}


def shipped() -> list[str]:
    return sorted(p.stem for p in HERE.glob("*.json"))


def from_dict(raw: dict, key: str = "") -> Hardware:
    try:
        links = raw["links"]
        return Hardware(name=raw["name"], memory_gib=float(raw["memory_gib"]),
                        usable_memory_gib=float(raw.get("usable_memory_gib", raw["memory_gib"])),
                        peak_tflops={k: float(v) for k, v in raw["peak_tflops"].items()},
                        hbm_gbps=float(raw["hbm_gbps"]), gpus_per_node=int(raw.get("gpus_per_node", 8)),
                        intra=Link(**links["intra"]), inter=Link(**links["inter"]),
                        efficiency={"matmul": 0.7, "attention": 0.4, "memory": 0.75, "collective": 0.8,
                                    "kernel_overhead_us": 4.0, "overlap": 1.0, "controller_op_us": 0.0,
                                    "vjp_overhead_us": 0.0, "vjp_recompute": 0,
                                    "eager_kernels": 0,
                                    **raw.get("efficiency", {})},
                        memory_overhead_gib=float(raw.get("memory_overhead_gib", 2.5)),
                        sources=tuple(raw.get("sources", ())), key=key,
                        collectives={k: Link(**v) for k, v in raw.get("collectives", {}).items()})
    except (KeyError, TypeError, ValueError) as exc:
        raise HardwareError(f"hardware profile {key or raw.get('name', '?')}: {type(exc).__name__}: {exc}; a profile needs "
                            "name, memory_gib, peak_tflops {dtype: TFLOPS}, hbm_gbps and links {intra, inter: "
                            "{name, gbps, latency_us}} (see dtorch/plan/hardware/h100-sxm-80gb.json)") from exc


def load(name_or_file) -> Hardware:
    """A shipped profile by name (``h100-sxm-80gb``, ``h200``, ...; case and a few aliases forgiven) or a profile
    file (.json or .toml)."""
    if isinstance(name_or_file, Hardware):
        return name_or_file
    text = str(name_or_file)
    path = Path(text)
    if path.suffix in (".json", ".toml") or path.is_file():
        if not path.is_file():
            raise HardwareError(f"--hardware {text}: no such file")
        try:
            if path.suffix == ".toml":
                import tomllib

                raw = tomllib.loads(path.read_text())
            else:
                raw = json.loads(path.read_text())
        except Exception as exc:  # noqa: BLE001
            raise HardwareError(f"--hardware {text}: cannot read it: {exc}") from exc
        return from_dict(raw, str(path))
    key = text.lower().replace("_", "-")
    key = ALIASES.get(key, key)
    file = HERE / f"{key}.json"
    if not file.is_file():
        raise HardwareError(f"unknown hardware {text!r}; choose one of {', '.join(shipped())} or pass a profile file "
                            "(.json/.toml, e.g. written by dtorch plan --calibrate)")
    return from_dict(json.loads(file.read_text()), key)
