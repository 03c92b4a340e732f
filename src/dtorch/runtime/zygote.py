"""A zygote: one process that imported torch and dtorch once, and forks the process backend's workers on request.

Starting a worker the plain way (``python -m dtorch.runtime.worker``) spends seconds importing torch; eight of
them at once on a few cores made most of a recovery's time (every worker is restarted). The controller starts
one zygote per transport the first time it needs workers on its own host, and asks it for each worker: a fork
is ready to connect in milliseconds. ``DTORCH_PROCESS_ZYGOTE=0`` starts every worker as its own interpreter.

Why forking is safe here: the zygote never runs a torch op (no OpenMP pool, no CUDA: both break across a fork),
only imports; each child sets its own thread count (``torch.set_num_threads``), environment, session and log
before it becomes a worker (``worker.run_worker``), and closes the zygote's pipes.

Lifetime: the zygote reads requests on its stdin and exits at its end of file, i.e. when the controller closes
it or dies (and when its parent pid changes, should another process hold the pipe). Its workers then see their
parent gone and exit too (``worker._watch``). It reaps its children and reports each exit status, so the
controller sees a worker's death (and its signal) as it would a child's (``ForkedWorker``, the subset of
``subprocess.Popen`` that ``process_pool.Pool`` uses).

The store server: the zygote also forks the process that hosts the pool's TCPStore (``serve_store``), so that
serving the workers' pushes, queue pops, heartbeats and answers does not count in the controller's CPU (a server
thread inside the controller did: ~1 ms of its CPU per compiled step, most of it during a sync). The controller
is a client like the workers. The server exits when its zygote does (so with the controller), or when the pool
kills it (``Pool.stop``).

Protocol: JSON lines. Requests ``{"rank", "device_index", "address", "connect_timeout", "threads", "env",
"log"}`` (a worker) or ``{"store": [host, port, timeout]}`` (a store server); answers ``{"forked": pid}`` (in
request order), ``{"exit": pid, "code": returncode}`` (Popen's convention: minus the signal number for a
signal), and from a store server itself ``{"store": pid, "port": port}`` or ``{"store": pid, "error": text}``.
"""
from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from ..errors import RuntimeBackendError

ZYGOTE_VAR = "DTORCH_PROCESS_ZYGOTE"


def zygote_enabled() -> bool:
    """DTORCH_PROCESS_ZYGOTE: 1 (default) forks workers from a zygote; 0 starts each as its own interpreter."""
    raw = os.environ.get(ZYGOTE_VAR, "1").strip().lower()
    if raw not in ("0", "1", "false", "true", ""):
        raise ValueError(f"{ZYGOTE_VAR}={raw!r} must be 1 (fork workers from a pre-imported process) or 0 "
                         "(start each worker as its own Python process)")
    return raw not in ("0", "false")


class ZygoteError(RuntimeBackendError):
    """The zygote did not start or stopped answering."""


