"""The process backend's workers: start them, grow them, watch them, stop them.

The pool has a TCPStore (loopback and a free port unless told otherwise), hosted by a process the zygote forks
(``zygote.Zygote.serve_store``: serving the workers does not take the controller's CPU), else (no zygote: workers
that join from elsewhere, or DTORCH_PROCESS_ZYGOTE=0) by a thread of the controller. It publishes the
process-group configuration under ``cfg``; workers join ``init_process_group`` with it and announce
``ready/<gen>/<rank>``. Growing the pool publishes a new generation: running workers re-join (their
blocks stay), new ones are started. Faults reach the controller three ways: a worker's exception
(``err/<rank>``), a launcher reporting a dead worker (``dead/<rank>``), both counted in ``nfault``;
and, for workers this controller started, their exit status. Every worker ticks ``hb/<rank>`` from a
watchdog thread twice a second, so a worker that stops answering (a stopped process, a vanished node)
is noticed after ``DTORCH_PROCESS_HEARTBEAT_TIMEOUT`` seconds.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import torch.distributed as dist

from ..errors import RuntimeBackendError
from . import process_plan as pp
from . import protocol as rec
from .worker import worker_command, worker_env

# A worker whose heartbeat (ticked every 0.5 s by its watchdog thread) has not moved for this long is
# declared unresponsive: stopped (SIGSTOP), frozen, or its node is gone. The tick runs beside the
# worker's work, so long kernels and collectives do not look silent. Override with this variable.
HEARTBEAT_TIMEOUT_VAR = "DTORCH_PROCESS_HEARTBEAT_TIMEOUT"
HEARTBEAT_TIMEOUT_S = 15.0
HEARTBEAT_MIN_S = 1.0  # two missed ticks: anything shorter would flag healthy workers
CHECK_MAX_S = 0.25  # the longest pause between a long wait's health checks (a fault is reported within it)
# a blocking wait's first health check comes this long after it starts, the next ones ever further apart up to
# CHECK_MAX_S. Most waits end before it (a sync of a few steps): each wake-up is a cold run of this thread on a core
# the workers compute on (a check and a wake-up took ~0.35 ms of the controller's CPU each with 4 workers busy)
FIRST_CHECK_S = 0.1
BATCH_LIMIT = 6 << 20  # larger record batches go to the store by key (the store caps values at 8 MiB)


def heartbeat_timeout(value: float | None = None) -> float:
    """The heartbeat timeout: ``value``, else DTORCH_PROCESS_HEARTBEAT_TIMEOUT, else 15 s."""
    raw = value if value is not None else os.environ.get(HEARTBEAT_TIMEOUT_VAR) or HEARTBEAT_TIMEOUT_S
    try:
        out = float(raw)
    except ValueError:
        out = float("nan")
    if not out >= HEARTBEAT_MIN_S:
        raise ValueError(f"{HEARTBEAT_TIMEOUT_VAR}={raw!r} must be a number of seconds >= {HEARTBEAT_MIN_S} "
                         f"(default {HEARTBEAT_TIMEOUT_S:.0f}): workers tick their heartbeat every 0.5 s")
    return out


class Heartbeats:
    """Which workers' heartbeat counters stood still for ``timeout`` seconds. ``silent(now, read)`` reads
    the counters (``read(rank)``) at most every quarter timeout (every second at most)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._seen: dict = {}  # rank -> (counter, when it last moved)
        self._next = 0.0

    def silent(self, now: float, ranks, read) -> list:
        if now < self._next:
            return []
        self._next = now + min(1.0, self.timeout / 4)
        out = []
        for r in ranks:
            beat = read(r)
            if beat == 0:  # not started yet: starting and joining have their own timeouts
                continue
            last = self._seen.get(r)
            if last is None or last[0] != beat:
                self._seen[r] = (beat, now)
            elif now - last[1] > self.timeout:
                out.append(r)
        return out

    def message(self, who: str) -> str:
        return (f"{who} stopped answering: no heartbeat for {self.timeout:g} s (the process is stopped or frozen, "
                f"or its node is gone; {HEARTBEAT_TIMEOUT_VAR} sets this limit)")


