"""A rank that fails before or inside `make_mpmd_mesh`, and ranks that ask for different
meshes, end the job promptly with the cause named, under a plain `mpirun` as under
launch/jpprun (`Note: abort before the mesh` in launch/abort.py, `Note: mesh agreement`
in arrays/mesh_agreement.py).

Each test starts tests/jobs/harness/mesh_faults.py. A plain `mpirun -n N python ...` is
what a user types (the venv's Open MPI, with only the flags this machine needs); jpprun
starts the ranks through `python -m mpi4py`. A job that does not end within LIMIT_S is
a hang, and fails the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from job_env import job_env

from jaxpp_mpi._src.launch import jpprun as launcher

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "tests/jobs/harness/mesh_faults.py"
LIMIT_S = 60  # every fault here ends its job far sooner
LAUNCHERS = ("mpirun", "jpprun")
OPEN_MPI_ABORT = "MPI_ABORT was invoked"  # Open MPI: a rank called MPI_Abort
DIFFERENT = "ValueError: make_mpmd_mesh was called with different arguments on different ranks:"
# Variables of this process that would change what the jobs do.
_INHERITED = ("JAXPP_MPI_ABORT_ON_EXCEPTION", "JAXPP_MPI_DEADLINE", "JAXPP_MPI_STEP_TIMEOUT",
              "JAXPP_MPI_WATCHDOG_GRACE")


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (Open MPI's launcher gives each rank a session of its
    own, so a signal to the launcher's group misses them)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _attempt(argv: list[str], env: dict[str, str]) -> tuple[int | None, str]:
    """One run of `argv`: (status, output), status None when it ran past LIMIT_S (then
    the launcher and every process below it are killed)."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
        return proc.returncode, (out + err).decode(errors="replace")
    except subprocess.TimeoutExpired:
        for pid in (proc.pid, *_descendants(proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, (out + err).decode(errors="replace")


def run_job(launch: str, ranks: int, fault: str, **env: str) -> tuple[int, str]:
    """Runs the harness with `fault` on `ranks` ranks under `launch`: (status, output).

    A plain mpirun that outlives LIMIT_S after a rank's `MPI_Abort` (Open MPI's
    `MPI_ABORT was invoked` is in its output: the ranks did their part) is Open MPI's
    launcher failing its own teardown, not a jaxpp_mpi hang: prterun 5.0 does so
    rarely (in `raise-with-the-hook-off` it once hung past 60 s in CI, and it ended by
    SIGSEGV in 2 of 150 runs on this machine), and jpprun ends it (`Note: Watching the
    launcher`). Such a job runs once more; any other overrun is a hang and fails.
    """
    if launch == "jpprun":
        prefix = [str(ROOT / "launch" / "jpprun"), "-n", str(ranks)]
    else:
        prefix = launcher.plain_mpirun_argv(ranks, [], mpirun=launcher.find_mpirun(),
                                            is_root=os.geteuid() == 0,
                                            cores=launcher.usable_cores())
    full_env = {k: v for k, v in job_env(**env).items() if k not in _INHERITED or k in env}
    argv = [*prefix, sys.executable, SCRIPT, fault]
    status, out = _attempt(argv, full_env)
    if status is None and launch == "mpirun" and OPEN_MPI_ABORT in out:
        print(f"mpirun -n {ranks} {fault}: Open MPI's launcher still ran {LIMIT_S} s after "
              f"its start, past a rank's MPI_Abort; once more. Its output:\n{out}")
        status, out = _attempt(argv, full_env)
    if status is None:
        pytest.fail(f"{launch} -n {ranks} {fault}: the job hung for {LIMIT_S} s:\n{out}")
    return status, out


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_a_rank_failing_while_its_peer_is_in_make_mpmd_mesh_ends_the_job(launch):
    """Rank 1 raises once MPI runs; rank 0 waits in make_mpmd_mesh's agreement. Without
    the hook at import, a plain mpirun hung: rank 1's exit waited in MPI_Finalize."""
    rc, out = run_job(launch, 2, "raise-before-mesh")
    assert rc != 0, out
    assert "rank 0 builds its mesh" in out, out
    assert "[rank 1] RuntimeError: deliberate failure on rank 1 before make_mpmd_mesh" in out
    assert "[rank 1] jaxpp_mpi: aborting the MPI job after an uncaught RuntimeError" in out
    assert " built " not in out, out


def test_a_rank_failing_before_mpi_starts_ends_the_job():
    """Plain mpirun only: under jpprun MPI starts before the script."""
    rc, out = run_job("mpirun", 2, "raise-before-mpi")
    assert rc != 0, out
    assert "[rank 1] RuntimeError: deliberate failure on rank 1 before MPI starts" in out, out
    assert "[rank 1] jaxpp_mpi: aborting the MPI job after an uncaught RuntimeError" in out
    assert " built " not in out, out


@pytest.mark.parametrize("fault, env", [
    ("stall-before-mesh", {}),
    ("raise-before-mesh", {"JAXPP_MPI_ABORT_ON_EXCEPTION": "0"}),
], ids=["stall", "raise-with-the-hook-off"])
def test_a_peer_that_never_arrives_ends_the_job_at_the_mesh_deadline(fault, env):
    """Rank 1 stalls, or raises with the abort hook off (then its exit waits in
    MPI_Finalize): rank 0, in make_mpmd_mesh's agreement, names it at the deadline."""
    rc, out = run_job("mpirun", 2, fault, JAXPP_MPI_DEADLINE="2",
                      JAXPP_MPI_WATCHDOG_GRACE="1", **env)
    assert rc != 0, out
    waits = [ln for ln in out.splitlines()
             if ln.startswith("[rank 0] jaxpp_mpi deadline: waiting in ")]
    assert len(waits) == 1, out
    assert "make_mpmd_mesh argument agreement" in waits[0], waits[0]
    assert "past its deadline of 2.0 s" in waits[0], waits[0]
    if env:  # the hook is off: rank 1 did not abort, its traceback has no prefix
        assert "[rank 1] jaxpp_mpi: aborting" not in out, out
        assert "\nRuntimeError: deliberate failure on rank 1 before make_mpmd_mesh" in out
    assert " built " not in out, out


@pytest.mark.parametrize("launch", LAUNCHERS)
def test_mesh_arguments_that_differ_across_ranks_are_refused_on_every_rank(launch):
    """2 replicas x 2 groups, but rank 3 asks for 4 groups: before any communicator,
    every rank raises the same error naming each differing argument and each rank's
    value (Open MPI gave rank 3 MPI_ERR_ARG, or hung, in the communicators' Split)."""
    rc, out = run_job(launch, 4, "mismatch", JAXPP_MPI_WATCHDOG_GRACE="2")
    assert rc != 0, out
    for r in range(4):
        lines = [ln[len(f"[rank {r}] "):] for ln in out.splitlines()
                 if ln.startswith(f"[rank {r}] ")]
        assert DIFFERENT in lines, (r, out)
        assert "  axis_shapes: (2, 2, 1) on ranks 0-2; (4, 1) on rank 3" in lines, (r, out)
        assert ("  axis_names: ('replica', 'stage', 'data') on ranks 0-2; ('stage', 'data') "
                "on rank 3") in lines, (r, out)
        assert "  replica_axis_name: 'replica' on ranks 0-2; None on rank 3" in lines
        assert not any(ln.startswith("  axis_types") for ln in lines), out
    assert " built " not in out, out
