"""The ray backend's device actor: a process-backend worker (``worker.Worker``) living in a Ray actor.

Records, kernels and redistribution primitives are the process backend's own (``Worker``: one piece of
code for what a device does); what differs is how records arrive and how answers leave:

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
from .worker import Worker, connect, failure


class DeviceActor(Worker):
    """One mesh device: its blocks, its process-group membership (wrapped by ``ray.remote`` by the
    controller, with the resources its device needs)."""

    def __init__(self, rank: int):
        faulthandler.enable()  # a crash in native code leaves its Python stack in the actor's log
        # Ray gives a GPU actor one visible GPU: it is cuda:0 here
        super().__init__(None, rank, 0, None)
        self.arrived: dict = {}  # key -> a placed block's bytes, resolved by Ray from its object store
        self.answers: dict = {}
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
        self.arrived.update(zip(keys, blocks))
        self.answers = {}
        Worker.run(self, pickle.loads(blob))
        return self.answers or None

    def report(self, rec, exc: BaseException) -> None:
        self.failed = True  # the records after it are skipped; the controller stops every actor
        self.answers["err"] = failure(rec, exc)

    def leave(self) -> None:
        self.leaving = True
        self.settle()
        if dist.is_initialized():
            dist.destroy_process_group()

    def identity(self, cfg) -> dict:
        if not cfg["cuda"]:
            return {"pid": os.getpid(), "host": socket.gethostname(), "device": "cpu"}
        import ray

        return {"pid": os.getpid(), "host": socket.gethostname(), "device": f"cuda:0 (Ray GPU {ray.get_gpu_ids()})"}

    # -- records whose transport differs from the process backend's ------------------------------------
    def op_reform(self, cfg):
        """Join process-group generation ``cfg["gen"]`` (the first call, and after the mesh grew)."""
        self.settle()
        if self.store is None:
            self.store = connect(cfg["rendezvous"], cfg["timeout"])
            threading.Thread(target=_beat, args=(self.store.clone(), self.rank), name="dtorch-heartbeat",
                             daemon=True).start()
        torch.set_num_threads(cfg["threads"])
        self.shm = pp.shm_reachable(cfg.get("shm"))  # on the controller's node: collectives through /dev/shm
        self.form(cfg, dist.PrefixStore(f"g{cfg['gen']}/", self.store))
        self.answers["info"] = self.identity(cfg)

    def op_put(self, seq, hid, dtype, shape, device_type, data):
        if not (isinstance(data, tuple) and data[0] == "ray"):
            return Worker.op_put(self, seq, hid, dtype, shape, device_type, data)
        # Ray's mapping is read-only and may be shared by the actors of this node: the block is our copy
        raw = torch.from_numpy(np.array(self.arrived.pop(data[1]), copy=True))
        self.t[hid] = pp.from_bytes(raw, dtype, shape).to(self.device(device_type))

    def op_get(self, seq, hid, req, how=False):
        # the controller flushes right after a get, so no later record of this batch writes the block
        # before Ray copies the result into its object store
        x = self.t[hid]
        self.answers[("get", req)] = (x.dtype, tuple(x.shape), pp.as_bytes(x.detach().cpu()).numpy())

    def op_sync(self, tok):
        self.settle()  # the call's completion is the answer

    def op_stats(self, req, collectives=False):
        self.answers[("stats", req)] = self.statistics(collectives)


def _beat(store: dist.TCPStore, rank: int) -> None:
    """Tick ``hb/<rank>`` twice a second beside the work (``RayPool._silent`` names an actor whose tick stood
    still: stopped, frozen, or on a node that is gone; Ray itself names only dead actors)."""
    while True:
        try:
            store.add(f"hb/{rank}", 1)
        except Exception:  # noqa: BLE001  (the store's host, actor 0, is gone: the pool is being stopped)
            return
        time.sleep(0.5)
