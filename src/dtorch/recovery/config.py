"""Recovery's settings, its error and its event record (``dtorch.recovery.configure``)."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import RuntimeBackendError

MODES = ("replace", "shrink", "off")
_config = {"mode": None, "max_faults_per_step": 1}  # mode None: "replace" (run_step needs a snapshot anyway)


class RecoveryError(RuntimeBackendError):
    """A fault recovery could not undo; the message says what was lost and why nothing was re-run."""


@dataclass(frozen=True)
class RecoveryEvent:
    """One recovery: the step it interrupted, the devices lost, the tensors rebuilt, the seconds from the
    fault's report to the re-run's start (new workers and the snapshot's placement included)."""
    step: int
    devices: tuple
    rebuilt: int
    seconds: float
    reason: str
    mesh: str = ""  # shrink: the mesh after it ("cpu[dp=3]"); replace: ""

    def __str__(self) -> str:
        ids = ", ".join(map(str, self.devices))
        what = f"lost, mesh shrunk to {self.mesh}" if self.mesh else "lost and replaced"
        return (f"recovered step {self.step}: device{'s' if len(self.devices) > 1 else ''} {ids} {what}, "
                f"{self.rebuilt} tensors rebuilt from the snapshot, {self.seconds:.1f} s lost")


def configure(mode: str = "replace", *, max_faults_per_step: int = 1) -> None:
    """How ``run_step`` answers a lost device: ``"replace"`` (new workers, same mesh), ``"shrink"`` (go on without
    it: the mesh's "dp" dim loses the lost device's slice, docs/recovery.md) or ``"off"`` (raise, as without
    recovery). ``max_faults_per_step``: device losses one step may see before it gives up with a
    ``RecoveryError`` (a fault that keeps coming back is not retried forever)."""
    if mode not in MODES:
        raise ValueError(f"dtorch.recovery.configure(mode={mode!r}): choose one of {', '.join(map(repr, MODES))}")
    if not (isinstance(max_faults_per_step, int) and max_faults_per_step >= 1):
        raise ValueError(f"max_faults_per_step={max_faults_per_step!r} must be an integer >= 1")
    _config.update(mode=mode, max_faults_per_step=max_faults_per_step)


def mode() -> str:
    """The mode in force: the configured one, else "replace"."""
    return _config["mode"] or "replace"


def max_faults_per_step() -> int:
    return _config["max_faults_per_step"]
