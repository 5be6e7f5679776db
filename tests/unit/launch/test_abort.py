"""The abort-on-exception hook and `import jaxpp_mpi` installing it in a job of several
ranks (`Note: abort before the mesh` in launch/abort.py): no MPI is started here."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jaxpp_mpi._src.launch import abort

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def fresh_hooks(monkeypatch):
    """Lets a test install the hooks; restores Python's afterwards."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(abort, "_installed", False)
    pauses = []
    monkeypatch.setattr(abort.time, "sleep", pauses.append)
    return pauses


def _raise(error: BaseException):
    try:
        raise error
    except BaseException as e:  # noqa: BLE001 - handed to the hook as Python would
        return type(e), e, e.__traceback__


def test_the_hook_prints_the_prefixed_traceback_once_then_aborts(fresh_hooks, capfd):
    statuses = []
    assert abort.install_abort_on_exception(2, statuses.append)
    assert not abort.install_abort_on_exception(5, statuses.append)  # the first one stays
    sys.excepthook(*_raise(KeyError("lost")))
    err = capfd.readouterr().err
    assert err.count("[rank 2] Traceback (most recent call last):") == 1, err
    assert "[rank 2] KeyError: 'lost'\n" in err
    assert err.endswith("[rank 2] jaxpp_mpi: aborting the MPI job after an uncaught "
                        "KeyError on rank 2\n")
    assert statuses == [1] and fresh_hooks == []  # no pause: its peers know nothing


def test_an_error_every_rank_raises_pauses_for_the_grace_first(fresh_hooks, monkeypatch,
                                                               capfd):
    monkeypatch.setenv("JAXPP_MPI_WATCHDOG_GRACE", "3")
    statuses = []
    abort.install_abort_on_exception(0, statuses.append)
    sys.excepthook(*_raise(abort.raised_on_every_rank(ValueError("ranks differ"))))
    assert "[rank 0] ValueError: ranks differ" in capfd.readouterr().err
    assert fresh_hooks == [3.0] and statuses == [1]


def test_system_exit_is_left_alone(fresh_hooks):
    statuses = []
    abort.install_abort_on_exception(0, statuses.append)
    sys.excepthook(*_raise(SystemExit(3)))
    assert statuses == []


def test_the_rank_comes_from_the_launcher_before_mpi_starts(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    monkeypatch.setattr(abort, "_mpi_world", lambda: None)
    assert abort.job_rank() == 5


def _import_and_raise(**env: str) -> subprocess.CompletedProcess:
    """A process that imports jaxpp_mpi with `env` as its launcher's, then raises."""
    code = ("import sys, jaxpp_mpi\n"
            "assert not any(m.startswith('mpi4py') for m in sys.modules)\n"
            "print('hook', sys.excepthook is not sys.__excepthook__, flush=True)\n"
            "raise RuntimeError('deliberate')\n")
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("OMPI_", "PMI", "SLURM_", "JAXPP_MPI_"))}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60,
                          env={**clean, "JAXPP_MPI_AUTO_SETTINGS": "0", **env})


OPEN_MPI_RANK_1_OF_2 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def test_import_installs_the_hook_in_a_job_of_several_ranks():
    proc = _import_and_raise(**OPEN_MPI_RANK_1_OF_2)
    assert proc.stdout == "hook True\n"
    assert proc.returncode == 1, proc.stderr
    assert "[rank 1] RuntimeError: deliberate\n" in proc.stderr
    assert "[rank 1] jaxpp_mpi: aborting the MPI job after an uncaught RuntimeError" in (
        proc.stderr)


@pytest.mark.parametrize("env", [{}, {**OPEN_MPI_RANK_1_OF_2,
                                      "JAXPP_MPI_ABORT_ON_EXCEPTION": "0"}],
                         ids=["one process", "switched off"])
def test_import_leaves_the_hook_alone(env):
    proc = _import_and_raise(**env)
    assert proc.stdout == "hook False\n"
    assert proc.returncode == 1 and "\nRuntimeError: deliberate\n" in proc.stderr
    assert "[rank" not in proc.stderr
