"""Resuming from a checkpoint in a new MPI job reproduces the uninterrupted run, bit for bit.

Two 2-rank jobs of tests/jobs/harness/resume_training.py: the first trains 6 steps (the
reference) and, from the same start, 3 steps that it saves; it then ends. The second, a
fresh MPI job, restores the checkpoint and trains 3 more steps.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
SCRIPT = "tests/jobs/harness/resume_training.py"
LIMIT_S = 240


def _job(*args: str) -> None:
    env = job_env()
    try:
        proc = subprocess.run([str(JPPRUN), "-n", "2", "python", SCRIPT, *args], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{args[0]} job did not finish in {LIMIT_S} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_resume_in_a_new_job_matches_uninterrupted_training(tmp_path):
    _job("first", str(tmp_path))
    _job("second", str(tmp_path))
    compared_losses = 0
    for rank in (0, 1):
        reference = np.load(tmp_path / f"reference_rank{rank}.npz")
        resumed = np.load(tmp_path / f"resumed_rank{rank}.npz")
        state = sorted(k for k in reference.files if k.startswith("state/"))
        assert state, f"rank {rank} held no parameters"
        assert sorted(k for k in resumed.files if k.startswith("state/")) == state
        for key in resumed.files:  # final params and opt state, losses of steps 4..6
            np.testing.assert_array_equal(resumed[key], reference[key], err_msg=key)
            assert resumed[key].dtype == reference[key].dtype
            compared_losses += key.startswith(("loss4/", "loss5/", "loss6/"))
    assert compared_losses == 3  # the last stage's rank holds the losses of each step
