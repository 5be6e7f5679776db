"""The MPI harness itself: a failure on one rank ends the whole job fast, never a hang."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
HANG_LIMIT_S = 120  # a hang shows up as this timeout; a pass needs far less


def _run_2_ranks(*command: str) -> tuple[int, str, float]:
    env = job_env()
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [str(JPPRUN), "-n", "2", *command],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the 2-rank job hung for {HANG_LIMIT_S} s instead of aborting")
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def test_failing_pytest_rank_aborts_job_with_its_traceback():
    rc, out, elapsed = _run_2_ranks(
        "python", "-m", "pytest", "tests/jobs/harness/deliberate_mpi_failure.py",
        "--with-mpi", "-p", "no:cacheprovider", "-q",
    )
    assert rc != 0, out
    assert "[rank 1]" in out and "deliberate failure on rank 1" in out, out
    assert elapsed < 60, f"took {elapsed:.1f} s to abort"


def test_uncaught_exception_in_script_aborts_job():
    rc, out, elapsed = _run_2_ranks("python", "tests/jobs/harness/deliberate_script_failure.py")
    assert rc != 0, out
    assert "deliberate uncaught exception on rank 1" in out, out
    assert elapsed < 60, f"took {elapsed:.1f} s to abort"
