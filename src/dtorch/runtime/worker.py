"""The process backend's worker processes: their link to the controller, and the launcher.

A worker (``worker_loop.Worker``) pops batches of records from its queue in the controller's TCPStore
and runs them. ``StoreLink`` is how it talks back: answers and fault reports through the store, fetched
blocks through a shared-memory file (same host) or the gloo group of two it shares with the controller
(``Pair``), placed blocks likewise. A watchdog thread ticks its heartbeat and exits the process when the
controller is gone.

Run by the controller (``--rank``), or on another node by ``dtorch worker --controller HOST:PORT
--ranks 0-3``, which starts one worker per rank and reports the ones that die.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from . import process_plan as pp
from . import protocol as rec
from .protocol import failure
from .worker_loop import Link, Worker


def connect(address: str, timeout_s: float) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class StoreLink(Link):
    """The process backend's link: the controller's TCPStore for control, shared memory and a gloo pair
    for data."""

    def __init__(self, store: dist.TCPStore, parent_pid: int | None = None):
        self.store = store
        self.parent_pid = parent_pid
        self.pair = None  # a gloo group of two with the controller: blocks that do not go through worker.shm

    def identity(self, worker: Worker, cfg) -> dict:
        where = f"cuda:{worker.device_index}" if cfg["cuda"] else "cpu"
        return {"pid": os.getpid(), "host": socket.gethostname(), "device": where}

    def join(self, worker: Worker, cfg=None) -> None:
        """(Re-)join the current process group generation the controller published."""
        cfg = pickle.loads(self.store.get("cfg"))
        shm = pp.shm_reachable(cfg.get("shm"))
        # who this worker is, for the controller's fault messages (a hung worker is named by these)
        self.store.set(f"info/{worker.rank}", pickle.dumps(dict(self.identity(worker, cfg), shm=shm is not None)))
        # the process groups get their own store connection: sharing ours with gloo's rendezvous
        # corrupted it (crashes in gloo's address parsing when groups were made under load)
        worker.form(cfg, dist.PrefixStore(f"g{cfg['gen']}/", self.store.clone()))
        self.store.set(f"ready/{cfg['gen']}/{worker.rank}", str(os.getpid()))

    def answer(self, worker: Worker, kind: str, req: int, value, world: int) -> None:
        """The value under ``<kind>/<req>/<rank>``; one more of the ``world`` workers answered: the last one
        wakes the controller (``Pool.wait_key`` on ``<kind>/<req>/all``)."""
        key = f"{kind}/{req}"
        if value is not None:
            self.store.set(f"{key}/{worker.rank}", pickle.dumps(value))
        if self.store.add(key, 1) == world:
            self.store.set(f"{key}/all", b"")

    def open_pair(self, worker: Worker, gen: int) -> None:
        """Join the controller's gloo group of two for this worker (``StoreTransport.resize``)."""
        store = dist.PrefixStore(f"pair/{gen}/{worker.rank}/", self.store.clone())
        self.pair = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=worker.cfg["timeout"]))

    def batch(self, worker: Worker, r: rec.Batch) -> list:
        _, name, size = r
        return pickle.loads(pp.store_take(self.store, name, size))

    def receive(self, worker: Worker, r: rec.Put) -> torch.Tensor:
        _, seq, hid, dtype, shape, device_type, data = r
        if data[0] == "shm":  # a file in the shared-memory directory
            _, path, size, name = data
            block = pp.shm_take(path, size, dtype, shape, unlink=False)  # mapped before anyone unlinks
            if self.store.add(f"{name}/left", -1) == 0:  # the last reader unlinks it
                os.unlink(path)
                self.store.delete_key(f"{name}/left")
            return block
        _, size, tag = data  # a large block the controller sent through our pair
        buf = torch.empty(size, dtype=torch.uint8)
        self.pair.recv([buf], 0, tag).wait()
        return pp.from_bytes(buf, dtype, shape)

    def send(self, worker: Worker, r: rec.Get, x: torch.Tensor) -> None:
        """Our block of a fetch: into shared memory when the controller asked and there is room, else
        inline (small) or through our pair (the header in the store says which)."""
        _, seq, hid, req, how, tag = r
        key = f"g/{req}/{worker.rank}"
        head = (x.dtype, tuple(x.shape))
        sent = None
        try:
            if isinstance(how, tuple):  # into the controller's file of the global value, at our block's offset
                path, offset = how
                pp.shm_write_at(path, offset, x)
                sent = head + ("direct",)
            elif how and worker.shm:  # a file of its own: the controller maps it and unlinks it
                path = os.path.join(worker.shm, f"g-{req}-{worker.rank}")
                try:
                    sent = head + ("shm", path, pp.shm_write(path, x))
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    raise
        except OSError:  # /dev/shm is full (a container's is often 64 MB): the pair carries it
            pass
        data = None
        if sent is None:
            data = pp.as_bytes(x.detach().cpu())
            sent = head + (("inline", data.numpy().tobytes()) if data.numel() <= pp.INLINE_BYTES else ("pg", tag))
        self.store.set(key, pickle.dumps(sent))
        if self.store.add(f"g/{req}", 1) == 0:  # the last block of the fetch (the count starts at minus their number)
            self.store.set(f"g/{req}/all", b"")
        if sent[2] == "pg":  # the controller receives once every block's header is in
            if self.pair is None:  # (the controller opens its side when it reads our header)
                self.open_pair(worker, worker.cfg["gen"])
            self.pair.send([data], 0, tag).wait()

    def report(self, worker: Worker, r, exc: BaseException) -> None:
        self.store.set(f"err/{worker.rank}", pickle.dumps(failure(r, exc)))
        self.store.add("nfault", 1)

    def leave(self, worker: Worker) -> None:
        # A barrier before exiting: a gloo process that exits while a peer still talks to it can abort
        # at interpreter exit; os._exit skips the teardown that aborts.
        worker.leaving = True
        try:
            if not worker.stopping:  # (skipped work posted nothing its peers wait for)
                worker.settle()
            dist.barrier()
        except Exception:  # noqa: BLE001
            pass
        try:
            self.store.set(f"bye/{worker.rank}", "")
        finally:
            os._exit(0)

    def loop(self, worker: Worker) -> None:
        key = f"q/{worker.rank}"
        while True:
            try:
                blob = self.store.queue_pop(key)
            except dist.DistNetworkError:  # the controller is gone
                if not worker.leaving:
                    _orphaned(worker)
                os._exit(1)
            except dist.DistStoreError:
                continue  # idle past the store timeout
            worker.run(pickle.loads(blob))


