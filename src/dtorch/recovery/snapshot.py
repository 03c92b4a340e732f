"""What a training step needs to restart: ``Snapshot``.

After every ``every``-th step the snapshot keeps the value of every parameter, buffer and optimizer-state tensor
(and copies the optimizer's host-side state: step counters, group options; the controller's RNG state), so a
lost device loses nothing the snapshot cannot give back, whatever held it. Where the values are kept: by the
workers, each writing its own blocks into a file in shared memory (``mirror.py``: the process backend on one
host), else fetched to the controller's host (``Fetch``). Restoring writes each value back into the *same*
tensor object (a new storage handle on the new workers: ``Tensor._written``, as an in-place copy would), so
tensors the user holds stay valid. Within ``run_step`` the copy overlaps the next step: it is asked for right
after the step (so the values are the step's), and the snapshot counts once it is complete (until then the
previous one stands, and a fault re-runs from it). Costs: docs/recovery.md, docs/benchmarks.md.
"""
from __future__ import annotations

import concurrent.futures
import copy
import time
import warnings

import torch

from ..errors import RuntimeBackendError
from ..placement import Partial
from ..tensor import Tensor
from .config import RecoveryError, RecoveryEvent, max_faults_per_step, mode
from .mirror import Mirror


def _owned_tensors(model, optimizer) -> list:
    """Every dtorch tensor a restart needs, each once: parameters, buffers, optimizer states."""
    seen: dict = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen.setdefault(id(t), t)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, Tensor):
                    seen.setdefault(id(v), v)
    return list(seen.values())


class Fetch:
    """Host copies of ``tensors`` that ``place`` lays out again with the same bits, asked for now (their values
    after the work issued so far) and collected meanwhile: each tensor's global value (all in one pass:
    ``Runtime.to_global_many_async``), or, for a Partial tensor (whose terms a global value would not give back
    bit for bit), every device's block (fetched at once). (``mirror.Mirrored`` has the same interface.)"""

    def __init__(self, tensors):
        self.tensors = list(tensors)
        self.partial = [any(isinstance(p, Partial) for p in t.placements) for t in self.tensors]
        self.blocks = {i: ("blocks", [b.clone() for b in t._graph.runtime.local_blocks(t._h, t._spec)])
                       for i, (t, p) in enumerate(zip(self.tensors, self.partial)) if p}
        whole = [t for t, p in zip(self.tensors, self.partial) if not p]
        self.future = (whole[0]._graph.runtime.to_global_many_async([t._h for t in whole], [t._spec for t in whole])
                       if whole else None)

    def succeeded(self) -> bool:
        """All collected, without a fault (does not wait)."""
        return self.future is None or (self.future.done() and self.future.exception() is None)

    def failure(self) -> str | None:
        return None  # (a fetch that fails is a lost device: ``fault``)

    def fault(self, timeout: float):
        """The lost-device report that ended the collection (waiting up to ``timeout`` for it), else None. The
        collecting thread may be the first to see a worker die: the step then finds only its tensors gone."""
        if self.future is None:
            return None
        try:
            exc = self.future.exception(timeout)
        except concurrent.futures.TimeoutError:
            return None
        return None if exc is None else _lost_device(exc)

    def values(self, only=None) -> list:
        """(tensor, host copy) of each tensor (``only``: of these); waits for them (the backend's waits have
        timeouts)."""
        got = iter(self.future.result() if self.future is not None else [])
        out = [(t, self.blocks[i] if p else ("global", next(got)))
               for i, (t, p) in enumerate(zip(self.tensors, self.partial))]
        if only is None:
            return out
        value = {id(t): v for t, v in out}
        return [(t, value[id(t)]) for t in only]

    def place_direct(self, tensors) -> list:
        return list(tensors)  # (host copies: every tensor takes its value through ``place``)

    def wait(self) -> None:
        self.values()

    def nbytes(self) -> int:
        return sum(nbytes(v) for _, v in self.values())


def place(t: Tensor, value) -> None:
    """Write the host copy ``value`` (``Fetch``) back into ``t`` itself: a new handle on the current workers."""
    how, data = value
    rt = t._graph.runtime
    t._written(rt.from_blocks(data, t._spec) if how == "blocks" else rt.from_global(data, t._spec))