class WorkerError(RuntimeBackendError):
    """A worker died, raised, or stopped answering; the backend's workers were stopped. ``lost_devices``: the
    device ids whose worker died or hung (empty when workers only raised: re-running would fail the same way),
    which ``dtorch.recovery`` replaces."""

    lost_devices: tuple = ()


def sleeper(fut: concurrent.futures.Future):
    """``sleep(s)``: until ``fut`` is done or ``s`` seconds passed (``Pool.wait``'s ``block``). A lock the future's
    callback releases: one C call per wake-up, where ``concurrent.futures.wait`` ran ~100 lines of Python, ~0.15 ms
    of the controller's CPU each while the workers kept the cores busy."""
    lock = threading.Lock()
    lock.acquire()
    fut.add_done_callback(lambda _: lock.release())  # (run at once when already done)
    return lambda s: lock.acquire(timeout=max(s, 0.0))


class Pool:
    def __init__(self, listen: str, spawn: bool, timeout: float, start_timeout: float,
                 heartbeat: float = HEARTBEAT_TIMEOUT_S, zygote=None):
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"DTORCH_PROCESS_LISTEN={listen!r} must be HOST:PORT, e.g. 127.0.0.1:0 (0: a free port)")
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.beats = Heartbeats(heartbeat)
        self.spawn = spawn
        self.zygote = zygote  # forks the workers this pool starts (``zygote.Zygote``); None: each is spawned
        connect_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        wait = datetime.timedelta(seconds=timeout)
        self.server = None  # the store's own process (a zygote.ForkedWorker), when the zygote hosts it
        if zygote is not None:
            self.server, port = zygote.serve_store(host, int(port), timeout)
            try:
                self.store = dist.TCPStore(connect_host, port, is_master=False, timeout=wait)
            except BaseException:
                self._stop_server()
                raise
        else:
            self.store = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False, timeout=wait)
        self.address = f"{connect_host}:{self.store.port}"
        self.listen = f"{host}:{self.store.port}"
        self.procs: dict = {}  # rank -> subprocess.Popen, or zygote.ForkedWorker (the same calls)
        self.world = 0
        self.gen = -1
        self.logdir = tempfile.mkdtemp(prefix="dtorch-workers-") if spawn else None
        # same-host blocks travel as files here (removed in ``stop``, faults included)
        self.shm = pp.shm_dir()
        self._logs: dict = {}
        self._info: dict = {}  # rank -> what the worker said about itself (pid, host, device)
        self._next_check = 0.0
        self.describe = lambda seq, kind: f"{kind} #{seq}"
        self.last_op = lambda: None
        self._owner = threading.get_ident()
        self._tls = threading.local()
        self._batches = 0
        self._waiter: concurrent.futures.ThreadPoolExecutor | None = None  # blocks on store keys (wait_key)
        self.stopping = False  # ``stop`` runs: the workers it kills are not lost devices

    @property
    def client(self) -> dist.TCPStore:
        """This thread's store connection (connections are not shared between threads)."""
        if threading.get_ident() == self._owner:
            return self.store
        c = getattr(self._tls, "store", None)
        if c is None:
            c = self._tls.store = self.store.clone()
        return c

    # -- membership ----------------------------------------------------------------------------
    def resize(self, world: int, backend: str, cuda: bool, reform) -> None:
        """Make ``world`` workers run process-group generation gen+1 (``reform()`` tells the running ones)."""
        gen = self.gen + 1
        self.store.set("cfg", pickle.dumps({"gen": gen, "world": world, "backend": backend, "cuda": cuda,
                                            "timeout": self.timeout, "shm": self.shm}))
        if self.world:
            reform()
        if self.spawn:
            threads = max(1, (os.cpu_count() or 1) // world)
            env = worker_env(threads)
            for r in range(self.world, world):
                log = self._logs[r] = open(os.path.join(self.logdir, f"worker-{r}.log"), "ab")
                if self.zygote is not None:
                    self.procs[r] = self.zygote.spawn(r, r, self.address, self.start_timeout, threads, env, log.name)
                    continue
                self.procs[r] = subprocess.Popen(worker_command(self.address, r, r, os.getpid(), self.start_timeout),
                                                 env=env, stdout=log, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL,
                                                 start_new_session=True)  # Ctrl-C goes to the controller only
            wait_s = self.start_timeout
        else:
            if self.world == 0:
                print(f"dtorch: waiting for {world} workers to join at {self.listen}; on each node run "
                      f"`dtorch worker --controller {self.listen} --ranks FIRST-LAST`", file=sys.stderr, flush=True)
            wait_s = self.timeout
        self.world = world
        keys = [f"ready/{gen}/{r}" for r in range(world)]
        self.wait(lambda: self.store.check(keys), f"{world} workers to join (generation {gen})", wait_s)
        self.gen = gen

    def push(self, rank: int, blob: bytes) -> int:
        """Queue a batch of records for worker ``rank``; the bytes pushed. A batch larger than one queue
        message (the store caps values at 8 MiB) goes to the store by key and the queue gets its name."""
        if len(blob) > BATCH_LIMIT:
            self._batches += 1
            name = f"b/{self._batches}"
            pp.store_put(self.client, name, blob)
            blob = pickle.dumps([rec.Batch(name, len(blob))])
        try:
            self.client.queue_push(f"q/{rank}", blob)
        except dist.DistError:
            self.check(force=True)  # the store server died: that is the news (WorkerError)
            raise
        return len(blob)

    # -- waiting and health ------------------------------------------------------------------------
    def wait(self, done, what: str, timeout: float | None = None, block=None) -> None:
        """Poll ``done()`` until true; check the workers' health meanwhile; never longer than ``timeout``.
        ``block(s)``, when given, sleeps until ``done()`` may have turned true or ``s`` seconds passed (an
        event's wait): then this thread wakes only for the health checks, the first FIRST_CHECK_S after the
        start, then ever less often, every CHECK_MAX_S once the wait is long (each check is store round trips:
        a sync of a few steps woke ~20 times when it polled, 5 times with checks every 50 ms at first)."""
        timeout = self.timeout if timeout is None else timeout
        start = time.perf_counter()
        delay = 0.0
        if block is not None:
            self._next_check = max(self._next_check, start + FIRST_CHECK_S)
        while not done():
            now = time.perf_counter()
            self.check(now, every=0.05 if block is None else min(CHECK_MAX_S, FIRST_CHECK_S + (now - start) / 2))
            if now - start > timeout:
                raise WorkerError(f"dtorch process backend: timed out after {timeout:.0f} s waiting for {what}. "
                                  "Raise DTORCH_PROCESS_TIMEOUT if the work is just long.")
            if block is not None:
                block(min(self._next_check, start + timeout) - now + 1e-4)
                continue
            time.sleep(delay)
            # answers usually come within a few ms; a long wait polls less often (the cores are the workers')
            delay = min(0.002 if now - start < 0.2 else 0.01, delay * 2 + 2e-5)

    def wait_key(self, key: str, what: str, timeout: float | None = None) -> None:
        """Until some worker sets ``key``. A thread of the pool blocks on the store for it while this one
        sleeps, waking only for the health checks: polling the store instead woke the controller about 40
        times in an 80 ms forward, each time taking a core the workers were computing on."""
        timeout = self.timeout if timeout is None else timeout
        if self._waiter is None:
            # (several: fetches may wait in threads of their own, to_torch_async; each thread keeps its store
            # connection, ``client``, for the next wait)
            self._waiter = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="dtorch-store-wait")
        # (the thread's wait outlasts ours, which raises first)
        got = self._waiter.submit(lambda: self.client.wait([key], datetime.timedelta(seconds=timeout + 5)))
        try:
            self.wait(got.done, what, timeout, sleeper(got))
            got.result()
        except dist.DistError:
            self.check(force=True)  # the store server died: that is the news (WorkerError)
            raise
        except BaseException:
            # the key will not come (a worker died, a timeout): set it, so that the thread stops waiting now. An
            # executor's threads are joined at interpreter exit: one left blocked held the controller's exit
            # until the store's timeout
            try:
                self.client.set(key, b"")
            except Exception:  # noqa: BLE001 (the store is gone too: the thread's wait fails with it)
                pass
            raise

    def check(self, now: float | None = None, force: bool = False, every: float = 0.05) -> None:
        """Raise WorkerError if a worker died, raised, or stopped answering (its heartbeat stood still); at most
        once per ``every`` seconds unless ``force``."""
        now = time.perf_counter() if now is None else now
        if not force and now < self._next_check:
            return
        self._next_check = now + every
        try:
            if self.server is not None and self.server.poll() is not None:
                raise dist.DistError("exited")
            faults = int(self.client.add("nfault", 0))
        except dist.DistError:
            if self.server is None or self.stopping:  # (``stop`` kills the server: another thread's news)
                raise
            code = self.server.poll()  # (None: its exit not reported yet, but it stopped answering)
            err = WorkerError(f"dtorch process backend: the workers' store server (pid {self.server.pid}) exited"
                              f"{'' if code is None else f' with code {code}'}; every worker exits with it")
            err.lost_devices = tuple(range(self.world))
            raise err from None
        dead = [r for r, p in self.procs.items() if p.poll() is not None]
        silent = self._silent(now)
        if dead or faults or silent:
            time.sleep(0.3)  # let a dying worker's peers and launchers report too: name the root cause
            try:
                lost = self._lost(dead, silent)
                err = WorkerError(self._fault_report(silent, lost))
            except AttributeError:
                if self.store is not None:
                    raise
                # another thread saw the fault too and stopped the pool meanwhile (its store is gone): its
                # report is the full one; this one names what this thread saw
                lost = tuple(sorted(set(dead).union(silent)))
                err = WorkerError(f"dtorch process backend: a worker fault stopped the workers (device ids "
                                  f"{', '.join(map(str, lost)) or 'unknown'} lost); another thread reported it")
            err.lost_devices = lost
            raise err

    def _silent(self, now: float) -> list:
        return self.beats.silent(now, range(self.world), lambda r: int(self.client.add(f"hb/{r}", 0)))

    def _lost(self, dead, silent) -> tuple:
        """The device ids whose worker died (exit status, or a launcher's report) or stopped answering. ``dead``:
        the exits seen before the wait for the peers' reports; those seen after it count unless another thread
        is stopping the pool meanwhile (its kills are no faults)."""
        lost = set(dead).union(silent)
        if not self.stopping:
            lost.update(r for r, p in self.procs.items() if p.poll() is not None)
        lost.update(r for r in range(self.world) if self.client.check([f"dead/{r}"]))
        return tuple(sorted(lost))

    def pid(self, r: int) -> int | None:
        """Worker ``r``'s process id (the one this controller started, else the one it announced)."""
        if r in self.procs:
            return self.procs[r].pid
        self.who(r)  # reads info/<r> into _info
        return self._info.get(r, {}).get("pid")

    def who(self, r: int) -> str:
        """'worker 1 (device id 1, pid 4242, host node2, cuda:1)': everything known that finds the process."""
        info = self._info.get(r)
        if info is None:
            try:
                if self.client.check([f"info/{r}"]):
                    info = self._info[r] = pickle.loads(self.client.get(f"info/{r}"))
            except Exception:  # noqa: BLE001  (a message must not fail for want of details)
                pass
        info = info or {}
        parts = [f"device id {r}"]
        pid = self.procs[r].pid if r in self.procs else info.get("pid")
        if pid is not None:
            parts.append(f"pid {pid}")
        if info.get("host") not in (None, socket.gethostname()):
            parts.append(f"host {info['host']}")
        if info.get("device", "cpu") != "cpu":
            parts.append(info["device"])
        return f"worker {r} ({', '.join(parts)})"

    def _fault_report(self, silent, lost) -> str:
        store = self.client
        lines = []
        for r, p in sorted(self.procs.items()):
            rc = p.poll()
            if rc is not None and r in lost:
                how = f"killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}"
                lines.append(f"{self.who(r)} died: {how}{self._log_tail(r)}")
        for r in range(self.world):
            if store.check([f"dead/{r}"]):
                lines.append(f"{self.who(r)} died: {store.get(f'dead/{r}').decode()}")
        for r in silent:
            lines.append(self.beats.message(self.who(r)))
        errors = []
        for r in range(self.world):
            if store.check([f"err/{r}"]):
                seq, kind, text, tb = pickle.loads(store.get(f"err/{r}"))
                errors.append(f"worker {r} failed running {self.describe(seq, kind)}:\n    {text}")
        # a dead peer makes the others' collectives fail too; the death is the news, their errors follow
        lines += errors
        if not lines:
            lines.append("a worker reported a fault but left no message")
        logs = f" Worker logs: {self.logdir}" if self._logs_written() else ""
        return ("dtorch process backend: " + "\n".join(lines) +
                "\nThe backend's workers were stopped; tensors on them are lost (the next operation starts new "
                f"workers).{logs}")

    def _logs_written(self) -> bool:
        # a log someone else removed (a /tmp cleaner) says nothing: stopping must not fail on it
        return any(os.path.exists(f.name) and os.path.getsize(f.name) for f in self._logs.values())

    def _log_tail(self, r: int, n: int = 6) -> str:
        try:
            with open(os.path.join(self.logdir, f"worker-{r}.log"), "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 4000))
                tail = f.read().decode(errors="replace").strip().splitlines()[-n:]
        except OSError:
            return ""
        return ("; its log ends:\n      " + "\n      ".join(tail)) if tail else ""

    def shm_ranks(self) -> set:
        """The workers that see this pool's shared-memory directory (on this host)."""
        out = set()
        for r in range(self.world):
            info = pickle.loads(self.client.get(f"info/{r}"))
            self._info[r] = info
            if info.get("shm"):
                out.add(r)
        return out

    def drop_shm(self) -> None:
        pp.shm_drop(self.shm)

    # -- stopping ------------------------------------------------------------------------------
    def stop(self, clean: bool, grace: float = 5.0) -> None:
        """Clean: the workers got an exit record; wait for them. Else (or after ``grace``) kill them."""
        self.stopping = True
        deadline = time.monotonic() + (grace if clean else 0.0)
        if not clean:
            try:
                self.store.set("abort", "1")  # workers started elsewhere exit on this
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs.values():
            left = deadline - time.monotonic()
            try:
                p.wait(timeout=max(left, 0.01)) if clean else None
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        if clean and not self.spawn:
            keys = [f"bye/{r}" for r in range(self.world)]
            while time.monotonic() < deadline and not self.store.check(keys):
                time.sleep(0.02)
        keep = not clean and self._logs_written()  # a fault's logs stay for reading
        for f in self._logs.values():
            f.close()
        if self.logdir and not keep:
            shutil.rmtree(self.logdir, ignore_errors=True)
        self.procs.clear()
        self.drop_shm()
        if self._waiter is not None:
            self._waiter.shutdown(wait=False)
        self.store = None  # closes our connection, or the server (its thread): workers started elsewhere exit
        self._stop_server()

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.kill()
            try:
                self.server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
