"""A malformed JAXPP_MPI_* variable under `launch/jpprun -n 2` ends the job promptly with
the variable's message from every rank, before any step (base/variables.py); one that
jpprun reads itself ends jpprun before any rank starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from job_env import job_env

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
HARNESS = "tests/jobs/harness/bad_variable.py"
HANG_LIMIT_S = 120  # a hang shows up as this timeout; the job ends far sooner


def _run(command: list[str], **env: str) -> tuple[int, str]:
    try:
        proc = subprocess.run([str(JPPRUN), "-n", "2", *command], cwd=ROOT,
                              env=job_env(JAX_PLATFORMS="cpu", **env), capture_output=True,
                              timeout=HANG_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the job hung for {HANG_LIMIT_S} s")
    return proc.returncode, (proc.stdout + proc.stderr).decode(errors="replace")


@pytest.mark.parametrize("launch", ["jpprun", "plain"])
@pytest.mark.parametrize("name, raw, message", [
    ("JAXPP_MPI_STEP_TIMEOUT", "nan",
     "JAXPP_MPI_STEP_TIMEOUT='nan': use a number of seconds from 0 to 2592000 (30 days), "
     "auto or off"),
    ("JAXPP_MPI_LOCAL_SIZE", "two", "JAXPP_MPI_LOCAL_SIZE='two': not an integer; use an "
     "integer from 1 to 4096"),
])
def test_every_rank_refuses_a_bad_value_at_its_mesh(launch, name, raw, message):
    """`jpprun`: its own `python -m mpi4py` start; `plain`: the program started as by a
    plain `mpirun -n 2 python prog.py` (through `env`, so without mpi4py's runner)."""
    python = ["python"] if launch == "jpprun" else ["env", sys.executable]
    rc, out = _run([*python, HARNESS], **{name: raw})
    assert rc != 0, out
    assert out.count("building its mesh") == 2, out  # both ranks started...
    assert "past its mesh" not in out, out           # ...and neither got further
    reports = [line for line in out.splitlines() if line.endswith(f"VariableError: {message}")]
    if launch == "jpprun":  # through jaxpp_mpi's abort hook: prefixed by rank
        assert sorted(line.split("]")[0] for line in reports) == ["[rank 0", "[rank 1"], out
    else:
        assert len(reports) == 2, out


@pytest.mark.parametrize("name, raw, message", [
    ("JAXPP_MPI_THREADS_PER_RANK", "abc",
     "JAXPP_MPI_THREADS_PER_RANK='abc': not an integer; use an integer from 1 to 4096"),
    ("JAXPP_MPI_THREADS_PER_RANK", "", "JAXPP_MPI_THREADS_PER_RANK='': empty; unset it"),
    ("JAXPP_MPI_GPUS_PER_RANK", "-1", "JAXPP_MPI_GPUS_PER_RANK='-1': use an integer from 0"),
])
def test_jpprun_refuses_a_bad_count_before_starting_anything(name, raw, message):
    rc, out = _run(["python", HARNESS], **{name: raw})
    assert rc == 2, out
    assert out.startswith(f"jpprun: {message}"), out
    assert "Traceback" not in out and "building its mesh" not in out, out