class ForkedWorker:
    """A worker the zygote forked: the part of ``subprocess.Popen`` the pool uses (pid, poll, wait, kill)."""

    def __init__(self, zygote: "Zygote", pid: int):
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self):
        return self.poll()

    def poll(self):
        return self.zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None):
        code = self.zygote.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
        return code

    def kill(self) -> None:
        if self.poll() is None:  # (an exit not yet reaped is still our process: its pid is not reused)
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """The controller's side: starts the zygote process (``env``: the workers' environment) and asks it for
    workers. ``start_timeout``: seconds its first answer may take (it imports torch first)."""

    def __init__(self, env: dict, start_timeout: float):
        self.start_timeout = start_timeout
        self._errlog = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", "dtorch.runtime.zygote", str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._errlog, env=env,
                                     start_new_session=True)  # Ctrl-C goes to the controller only
        self._cond = threading.Condition()
        self._lock = threading.Lock()  # one request at a time: answers come in request order
        self._forked: collections.deque = collections.deque()
        self._exits: dict = {}
        self._stores: dict = {}  # store server pid -> its message (its port, or why it could not listen)
        self._eof = False
        self._answered = False
        threading.Thread(target=self._read, name="dtorch-zygote", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return not self._eof and self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    self._exits[msg["exit"]] = msg["code"]
                elif "store" in msg:
                    self._stores[msg["store"]] = msg
                else:
                    self._forked.append(msg["forked"])
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def spawn(self, rank: int, device_index: int, address: str, connect_timeout: float, threads: int, env: dict,
              log: str) -> ForkedWorker:
        """Fork worker ``rank``; its output goes to the file ``log``."""
        req = {"rank": rank, "device_index": device_index, "address": address, "connect_timeout": connect_timeout,
               "threads": threads, "env": env, "log": log}
        with self._lock:
            return ForkedWorker(self, self._fork(req, f"worker {rank}"))

    def serve_store(self, host: str, port: int, timeout: float) -> tuple[ForkedWorker, int]:
        """Fork a process that hosts a TCPStore (``is_master``) listening on ``host:port`` (0: a free port);
        (that process, the port it listens on)."""
        with self._lock:
            pid = self._fork({"store": [host, port, timeout]}, "the store server")
            with self._cond:
                if not self._cond.wait_for(lambda: pid in self._stores or pid in self._exits or self._eof, 30.0):
                    ForkedWorker(self, pid).kill()
                    raise ZygoteError(self._failed(f"forked a store server (pid {pid}) that did not listen "
                                                   "within 30 s"))
                msg = self._stores.pop(pid, None) or {"error": "it exited before it listened"}
            if "error" in msg:
                raise ZygoteError(self._failed(f"forked a store server (pid {pid}) that could not listen on "
                                               f"{host}:{port}: {msg['error']}"))
            return ForkedWorker(self, pid), msg["port"]

    def _fork(self, req: dict, what: str) -> int:
        """Send one request (the caller holds ``_lock``); the forked child's pid."""
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise ZygoteError(self._failed(f"stopped before it could fork {what}")) from None
        # the first answer waits for the zygote's imports
        timeout = 30.0 if self._answered else self.start_timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._forked or self._eof, timeout):
                self.close()
                raise ZygoteError(self._failed(f"did not fork {what} within {timeout:.0f} s"))
            if not self._forked:
                raise ZygoteError(self._failed(f"exited before it forked {what}"))
            self._answered = True
            return self._forked.popleft()

    def exit_code(self, pid: int):
        """The worker's exit status (Popen's convention), or None while it runs."""
        with self._cond:
            code = self._exits.get(pid)
            if code is None and self._eof and not _running(pid):
                code = self._exits[pid] = 1  # the zygote died: nobody reaped it for us, the status is lost
            return code

    def wait_exit(self, pid: int, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.exit_code(pid)
            if code is not None:
                return code
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            with self._cond:
                self._cond.wait(0.1 if left is None else min(left, 0.1))

    def _failed(self, what: str) -> str:
        try:
            self._errlog.seek(0)
            tail = self._errlog.read().decode(errors="replace").strip().splitlines()[-8:]
        except (OSError, ValueError):
            tail = []
        said = ("; it said:\n  " + "\n  ".join(tail)) if tail else ""
        return (f"dtorch process backend: the zygote process (pid {self.proc.pid}, which forks workers) {what}{said}\n"
                f"{ZYGOTE_VAR}=0 starts each worker as its own Python process instead.")

    def close(self, timeout: float = 5.0) -> None:
        """End of file on its stdin: it exits (its remaining workers follow: their parent is gone)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._errlog.close()


def _running(pid: int) -> bool:
    """Is ``pid`` a live process (not a zombie)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


# -- the zygote process ------------------------------------------------------------------------------


def serve(parent_pid: int) -> int:
    """Import once, then fork a worker per request until stdin ends or the parent is gone."""
    requests, answers = os.dup(0), os.dup(1)  # the pipes, kept off fds 0-2 (which the children take over)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # anything printed goes to the error log, not into the protocol
    os.close(devnull)
    import torch  # noqa: F401  (the point: imported once, here, not in every worker)
    import torch.distributed  # noqa: F401
    from . import worker  # noqa: F401  (and with it the dtorch package)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # (a handler, so that the wakeup fd hears of exits)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pending = b""
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        _reap(answers)
        if os.getppid() != parent_pid:
            return 0
        if requests not in ready:
            continue
        data = os.read(requests, 1 << 16)
        if not data:
            return 0
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            req = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()  # (a child would write the zygote's buffered output again)
            zygote = os.getpid()
            pid = os.fork()
            if pid == 0:
                for fd in (requests, wake_r, wake_w):
                    os.close(fd)
                if "store" in req:
                    _become_store(req["store"], answers, zygote)  # never returns
                os.close(answers)
                _become_worker(req)  # never returns
            os.write(answers, (json.dumps({"forked": pid}) + "\n").encode())


def _reap(answers: int) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        os.write(answers, (json.dumps({"exit": pid, "code": code}) + "\n").encode())


def _become_store(where: list, answers: int, zygote: int) -> None:
    """In the forked child: host the pool's TCPStore, say on which port, and live as long as the zygote."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # Ctrl-C goes to the controller only
        try:
            import datetime

            import torch.distributed as dist

            host, port, timeout = where
            store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                  timeout=datetime.timedelta(seconds=timeout))
            msg = {"store": os.getpid(), "port": store.port}
        except Exception as exc:  # noqa: BLE001  (the controller raises it)
            msg = {"store": os.getpid(), "error": f"{type(exc).__name__}: {exc}"}
        os.write(answers, (json.dumps(msg) + "\n").encode())  # (one short write: not interleaved with the zygote's)
        os.close(answers)
        if "error" in msg:
            return
        # the server runs in the store's own thread; this one only watches the zygote, which ends with the controller
        while os.getppid() == zygote:
            time.sleep(0.5)
        code = 0
    finally:
        os._exit(code)


def _become_worker(req: dict) -> None:
    """In the forked child: a fresh session, the request's environment, log and thread count; then the worker."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # Ctrl-C goes to the controller only (as with start_new_session)
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.environ.clear()
        os.environ.update(req["env"])
        import random

        import torch

        random.seed()  # (forked children would otherwise share the zygote's state)
        try:  # OMP_NUM_THREADS was read when the zygote loaded OpenMP: the child sets its own count
            threads = int(req["env"].get("OMP_NUM_THREADS") or req["threads"])
        except ValueError:
            threads = req["threads"]
        torch.set_num_threads(max(1, threads))
        from .worker import run_worker

        run_worker(req["address"], req["rank"], req["device_index"], os.getppid(), req["connect_timeout"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001  (the log is where a worker's failure is read)
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    sys.exit(serve(int(sys.argv[1])))
