"""What a launched rank reads from and writes to its environment (stdlib only, no JAX).

The one home of the launchers' variable names, shared by jpprun (which writes the
environment every rank starts with), `jaxpp_mpi.launch` (which reads it on each rank) and
the settings `import jaxpp_mpi` applies (Note: Settings at import in auto.py), with the
facts about the node they read (its GPUs, the cores it gives the job). Our own
`JAXPP_MPI_*` variables are defined and parsed in base/variables.py; here a malformed one
is a BindError naming it (`our_variable`).

Note: Local rank detection.
  Every launcher tells a process where it sits on its node through the environment, each
  in its own names. They are read in this order, and the first launcher whose variables
  are present wins:
  1. `JAXPP_MPI_LOCAL_RANK` / `JAXPP_MPI_LOCAL_SIZE`: an explicit override;
  2. Open MPI (`mpirun`, `prterun`): `OMPI_COMM_WORLD_LOCAL_RANK` / `_LOCAL_SIZE`;
  3. MVAPICH2: `MV2_COMM_WORLD_LOCAL_RANK` / `_LOCAL_SIZE`;
  4. MPICH / Intel MPI (Hydra's `mpiexec`): `MPI_LOCALRANKID` / `MPI_LOCALNRANKS`;
  5. SLURM, inside an `srun` step only (`SLURM_STEP_NUM_TASKS` set): `SLURM_LOCALID`, the
     node's task count from `SLURM_STEP_TASKS_PER_NODE` (e.g. `2(x3),1`, indexed by
     `SLURM_NODEID`), else `SLURM_NTASKS_PER_NODE`, else the step's task count when the
     step has one node. The batch script itself also has `SLURM_LOCALID=0` and the job's
     `SLURM_NTASKS`, yet a program it starts without srun is a single process.
  The MPI launchers come before SLURM on purpose: `mpirun` or `mpiexec` inside an
  allocation start their ranks through srun-launched daemons, so every rank inherits the
  daemon's `SLURM_LOCALID` (0 on every node) while the MPI variables are right.
  PMI (`PMI_RANK`, `PMI_SIZE`) and PMIx (`PMIX_RANK`) alone give a global rank but not a
  local one: PMI's are taken as one node's ranks (unless SLURM says the step spans several
  nodes); otherwise a clear error names the override.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from typing import NamedTuple

from jaxpp_mpi._src.base import variables

# Defined and parsed, with their ranges, in base/variables.py (`Note: variable values`).
THREADS_PER_RANK_ENV = "JAXPP_MPI_THREADS_PER_RANK"
GPUS_PER_RANK_ENV = "JAXPP_MPI_GPUS_PER_RANK"
# `0`/`off`: `import jaxpp_mpi` leaves the rank's settings alone (Note: Settings at import).
AUTO_SETTINGS_ENV = "JAXPP_MPI_AUTO_SETTINGS"
# Note: one-thread XLA flags.
#   A rank with one compute thread gets XLA's multi-threaded CPU kernels off, and XLA's
#   memory-minimising CPU scheduler instead of the concurrency-optimised default: with one
#   thread there is no concurrency to gain, while the default runs a task's independent
#   dots before their consumers and keeps every temporary live. In a zero-bubble W task
#   (8 weight-gradient dots, each followed by its accumulation) that made the task 3x
#   slower, from page faults on 128 MiB of fresh temporaries per call (measured on
#   bench/schedules.py's workload: ZeroBubble 0.57 -> 0.95 of its ideal). The flag is
#   global (XLA reads it from XLA_FLAGS, not from a compile's `compiler_options`). A
#   flag the user set either way is kept as given. jpprun exports them (`thread_env`);
#   a rank started by another launcher gets them from `import jaxpp_mpi` (Note:
#   Settings at import in auto.py).
_SINGLE_THREAD_XLA = ("--xla_cpu_multi_thread_eigen=false",
                      "--xla_cpu_enable_concurrency_optimized_scheduler=false")
_NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"
_CGROUP_ROOT = "/sys/fs/cgroup"


class LauncherVars(NamedTuple):
    """The variables through which one launcher places a process (None: not given)."""

    name: str
    local_rank: str
    local_size: str
    rank: str | None
    size: str | None


# The launchers that give a local rank directly, in Note: Local rank detection's order.
MPI_LAUNCHERS = (
    LauncherVars("override", "JAXPP_MPI_LOCAL_RANK", "JAXPP_MPI_LOCAL_SIZE", None, None),
    LauncherVars("openmpi", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    LauncherVars("mvapich", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
                 "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
    LauncherVars("hydra", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_RANK", "PMI_SIZE"),
)
# An srun step's task count (under mpirun inside an allocation it counts mpirun's
# daemons, not ranks, which is why it comes last in WORLD_SIZE_VARS).
SLURM_STEP_SIZE = "SLURM_STEP_NUM_TASKS"
# The job's size as each launcher gives it, in Note: Local rank detection's order.
WORLD_SIZE_VARS = (*(v.size for v in MPI_LAUNCHERS if v.size is not None), SLURM_STEP_SIZE)


class BindError(RuntimeError):
    """The local rank or the device binding cannot be worked out, or it is too late."""


@dataclasses.dataclass(frozen=True)
class LocalRank:
    """Where this process sits: its node-local rank among `local_size`, and globally.

    `rank` and `size` are None when the launcher's environment does not give them.
    """

    local_rank: int
    local_size: int
    rank: int | None
    size: int | None
    launcher: str


def our_variable(env: Mapping[str, str], name: str) -> object:
    """The value of our variable `name` in `env`, parsed by its definition in
    base/variables.py (None when it is absent, for those without a default).

    Raises:
      BindError: naming the variable, its value and what it takes.
    """
    try:
        return variables.variable(name).parse(env)
    except variables.VariableError as e:
        raise BindError(str(e)) from None


def env_int(env: Mapping[str, str], name: str | None) -> int | None:
    """The integer value of variable `name` in `env`, or None when it is absent.

    Args:
      env: the environment.
      name: the variable (None: absent); one of ours (`JAXPP_MPI_*`) is parsed by its
        definition (`our_variable`), in its range.

    Returns:
      Its value as an int, or None.

    Raises:
      BindError: when the value is not an integer, or one of ours is out of its range.
    """
    if name is None or name not in env:
        return None
    if name.startswith("JAXPP_MPI_"):
        return our_variable(env, name)  # type: ignore[return-value]
    try:
        return int(env[name])
    except ValueError:
        raise BindError(f"{name}={env[name]!r} is not an integer") from None


def slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """The task count of node `node_id` in SLURM's compressed list, e.g. `2(x3),1`.

    Args:
      tasks_per_node: the value of `SLURM_STEP_TASKS_PER_NODE` or `SLURM_TASKS_PER_NODE`.
      node_id: the node's index within the job (`SLURM_NODEID`).

    Returns:
      How many tasks run on that node.

    Raises:
      BindError: on a malformed list or a node index beyond it.
    """
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise BindError(f"cannot parse SLURM tasks per node {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise BindError(f"SLURM_NODEID={node_id} is outside tasks per node {tasks_per_node!r}")
    return counts[node_id]


def _slurm(env: Mapping[str, str]) -> LocalRank | None:
    local_rank = env_int(env, "SLURM_LOCALID")
    size = env_int(env, SLURM_STEP_SIZE)
    if local_rank is None or size is None:  # not in an srun step (e.g. the batch script)
        return None
    nodes = env_int(env, "SLURM_STEP_NUM_NODES")
    local_size = None
    if "SLURM_STEP_TASKS_PER_NODE" in env:
        local_size = slurm_tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"],
                                         env_int(env, "SLURM_NODEID") or 0)
    if local_size is None:
        local_size = env_int(env, "SLURM_NTASKS_PER_NODE")
    if local_size is None and nodes == 1:
        local_size = size
    if local_size is None:
        raise BindError("SLURM_LOCALID is set but the tasks on this node are not "
                        "(no SLURM_STEP_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE); set "
                        "JAXPP_MPI_LOCAL_RANK and JAXPP_MPI_LOCAL_SIZE")
    return LocalRank(local_rank, local_size, env_int(env, "SLURM_PROCID"), size, "slurm")


def _pmi_only(env: Mapping[str, str]) -> LocalRank | None:
    rank, size = env_int(env, "PMI_RANK"), env_int(env, "PMI_SIZE")
    if (rank is not None and size is not None
            and (env_int(env, "SLURM_STEP_NUM_NODES") or 1) == 1):
        return LocalRank(rank, size, rank, size, "pmi")  # taken as one node's ranks
    for var in ("PMI_RANK", "PMIX_RANK"):
        if var in env:
            raise BindError(f"only {var} is set: the rank on this node is unknown; set "
                            "JAXPP_MPI_LOCAL_RANK and JAXPP_MPI_LOCAL_SIZE")
    return None


def detect_local_rank(env: Mapping[str, str]) -> LocalRank:
    """Reads this process's local rank and local size from its launcher's environment.

    See Note: Local rank detection for the launchers and their order.

    Args:
      env: the environment to read (normally `os.environ`).

    Returns:
      The LocalRank; a process started without any launcher is rank 0 of 1 ('none').

    Raises:
      BindError: when a launcher's variables are present but incomplete or inconsistent.
    """
    for launcher, lr_var, ls_var, rank_var, size_var in MPI_LAUNCHERS:
        local_rank = env_int(env, lr_var)
        if local_rank is None:
            continue
        local_size = env_int(env, ls_var)
        if local_size is None:
            raise BindError(f"{lr_var} is set but {ls_var} is not")
        found = LocalRank(local_rank, local_size, env_int(env, rank_var),
                          env_int(env, size_var), launcher)
        break
    else:
        found = _slurm(env) or _pmi_only(env) or LocalRank(0, 1, None, None, "none")
    if not 0 <= found.local_rank < found.local_size:
        raise BindError(f"local rank {found.local_rank} is outside local size "
                        f"{found.local_size} ({found.launcher})")
    return found


def launcher_world_size(env: Mapping[str, str]) -> int:
    """The number of ranks the launcher started, from its environment (1 without one).

    For deciding, before MPI or JAX start, whether a program runs as one process or as
    an MPI job (`mpirun`, `mpiexec`, `srun` alike).

    Args:
      env: the environment to read (normally `os.environ`).

    Returns:
      The world size: the first of `WORLD_SIZE_VARS` that is set, else 1.

    Raises:
      BindError: when that variable is not an integer.
    """
    for name in WORLD_SIZE_VARS:
        size = env_int(env, name)
        if size is not None:
            return size
    return 1


def job_world_size() -> int:
    """The MPI job's size, without importing mpi4py.

    Returns:
      `COMM_WORLD`'s size when `mpi4py.MPI` is already imported and initialised (as
      under `python -m mpi4py`, which `launch/jpprun` uses), else the launcher's
      (`launcher_world_size(os.environ)`), which is 1 without a launcher.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return int(mpi.COMM_WORLD.Get_size())
    return launcher_world_size(os.environ)


