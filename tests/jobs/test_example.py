"""examples/train.py runs as documented: one 2-rank job with the options `make example`
leaves out (bfloat16, a tied embedding, groups of 2 devices on "data", a trace and a
checkpoint directory) ends with the example's own jax.jit check passing.

One job rather than one per option: starting the job and compiling the step is most of
its time, and each option changes a different part of the run. CI's `make example` runs
the default (float32, 1F1B, 4 ranks of one device) right before `make test`; the other
schedules are checked against jax.jit by the parity tests (tests/local, tests/mpi).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 240
STEPS = 2  # the trace records the second


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[str, Path]:
    """The job's output (its exit status checked: 0, so the jax.jit check passed) and
    its working directory, with the trace and the checkpoint it wrote."""
    where = tmp_path_factory.mktemp("example")
    env = job_env()  # the example gives each rank the 2 devices it needs
    cmd = [str(ROOT / "launch" / "jpprun"), "-n", "2", "python", "examples/train.py",
           "--dtype", "bfloat16", "--tied", "--data-axis", "2", "--steps", str(STEPS),
           "--hidden", "16", "--heads", "2", "--seq", "8", "--vocab", "32",
           "--microbatches", "2", "--microbatch-size", "2",
           "--trace", str(where / "trace.json"), "--ckpt-dir", str(where / "ckpt")]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"examples/train.py did not finish in {LIMIT_S} s")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out  # its own check against jax.jit passed
    return out, where


def test_example_matches_jax_jit_on_data_parallel_groups(run):
    out, _ = run
    assert "1f1b: 2 stages on 2 groups of 2 device(s) (data=2, model=1)" in out, out
    assert f"max |loss - jax.jit loss| over {STEPS} steps" in out, out
    assert "(tolerance 0.05)" in out, out  # the bfloat16 run's tolerance


def test_example_trace_has_tasks_of_both_ranks(run):
    out, where = run
    assert f"wrote {where / 'trace.json'}" in out, out
    events = json.loads((where / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}


def test_example_saves_its_checkpoint(run):
    _, where = run
    manifest = json.loads((where / "ckpt" / "ckpt" / str(STEPS) / "manifest.json").read_text())
    assert manifest["step"] == STEPS, manifest