def _watch(store: dist.TCPStore, worker: Worker, parent_pid: int | None) -> None:
    """Exit when the controller (its store or its process) goes away, even mid-collective."""
    s = store.clone()
    while True:
        try:
            s.add(f"hb/{worker.rank}", 1)
            if s.check(["abort"]):
                os._exit(1)
            if not worker.stopping and s.check(["stop"]):
                worker.stopping = True
        except Exception:  # noqa: BLE001
            # the store is gone: after the exit record that is the controller finishing (exit quietly,
            # so a launcher has nothing to report), before it the controller died
            if not worker.leaving:
                _orphaned(worker)
            os._exit(0 if worker.leaving else 1)
        if parent_pid and os.getppid() != parent_pid:
            _orphaned(worker)
            os._exit(1)
        time.sleep(0.5)


def _orphaned(worker: Worker) -> None:
    """The controller died (killed: it could not clean up): remove its shared-memory directory."""
    if worker.shm:
        shutil.rmtree(worker.shm, ignore_errors=True)


def run_worker(address: str, rank: int, device_index: int, parent_pid: int | None, connect_timeout: float) -> None:
    faulthandler.enable()  # a crash in native code leaves its Python stack in the worker's log
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the controller, which stops us
    store = connect(address, connect_timeout)
    link = StoreLink(store, parent_pid)
    w = Worker(link, rank, device_index)
    threading.Thread(target=_watch, args=(store, w, parent_pid), daemon=True).start()
    link.join(w)
    store.set_timeout(datetime.timedelta(seconds=30))
    link.loop(w)


# -- launcher: the workers of one node ----------------------------------------------------------------


