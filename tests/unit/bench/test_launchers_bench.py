"""bench/launchers.py's and bench/_alone.py's logic (no JAX, no MPI): the plain mpirun
command (`plain_mpirun_argv` in launch/jpprun.py, which they use), the environments, the
rounds' order, the summary, NUMA nodes, torch's match."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from jaxpp_mpi._src.launch import jpprun as launcher

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import _alone as alone  # noqa: E402
import _common as common  # noqa: E402
import launchers as bench  # noqa: E402

ONE_THREAD = ("--xla_cpu_multi_thread_eigen=false "
              "--xla_cpu_enable_concurrency_optimized_scheduler=false")
PROGRAM = ["/venv/bin/python", "bench/launchers.py", "--worker", "r.json"]


@pytest.mark.parametrize("is_root, cores, extra", [
    (False, 2, []),
    (True, 2, ["--allow-run-as-root"]),
    (False, 1, ["--oversubscribe"]),
    (True, 1, ["--allow-run-as-root", "--oversubscribe"]),
])
def test_plain_mpirun_adds_only_what_open_mpi_demands(is_root, cores, extra):
    argv = launcher.plain_mpirun_argv(2, PROGRAM, mpirun="/venv/bin/mpirun", is_root=is_root,
                                      cores=cores)
    assert argv == ["/venv/bin/mpirun", "-n", "2", *extra, *PROGRAM]
    # a plain launch: no binding, no exported settings, the program started as it is
    assert not {"--bind-to", "--map-by", "-x", "-m", "mpi4py"} & set(argv)


def test_jpprun_argv_hands_the_program_to_jpprun():
    assert bench.jpprun_argv(2, PROGRAM, jpprun="launch/jpprun") == [
        "launch/jpprun", "-n", "2", *PROGRAM]


def test_without_rank_settings_keeps_only_the_users_own():
    env = {"XLA_FLAGS": f"--xla_cpu_use_thunk_runtime=true {ONE_THREAD}",
           "OMP_NUM_THREADS": "1", "JAXPP_MPI_THREADS_PER_RANK": "1",
           "JAXPP_MPI_AUTO_SETTINGS": "0", "PATH": "/bin", "OMPI_COMM_WORLD_RANK": "0"}
    assert common.without_rank_settings(env) == {
        "XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true", "PATH": "/bin",
        "OMPI_COMM_WORLD_RANK": "0"}
    assert "XLA_FLAGS" not in common.without_rank_settings({"XLA_FLAGS": ONE_THREAD})


@pytest.mark.parametrize("one_thread", [False, True])
def test_child_env_leaves_mpi_and_sets_threads_as_asked(one_thread):
    env = {"XLA_FLAGS": ONE_THREAD, "OMP_NUM_THREADS": "1", "PATH": "/bin",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_RANK": "0", "PRTE_MCA_x": "y"}
    out = common.child_env(env, one_thread=one_thread)
    assert not any(k.startswith(("OMPI_", "PMIX_", "PRTE_")) for k in out)
    assert out["JAXPP_MPI_AUTO_SETTINGS"] == "0" and out["PATH"] == "/bin"
    if one_thread:
        assert set(out["XLA_FLAGS"].split()) == set(ONE_THREAD.split())
        assert out["OMP_NUM_THREADS"] == "1"
    else:
        assert "XLA_FLAGS" not in out and "OMP_NUM_THREADS" not in out


def test_launch_order_alternates_by_round():
    assert [bench.launch_order(["jpprun", "mpirun"], r) for r in range(3)] == [
        ["jpprun", "mpirun"], ["mpirun", "jpprun"], ["jpprun", "mpirun"]]


def test_summary_pools_every_launchs_steps():
    launches = [
        {"launcher": "jpprun", "steps_ms": {"1f1b": [10.0, 12.0, 11.0]}},
        {"launcher": "mpirun", "steps_ms": {"1f1b": [12.0, 13.0, 14.0]}},
        {"launcher": "mpirun", "steps_ms": {"1f1b": [20.0, 21.0, 22.0]}},
        {"launcher": "jpprun", "steps_ms": {"1f1b": [9.0, 30.0, 31.0]}},
    ]
    row = bench.summarize(launches, ["jpprun", "mpirun"])["1f1b"]
    # jpprun's six steps 9 10 11 12 30 31: median 11.5; mpirun's 12 13 14 20 21 22: 17
    assert row["jpprun"] == {"step_ms": 11.5, "launch_medians_ms": [11.0, 30.0]}
    assert row["mpirun"] == {"step_ms": 17.0, "launch_medians_ms": [13.0, 21.0]}
    assert row["ratio"] == pytest.approx(17.0 / 11.5)
    assert "ratio" not in bench.summarize(launches[:1], ["jpprun"])["1f1b"]


def test_numa_node_reads_sysfs(tmp_path):
    (tmp_path / "cpu0" / "node0").mkdir(parents=True)
    (tmp_path / "cpu9" / "node1").mkdir(parents=True)
    (tmp_path / "cpu3").mkdir()
    assert [bench.numa_node(c, str(tmp_path)) for c in (0, 9, 3, 42)] == [0, 1, None, None]


def test_launchers_option_is_checked():
    with pytest.raises(SystemExit):
        bench.parse_args(["--launchers", "srun"])
    args = bench.parse_args(["--quick", "--launchers", "mpirun"])
    assert (args.launchers, args.steps, args.repeats, args.width) == (["mpirun"], 3, 3, 256)


def test_torch_match_same_name_else_fastest():
    torch = {"schedules": {"gpipe": {"step_ms": 12.0}, "1f1b": {"step_ms": 10.0}}}
    assert alone.torch_match("gpipe", torch) == ("gpipe", 12.0)
    assert alone.torch_match("gpipe+chained", torch) == ("gpipe", 12.0)
    assert alone.torch_match("zerobubble", torch) == ("1f1b", 10.0)
    assert alone.torch_match("1f1b", {"skipped": "torch is not installed"}) is None


def test_torch_absent_is_skipped_with_the_install_line(monkeypatch):
    monkeypatch.setattr(alone.importlib.util, "find_spec", lambda name: None)
    out = alone.torch_pipelining(None, [[0], [1]], repeats=1)
    assert out == {"skipped": f"torch is not installed: {alone.TORCH_HINT}"}
    assert "download.pytorch.org/whl/cpu" in out["skipped"]
