"""The ray backend's device actor: a worker (``worker_loop.Worker``) living in a Ray actor, with its link.

Records, kernels and redistribution primitives are the process backend's own (``Worker``: one piece of
code for what a device does); what differs is how records arrive and how answers leave (``RayLink``):

* the controller calls ``run(batch, keys, *blocks)`` without waiting (Ray runs one caller's calls on an
  actor in order). Blocks to place that are too large to ride in the batch come as top-level object refs
  (``blocks``), which Ray resolves from its object store (mapped, not copied, on the same node);
* a call returns its answers as its result: fetched blocks (uint8 numpy arrays, which Ray puts in its
  object store), statistics, who this actor is after a (re-)join, and the first failure. No store carries
  data; a TCPStore that the first device actor hosts serves only torch.distributed's rendezvous.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import socket
import threading
import time

import numpy as np
import torch
import torch.distributed as dist

from . import process_plan as pp
from . import protocol as rec
from .protocol import failure
from .worker import connect
from .worker_loop import Link, Worker


class DeviceActor:
    """One mesh device: a worker and its Ray link (wrapped by ``ray.remote`` by the controller, with the
    resources its device needs)."""

    def __init__(self, rank: int):
        faulthandler.enable()  # a crash in native code leaves its Python stack in the actor's log
        self.link = RayLink()
        # Ray gives a GPU actor one visible GPU: it is cuda:0 here
        self.worker = Worker(self.link, rank, 0)
        self._rendezvous = None  # the TCPStore this actor hosts (the first device actor)

    def host_rendezvous(self, timeout_s: float) -> str:
        """Host torch.distributed's rendezvous store on this node; its HOST:PORT."""
        import ray

        host = ray.util.get_node_ip_address()
        self._rendezvous = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                         timeout=datetime.timedelta(seconds=timeout_s))
        return f"{host}:{self._rendezvous.port}"

    def run(self, blob: bytes, keys=(), *blocks):
        """Run a batch of records in order; the answers they produced (None when there are none)."""
        link = self.link
        link.arrived.update(zip(keys, blocks))
        link.answers = {}
        self.worker.run(pickle.loads(blob))
        return link.answers or None


class RayLink(Link):
    """A call's answers are its result: fetched blocks (uint8 numpy arrays, which Ray puts in its object
    store), statistics, who this actor is after a (re-)join, and the first failure."""

    def __init__(self):
        self.arrived: dict = {}  # key -> a placed block's bytes, resolved by Ray from its object store
        self.answers: dict = {}
        self.store = None  # the rendezvous store (actor 0 hosts it): process groups and heartbeats

    def identity(self, worker: Worker, cfg) -> dict:
        if not cfg["cuda"]:
            return {"pid": os.getpid(), "host": socket.gethostname(), "device": "cpu"}
        import ray

        return {"pid": os.getpid(), "host": socket.gethostname(), "device": f"cuda:0 (Ray GPU {ray.get_gpu_ids()})"}

    def join(self, worker: Worker, cfg) -> None:
        """Join process-group generation ``cfg["gen"]`` (the first call, and after the mesh grew)."""
        if self.store is None:
            self.store = connect(cfg["rendezvous"], cfg["timeout"])
            threading.Thread(target=_beat, args=(self.store.clone(), worker.rank), name="dtorch-heartbeat",
                             daemon=True).start()
        torch.set_num_threads(cfg["threads"])
        worker.form(cfg, dist.PrefixStore(f"g{cfg['gen']}/", self.store))
        self.answers["info"] = self.identity(worker, cfg)

    def answer(self, worker: Worker, kind: str, req: int, value, world: int) -> None:
        self.answers[(kind, req)] = value  # (a sync's answer is the call's completion)

    def receive(self, worker: Worker, r: rec.Put) -> torch.Tensor:
        # Ray's mapping is read-only and may be shared by the actors of this node: the block is our copy
        _, seq, hid, dtype, shape, device_type, data = r
        raw = torch.from_numpy(np.array(self.arrived.pop(data[1]), copy=True))
        return pp.from_bytes(raw, dtype, shape)

    def send(self, worker: Worker, r: rec.Get, x: torch.Tensor) -> None:
        # the controller flushes right after a get, so no later record of this batch writes the block
        # before Ray copies the result into its object store
        self.answers[("get", r[3])] = (x.dtype, tuple(x.shape), pp.as_bytes(x.detach().cpu()).numpy())

    def report(self, worker: Worker, r, exc: BaseException) -> None:
        self.answers["err"] = failure(r, exc)  # the records after it are skipped; the controller stops every actor

    def leave(self, worker: Worker) -> None:
        worker.leaving = True
        worker.settle()
        if dist.is_initialized():
            dist.destroy_process_group()


def _beat(store: dist.TCPStore, rank: int) -> None:
    """Tick ``hb/<rank>`` twice a second beside the work (``RayPool._silent`` names an actor whose tick stood
    still: stopped, frozen, or on a node that is gone; Ray itself names only dead actors)."""
    while True:
        try:
            store.add(f"hb/{rank}", 1)
        except Exception:  # noqa: BLE001  (the store's host, actor 0, is gone: the pool is being stopped)
            return
        time.sleep(0.5)
