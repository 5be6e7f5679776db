"""The settings `import jaxpp_mpi` applies to a rank by itself (Note: Settings at import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxpp_mpi._src.launch import auto
from jaxpp_mpi._src.launch import env as launch_env
from jaxpp_mpi._src.launch import jpprun as launcher

ONE_THREAD_FLAGS = ["--xla_cpu_multi_thread_eigen=false",
                    "--xla_cpu_enable_concurrency_optimized_scheduler=false"]
# Rank 1 of 2 on one node, as each launcher says it (trimmed; see test_bind.py).
OPENMPI = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
HYDRA = {"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_RANK": "1", "PMI_SIZE": "2"}
SRUN = {"SLURM_LOCALID": "1", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2"}


def _plan(env, cores=range(8), node_cores=8, platform="cpu"):
    return auto.plan_auto_settings(env, cores=list(cores), node_cores=node_cores,
                                   platform=platform)


@pytest.mark.parametrize("launch", [OPENMPI, HYDRA, SRUN], ids=["openmpi", "hydra", "srun"])
def test_unbound_cpu_rank_gets_one_thread_flags_and_its_core(launch):
    s = _plan({**launch, "XLA_FLAGS": "--xla_dump_to=/d"})
    env = dict(s.env)
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/d", *ONE_THREAD_FLAGS]
    assert env["OMP_NUM_THREADS"] == "1" and env["JAXPP_MPI_THREADS_PER_RANK"] == "1"
    assert s.cores == (1,) and s.changes


def test_same_settings_as_jpprun():
    """The environment the hook gives a plain-mpirun rank is what jpprun exports; under
    jpprun (its environment, the rank bound to a core by mpirun) the hook changes nothing."""
    user = {"XLA_FLAGS": "--xla_dump_to=/d --xla_cpu_multi_thread_eigen=true"}
    plan = launcher.build_plan(2, ["python", "t.py"], mpirun="mpirun", vendor="openmpi",
                               cores=8, is_root=False, base_env=user)
    under_jpprun = {**user, **dict(plan.env), **OPENMPI}
    plain = {**user, **OPENMPI}
    assert {**plain, **dict(_plan(plain).env)} == under_jpprun
    assert not _plan(under_jpprun, cores=[1]).changes  # mpirun --bind-to core


def test_the_users_settings_win():
    env = {**OPENMPI, "XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
           "OMP_NUM_THREADS": "3"}
    s = _plan(env)
    assert dict(s.env) == {
        "XLA_FLAGS": "--xla_cpu_enable_concurrency_optimized_scheduler=true "
                     "--xla_cpu_multi_thread_eigen=false",
        "JAXPP_MPI_THREADS_PER_RANK": "1"}
    # Both flags set either way and the thread counts given: only the core is left to set.
    env = {**OPENMPI, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen "
           "--xla_cpu_enable_concurrency_optimized_scheduler=false",
           "OMP_NUM_THREADS": "1", "JAXPP_MPI_THREADS_PER_RANK": "1"}
    s = _plan(env)
    assert s.env == () and s.cores == (1,)


@pytest.mark.parametrize("cores, node_cores", [
    ([5], 8),               # Open MPI's default --bind-to core (2 ranks), srun --cpu-bind
    ([4, 5, 6, 7], 8),      # --bind-to package: the mask is narrower than the node's
    ([0, 1], 2),            # 2 cores for 4 ranks: oversubscribed, as jpprun leaves it
])
def test_an_existing_or_impossible_binding_is_left_alone(cores, node_cores):
    env = {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    s = _plan(env, cores=cores, node_cores=node_cores)
    assert s.cores is None
    assert dict(s.env)["XLA_FLAGS"].split() == ONE_THREAD_FLAGS  # the flags still apply


def test_threads_per_rank_from_the_environment():
    s = _plan({**OPENMPI, "JAXPP_MPI_THREADS_PER_RANK": "2"})
    assert "XLA_FLAGS" not in dict(s.env) and s.cores == (2, 3)
    assert dict(s.env) == {"OMP_NUM_THREADS": "2"}
    # srun --cpus-per-task=4 (bound by srun: the mask is its 4 cores).
    s = _plan({**SRUN, "SLURM_CPUS_PER_TASK": "4"}, cores=[4, 5, 6, 7])
    assert dict(s.env) == {"OMP_NUM_THREADS": "4", "JAXPP_MPI_THREADS_PER_RANK": "4"}
    assert s.cores is None


@pytest.mark.parametrize("env, platform, reason", [
    (OPENMPI, "gpu", "a gpu rank"),
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
     "cpu", "no other rank on this node"),   # one rank per node
    ({}, "cpu", "no other rank on this node"),      # no launcher: one process
    ({"SLURM_LOCALID": "0", "SLURM_NTASKS": "2"}, "cpu", "no other rank"),  # sbatch shell
    ({**OPENMPI, "JAXPP_MPI_AUTO_SETTINGS": "0"}, "cpu", "JAXPP_MPI_AUTO_SETTINGS is off"),
    ({**OPENMPI, "JAXPP_MPI_AUTO_SETTINGS": " Off "}, "cpu", "is off"),
])
def test_nothing_to_do(env, platform, reason):
    s = _plan(env, platform=platform)
    assert not s.changes and reason in s.reason


@pytest.mark.parametrize("env, match", [
    ({**OPENMPI, "JAXPP_MPI_AUTO_SETTINGS": "maybe"}, "use 1 or 0"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, "but OMPI_COMM_WORLD_LOCAL_SIZE is not"),
    ({**OPENMPI, "JAXPP_MPI_THREADS_PER_RANK": "x"}, "not an integer"),
])
def test_bad_environments_raise(env, match):
    with pytest.raises(launch_env.BindError, match=match):
        _plan(env)


@pytest.mark.parametrize("env, gpus, plugin, expected", [
    ({}, [], False, "cpu"),
    ({}, ["0", "1"], False, "cpu"),          # GPUs, but JAX has no GPU plugin: CPU
    ({}, [], True, "cpu"),                   # a plugin on a CPU node: CPU
    ({}, ["0"], True, "gpu"),
    ({"JAX_PLATFORMS": "cpu"}, ["0"], True, "cpu"),
    ({"JAX_PLATFORMS": " CUDA,cpu"}, [], False, "gpu"),
    ({"JAX_PLATFORMS": "cpu,cuda"}, ["0"], True, "cpu"),
    ({"JAX_PLATFORMS": ""}, ["0"], True, "gpu"),
])
def test_backend_platform(env, gpus, plugin, expected):
    assert auto.backend_platform(env, gpus, plugin) == expected


def test_rank_0_speaks_for_the_job():
    s = _plan(OPENMPI)
    assert not auto.speaks_for_job(s.local)
    assert auto.speaks_for_job(_plan({**OPENMPI, "OMPI_COMM_WORLD_RANK": "0",
                                      "OMPI_COMM_WORLD_LOCAL_RANK": "0"}).local)
    text = auto.too_late_warning(s, OPENMPI)
    for part in ["before `import jaxpp_mpi`", *ONE_THREAD_FLAGS, "OMP_NUM_THREADS=1",
                 "core(s) 1 of 0,1,2,3,4,5,6,7", "launch/jpprun", "JAXPP_MPI_AUTO_SETTINGS=0"]:
        assert part in text


@pytest.mark.parametrize("text, count", [
    ("0-3,8,10-11\n", 7), ("0", 1), ("", 0), ("0-1", 2)])
def test_count_cpu_list(text, count):
    assert launch_env.count_cpu_list(text) == count


def test_count_node_cores_from_the_cgroup(tmp_path):
    def write(path, text):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    proc = tmp_path / "cgroup"
    # cgroup v2: the process's own cgroup, else the nearest ancestor with a cpuset.
    write(proc, "0::/job/step\n")
    write(tmp_path / "v2/job/cpuset.cpus.effective", "2-5\n")
    assert launch_env.count_node_cores(str(proc), str(tmp_path / "v2")) == 4
    write(tmp_path / "v2/job/step/cpuset.cpus.effective", "3\n")
    assert launch_env.count_node_cores(str(proc), str(tmp_path / "v2")) == 1
    # cgroup v1: the cpuset hierarchy; a container sees its cgroup's files at the root.
    write(proc, "4:memory:/x\n3:cpuset:/docker/abc\n")
    write(tmp_path / "v1/cpuset/cpuset.effective_cpus", "0-7")
    assert launch_env.count_node_cores(str(proc), str(tmp_path / "v1")) == 8
    # Nothing readable: every CPU of the machine.
    assert launch_env.count_node_cores(str(tmp_path / "none"), str(tmp_path)) == os.cpu_count()


def test_gpu_plugin_found_without_importing_it(tmp_path, monkeypatch):
    assert not launch_env.gpu_plugin_installed()  # this test venv has CPU-only jaxlib
    (tmp_path / "jax_plugins" / "xla_cuda12").mkdir(parents=True)
    (tmp_path / "jax_plugins" / "xla_cuda12" / "__init__.py").write_text("raise ImportError")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert launch_env.gpu_plugin_installed()
    assert "jax_plugins.xla_cuda12" not in sys.modules


# -- the hook itself, in a fresh process (it runs at `import jaxpp_mpi`) ----------------

_REPORT = ("import json, os; print(json.dumps([os.environ.get('XLA_FLAGS'), "
           "os.environ.get('OMP_NUM_THREADS'), sorted(os.sched_getaffinity(0))]))")


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_", "PMI", "SLURM_", "MPI_", "MV2_", "JAXPP_MPI_",
                                 "XLA_FLAGS", "OMP_NUM_THREADS", "JAX_PLATFORMS"))}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env},
                          capture_output=True, text=True, timeout=120)


def _report(out: subprocess.CompletedProcess) -> list:
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_import_applies_the_settings():
    cores = sorted(os.sched_getaffinity(0))
    free = len(cores) >= 2 and len(cores) == launch_env.count_node_cores()
    flags, threads, mask = _report(_python("import jaxpp_mpi; " + _REPORT,
                                           {**OPENMPI, "JAX_PLATFORMS": "cpu"}))
    assert flags.split() == ONE_THREAD_FLAGS and threads == "1"
    assert mask == (cores[1:2] if free else cores)
    flags, threads, mask = _report(_python(
        "import jaxpp_mpi; " + _REPORT,
        {**OPENMPI, "JAX_PLATFORMS": "cpu", "JAXPP_MPI_AUTO_SETTINGS": "0"}))
    assert flags is None and threads is None and mask == cores


def test_too_late_warns_once_on_rank_0_and_changes_nothing():
    rank0 = {**OPENMPI, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
             "JAX_PLATFORMS": "cpu"}
    code = "import jax; jax.devices(); import jaxpp_mpi; " + _REPORT
    out = _python(code, rank0)
    assert _report(out)[:2] == [None, None]
    assert out.stderr.count("RuntimeWarning") == 1, out.stderr
    assert "JAX's backends were created before `import jaxpp_mpi`" in out.stderr
    out = _python(code, {**rank0, "OMPI_COMM_WORLD_RANK": "1"})
    assert "RuntimeWarning" not in out.stderr, out.stderr
    # Importing JAX alone starts no backend: the settings still apply.
    out = _python("import jax; import jaxpp_mpi; " + _REPORT, rank0)
    assert _report(out)[0].split() == ONE_THREAD_FLAGS and "Warning" not in out.stderr


def test_bind_local_devices_decides_over_the_hook():
    code = "import jaxpp_mpi.launch as l; l.bind_local_devices(threads_per_rank=2); " + _REPORT
    flags, threads, mask = _report(_python(code, {**OPENMPI, "JAX_PLATFORMS": "cpu"}))
    cores = sorted(os.sched_getaffinity(0))
    # Two threads: no one-thread flags (the hook's are gone), and rank 1's two cores of
    # the mask the process started with when 2 ranks x 2 fit in it, else that mask.
    assert flags in (None, "") and threads == "2"
    assert mask == (cores[2:4] if len(cores) >= 4 else cores)


def test_lone_rank_of_a_host_bound_to_one_core_gets_the_one_thread_flags():
    """Hosts given 1, 2 and 1 ranks under a plain mpirun: the lone rank of a host, bound
    to a core by mpirun, runs with the same thread settings as the others; its mask stays."""
    lone = {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
            "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    s = _plan(lone, cores=[0], node_cores=2)
    assert dict(s.env)["OMP_NUM_THREADS"] == "1" and s.cores is None
    assert "--xla_cpu_multi_thread_eigen=false" in dict(s.env)["XLA_FLAGS"]
    # Alone and unbound (every core), or alone in a job of one: nothing changes.
    assert not _plan(lone, cores=[0, 1], node_cores=2).changes
    assert not _plan({**lone, "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"},
                     cores=[0], node_cores=2).changes
    assert not _plan(lone, cores=[0], node_cores=2, platform="gpu").changes
