"""launch/jpprun's command construction (pure: no MPI is started here)."""

from __future__ import annotations

import pytest

from jaxpp_mpi._src.launch import jpprun as launcher


def _plan(n=2, command=("python", "t.py"), **kw):
    args = dict(
        threads_per_rank=1, mpirun="/v/bin/mpirun", vendor="openmpi", cores=2,
        is_root=False, base_env={},
    )
    args.update(kw)
    return launcher.build_plan(n, list(command), **args)


def test_openmpi_fits_binds_to_cores_without_root_or_oversubscribe_flags():
    argv = _plan(2).argv
    assert argv[:3] == ("/v/bin/mpirun", "-n", "2")
    assert "--oversubscribe" not in argv and "--allow-run-as-root" not in argv
    i = argv.index("--bind-to")
    assert argv[i + 1] == "core" and "slot:PE=1" in argv


def test_openmpi_root_and_oversubscribed():
    argv = _plan(4, is_root=True).argv
    assert "--allow-run-as-root" in argv and "--oversubscribe" in argv
    assert argv[argv.index("--bind-to") + 1] == "none"


def test_threads_per_rank_counts_towards_oversubscription():
    assert "--oversubscribe" in _plan(2, threads_per_rank=2, cores=2).argv
    assert "--oversubscribe" not in _plan(2, threads_per_rank=2, cores=4).argv
    assert "slot:PE=2" in _plan(2, threads_per_rank=2, cores=4).argv


def test_thread_env_exported_and_xla_flags_kept():
    plan = _plan(2, base_env={"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    env = dict(plan.env)
    assert env["OMP_NUM_THREADS"] == "1" and env["JAXPP_MPI_THREADS_PER_RANK"] == "1"
    assert env["XLA_FLAGS"].split() == [
        "--xla_dump_to=/tmp/x", "--xla_cpu_multi_thread_eigen=false",
        "--xla_cpu_enable_concurrency_optimized_scheduler=false"]
    # A one-thread flag the user set either way is kept as given.
    user = _plan(2, base_env={"XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true"})
    assert dict(user.env)["XLA_FLAGS"].split() == [
        "--xla_cpu_enable_concurrency_optimized_scheduler=true",
        "--xla_cpu_multi_thread_eigen=false"]
    for key in env:
        assert ("-x", key) in zip(plan.argv, plan.argv[1:])
    # More than one thread: no single-thread XLA flag.
    assert "XLA_FLAGS" not in dict(_plan(1, threads_per_rank=2, cores=4).env)


def test_mpich_uses_genv_and_bind_to():
    argv = _plan(2, vendor="mpich", is_root=True).argv
    assert "--allow-run-as-root" not in argv
    assert ("-genv", "OMP_NUM_THREADS", "1") in zip(argv, argv[1:], argv[2:])
    assert ("-bind-to", "core:1") in zip(argv, argv[1:])


def test_python_programs_run_through_mpi4py_abort_wrapper():
    f = launcher.with_abort_on_error
    assert f(["python", "t.py", "-x"], "/py") == ["/py", "-m", "mpi4py", "t.py", "-x"]
    assert f(["python", "-u", "-X", "dev", "-m", "pytest"], "/py") == [
        "/py", "-u", "-X", "dev", "-m", "mpi4py", "-m", "pytest"]
    assert f(["python", "-m", "mpi4py", "t.py"], "/py") == ["/py", "-m", "mpi4py", "t.py"]
    assert f(["./a.out", "1"], "/py") == ["./a.out", "1"]
    for name in ("python3", "python3.12", "/usr/bin/python3.13"):  # any Python 3 is the venv's
        assert f([name, "t.py"], "/py") == ["/py", "-m", "mpi4py", "t.py"], name
    assert f(["python3.12-config"], "/py") == ["python3.12-config"]


@pytest.mark.parametrize(
    "n, threads, command, match",
    [(0, 1, ["p"], "-n must be >= 1"), (2, 0, ["p"], "threads-per-rank"), (2, 1, [], "no program")],
)
def test_bad_arguments(n, threads, command, match):
    with pytest.raises(ValueError, match=match):
        _plan(n, command=command, threads_per_rank=threads)


def test_dry_run_prints_and_runs_nothing(capsys):
    rc = launcher.main(["-n", "2", "--mpirun", "/bin/false", "--dry-run", "python", "t.py"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "jpprun:" in err and "-m mpi4py t.py" in err


def test_gpus_bound_by_local_rank_through_the_wrapper():
    plan = _plan(2, gpus_per_rank=2, visible_gpus=4, python="/v/bin/python")
    i = plan.argv.index("jaxpp_mpi.launch")
    assert plan.argv[i - 2:] == (
        "/v/bin/python", "-m", "jaxpp_mpi.launch", "--gpus-per-rank", "2", "--",
        "python", "t.py")
    assert dict(plan.env)["JAXPP_MPI_GPUS_PER_RANK"] == "2"
    assert ("-x", "JAXPP_MPI_GPUS_PER_RANK") in zip(plan.argv, plan.argv[1:])
    argv = _plan(2, gpus_per_rank=1, visible_gpus=2, vendor="mpich").argv
    assert ("-genv", "JAXPP_MPI_GPUS_PER_RANK", "1") in zip(argv, argv[1:], argv[2:])


@pytest.mark.parametrize("gpus_per_rank, visible, env, expected, note", [
    (None, 8, {}, 4, False),                     # default: the visible GPUs shared evenly
    (None, 0, {}, 0, False),                     # no GPU: CPU
    (None, 8, {"JAX_PLATFORMS": "cpu"}, 0, False),
    (None, 1, {}, 0, True),                      # fewer GPUs than ranks: CPU, with a note
    (0, 8, {}, 0, False),                        # --gpus-per-rank 0: CPU
    (3, 8, {}, 3, False),
])
def test_gpus_per_rank_decision(gpus_per_rank, visible, env, expected, note):
    plan = _plan(2, gpus_per_rank=gpus_per_rank, visible_gpus=visible, base_env=env)
    wrapped = "jaxpp_mpi.launch" in plan.argv
    assert wrapped == (expected > 0) and bool(plan.notes) == note
    assert dict(plan.env).get("JAXPP_MPI_GPUS_PER_RANK") == (str(expected) if expected else None)


def test_too_many_gpus_asked_for():
    with pytest.raises(ValueError, match="need 8 GPUs, 4 visible"):
        _plan(2, gpus_per_rank=4, visible_gpus=4)
    with pytest.raises(ValueError, match="--gpus-per-rank must be >= 0"):
        _plan(2, gpus_per_rank=-1, visible_gpus=4)