def parse_ranks(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    if not out or len(set(out)) != len(out) or min(out) < 0:
        raise ValueError(f"--ranks {text!r} must name distinct non-negative ranks, e.g. 0-3 or 0,2,4")
    return out


def worker_command(address: str, rank: int, device_index: int, parent_pid: int, connect_timeout: float) -> list[str]:
    return [sys.executable, "-m", "dtorch.runtime.worker", "--controller", address, "--rank", str(rank),
            "--device-index", str(device_index), "--parent-pid", str(parent_pid),
            "--connect-timeout", str(connect_timeout)]


def worker_env(threads: int) -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # idle queue waits time out; that is not news
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def launch(address: str, ranks: list[int], devices: list[int] | None, connect_timeout: float) -> int:
    """Start one worker per rank on this node; report the ones that die; return when all have exited."""
    devices = devices or list(range(len(ranks)))
    env = worker_env(max(1, (os.cpu_count() or 1) // len(ranks)))
    procs = {r: subprocess.Popen(worker_command(address, r, d, os.getpid(), connect_timeout), env=env)
             for r, d in zip(ranks, devices)}

    def stop(*_):
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        sys.exit(130)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    store = None
    worst = 0
    live = dict(procs)
    while live:
        time.sleep(0.2)
        for r, p in list(live.items()):
            rc = p.poll()
            if rc is None:
                continue
            del live[r]
            if rc != 0:
                worst = worst or rc
                if not _listening(address):
                    continue  # the controller is gone: nobody to tell (and c10d would print a stack trying)
                try:
                    store = store or connect(address, 5)
                    if not store.check([f"bye/{r}"]):
                        store.set(f"dead/{r}", f"exit code {rc}")
                        store.add("nfault", 1)
                except Exception:  # noqa: BLE001  (the controller is gone: nobody to tell)
                    pass
    return 0 if worst == 0 else 1


def torchrun_identity(env, controller: str | None) -> tuple[str, int, int, int]:
    """(controller address, rank, local rank, world size) from torchrun's environment."""
    missing = [k for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if k not in env]
    if missing:
        raise ValueError(f"--torchrun needs torchrun's {', '.join(missing)} in the environment; start it as "
                         "`torchrun ... -m dtorch.runtime.worker --torchrun`, or use --ranks without torchrun")
    try:
        rank, local, world = (int(env[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    except ValueError:
        raise ValueError("RANK, LOCAL_RANK and WORLD_SIZE must be integers (as torchrun sets them)") from None
    if controller is None:
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ValueError("give --controller HOST:PORT (MASTER_ADDR/MASTER_PORT are not set to derive it from)")
        # torchrun's own store holds MASTER_PORT on the first node: the controller listens next to it
        controller = f"{env['MASTER_ADDR']}:{int(env['MASTER_PORT']) + 1}"
    return controller, rank, local, world


def run_torchrun_worker(address: str, rank: int, local: int, world: int, connect_timeout: float) -> int:
    """One worker torchrun started: its rank is the device id, LOCAL_RANK its CUDA device. The world
    torchrun made must be the one the controller waits for, else no process group could form."""
    store = connect(address, connect_timeout)
    cfg = pickle.loads(store.get("cfg"))
    if cfg["world"] != world:
        msg = (f"torchrun started WORLD_SIZE={world} workers but the controller at {address} waits for "
               f"{cfg['world']}; set DTORCH_PROCESS_WORKERS={world} for the controller (or change --nnodes/"
               "--nproc-per-node)")
        print(f"dtorch worker (rank {rank}): {msg}", file=sys.stderr, flush=True)
        if rank == 0:  # one report is enough: the controller raises it instead of waiting for its timeout
            store.set("dead/0", msg)
            store.add("nfault", 1)
        return 2
    del store
    # torchrun's agent is the parent: a worker whose agent is gone exits (as under `dtorch worker`)
    run_worker(address, rank, local, os.getppid(), connect_timeout)
    return 0


def _listening(address: str) -> bool:
    """Does anything accept connections at HOST:PORT? (a plain socket: no c10d retries or logs)"""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dtorch worker",
                                 description="start process-backend workers and join a controller")
    ap.add_argument("--controller", help="HOST:PORT of the controller's store (DTORCH_PROCESS_LISTEN); under "
                    "--torchrun the default is MASTER_ADDR:MASTER_PORT+1")
    ap.add_argument("--torchrun", action="store_true",
                    help="this process is one worker started by torchrun: rank RANK, CUDA device LOCAL_RANK")
    ap.add_argument("--ranks", help="the ranks (device ids) this node runs, e.g. 0-3 or 4,5")
    ap.add_argument("--devices", help="local CUDA device index of each rank (default: 0, 1, ... in --ranks order)")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--device-index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--connect-timeout", type=float, default=300.0, help="seconds to wait for the controller")
    args = ap.parse_args(argv)
    if args.torchrun:
        try:
            address, rank, local, world = torchrun_identity(os.environ, args.controller)
        except ValueError as exc:
            ap.error(str(exc))
        return run_torchrun_worker(address, rank, local, world, args.connect_timeout)
    if not args.controller:
        ap.error("give --controller HOST:PORT (where the controller listens: DTORCH_PROCESS_LISTEN)")
    if args.rank is not None:
        run_worker(args.controller, args.rank, args.device_index, args.parent_pid, args.connect_timeout)
        return 0
    if not args.ranks:
        ap.error("give --ranks (e.g. --ranks 0-3)")
    ranks = parse_ranks(args.ranks)
    devices = parse_ranks(args.devices) if args.devices else None
    if devices is not None and len(devices) != len(ranks):
        ap.error(f"--devices names {len(devices)} devices for {len(ranks)} ranks; give one per rank")
    return launch(args.controller, ranks, devices, args.connect_timeout)


if __name__ == "__main__":
    sys.exit(main())
