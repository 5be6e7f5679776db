"""examples/train.py runs as documented: a 2-rank bfloat16 ZeroBubble run with a trace and
a checkpoint directory ends with its own jax.jit check passing (exit status 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 240


def test_example_bfloat16_zerobubble_with_trace_and_checkpoint(tmp_path):
    env = dict(os.environ, JAXPP_MPI_PYTHON=sys.executable)
    env.pop("XLA_FLAGS", None)
    trace = tmp_path / "trace.json"
    cmd = [str(ROOT / "launch" / "jpprun"), "-n", "2", "python", "examples/train.py",
           "--schedule", "zerobubble", "--dtype", "bfloat16", "--tied", "--steps", "3",
           "--hidden", "32", "--heads", "2", "--seq", "16", "--vocab", "64",
           "--microbatches", "4", "--microbatch-size", "2", "--trace", str(trace),
           "--ckpt-dir", str(tmp_path / "ckpt")]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"examples/train.py did not finish in {LIMIT_S} s")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out  # its own check against jax.jit passed
    assert "max |loss - jax.jit loss| over 3 steps" in out, out
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert (tmp_path / "ckpt" / "ckpt" / "manifest.json").exists()
