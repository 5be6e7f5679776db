"""A failure in a staged-message thread (`Note: staged messages` in mpi/staged.py) ends
a 2-rank job promptly, reported with the rank's prefix: the thread's exception goes
through jaxpp_mpi's abort hook (`Note: abort on exception`), never a silent hang.

Each test starts tests/jobs/harness/staged_faults.py under jpprun without `python -m
mpi4py` (through `env`), with JAXPP_MPI_STAGED_MESSAGES=1, as tests/jobs/test_faults.py
does for the other faults.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
HANG_LIMIT_S = 120  # a hang shows up as this timeout; the job ends far sooner


def run(fault: str) -> tuple[int, str]:
    """(exit status, output) of the harness with `fault` on 2 ranks."""
    try:
        proc = subprocess.run(
            [str(JPPRUN), "-n", "2", "env", sys.executable,
             "tests/jobs/harness/staged_faults.py", fault],
            cwd=ROOT, env=job_env(JAXPP_MPI_STAGED_MESSAGES="1"), capture_output=True,
            timeout=HANG_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fault {fault!r}: the job hung for {HANG_LIMIT_S} s")
    return proc.returncode, (proc.stdout + proc.stderr).decode(errors="replace")


def test_staged_job_finishes_without_a_fault():
    rc, out = run("none")
    assert rc == 0, out
    assert "rank 0 finished" in out and "rank 1 finished" in out, out


@pytest.mark.parametrize("thread", ["sender", "receiver"])
def test_failure_in_a_staged_thread_aborts_the_job(thread):
    rc, out = run(thread)
    assert rc != 0, out
    assert (f"[rank 1] OSError: deliberate failure in the staged {thread} thread on "
            "rank 1") in out, out
    assert "[rank 1] jaxpp_mpi: aborting the MPI job after an uncaught" in out, out
    assert "rank 0 finished" not in out, out