def thread_env(threads: int, base_env: Mapping[str, str]) -> dict[str, str]:
    """Environment entries that hold a rank's XLA/OpenMP to `threads` threads.

    Args:
      threads: compute threads per rank.
      base_env: the environment the entries are added to (its `XLA_FLAGS` are kept).

    Returns:
      `JAXPP_MPI_THREADS_PER_RANK` and `OMP_NUM_THREADS`, plus, for one thread,
      `XLA_FLAGS` with the one-thread flags (`Note: one-thread XLA flags`).
    """
    env = {THREADS_PER_RANK_ENV: str(threads), "OMP_NUM_THREADS": str(threads)}
    if threads == 1:
        flags = base_env.get("XLA_FLAGS", "")
        given = {f.split("=")[0] for f in flags.split()}
        for flag in _SINGLE_THREAD_XLA:
            if flag.split("=")[0] not in given:
                flags = (flags + " " + flag).strip()
        env["XLA_FLAGS"] = flags
    return env


def threads_from_env(env: Mapping[str, str]) -> int | None:
    """The compute threads per rank the environment asks for, or None when it does not.

    Args:
      env: the environment.

    Returns:
      `$JAXPP_MPI_THREADS_PER_RANK` (jpprun exports it to every rank), else
      `$SLURM_CPUS_PER_TASK` (the cores Slurm gave each task), else None.

    Raises:
      BindError: when the value is not an integer, or ours is out of its range.
    """
    return env_int(env, THREADS_PER_RANK_ENV) or env_int(env, "SLURM_CPUS_PER_TASK")


