"""bench/gpu_check.sh on a machine without CUDA: one clear line and exit status 0 (CI runs it so)."""
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


def test_gpu_check_skips_cleanly_without_cuda():
    # hide any GPU, so the check takes the CPU-only path on every machine (and stays fast)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no CUDA device: nothing to check; "), r.stdout


def test_gpu_check_names_a_python_without_torch():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON="/bin/false")
    r = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "set PYTHON" in r.stderr, r.stdout + r.stderr
