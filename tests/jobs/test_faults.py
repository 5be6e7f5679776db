"""Injected faults end a 2-rank job promptly, naming the rank and what it was doing.

Each test starts tests/jobs/harness/faults.py under jpprun *without* `python -m mpi4py`
(through `env`), so what ends the job is jaxpp_mpi's own abort hook, watchdog and
deadlines (runtime/failure.py), as for a user's plain `mpirun -n N python train.py`.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
HANG_LIMIT_S = 120  # a hang shows up as this timeout; every fault ends far sooner


def run_fault(fault: str, **env: str) -> tuple[int, str, float]:
    """Runs the harness with `fault` on 2 ranks; (exit status, output, seconds): from
    the fault (the harness's stamp) to the job's end when `env` asks for the stamp."""
    full_env = job_env(**env)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [str(JPPRUN), "-n", "2", "env", sys.executable, "tests/jobs/harness/faults.py", fault],
            cwd=ROOT, env=full_env, capture_output=True, timeout=HANG_LIMIT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"fault {fault!r}: the job hung for {HANG_LIMIT_S} s")
    end = time.time()
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    stamps = [float(ln.split()[-1]) for ln in out.splitlines() if ln.startswith("fault at ")]
    if stamps:
        return proc.returncode, out, end - stamps[0]
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
    # the last stage runs its F and B as one task (`Note: back-to-back tasks`)
    assert ("blocked in task F0s1+B0s1 (forward, microbatch 0, stage 1; backward, "
            "microbatch 0, stage 1)") in by_rank["[rank 1]"]
    # the peer and its host (`Note: rank hosts`): here every rank runs on this host
    assert f"from rank 1 on host {socket.gethostname()}" in by_rank["[rank 0]"], by_rank
    assert elapsed < 60, f"took {elapsed:.1f} s"


def test_rank_killed_mid_step_ends_the_job_naming_it():
    rc, out, elapsed = run_fault("sigkill")
    assert rc != 0, out
    assert "rank 1" in out and "signal 9" in out, out
    assert elapsed < 60, f"took {elapsed:.1f} s"


# Where rank 0 waits while rank 1 stalls before it (Note: deadlines in failure.py).
STALLS = {
    "stall-trace": ("step trace agreement",),
    "stall-should-stop": ("preemption agreement (PreemptionGuard.should_stop)",),
    "stall-save": ("checkpoint save of ",),
    "stall-reshard": ("reshard agreement",),
    "stall-export": ("trace.export to ",),
    "stall-user": ("loss broadcast",),
}
DEADLINE_S, GRACE_S = 2, 1


@pytest.mark.parametrize("fault", sorted(STALLS))
def test_a_stall_outside_the_step_ends_the_job_naming_where_the_ranks_wait(fault):
    """Rank 1 stalls before a collective outside the step (tracing, `should_stop`,
    `checkpoint.save`, a reshard, `trace.export`, the user's own bcast under
    `jaxpp_mpi.launch.deadline`): rank 0 prints where it waits and the job aborts
    within the deadline plus grace."""
    rc, out, since_fault = run_fault(fault, JAXPP_MPI_DEADLINE=str(DEADLINE_S),
                                     JAXPP_MPI_WATCHDOG_GRACE=str(GRACE_S),
                                     JAXPP_MPI_FAULT_STAMP="1")
    assert rc != 0, out
    waits = [ln for ln in out.splitlines()
             if ln.startswith("[rank 0] jaxpp_mpi deadline: waiting in ")]
    assert len(waits) == 1, out
    assert any(label in waits[0] for label in STALLS[fault]), waits[0]
    assert f"past its deadline of {DEADLINE_S:.1f} s" in waits[0], waits[0]
    assert "rank 0 finished" not in out
    assert since_fault < DEADLINE_S + GRACE_S + 8, f"{since_fault:.1f} s after the fault"


def test_watchdog_deadline_adapts_to_back_to_back_steps():
    """Steps run back to back (each waits for the last one's results): after the first 3
    the automatic deadline is max(floor, 20 x slowest step), so a stall at step 6 ends
    the job within it (the floor set to 2 s here, 60 s by default), not after 300 s."""
    rc, out, since_fault = run_fault("stall-step6", JAXPP_MPI_WATCHDOG_FLOOR="2",
                                     JAXPP_MPI_WATCHDOG_GRACE=str(GRACE_S),
                                     JAXPP_MPI_FAULT_STAMP="1")
    assert rc != 0, out
    lines = [ln for ln in out.splitlines() if "jaxpp_mpi watchdog: step 6 " in ln]
    assert lines and all("(automatic;" in ln for ln in lines), out
    deadline = max(float(re.search(r"past its deadline of ([0-9.]+) s", ln)[1])
                   for ln in lines)
    assert 2 <= deadline < 20, lines  # learnt: the floor, or 20 x a slow first step
    assert since_fault < deadline + GRACE_S + 8, f"{since_fault:.1f} s after the fault"


@pytest.mark.parametrize("fault, stalled", [("stall-between", 1), ("stall-between-0", 0)])
def test_a_stall_between_steps_ends_the_job_at_the_learnt_step_deadline(fault, stalled):
    """One rank stalls before calling step 6 of 8 back-to-back steps: the other waits in
    the step call agreement under the step's learnt deadline (the floor set to 2 s here,
    60 s by default), not the 300 s of other collectives (`Note: deadlines`), and names
    the rank it waits for and its host (rank 0 the stalled rank, the others rank 0:
    `Note: watched allgather`)."""
    rc, out, since_fault = run_fault(fault, JAXPP_MPI_WATCHDOG_FLOOR="2",
                                     JAXPP_MPI_WATCHDOG_GRACE=str(GRACE_S),
                                     JAXPP_MPI_FAULT_STAMP="1")
    assert rc != 0, out
    waiting = 1 - stalled
    waits = [ln for ln in out.splitlines() if ln.startswith(
        f"[rank {waiting}] jaxpp_mpi deadline: waiting in step call agreement")]
    assert len(waits) == 1 and "(the step's deadline, the watchdog's;" in waits[0], out
    named = f"; it waits for rank {stalled} on host {socket.gethostname()} (stalled, or lost"
    assert named in waits[0], waits[0]
    deadline = float(re.search(r"past its deadline of ([0-9.]+) s", waits[0])[1])
    assert 2 <= deadline < 60, waits  # learnt: the floor, or 20 x a slow first step
    assert since_fault < deadline + GRACE_S + 8, f"{since_fault:.1f} s after the fault"
