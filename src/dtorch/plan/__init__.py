"""Planning at scale without the hardware (issue 26): ``estimate`` one training layout, ``search`` the layouts of
a device count. A step runs on the meta backend (shapes only: the placements, collectives and memory accounting
of a real run), then a cost model (a roofline per kernel, alpha-beta per collective, pipeline bubbles, overlap)
turns the trace into time on a hardware profile. ``dtorch plan`` is the command; docs/plan.md the method."""
from .estimate import Estimate, PlanError, estimate, load_config, model_flops_per_token
from .hardware import Hardware, HardwareError, load as load_hardware, shipped as shipped_hardware
from .trace import Layout, trace_step

__all__ = ["estimate", "Estimate", "PlanError", "load_config", "model_flops_per_token", "Hardware", "HardwareError",
           "load_hardware", "shipped_hardware", "Layout", "trace_step"]
