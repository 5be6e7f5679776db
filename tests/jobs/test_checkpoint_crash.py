"""A job killed at any point of an asynchronous save loses no committed step: SIGKILL of
one rank or of the whole job during the background write, before the rename, or while
an old step is removed (`Note: Background saves`, `Note: Checkpoint steps`).

Each case pre-saves steps 1..3 here, then runs a 2-rank job
(tests/jobs/harness/checkpoint_steps.py) that saves step 4 with
JAXPP_MPI_CHECKPOINT_PAUSE_AT set, and kills it where it pauses. The next run (a
`CheckpointManager` over the same directory) finds the newest complete step, every kept
step bit for bit as saved, and nothing else left in the directory. One case then resumes
in a new 2-rank job: restore onto the groups, save while the arrays are deleted, and a
write failing on one rank raised on both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from job_env import job_env

from jaxpp_mpi import checkpoint

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
SCRIPT = "tests/jobs/harness/checkpoint_steps.py"
LIMIT_S = 120

sys.path.insert(0, str(ROOT / "tests" / "jobs" / "harness"))
from checkpoint_steps import values  # noqa: E402


def _pre_save(directory: Path) -> None:
    manager = checkpoint.CheckpointManager(str(directory), max_to_keep=2)
    for step in (1, 2, 3):
        manager.save(step, values(step))
    manager.close()
    assert manager.all_steps() == [2, 3]


def _crash(directory: Path, point: str, kill: str) -> str:
    """Runs the `crash` job paused at `point`; SIGKILLs `kill` ("rank 0", "rank 1" or
    "job") once every rank expected there has paused; returns the job's output."""
    proc = subprocess.Popen([str(JPPRUN), "-n", "2", "python", SCRIPT, "crash", str(directory)],
                            cwd=ROOT, env=job_env(JAXPP_MPI_CHECKPOINT_PAUSE_AT=point),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids: dict[int, int] = {}
    paused: set[int] = set()
    expect = {0, 1} if point == "write" else {0}
    lines: list[str] = []
    end = time.monotonic() + LIMIT_S
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        words = line.split()
        if words[:1] == ["rank"] and words[2:3] == ["pid"]:
            pids[int(words[1])] = int(words[3])
        if line.startswith(f"jaxpp_mpi checkpoint paused at {point} (rank "):
            paused.add(int(words[6].rstrip(",")))
        if paused >= expect and len(pids) == 2:
            break
        assert time.monotonic() < end, "".join(lines)
    else:
        pytest.fail("the job ended without pausing:\n" + "".join(lines))
    for rank in ((0, 1) if kill == "job" else (int(kill.split()[1]),)):
        os.kill(pids[rank], signal.SIGKILL)
    try:
        rest, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the job went on after a rank was killed:\n" + "".join(lines))
    out = "".join(lines) + rest
    assert proc.returncode != 0, out
    assert " saved 4" not in out, out
    return out


def _assert_steps(directory: Path, steps: list[int]) -> None:
    """The next run: it finds `steps`, each bit for bit as saved, and nothing else."""
    manager = checkpoint.CheckpointManager(str(directory), max_to_keep=2)
    assert manager.all_steps() == steps
    assert manager.latest_step() == steps[-1]
    assert sorted(os.listdir(directory)) == sorted(str(s) for s in steps)
    for step in steps:
        got = checkpoint.load_whole(manager.step_path(step))
        want = values(step)
        assert sorted(got) == sorted(want)
        for key, x in want.items():
            assert got[key].dtype == x.dtype and got[key].shape == x.shape, key
            assert got[key].tobytes() == np.asarray(x).tobytes(), (step, key)


@pytest.mark.parametrize("point, kill, steps", [
    ("write", "rank 1", [2, 3]),   # step 4 half-written: lost, 2 and 3 intact
    ("rename", "rank 0", [2, 3, 4]),  # step 4 complete beside its name: renamed in
    ("delete", "job", [3, 4]),     # step 2 half-removed after 4 was committed
])
def test_a_kill_during_an_asynchronous_save_loses_no_committed_step(tmp_path, point, kill,
                                                                     steps):
    _pre_save(tmp_path)
    _crash(tmp_path, point, kill)
    _assert_steps(tmp_path, steps)


def test_after_the_job_is_killed_mid_write_a_new_job_resumes_and_saves(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    _pre_save(run)
    _crash(run, "write", "job")
    _assert_steps(run, [2, 3])
    proc = subprocess.run([str(JPPRUN), "-n", "2", "python", SCRIPT, "resume", str(run),
                           str(out)], cwd=ROOT, env=job_env(), capture_output=True,
                          text=True, timeout=LIMIT_S)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for rank, key in ((0, "a"), (1, "b")):  # each rank restored its group's leaf
        held = np.load(out / f"rank{rank}.npz")
        assert sorted(held.files) == [key]
        assert held[key].tobytes() == values(3)[key].tobytes()
    assert text.count("saved 4 steps [3, 4]") == 2, text
    # step 5's write failed on rank 1: raised on both ranks, nothing committed
    assert "rank 1 raised OSError: [Errno 28] No space left on device (injected)" in text
    assert ("rank 0 raised CheckpointError: rank 1 failed: OSError: [Errno 28] No space "
            "left on device (injected)") in text, text
    assert text.count("done steps [3, 4]") == 2, text
    _assert_steps(run, [3, 4])
