"""The futex barrier of same-host collectives (``runtime/shm_barrier.py``) among real processes.

Each member stores its round's value in its data slot of the shared file, then waits at the barrier,
then reads every member's slot: any member let through before every other arrived reads a stale value.
A member that never arrives is named after the timeout; the counts wrap at 2**31.

    .venv/bin/pytest -q tests/runtime/test_shm_barrier.py
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from dtorch.runtime import shm_barrier

pytestmark = pytest.mark.skipif(not shm_barrier.AVAILABLE,
                                reason="futex barrier is x86-64 Linux only (elsewhere the slots use gloo's barrier)")

MEMBER = textwrap.dedent("""
    import sys, time, torch
    from dtorch.runtime import shm_barrier
    path, m, j, rounds, start, timeout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5]), float(sys.argv[6])
    head = shm_barrier.header_bytes(m)
    whole = torch.from_file(path, shared=True, size=head + 8 * m, dtype=torch.uint8)
    data = whole[head:].view(torch.int64)
    b = shm_barrier.Barrier(whole.data_ptr(), m, j, timeout)
    b.n = start
    for r in range(rounds):
        data[j] = r * m + j
        b.wait()  # every member wrote round r
        seen = data.tolist()
        if seen != [r * m + k for k in range(m)]:
            print(f"member {j} round {r}: saw {seen}", flush=True)
            sys.exit(3)
        b.wait()  # every member read round r before anyone writes round r + 1
    print("ok", flush=True)
""")


def members(tmp_path, m: int, rounds: int, start: int = 0, timeout: float = 60.0, only=None):
    path = tmp_path / "barrier"
    with open(path, "wb") as f:
        f.truncate(shm_barrier.header_bytes(m) + 8 * m)
        for k in range(m):  # every member's count as if it had passed ``start`` barriers
            f.seek(k * shm_barrier.WORD_BYTES)
            f.write(start.to_bytes(4, "little"))
    script = tmp_path / "member.py"
    script.write_text(MEMBER)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, str(script), str(path), str(m), str(j), str(rounds), str(start),
                              str(timeout)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for j in (range(m) if only is None else only)]


def finish(procs, timeout: float = 120.0) -> list:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout + stderr))
    return out


# 5 members spin on 2 cores: -m slow (CI)
@pytest.mark.parametrize("m", [2, 3, pytest.param(5, marks=pytest.mark.slow)])
def test_no_member_passes_before_every_member_arrived(tmp_path, m):
    for code, text in finish(members(tmp_path, m, rounds=150)):
        assert code == 0 and "ok" in text, text


def test_counts_wrap_at_2_31(tmp_path):
    for code, text in finish(members(tmp_path, 3, rounds=50, start=0x7FFFFFFF - 40)):
        assert code == 0 and "ok" in text, text


def test_a_member_that_never_arrives_is_named_after_the_timeout(tmp_path):
    t0 = time.monotonic()
    [(code, text)] = finish(members(tmp_path, 3, rounds=5, timeout=1.0, only=[0]), timeout=60)
    assert code != 0
    assert "group member 1 did not arrive within 1 s" in text, text
    assert time.monotonic() - t0 < 30
