"""Injected faults end a 2-rank job promptly, naming the rank and what it was doing.

Each test starts tests/jobs/harness/faults.py under jpprun *without* `python -m mpi4py`
(through `env`), so what ends the job is jaxpp_mpi's own abort hook and watchdog
(runtime/failure.py), as for a user's plain `mpirun -n N python train.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
HANG_LIMIT_S = 120  # a hang shows up as this timeout; every fault ends far sooner


def run_fault(fault: str, **env: str) -> tuple[int, str, float]:
    """Runs the harness with `fault` on 2 ranks; (exit status, output, seconds)."""
    full_env = dict(os.environ, JAXPP_MPI_PYTHON=sys.executable, **env)
    full_env.pop("XLA_FLAGS", None)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [str(JPPRUN), "-n", "2", "env", sys.executable, "tests/jobs/harness/faults.py", fault],
            cwd=ROOT, env=full_env, capture_output=True, timeout=HANG_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"fault {fault!r}: the job hung for {HANG_LIMIT_S} s")
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    return proc.returncode, out, time.monotonic() - start


def test_exception_in_a_stage_prints_the_rank_prefixed_traceback_once_and_aborts():
    rc, out, elapsed = run_fault("stage-exception")
    assert rc != 0, out
    assert "[rank 1] jaxpp_mpi: aborting the MPI job after an uncaught" in out, out
    assert "deliberate NaN check failure in stage 1 on rank 1" in out, out
    assert out.count("[rank 1] Traceback (most recent call last)") == 1, out
    assert "rank 0 finished" not in out
    assert elapsed < 60, f"took {elapsed:.1f} s"


def test_exception_while_tracing_on_one_rank_aborts_the_job():
    """Rank 0 has gone on to the program-hash allgather; rank 1's abort ends it."""
    rc, out, elapsed = run_fault("trace-exception")
    assert rc != 0, out
    assert "[rank 1] ValueError: deliberate exception while tracing on rank 1" in out, out
    assert elapsed < 60, f"took {elapsed:.1f} s"


def test_watchdog_reports_where_each_rank_is_blocked_then_aborts():
    """Rank 1's stage 1 stalls; with a 4 s deadline each rank prints the instruction it
    is blocked on (rank 1 its stalled task, rank 0 the message waiting for rank 1)."""
    rc, out, elapsed = run_fault("stall", JAXPP_MPI_STEP_TIMEOUT="4",
                                 JAXPP_MPI_WATCHDOG_GRACE="2")
    assert rc != 0, out
    lines = [ln for ln in out.splitlines() if "jaxpp_mpi watchdog: step 1" in ln]
    by_rank = {ln.split("]")[0] + "]": ln for ln in lines}
    assert set(by_rank) == {"[rank 0]", "[rank 1]"}, out
    assert "past its deadline of 4.0 s" in by_rank["[rank 0]"]
    assert "blocked in task F0s1 (forward, microbatch 0, stage 1)" in by_rank["[rank 1]"]
    assert "from rank 1" in by_rank["[rank 0]"], by_rank["[rank 0]"]
    assert elapsed < 60, f"took {elapsed:.1f} s"


def test_rank_killed_mid_step_ends_the_job_naming_it():
    rc, out, elapsed = run_fault("sigkill")
    assert rc != 0, out
    assert "rank 1" in out and "signal 9" in out, out
    assert elapsed < 60, f"took {elapsed:.1f} s"
