"""Jobs of 2 pipeline replicas x 2 stages on 4 ranks: the example matches `jax.jit`, bad
replica counts are refused on every rank, and a fault in one replica ends the whole job.

The example checks itself against `jax.jit` on the global batch (its losses and every
rank's final parameters) and exits non-zero on a mismatch. The faults run
tests/jobs/harness/replica_faults.py under jpprun without `python -m mpi4py` (through
`env`), so what ends the job is jaxpp_mpi's own abort hook and step watchdog
(runtime/failure.py), as for a plain `mpirun -n 4 python train.py`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
LIMIT_S = 240  # a hang shows up as this timeout; every job here ends far sooner
STEP_TIMEOUT_S, GRACE_S = 5, 2


def _run(ranks: int, command: list[str], **env: str) -> tuple[int, str, float]:
    """Runs `command` on `ranks` ranks from the repository root; (exit status, output,
    seconds from the harness's "fault at" stamp, or from the start, to the job's end)."""
    full_env = job_env(**env)
    start = time.time()
    try:
        proc = subprocess.run([str(JPPRUN), "-n", str(ranks), *command], cwd=ROOT,
                              env=full_env, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{command} on {ranks} ranks did not end in {LIMIT_S} s")
    end = time.time()
    out = proc.stdout + proc.stderr
    stamps = [float(ln.split()[-1]) for ln in out.splitlines() if ln.startswith("fault at ")]
    return proc.returncode, out, end - (stamps[0] if stamps else start)


def _still_running(tag: str, wait_s: float = 5.0) -> list[str]:
    """The command lines of processes carrying `tag` after up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                words = cmdline.read_bytes().split(b"\0")
            except OSError:  # the process ended meanwhile
                continue
            if tag.encode() in words and cmdline.parent.name != str(os.getpid()):
                left.append(b" ".join(words).decode(errors="replace"))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def test_example_with_two_replicas_matches_jit(tmp_path):
    steps = 2
    rc, out, _ = _run(4, [
        "python", "examples/train.py", "--replicas", "2", "--schedule", "1f1b",
        "--steps", str(steps), "--hidden", "16", "--heads", "2", "--seq", "8",
        "--vocab", "32", "--microbatches", "4", "--microbatch-size", "2",
        "--ckpt-dir", str(tmp_path)])
    assert rc == 0, out  # its own check against jax.jit passed
    assert "2 stages on 2 groups of 1 device(s) x 2 replicas (2 microbatches each)" in out, out
    # Rank 0 of the job, alone, printed one row per step and compared every rank's values.
    rows = re.findall(r"^ +(\d+) +\d+\.\d{4} ", out, re.M)
    assert rows == [str(i) for i in range(steps)], out
    assert f"max |loss - jax.jit loss| over {steps} steps: " in out, out
    assert "max |param - jax.jit param| on 4 rank(s): " in out, out
    manifest = json.loads((tmp_path / "ckpt" / str(steps) / "manifest.json").read_text())
    assert (manifest["step"], manifest["mpmd_dim"]) == (steps, 2), manifest


@pytest.mark.parametrize(("ranks", "args", "message"), [
    (3, [], "--replicas=2 must divide the job's 3 ranks"),
    (4, ["--microbatches", "3"], "--replicas=2 must divide --microbatches=3"),
])
def test_example_refuses_replicas_that_do_not_divide_on_every_rank(ranks, args, message):
    rc, out, _ = _run(ranks, ["python", "examples/train.py", "--replicas", "2", *args])
    assert rc != 0, out
    assert out.count(f"examples/train.py: {message}") == ranks, out
    assert "Traceback" not in out, out


def test_exception_in_one_replica_ends_the_whole_job():
    """Rank 3 (replica 1, group 1) raises in stage 1 of step 1: its traceback is printed
    once and every rank of both replicas is gone."""
    tag = f"replica-raise-{uuid.uuid4().hex}"
    rc, out, since_fault = _run(4, ["env", sys.executable,
                                    "tests/jobs/harness/replica_faults.py", "raise", tag],
                                FAULT_STAMP="1")
    assert rc != 0, out
    assert "deliberate failure in stage 1 of replica 1 on rank 3" in out, out
    # Not anchored to line starts: mpirun may interleave another rank's unfinished line.
    tracebacks = re.findall(r"\[rank (\d)\] Traceback \(most recent call last\):", out)
    assert tracebacks == ["3"], out
    assert out.count("jaxpp_mpi: aborting the MPI job after an uncaught") == 1, out
    assert "finished" not in out, out
    assert not _still_running(tag)
    assert since_fault < 30, f"{since_fault:.1f} s after the fault"


def test_stall_in_one_replica_ends_the_whole_job_within_the_deadline():
    """Rank 3's stage 1 sleeps in step 1: every rank reports where it is blocked (replica
    0 behind the AllReduce across replicas) and the job ends within the step deadline
    plus the grace period, no rank left waiting."""
    tag = f"replica-stall-{uuid.uuid4().hex}"
    rc, out, since_fault = _run(4, ["env", sys.executable,
                                    "tests/jobs/harness/replica_faults.py", "stall", tag],
                                FAULT_STAMP="1", JAXPP_MPI_STEP_TIMEOUT=str(STEP_TIMEOUT_S),
                                JAXPP_MPI_WATCHDOG_GRACE=str(GRACE_S))
    assert rc != 0, out
    lines = [ln for ln in out.splitlines() if "jaxpp_mpi watchdog: step 1 " in ln]
    by_rank = {ln.split("]")[0] + "]": ln for ln in lines}
    assert set(by_rank) == {f"[rank {r}]" for r in range(4)}, out
    # the last stage runs its F and B as one task (`Note: back-to-back tasks`)
    assert ("blocked in task F0s1+B0s1 (forward, microbatch 0, stage 1; backward, "
            "microbatch 0, stage 1)") in by_rank["[rank 3]"], out
    assert any("across the pipeline replicas" in by_rank[f"[rank {r}]"] for r in (0, 1)), out
    assert "finished" not in out, out
    assert not _still_running(tag)
    assert since_fault < STEP_TIMEOUT_S + GRACE_S + 10, f"{since_fault:.1f} s after the fault"
