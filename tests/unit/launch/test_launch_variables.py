"""The launchers' JAXPP_MPI_* variables go through their definitions (base/variables.py):
a bad value is a BindError naming the variable, its value and what it takes, in jpprun,
`jaxpp_mpi.launch` and the settings at import alike; jpprun ends with it, not a traceback."""

from __future__ import annotations

import pytest

from jaxpp_mpi._src.launch import bind, env
from jaxpp_mpi._src.launch import jpprun as launcher

OPENMPI = {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}


@pytest.mark.parametrize("raw, message", [
    ("abc", "JAXPP_MPI_THREADS_PER_RANK='abc': not an integer; use an integer from 1 to 4096"),
    ("", "JAXPP_MPI_THREADS_PER_RANK='': empty; unset it for the default, or use an integer"),
    ("0", "JAXPP_MPI_THREADS_PER_RANK='0': use an integer from 1 to 4096"),
    ("1e9", "JAXPP_MPI_THREADS_PER_RANK='1e9': not an integer"),
    ("5000", "JAXPP_MPI_THREADS_PER_RANK='5000': use an integer from 1 to 4096"),
])
def test_a_bad_thread_count_is_refused_by_name(raw, message):
    with pytest.raises(env.BindError, match=f"^{message}"):
        env.threads_from_env({"JAXPP_MPI_THREADS_PER_RANK": raw})


@pytest.mark.parametrize("given, threads", [
    ({"JAXPP_MPI_THREADS_PER_RANK": " 3 "}, 3),
    ({"JAXPP_MPI_THREADS_PER_RANK": "2", "SLURM_CPUS_PER_TASK": "8"}, 2),
    ({"SLURM_CPUS_PER_TASK": "8"}, 8),
    ({}, None),
])
def test_thread_counts_taken(given, threads):
    assert env.threads_from_env(given) == threads


@pytest.mark.parametrize("raw", ["maybe", "", "2"])
def test_a_bad_auto_settings_switch_is_refused_by_name(raw):
    with pytest.raises(env.BindError, match=f"^JAXPP_MPI_AUTO_SETTINGS='{raw}': .*use 1 or 0"):
        env.auto_settings_enabled({"JAXPP_MPI_AUTO_SETTINGS": raw})


@pytest.mark.parametrize("raw, on", [(None, True), ("1", True), ("off", False), ("No", False)])
def test_auto_settings_switch_taken(raw, on):
    given = {} if raw is None else {"JAXPP_MPI_AUTO_SETTINGS": raw}
    assert env.auto_settings_enabled(given) is on


@pytest.mark.parametrize("rank, size, message", [
    ("-1", "2", "JAXPP_MPI_LOCAL_RANK='-1': use an integer from 0 to 4095"),
    ("0", "0", "JAXPP_MPI_LOCAL_SIZE='0': use an integer from 1 to 4096"),
    ("0", "", "JAXPP_MPI_LOCAL_SIZE='': empty"),
    ("x", "2", "JAXPP_MPI_LOCAL_RANK='x': not an integer"),
])
def test_a_bad_local_rank_override_is_refused_by_name(rank, size, message):
    given = {**OPENMPI, "JAXPP_MPI_LOCAL_RANK": rank, "JAXPP_MPI_LOCAL_SIZE": size}
    with pytest.raises(env.BindError, match=f"^{message}"):
        env.detect_local_rank(given)


def test_the_local_rank_override_is_taken():
    found = env.detect_local_rank({**OPENMPI, "JAXPP_MPI_LOCAL_RANK": "1",
                                   "JAXPP_MPI_LOCAL_SIZE": "3"})
    assert (found.local_rank, found.local_size, found.launcher) == (1, 3, "override")


@pytest.mark.parametrize("raw, message", [
    ("two", "JAXPP_MPI_GPUS_PER_RANK='two': not an integer; use an integer from 0 to 256"),
    ("-1", "JAXPP_MPI_GPUS_PER_RANK='-1': use an integer from 0 to 256"),
    ("1000", "JAXPP_MPI_GPUS_PER_RANK='1000': use an integer from 0 to 256"),
])
def test_a_bad_gpu_count_is_refused_by_name(raw, message):
    local = env.LocalRank(0, 1, 0, 1, "none")
    with pytest.raises(env.BindError, match=f"^{message}"):
        bind.plan_binding(local, {"JAXPP_MPI_GPUS_PER_RANK": raw, "CUDA_VISIBLE_DEVICES": "0"},
                          cores=[0], node_gpus=1)


def _jpprun(monkeypatch, capsys, **variables: str) -> tuple[int, str]:
    for name in ("JAXPP_MPI_THREADS_PER_RANK", "JAXPP_MPI_GPUS_PER_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    rc = launcher.main(["-n", "2", "--mpirun", "/bin/false", "--dry-run", "python", "t.py"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("name, raw, message", [
    ("JAXPP_MPI_THREADS_PER_RANK", "abc", "JAXPP_MPI_THREADS_PER_RANK='abc': not an integer"),
    ("JAXPP_MPI_THREADS_PER_RANK", "", "JAXPP_MPI_THREADS_PER_RANK='': empty"),
    ("JAXPP_MPI_THREADS_PER_RANK", "nan", "JAXPP_MPI_THREADS_PER_RANK='nan': not an integer"),
    ("JAXPP_MPI_GPUS_PER_RANK", "1.5", "JAXPP_MPI_GPUS_PER_RANK='1.5': not an integer"),
    ("JAXPP_MPI_GPUS_PER_RANK", "300", "JAXPP_MPI_GPUS_PER_RANK='300': use an integer from 0"),
])
def test_jpprun_ends_with_the_variable_s_message(monkeypatch, capsys, name, raw, message):
    rc, err = _jpprun(monkeypatch, capsys, **{name: raw})
    assert rc == 2
    assert err.startswith(f"jpprun: {message}"), err


def test_jpprun_takes_its_counts_from_the_environment(monkeypatch, capsys):
    rc, err = _jpprun(monkeypatch, capsys, JAXPP_MPI_THREADS_PER_RANK="2",
                      JAXPP_MPI_GPUS_PER_RANK="0")
    assert rc == 0
    assert "JAXPP_MPI_THREADS_PER_RANK=2 OMP_NUM_THREADS=2" in err, err
    rc, err = _jpprun(monkeypatch, capsys)
    assert rc == 0 and "JAXPP_MPI_THREADS_PER_RANK=1 " in err, err  # the default: 1