def auto_settings_enabled(env: Mapping[str, str]) -> bool:
    """Whether `import jaxpp_mpi` may apply the rank's settings (`JAXPP_MPI_AUTO_SETTINGS`).

    Args:
      env: the environment.

    Returns:
      False for `0`, `false`, `no` or `off`; True when unset, or `1`, `true`, `yes`,
      `on`.

    Raises:
      BindError: on any other value, the empty one included.
    """
    return bool(our_variable(env, AUTO_SETTINGS_ENV))


def visible_gpus(env: Mapping[str, str], node_gpus: int) -> list[str]:
    """The GPU ids this process may use: `CUDA_VISIBLE_DEVICES` if set, else all of them.

    Args:
      env: the environment.
      node_gpus: GPUs on this node (see `count_node_gpus`).

    Returns:
      The ids as strings (indices, or UUIDs such as `GPU-...`/`MIG-...` as given).
    """
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return [str(i) for i in range(node_gpus)]
    ids = [v.strip() for v in value.split(",") if v.strip()]
    if ids and ids[0] in ("-1", "NoDevFiles"):
        return []
    return ids


def count_node_gpus(driver_dir: str = _NVIDIA_GPUS_DIR) -> int:
    """NVIDIA GPUs on this node, from the driver's /proc entries (0 without a driver)."""
    try:
        return len(os.listdir(driver_dir))
    except OSError:
        return 0


