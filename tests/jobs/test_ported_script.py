"""A JaxPP training script, ported by changing its import and its mesh line, runs and
matches `jax.jit`: in one process (2 groups) and under `launch/jpprun -n 4`
(first, middle and last stages on their own ranks: everything a 2-rank job would show).

The script (tests/jobs/harness/ported_jaxpp_script.py: flax-style model with dropout in
every stage, TrainState with a typed key, keyword batch, `in_specs`, `f"{loss:.3f}"`)
checks itself against single-process `jax.jit` (rtol 1e-5, keys bit for bit, so the
dropout masks are jax.jit's) and exits non-zero on a mismatch; these tests check that
it passed, printed its losses, and that every rank compared the values it holds.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/jobs/harness/ported_jaxpp_script.py"
LIMIT_S = 240
STEPS = 3
LOSS_LINE = re.compile(r"^\[Step (\d\d)\] Train Loss: (\d+\.\d{3})$", re.M)
UNHELD_LOSS_LINE = re.compile(r"^\[Step \d\d\] Train Loss: MpmdArray\(shape=\(\), ", re.M)
PARITY_LINE = re.compile(r"^parity with jax\.jit: (\d+) values held here match$", re.M)


def _check_output(out: str, ranks: int) -> None:
    """Every step's loss printed once as `x.xxx` (by the rank holding it, the other
    ranks print its repr), and every rank compared some values with jax.jit."""
    assert [int(s) for s, _ in LOSS_LINE.findall(out)] == list(range(1, STEPS + 1)), out
    assert len(UNHELD_LOSS_LINE.findall(out)) == (ranks - 1) * STEPS, out
    checked = [int(n) for n in PARITY_LINE.findall(out)]
    assert len(checked) == ranks and all(n > 0 for n in checked), out


def test_ported_script_in_one_process(capsys, monkeypatch):
    """Local mode: the pytest process's CPU devices (tests/conftest.py), 2 groups."""
    spec = importlib.util.spec_from_file_location("ported_jaxpp_script", ROOT / SCRIPT)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look it up
    spec.loader.exec_module(script)
    status = script.main(["--pp", "2", "--steps", str(STEPS)])
    out = capsys.readouterr()
    assert status == 0, out.out + out.err
    _check_output(out.out, ranks=1)


def test_ported_script_under_mpi():
    ranks = 4
    env = job_env()  # one CPU device per rank
    cmd = [
        str(ROOT / "launch" / "jpprun"),
        "-n",
        str(ranks),
        "python",
        SCRIPT,
        "--pp",
        str(ranks),
        "--steps",
        str(STEPS),
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the ported script on {ranks} ranks did not finish in {LIMIT_S} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # its jax.jit check passed
    _check_output(proc.stdout, ranks)
