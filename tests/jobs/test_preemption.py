"""SIGTERM mid-training, to one rank or to the launcher (`launch/jpprun`, which passes it
on as SIGUSR1: Note: Signals to the launcher): all ranks stop after the same step, save
it through a CheckpointManager (after its background save in flight) and exit 0;
re-running the same command resumes, also from a save left complete before its rename,
and ends where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
SCRIPT = "tests/jobs/harness/preempt_training.py"
LIMIT_S = 180


def _start(directory: Path) -> subprocess.Popen:
    env = job_env()
    return subprocess.Popen([str(JPPRUN), "-n", "2", "python", SCRIPT, str(directory)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, lines: list[str]) -> str:
    try:
        rest, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the training job hung")
    return "".join(lines) + rest


@pytest.mark.parametrize("target, mid_rename", [("rank 1", False), ("jpprun", True)])
def test_sigterm_stops_all_ranks_after_one_step_and_resume_finishes(tmp_path, target,
                                                                     mid_rename):
    proc = _start(tmp_path)
    lines: list[str] = []
    pids: dict[str, int] = {}
    deadline = time.monotonic() + LIMIT_S
    for line in proc.stdout:  # type: ignore[union-attr]
        lines.append(line)
        words = line.split()
        if words[:1] == ["rank"] and words[2:3] == ["pid"]:
            pids[words[1]] = int(words[3])
        if line.startswith("rank 0 step 2"):
            # only rank 1 is told, or the launcher (launch/jpprun execs jpprun.py)
            os.kill(pids["1"] if target == "rank 1" else proc.pid, signal.SIGTERM)
            break
        assert time.monotonic() < deadline, "".join(lines)
    out = _finish(proc, lines)
    assert proc.returncode == 0, out
    stops = sorted(ln for ln in out.splitlines() if " stopped at " in ln)
    assert len(stops) == 2, out
    stopped = {ln.split()[4] for ln in stops}
    assert len(stopped) == 1, f"ranks stopped after different steps: {stops}"
    at = stopped.pop()
    if target == "rank 1":
        assert "SIGTERM" in stops[1]  # rank 1 caught it; rank 0 stopped by agreement
    else:
        assert all(ln.endswith("on SIGUSR1") for ln in stops), stops
    assert int(at) < 8, "stopped only at the end"

    steps = tmp_path / "ckpt"
    assert (steps / at).is_dir(), sorted(os.listdir(steps))
    if mid_rename:  # a crash after the manifest, before the rename
        os.rename(steps / at, steps / f".{at}.tmp-0123456789ab")
    proc = _start(tmp_path)  # the same command again
    out = _finish(proc, [])
    assert proc.returncode == 0, out
    assert out.count(" resumed at ") == 2 and out.count(" done") == 2, out
    for rank in (0, 1):
        reference = np.load(tmp_path / f"reference_rank{rank}.npz")
        final = np.load(tmp_path / f"final_rank{rank}.npz")
        assert sorted(final.files) == sorted(reference.files) and final.files
        for key in final.files:
            np.testing.assert_array_equal(final[key], reference[key], err_msg=key)