def gpu_plugin_installed() -> bool:
    """Whether a GPU PJRT plugin for JAX (CUDA or ROCm) is installed, without importing it.

    JAX finds its plugins as modules of the `jax_plugins` namespace package (e.g.
    `jax_plugins.xla_cuda12`); this looks for them on the path without importing JAX.
    """
    import importlib.util
    import pkgutil

    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or spec.submodule_search_locations is None:
        return False
    return any(("cuda" in m.name or "rocm" in m.name)
               for m in pkgutil.iter_modules(list(spec.submodule_search_locations)))


def count_cpu_list(text: str) -> int:
    """The number of CPUs in a Linux CPU list such as `0-3,8,10-11` (0 for an empty one).

    Raises:
      ValueError: on a malformed list.
    """
    count = 0
    for item in text.strip().split(","):
        if not item:
            continue
        first, _, last = item.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def _cgroup_cpuset_files(proc_cgroup: str, root: str) -> list[str]:
    """The cpuset files that may hold this process's CPUs, its own cgroup's first."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    files = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: one tree for every controller
            base, name = root, "cpuset.cpus.effective"
        elif "cpuset" in controllers.split(","):  # cgroup v1: the cpuset tree
            base, name = os.path.join(root, "cpuset"), "cpuset.effective_cpus"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        # Its own cgroup, then each ancestor (a container sees its cgroup as the root).
        files += [os.path.join(base, *parts[:k], name) for k in range(len(parts), -1, -1)]
    return files


def count_node_cores(proc_cgroup: str = "/proc/self/cgroup", cgroup_root: str = _CGROUP_ROOT
                     ) -> int:
    """The CPUs this node gives the job: its cgroup's cpuset (a container's, or Slurm's
    for the job on a shared node) where it can be read, else every CPU of the node.

    Args:
      proc_cgroup: the process's cgroup membership file.
      cgroup_root: where the cgroup trees are mounted.

    Returns:
      The CPU count (at least 1).
    """
    for name in _cgroup_cpuset_files(proc_cgroup, cgroup_root):
        try:
            with open(name) as f:
                count = count_cpu_list(f.read())
        except (OSError, ValueError):
            continue
        if count > 0:
            return count
    return os.cpu_count() or 1