def _lost_device(exc: BaseException):
    """The backend's report of a lost device (``lost_devices`` not empty) that ``exc`` is or was caused by
    (code between the backend and the step may wrap it), else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeBackendError) and getattr(exc, "lost_devices", ()):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def nbytes(value) -> int:
    how, data = value
    return sum(b.numel() * b.element_size() for b in (data if how == "blocks" else [data]))


class Snapshot:
    """The state of ``model`` and ``optimizer`` after the latest snapshot step, on the host (see the module
    docstring). ``dtorch.recovery.snapshot`` makes one; ``run_step`` runs a step under it."""

    def __init__(self, model, optimizer, every: int = 1):
        if not (isinstance(every, int) and every >= 1):
            raise ValueError(f"snapshot(every={every!r}): every is a number of steps >= 1 (1: after every step)")
        params = list(model.parameters())
        if not params:
            raise ValueError("snapshot(model, ...): the model has no parameters to keep")
        self.model, self.optimizer, self.every = model, optimizer, every
        self.graph = params[0]._graph
        self.steps = 0  # steps run to completion under this snapshot
        self.taken_at = 0  # ... at the latest snapshot
        self.nbytes = 0
        # the values of the latest snapshot (``global_values``): a ``Mirrored`` copy the workers keep where the
        # backend can (``mirror.py``), else a ``Fetch`` (host copies)
        self._kept = None
        self._mirror = Mirror(self.graph.runtime)
        self._mirroring = True  # False once a worker could not write its mirror file: fetched from then on
        self._host: tuple = ({}, [], None)  # optimizer state {param: {key: tensor or host value}}, groups, RNG
        self._pending = None  # (step, Fetch or Mirrored, host state) of a snapshot being collected
        # (step number, fn, args, kwargs, dtorch tensor arguments with host copies) of the steps since the snapshot
        self._log: list = []
        self.events: list = []  # RecoveryEvent of every recovery
        self.take()

    def take(self, step: int | None = None) -> None:
        """Keep the current state, as that after ``step`` (default: the steps run so far); waits for the queued
        work, so a fault still in flight surfaces here."""
        self._begin(self.steps if step is None else step)
        self._settle(wait=True)

    def _begin(self, step: int) -> None:
        """Ask for the values after the work issued so far; the host-side state is copied now."""
        self.graph.sync()  # every worker, also those holding only replicas the fetches do not read
        opt = self.optimizer
        state, groups = {}, []
        if opt is not None:
            state = {p: {k: v if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in s.items()}
                     for p, s in opt.state.items()}
            groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        tensors = _owned_tensors(self.model, opt)
        values = None
        if self._mirroring:
            try:
                values = self._mirror.begin(tensors, self._kept)
            except OSError as full:  # no room in /dev/shm, known before the workers write: this one is fetched
                self._mirror_failed(step, str(full), fetched=True)
        values = values or Fetch(tensors)
        self._pending = (step, values, (state, groups, torch.random.get_rng_state()))

    def _settle(self, wait: bool) -> None:
        """The pending snapshot becomes the snapshot once all its values are in (``wait``: wait for them; else
        only if they are); a fault while fetching it leaves the previous one whole."""
        if self._pending is None:
            return
        step, values, host = self._pending
        if not wait and not values.succeeded() and values.failure() is None:
            return
        self._pending = None
        values.wait()
        if values.failure() is not None:
            return self._mirror_failed(step, values.failure())
        self._kept, self._host, self.taken_at = values, host, step
        self.nbytes = values.nbytes()
        self._log = [entry for entry in self._log if entry[0] > step]
        if not self._mirroring:
            self._mirror.close()  # a fetched snapshot counts: the older mirror files go (room in /dev/shm)

    def _mirror_failed(self, step: int, why: str, fetched: bool = False) -> None:
        """The snapshot of ``step`` could not be kept in the workers' mirror files: it is fetched to the controller
        instead (``fetched``: the room was known to be short before the write), or else a worker's write failed
        and it does not count (the steps since the previous one stay logged, so a fault re-runs them from it,
        with the same bits). Either way the values are fetched from now on; said once."""
        self._mirroring = False
        what = ("it is fetched to the controller instead" if fetched else
                f"it does not count (a lost device now re-runs from the snapshot of step {self.taken_at})")
        warnings.warn(
            f"dtorch.recovery: the snapshot of step {step} could not be kept in shared memory ({why}); {what}, and "
            "from now on this snapshot fetches its values to the controller after each snapshot step instead of "
            "keeping them in the workers' mirror files (slower: docs/benchmarks.md). To keep the mirror, make room "
            "in /dev/shm: it needs about twice the model's and optimizer's bytes (`df -h /dev/shm`; in a "
            "container, a larger --shm-size).", RuntimeWarning, stacklevel=2)

    def wait(self) -> None:
        """Wait until the snapshot being collected (that of the latest step) counts; ``taken_at`` is then that
        step. A fault while collecting it raises here (the previous snapshot stands: ``restore`` puts it back)."""
        self._settle(wait=True)

    def tensors(self) -> list:
        """Every dtorch tensor ``restore`` (with a recovery's re-run) may write, each once: those of the snapshot,
        of one still being collected (it may count at the restore) and the dtorch arguments of the logged steps."""
        pending = self._pending[1].tensors if self._pending is not None else []
        held = [t for entry in self._log for t, _ in entry[4]]
        return list({id(t): t for t in self._kept.tensors + pending + held}.values())

    def global_values(self, only=None) -> list:
        """(tensor, host copy) of every tensor of the latest snapshot (``only``: of these; ``place`` writes one
        back): read from the workers' mirror files, or the values fetched. The one accessor of the kept values."""
        return self._kept.values(only)

    def close(self) -> None:
        """Remove the snapshot's mirror files now (else when it is garbage collected or the backend shuts down)."""
        self._mirror.close()

    def restore(self) -> int:
        """Put every kept value back into its tensor (on the backend's current workers) and the optimizer's
        host state back; gradients are dropped (the step that made them is re-run). Returns the tensors rebuilt."""
        if self._pending is not None:  # collected before the fault: the newer state; else it is dropped
            self._settle(wait=False)
            self._pending = None
        # the widest mesh first: the new workers start once, not once and then again to grow
        order = sorted(self._kept.tensors, key=lambda t: -max(t.device_mesh.device_ids))
        # straight from the workers' mirror files where the layout is unchanged (replace), else global values
        for t, value in self.global_values(self._kept.place_direct(order)):
            place(t, value)
        for p in self.model.parameters():
            p.grad = None
        state, groups, rng = self._host
        opt = self.optimizer
        if opt is not None:
            opt.state.clear()
            for p, s in state.items():
                opt.state[p] = {k: v if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in s.items()}
            for g, kept in zip(opt.param_groups, groups):
                g.update(copy.deepcopy(kept))
        torch.random.set_rng_state(rng)
        return len(order)

    # -- steps -----------------------------------------------------------------------------------------
    def run_step(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``: one training step (zero_grad, forward, backward, optimizer step); returns what
        ``fn`` returns. A device lost meanwhile (a worker that died or hung) is replaced, the snapshot written
        back and the steps since it re-run, this one last, with the same bits. Pass the batch as torch tensors
        (a dtorch tensor argument costs a fetch per step, so that a re-run on new workers still has it)."""
        given = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
        self._log.append((self.steps + 1, fn, args, kwargs, Fetch(given).values()))
        lost: list = []
        reasons: list = []
        replay = False
        try:
            while True:
                try:
                    if replay:  # the steps since the snapshot, then this one again
                        for _, f, a, k, _ in self._log[:-1]:
                            f(*a, **k)
                    out = fn(*args, **kwargs)
                    self._settle(wait=False)
                    if (self.steps + 1) % self.every == 0:
                        self._settle(wait=True)  # (two fetches at most at once)
                        self._begin(self.steps + 1)  # syncs first: the step's faults surface here, in the step
                        self._settle(wait=False)  # (a backend that fetched at once: counts now)
                    else:
                        self.graph.sync()
                    break
                except Exception as exc:  # noqa: BLE001  (re-raised unless it is a lost device)
                    fault = _lost_device(exc)
                    if fault is None and self._pending is not None and isinstance(exc, RuntimeBackendError):
                        fault = self._pending[1].fault(timeout=10.0)
                    devices = () if fault is None else fault.lost_devices
                    if not devices or mode() == "off" or isinstance(exc, RecoveryError):
                        raise  # an op that raised would raise again; "off": the fault is the caller's
                    t0 = time.perf_counter()
                    lost += devices
                    reasons.append(str(fault).splitlines()[0])
                    shrunk = self._recover(lost, reasons, exc, devices)
                    self.events.append(RecoveryEvent(self.steps + 1, devices, len(self._kept.tensors),
                                                     time.perf_counter() - t0, reasons[-1], shrunk or ""))
                    replay = True
        except BaseException:
            self._log.pop()  # a step that did not finish is not re-run by a later recovery
            raise
        self.steps += 1
        return out

    def _recover(self, lost: list, reasons: list, exc: BaseException, devices=()):
        """The backend stopped every worker when it raised: rebuild on new workers (the first placement starts
        them), unless this step lost more devices than ``max_faults_per_step`` allows. ``shrink`` mode first
        re-points the meshes onto the devices left (``devices``: this fault's); returns the new mesh then."""
        step = self.steps + 1
        ids = ", ".join(map(str, lost))
        if len(lost) > max_faults_per_step():
            raise RecoveryError(
                f"step {step}: {len(lost)} device losses in one step (device ids {ids}), more than "
                f"max_faults_per_step={max_faults_per_step()} (dtorch.recovery.configure); the step was not re-run "
                "again. The faults:\n  " + "\n  ".join(reasons) + f"\nsnap.restore() puts back the state after step "
                f"{self.taken_at} (the latest snapshot) once the devices work.") from exc
        shrunk = None
        if mode() == "shrink":
            from .shrink import shrink  # (raises a RecoveryError, changing nothing, where the mesh cannot shrink)

            try:
                shrunk = shrink(self, devices)
            except RecoveryError as why:
                raise RecoveryError(f"step {step}: device ids {ids} were lost ({reasons[-1]}): {why}") from exc
        try:
            self.restore()
            for _, _, _, _, held in self._log:
                for t, value in held:
                    place(t, value)
        except RuntimeBackendError as again:
            raise RecoveryError(f"step {step}: device ids {ids} were lost ({reasons[-1]}) and rebuilding their "
                                f"blocks on new workers failed: {again}") from again
        return shrunk
