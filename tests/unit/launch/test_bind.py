"""bind_local_devices: local rank from each launcher's environment, and the device binding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxpp_mpi import launch
from jaxpp_mpi._src.launch import env as launch_env

# Environments as the launchers set them (trimmed to what matters), rank 1 of 2 on a node.
# srun: recorded from `srun --mpi=pmix -n 2` under Slurm 22.05 (tests/slurm).
SRUN_PMIX = {
    "SLURM_LOCALID": "1", "SLURM_PROCID": "1", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
    "SLURM_NTASKS": "2", "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2",
    "PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.1.0",
}
# The batch script's own environment: no SLURM_STEP_* (recorded under Slurm 22.05).
SBATCH_SHELL = {"SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "2",
                "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2"}
OPENMPI = {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
           "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "PMIX_RANK": "3"}
HYDRA = {"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_RANK": "3", "PMI_SIZE": "4"}
MVAPICH = {"MV2_COMM_WORLD_LOCAL_RANK": "1", "MV2_COMM_WORLD_LOCAL_SIZE": "2",
           "MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4"}
# mpirun inside an allocation starts its daemons with srun: every rank inherits the
# daemon's SLURM_LOCALID=0 (seen on a real run), while the MPI variables are right.
SRUN_DAEMON = {"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1",
               "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize("env, expected", [
    (OPENMPI, launch_env.LocalRank(1, 2, 3, 4, "openmpi")),
    (HYDRA, launch_env.LocalRank(1, 2, 3, 4, "hydra")),
    (MVAPICH, launch_env.LocalRank(1, 2, 3, 4, "mvapich")),
    (SRUN_PMIX, launch_env.LocalRank(1, 2, 1, 2, "slurm")),
    ({**SRUN_DAEMON, **OPENMPI}, launch_env.LocalRank(1, 2, 3, 4, "openmpi")),
    ({**SRUN_DAEMON, **HYDRA}, launch_env.LocalRank(1, 2, 3, 4, "hydra")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, launch_env.LocalRank(1, 2, 1, 2, "pmi")),
    ({**OPENMPI, "JAXPP_MPI_LOCAL_RANK": "0", "JAXPP_MPI_LOCAL_SIZE": "1"},
     launch_env.LocalRank(0, 1, None, None, "override")),
    (SBATCH_SHELL, launch_env.LocalRank(0, 1, None, None, "none")),
    ({}, launch_env.LocalRank(0, 1, None, None, "none")),
], ids=["openmpi", "hydra", "mvapich", "srun", "mpirun-in-slurm", "hydra-in-slurm", "pmi",
        "override", "sbatch-shell", "no-launcher"])
def test_detect_local_rank(env, expected):
    assert launch.detect_local_rank(env) == expected


@pytest.mark.parametrize("env, size", [
    (OPENMPI, 4), (HYDRA, 4), (MVAPICH, 4), (SRUN_PMIX, 2), ({**SRUN_DAEMON, **OPENMPI}, 4),
    (SBATCH_SHELL, 1), ({}, 1),
], ids=["openmpi", "hydra", "mvapich", "srun", "mpirun-in-slurm", "sbatch-shell", "none"])
def test_launcher_world_size(env, size):
    assert launch.launcher_world_size(env) == size


def test_srun_on_several_nodes_reads_this_nodes_task_count():
    env = {"SLURM_LOCALID": "0", "SLURM_PROCID": "6", "SLURM_NODEID": "3",
           "SLURM_STEP_NUM_TASKS": "7", "SLURM_STEP_NUM_NODES": "4",
           "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    assert launch.detect_local_rank(env) == launch_env.LocalRank(0, 1, 6, 7, "slurm")
    assert launch_env.slurm_tasks_on_node("2(x3),1", 2) == 2
    assert launch_env.slurm_tasks_on_node("4", 0) == 4
    # Without the per-node list: --ntasks-per-node, else only a one-node step is known.
    env = {"SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2"}
    assert launch.detect_local_rank({**env, "SLURM_NTASKS_PER_NODE": "4"}).local_size == 4
    with pytest.raises(launch.BindError, match="tasks on this node"):
        launch.detect_local_rank(env)


@pytest.mark.parametrize("env, match", [
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "0"}, "OMPI_COMM_WORLD_LOCAL_SIZE is not"),
    ({"MPI_LOCALRANKID": "x", "MPI_LOCALNRANKS": "2"}, "not an integer"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, "outside"),
    ({"PMIX_RANK": "0"}, "only PMIX_RANK"),
    ({"PMI_RANK": "0", "PMI_SIZE": "4", "SLURM_STEP_NUM_NODES": "2"}, "only PMI_RANK"),
    ({**SRUN_PMIX, "SLURM_STEP_TASKS_PER_NODE": "2(x"}, "cannot parse"),
    ({**SRUN_PMIX, "SLURM_NODEID": "1"}, "outside tasks per node"),
])
def test_detect_local_rank_errors(env, match):
    with pytest.raises(launch.BindError, match=match):
        launch.detect_local_rank(env)


RANK_1_OF_2 = launch_env.LocalRank(1, 2, 1, 2, "slurm")


def _plan(local=RANK_1_OF_2, env=None, cores=range(8), node_gpus=0, **kw):
    return launch.plan_binding(local, env or {}, cores=list(cores), node_gpus=node_gpus, **kw)


def test_gpus_sliced_by_local_rank():
    b = _plan(node_gpus=4)  # auto: 4 GPUs / 2 ranks
    assert b.platform == "gpu" and dict(b.env) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    assert b.cores == (4, 5, 6, 7)  # the node's cores shared too
    b = _plan(node_gpus=8, gpus_per_rank=1)
    assert dict(b.env) == {"CUDA_VISIBLE_DEVICES": "1"}
    # An existing CUDA_VISIBLE_DEVICES (the job's GPUs, UUIDs or indices) is sliced.
    env = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d", "JAXPP_MPI_GPUS_PER_RANK": "2"}
    assert dict(_plan(env=env, node_gpus=8).env) == {"CUDA_VISIBLE_DEVICES": "GPU-c,GPU-d"}


def test_gpus_already_bound_by_launcher_are_kept():
    # srun --gpus-per-task=1: each task sees exactly its own GPU.
    env = {"CUDA_VISIBLE_DEVICES": "3", "SLURM_GPUS_PER_TASK": "1"}
    assert dict(_plan(env=env, node_gpus=4).env) == {"CUDA_VISIBLE_DEVICES": "3"}
    env = {"CUDA_VISIBLE_DEVICES": "2,3", "SLURM_GPUS_PER_TASK": "a100:2"}
    assert dict(_plan(env=env, node_gpus=4).env) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    # Two GPUs on the node and two ranks asking for two each: not bound, an error.
    with pytest.raises(launch.BindError, match="need 4 GPUs, but 2 are visible"):
        _plan(node_gpus=2, gpus_per_rank=2)
    with pytest.raises(launch.BindError, match="fewer GPUs than ranks"):
        _plan(node_gpus=1)


@pytest.mark.parametrize("env, kw", [
    ({"JAX_PLATFORMS": "cpu"}, {}), ({}, {"gpus_per_rank": 0}), ({}, {"platform": "cpu"}),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, {}), ({"CUDA_VISIBLE_DEVICES": ""}, {}),
])
def test_cpu_chosen_despite_gpus(env, kw):
    b = _plan(env=env, node_gpus=4, **kw)
    assert b.platform == "cpu" and "CUDA_VISIBLE_DEVICES" not in dict(b.env)


def test_cpu_threads_and_core_slice():
    b = _plan(threads_per_rank=2)
    assert b.platform == "cpu" and b.cores == (2, 3)
    env = dict(b.env)
    assert env["OMP_NUM_THREADS"] == "2" and env["JAXPP_MPI_THREADS_PER_RANK"] == "2"
    assert "XLA_FLAGS" not in env
    # Default: the cores shared evenly; $SLURM_CPUS_PER_TASK when Slurm gave a count.
    assert _plan().cores == (4, 5, 6, 7)
    assert _plan(env={"SLURM_CPUS_PER_TASK": "3"}).cores == (3, 4, 5)
    # One thread: XLA's multi-threaded Eigen off, the user's flags kept; device count set.
    b = _plan(env={"XLA_FLAGS": "--xla_dump_to=/d --xla_force_host_platform_device_count=8"},
              threads_per_rank=1, cpu_devices=2)
    assert dict(b.env)["XLA_FLAGS"].split() == [
        "--xla_dump_to=/d", "--xla_cpu_multi_thread_eigen=false",
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
        "--xla_force_host_platform_device_count=2"]
    assert b.cores == (1,)


def test_cpu_mask_left_alone_when_oversubscribed_or_already_bound():
    assert _plan(cores=[0, 1], threads_per_rank=2).cores is None  # 2 ranks x 2 > 2 cores
    # The launcher already bound this rank to its one core (mpirun --bind-to core).
    assert _plan(cores=[5], threads_per_rank=1).cores is None


@pytest.mark.parametrize("kw, match", [
    ({"threads_per_rank": 0}, "threads_per_rank must be positive"),
    ({"gpus_per_rank": -1}, "gpus_per_rank must be positive"),
    ({"cpu_devices": 0}, "cpu_devices must be positive"),
    ({"platform": "tpu"}, "platform must be"),
    ({"env": {"SLURM_GPUS_PER_TASK": "a100"}}, "no GPU count"),
])
def test_plan_errors(kw, match):
    with pytest.raises(launch.BindError, match=match):
        _plan(**kw)


def test_describe_names_everything():
    text = _plan(node_gpus=4).describe()
    assert text == "local rank 1/2 (slurm): gpu, cores 4,5,6,7, CUDA_VISIBLE_DEVICES=2,3"


def test_refuses_after_jax_backends_exist():
    import jax

    jax.devices()  # creates the backends
    before = dict(os.environ)
    with pytest.raises(launch.BindError, match="before JAX initialises its backends"):
        launch.bind_local_devices()
    assert dict(os.environ) == before


_CHILD = ("import json, os; print(json.dumps([os.environ.get(k) for k in "
          "('CUDA_VISIBLE_DEVICES', 'OMP_NUM_THREADS')] + [sorted(os.sched_getaffinity(0))]))")


def _run_wrapper(args, env):
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_", "PMI", "SLURM_", "MPI_", "JAXPP_MPI_", "CUDA_",
                                 "JAX_PLATFORMS"))}
    out = subprocess.run([sys.executable, "-m", "jaxpp_mpi.launch", *args, "--",
                          sys.executable, "-c", _CHILD], env={**base, **env},
                         capture_output=True, text=True, timeout=60)
    return out


def test_wrapper_binds_then_execs_the_program():
    import json

    out = _run_wrapper(["--gpus-per-rank", "1"], {**OPENMPI, "CUDA_VISIBLE_DEVICES": "4,6"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)[0] == "6"
    cores = sorted(os.sched_getaffinity(0))
    # CPU binding, on a GPU node too (there, without JAX_PLATFORMS=cpu, the node's GPUs
    # would be shared out and 2 ranks on a 1-GPU node refused).
    out = _run_wrapper(["--threads-per-rank", "1", "--verbose"],
                       {**OPENMPI, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    gpus, threads, child_cores = json.loads(out.stdout)
    assert gpus is None and threads == "1"
    assert child_cores == (cores[1:2] if len(cores) >= 2 else cores)
    assert "local rank 1/2 (openmpi): cpu" in out.stderr
    out = _run_wrapper([], {"PMIX_RANK": "0"})
    assert out.returncode == 2 and "only PMIX_RANK is set" in out.stderr


def test_importing_the_module_does_not_import_jax():
    code = "import sys, jaxpp_mpi.launch; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr
