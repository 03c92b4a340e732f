"""A controller's normal exit is quiet for `dtorch worker` launchers: no c10d stacks, no false deaths."""
from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from dtorch.runtime.worker import worker_env


def _run(code: str, launcher: bool = False) -> subprocess.CompletedProcess:
    env = worker_env(1)  # what a worker process gets
    if launcher:  # `dtorch worker` runs in the user's shell: c10d's default log level
        env.pop("TORCH_CPP_LOG_LEVEL", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60, env=env)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_whose_controller_closes_the_store_after_the_exit_record_exits_0():
    # the controller closes its store once every worker said bye; a worker still between its exit
    # record and its exit (here: a slow barrier) must not count that as the controller dying
    r = _run("""
        import datetime, threading, time
        import torch.distributed as dist
        from dtorch.runtime import worker

        master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=10))
        link = worker.StoreLink(worker.connect(f"127.0.0.1:{master.port}", 10))
        w = worker.Worker(link, 0, 0)
        threading.Thread(target=worker._watch, args=(link.store, w, None), daemon=True).start()
        time.sleep(0.7)  # the watchdog ticks

        def slow_barrier():
            global master
            master = None  # the controller finishes: its store closes
            time.sleep(2)  # the watchdog notices meanwhile
        dist.barrier = slow_barrier
        link.leave(w)
    """)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr and "frame #" not in r.stderr, r.stderr


def test_the_launcher_does_not_call_a_controller_that_is_gone():
    # a worker that ends with an error after its controller is gone: the launcher used to connect to the
    # dead address to report it and c10d printed its connection failures with a C++ stack
    r = _run(f"""
        import sys
        from dtorch.runtime import worker

        worker.worker_command = lambda *args: [sys.executable, "-c", "raise SystemExit(3)"]
        sys.exit(worker.launch("127.0.0.1:{_free_port()}", [0, 1], None, 5))
    """, launcher=True)
    assert r.returncode == 1  # a worker failed: the launcher's exit status still says so
    assert r.stderr == "", r.stderr
