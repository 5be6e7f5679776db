"""launch/slurm/train.sbatch for several nodes, checked by its commands: the script runs
here with Slurm's environment for `sbatch --nodes=2 ...` and stand-ins for srun and
mpirun that record what they were asked to run (no Slurm here; a real single-node Slurm
runs it in `make test-slurm`). Each task's binding on its node then follows from the
variables srun gives it (Note: Local rank detection, Note: Device binding)."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from jaxpp_mpi._src.launch.bind import plan_binding
from jaxpp_mpi._src.launch.env import detect_local_rank

ROOT = Path(__file__).resolve().parents[3]
TEMPLATE = ROOT / "launch" / "slurm" / "train.sbatch"


def _submit(tmp_path: Path, launcher: str, **slurm: str) -> list[str]:
    """Runs the template as sbatch would on the first node; the command it started."""
    record = tmp_path / "argv"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("srun", "mpirun", "scontrol", "scancel"):
        stub = bin_dir / tool
        stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$0" "$@" > {record}\n')
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
           "JPP_REPO": str(ROOT), "JPP_PYTHON": "/venv/bin/python",
           "JPP_MPIRUN": str(bin_dir / "mpirun"), "JPP_LAUNCHER": launcher,
           "SLURM_JOB_ID": "7", **slurm}
    proc = subprocess.run(["bash", str(TEMPLATE)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return record.read_text().splitlines()


TWO_NODES = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4",
             "SLURM_CPUS_PER_TASK": "2", "SLURM_GPUS_PER_TASK": "1"}
RANK_CMD = ["/venv/bin/python", "-m", "jaxpp_mpi.launch", "--gpus-per-rank", "1",
            "--threads-per-rank", "2", "--", "/venv/bin/python", "-m", "mpi4py",
            str(ROOT / "examples" / "train.py"), "--schedule", "1f1b", "--steps", "100"]


def test_srun_on_two_nodes_starts_every_task_through_the_binding_wrapper(tmp_path):
    argv = _submit(tmp_path, "srun", **TWO_NODES)
    assert Path(argv[0]).name == "srun"
    assert argv[1:5] == ["--mpi=pmix", "--cpus-per-task=2", "--cpu-bind=cores",
                         "--kill-on-bad-exit=1"]
    assert argv[5:] == RANK_CMD


def test_mpirun_on_two_nodes_places_4_ranks_per_node(tmp_path):
    argv = _submit(tmp_path, "mpirun", **TWO_NODES)
    assert Path(argv[0]).name == "mpirun"
    line = shlex.join(argv[1:])
    assert "-n 8 --map-by ppr:4:node:PE=2 --bind-to core" in line, line
    assert argv[-len(RANK_CMD):] == RANK_CMD
    # Without --ntasks-per-node (sbatch -n 5 -N 2): each node's slots, filled in order.
    uneven = {k: v for k, v in TWO_NODES.items() if k != "SLURM_NTASKS_PER_NODE"}
    argv = _submit(tmp_path, "mpirun", **dict(uneven, SLURM_NTASKS="5"))
    assert "-n 5 --map-by slot:PE=2 --bind-to core" in shlex.join(argv), argv


def test_one_replica_per_node(tmp_path):
    argv = _submit(tmp_path, "srun", **TWO_NODES, JPP_REPLICAS="2")
    assert argv[-2:] == ["--replicas", "2"]


@pytest.mark.parametrize("per_node, node, local, gpus, cores", [
    ("4(x2)", 1, 2, "2", (4, 5)),   # -N 2 --ntasks-per-node=4: task 6, node 1
    ("3,1", 1, 0, "0", tuple(range(8))),  # -n 4 -N 2: the second node's only task: all
    ("3,1", 0, 2, "2", (4, 5)),
])
def test_each_task_binds_by_its_place_on_its_own_node(per_node, node, local, gpus, cores):
    """What `python -m jaxpp_mpi.launch` decides on a task of an srun step over 2 nodes,
    each with 4 GPUs and 8 cores, 2 threads per task (GPUs and cores by local rank)."""
    env = {"SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
           "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_PROCID": "0"}
    where = detect_local_rank(env)
    assert where.local_rank == local
    binding = plan_binding(where, env, cores=range(8), node_gpus=4, gpus_per_rank=1,
                           threads_per_rank=2)
    assert dict(binding.env)["CUDA_VISIBLE_DEVICES"] == gpus
    assert binding.cores == cores
