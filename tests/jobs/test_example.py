"""examples/train.py runs as documented: 2-rank jobs (a bfloat16 ZeroBubble run with a trace
and a checkpoint directory; a run on data-parallel groups of 2 devices) end with the
example's own jax.jit check passing (exit status 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 240


def _run_example(args: list[str], xla_flags: str | None = None) -> str:
    """Runs examples/train.py on 2 ranks; returns its output after checking it passed."""
    env = dict(os.environ, JAXPP_MPI_PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    cmd = [str(ROOT / "launch" / "jpprun"), "-n", "2", "python", "examples/train.py", *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"examples/train.py did not finish in {LIMIT_S} s")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out  # its own check against jax.jit passed
    return out


def test_example_bfloat16_zerobubble_with_trace_and_checkpoint(tmp_path):
    trace = tmp_path / "trace.json"
    out = _run_example([
        "--schedule", "zerobubble", "--dtype", "bfloat16", "--tied", "--steps", "3",
        "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64",
        "--microbatches", "4", "--microbatch-size", "2", "--trace", str(trace),
        "--ckpt-dir", str(tmp_path / "ckpt")])
    assert "max |loss - jax.jit loss| over 3 steps" in out, out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert (tmp_path / "ckpt" / "ckpt" / "manifest.json").exists()


def test_example_on_data_parallel_groups_of_two_devices():
    out = _run_example([
        "--schedule", "1f1b", "--steps", "2", "--data-axis", "2", "--hidden", "16",
        "--heads", "2", "--seq", "8", "--vocab", "32", "--microbatches", "2",
        "--microbatch-size", "2"], xla_flags="--xla_force_host_platform_device_count=2")
    assert "2 groups of 2 device(s) (data=2, model=1)" in out, out
    assert "max |loss - jax.jit loss| over 2 steps" in out, out
