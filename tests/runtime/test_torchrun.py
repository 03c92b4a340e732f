"""Workers started by torchrun join a controller: two torchrun "nodes" of 2 workers each on loopback
run a Llama layout (tp2 x pp2) across both, with Hugging Face's logits (slow: four worker processes,
two torchrun agents and a controller on a 2-core machine).

    .venv/bin/pytest -q -m slow tests/runtime/test_torchrun.py
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dtorch.runtime.worker import torchrun_identity

REPO = str(Path(__file__).resolve().parents[2])
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

CONTROLLER = """
import torch, transformers, dtorch
from dtorch.models.llama import LlamaForCausalLM
from tests.llama_models import hf_model
from tests.models.test_llama import ATOL, RTOL
hf = hf_model("gqa")
assert dtorch.default_graph().backend == "process"
mesh = dtorch.init_device_mesh("cpu", (2, 2), mesh_dim_names=["pp", "tp"])
model = LlamaForCausalLM(hf.config, mesh)
model.load_state_dict(hf.state_dict())
ids = torch.randint(0, hf.config.vocab_size, (3, 7))
with torch.no_grad():
    torch.testing.assert_close(model(ids), hf(ids).logits, rtol=RTOL, atol=ATOL)
print("OK", len(dtorch.default_graph().runtime.worker_stats()), flush=True)
"""


def test_identity_comes_from_torchruns_environment():
    env = dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", MASTER_ADDR="10.0.0.1", MASTER_PORT="29500")
    assert torchrun_identity(env, None) == ("10.0.0.1:29501", 3, 1, 4)
    assert torchrun_identity(env, "ctl:7000") == ("ctl:7000", 3, 1, 4)
    with pytest.raises(ValueError, match="RANK"):
        torchrun_identity({"WORLD_SIZE": "4"}, None)
    with pytest.raises(ValueError, match="--controller"):
        torchrun_identity({k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}, None)


def _free_port_pair() -> int:
    """A port P with P+1 free too (torchrun's store on P, the controller on P+1), below Linux's ephemeral
    range (32768-60999): a port handed out there can be taken by any outgoing connection (another test's
    gloo sockets) before the controller binds it."""
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(20000, 32000)
        try:
            for q in (p, p + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def _controller(tmp_path, source: str, port: int, env: dict, timeout_s: int) -> subprocess.Popen:
    """A controller process running ``source`` that waits for 4 workers to join at ``port + 1``."""
    script = tmp_path / "controller.py"
    script.write_text(source)
    return subprocess.Popen([sys.executable, str(script)], cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            env=dict(env, DTORCH_BACKEND="process", DTORCH_PROCESS_SPAWN="0", DTORCH_PROCESS_WORKERS="4",
                                     DTORCH_PROCESS_LISTEN=f"127.0.0.1:{port + 1}",
                                     DTORCH_PROCESS_TIMEOUT=str(timeout_s)))


@pytest.mark.slow
def test_two_torchrun_nodes_run_llama_across_both(tmp_path):
    port = _free_port_pair()
    env = dict(os.environ, PYTHONPATH=REPO)
    ctl = _controller(tmp_path, CONTROLLER, port, env, 120)
    nodes = [subprocess.Popen([TORCHRUN, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "2",
                               "--master-addr", "127.0.0.1", "--master-port", str(port),
                               "-m", "dtorch.runtime.worker", "--torchrun", "--connect-timeout", "60"],
                              cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
             for n in (0, 1)]
    try:
        out, err = ctl.communicate(timeout=200)
        assert ctl.returncode == 0 and out.split() == ["OK", "4"], err[-3000:]
        for n in nodes:
            _, nerr = n.communicate(timeout=60)
            assert n.returncode == 0, nerr[-3000:]
    finally:
        for p in [ctl] + nodes:
            if p.poll() is None:
                os.killpg(p.pid, 9)


MISMATCH = """
import torch, dtorch
mesh = dtorch.init_device_mesh("cpu", (4,))
try:
    dtorch.Tensor(torch.arange(4.0), device_mesh=mesh).to_torch()
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
"""


def test_a_torchrun_world_unlike_the_controllers_is_named(tmp_path):
    """torchrun made 2 workers, the controller waits for 4: the worker says so, the controller raises it
    at once instead of waiting for its timeout."""
    port = _free_port_pair()
    env = dict(os.environ, PYTHONPATH=REPO)
    ctl = _controller(tmp_path, MISMATCH, port, env, 60)
    worker = subprocess.Popen([sys.executable, "-m", "dtorch.runtime.worker", "--torchrun", "--connect-timeout", "30"],
                              cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                              env=dict(env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port)))
    try:
        _, werr = worker.communicate(timeout=60)
        assert worker.returncode == 2 and "WORLD_SIZE=2" in werr and "DTORCH_PROCESS_WORKERS=2" in werr, werr
        out, err = ctl.communicate(timeout=60)
        assert "WORLD_SIZE=2" in out and "waits for 4" in out, out + err[-2000:]
    finally:
        for p in (ctl, worker):
            if p.poll() is None:
                os.killpg(p.pid, 9)
