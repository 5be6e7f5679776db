"""Binds this MPI rank to its share of the node's devices before JAX starts (no JAX import).

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

Note: Device binding.
  GPUs: rank `local_rank` gets GPUs `[local_rank * K, (local_rank + 1) * K)` of those
  visible on its node (`CUDA_VISIBLE_DEVICES`, or every GPU of the node), written back
  as `CUDA_VISIBLE_DEVICES`; when `CUDA_VISIBLE_DEVICES` lists exactly K the launcher
  has already bound this rank (e.g. `srun --gpus-per-task=K`) and they are kept.
  CPU: T compute threads
  (the launcher's thread settings, `launcher.thread_env`) and, when `local_size * T`
  cores fit in this process's affinity mask, the core slice
  `[local_rank * T, (local_rank + 1) * T)`; when they do not fit (oversubscribed, or the
  launcher already bound the rank to fewer cores) the mask is left as it is. Optionally
  the CPU device count (`--xla_force_host_platform_device_count`). All of it must happen
  before JAX creates its backends, which read these settings once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Mapping, Sequence

from jaxpp_mpi._src.launch.jpprun import thread_env

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
_GPUS_ENV = "JAXPP_MPI_GPUS_PER_RANK"
_THREADS_ENV = "JAXPP_MPI_THREADS_PER_RANK"
_NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"

# (launcher name, local rank variable, local size variable, rank variable, size variable)
_MPI_LAUNCHERS = (
    ("override", "JAXPP_MPI_LOCAL_RANK", "JAXPP_MPI_LOCAL_SIZE", None, None),
    ("openmpi", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
     "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("mvapich", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
     "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
    ("hydra", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_RANK", "PMI_SIZE"),
)


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


@dataclasses.dataclass(frozen=True)
class Binding:
    """What `bind_local_devices` sets: environment entries and the CPU affinity mask."""

    local: LocalRank
    platform: str
    env: tuple[tuple[str, str], ...]
    cores: tuple[int, ...] | None

    def describe(self) -> str:
        """One line for logs, e.g. `local rank 1/2 (slurm): cpu, cores 1, ...`."""
        parts = [f"local rank {self.local.local_rank}/{self.local.local_size} "
                 f"({self.local.launcher}): {self.platform}"]
        if self.cores is not None:
            parts.append("cores " + ",".join(map(str, self.cores)))
        parts += [f"{k}={v}" for k, v in self.env]
        return ", ".join(parts)


def _int(env: Mapping[str, str], name: str | None) -> int | None:
    if name is None or name not in env:
        return None
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
    local_rank = _int(env, "SLURM_LOCALID")
    size = _int(env, "SLURM_STEP_NUM_TASKS")
    if local_rank is None or size is None:  # not in an srun step (e.g. the batch script)
        return None
    nodes = _int(env, "SLURM_STEP_NUM_NODES")
    local_size = None
    if "SLURM_STEP_TASKS_PER_NODE" in env:
        local_size = slurm_tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"],
                                         _int(env, "SLURM_NODEID") or 0)
    if local_size is None:
        local_size = _int(env, "SLURM_NTASKS_PER_NODE")
    if local_size is None and nodes == 1:
        local_size = size
    if local_size is None:
        raise BindError("SLURM_LOCALID is set but the tasks on this node are not "
                        "(no SLURM_STEP_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE); set "
                        "JAXPP_MPI_LOCAL_RANK and JAXPP_MPI_LOCAL_SIZE")
    return LocalRank(local_rank, local_size, _int(env, "SLURM_PROCID"), size, "slurm")


def _pmi_only(env: Mapping[str, str]) -> LocalRank | None:
    rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
    if rank is not None and size is not None and (_int(env, "SLURM_STEP_NUM_NODES") or 1) == 1:
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
    for launcher, lr_var, ls_var, rank_var, size_var in _MPI_LAUNCHERS:
        local_rank = _int(env, lr_var)
        if local_rank is None:
            continue
        local_size = _int(env, ls_var)
        if local_size is None:
            raise BindError(f"{lr_var} is set but {ls_var} is not")
        found = LocalRank(local_rank, local_size, _int(env, rank_var), _int(env, size_var),
                          launcher)
        break
    else:
        found = _slurm(env) or _pmi_only(env) or LocalRank(0, 1, None, None, "none")
    if not 0 <= found.local_rank < found.local_size:
        raise BindError(f"local rank {found.local_rank} is outside local size "
                        f"{found.local_size} ({found.launcher})")
    return found


# The job's size as each launcher gives it, in Note: Local rank detection's order (under
# mpirun inside an allocation, SLURM_STEP_NUM_TASKS counts mpirun's daemons, not ranks).
_WORLD_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE",
                    "SLURM_STEP_NUM_TASKS")


def launcher_world_size(env: Mapping[str, str]) -> int:
    """The number of ranks the launcher started, from its environment (1 without one).

    For deciding, before MPI or JAX start, whether a program runs as one process or as
    an MPI job (`mpirun`, `mpiexec`, `srun` alike).

    Args:
      env: the environment to read (normally `os.environ`).

    Returns:
      The world size.
    """
    for name in _WORLD_SIZE_VARS:
        size = _int(env, name)
        if size is not None:
            return size
    return 1


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


def _with_flag(flags: str, flag: str, value: str) -> str:
    kept = [f for f in flags.split() if f.split("=", 1)[0] != flag]
    return " ".join([*kept, f"{flag}={value}"])


def _core_slice(cores: Sequence[int], index: int, count: int, width: int) -> tuple[int, ...] | None:
    ordered = sorted(cores)
    if width < 1 or len(ordered) < count * width:
        return None  # oversubscribed, or the launcher already bound us: leave the mask
    return tuple(ordered[index * width:(index + 1) * width])


def plan_binding(
    local: LocalRank,
    env: Mapping[str, str],
    *,
    cores: Sequence[int],
    node_gpus: int,
    platform: str = "auto",
    gpus_per_rank: int | None = None,
    threads_per_rank: int | None = None,
    cpu_devices: int | None = None,
) -> Binding:
    """Decides this rank's devices (pure: every fact about the node is an argument).

    See Note: Device binding.

    Args:
      local: this process's place on its node (`detect_local_rank`).
      env: the environment the program was started with.
      cores: the cores in this process's affinity mask.
      node_gpus: NVIDIA GPUs on the node (`count_node_gpus`).
      platform: 'gpu', 'cpu', or 'auto': 'cpu' when `JAX_PLATFORMS` names only cpu or
        `gpus_per_rank == 0` or no GPU is visible, else 'gpu'.
      gpus_per_rank: GPUs per rank; default `$JAXPP_MPI_GPUS_PER_RANK`, else
        `$SLURM_GPUS_PER_TASK`, else the visible GPUs shared evenly among the node's ranks.
      threads_per_rank: CPU compute threads per rank; default
        `$JAXPP_MPI_THREADS_PER_RANK`, else `$SLURM_CPUS_PER_TASK`, else the cores shared
        evenly (at least 1).
      cpu_devices: if given, the CPU device count per rank (`XLA_FLAGS`).

    Returns:
      The Binding.

    Raises:
      BindError: on a bad count, or too few GPUs for the node's ranks.
    """
    if gpus_per_rank is None:
        gpus_per_rank = _int(env, _GPUS_ENV)
    slurm_gpus = env.get("SLURM_GPUS_PER_TASK", "")  # e.g. "2" or "a100:2"
    if gpus_per_rank is None and slurm_gpus:
        count = slurm_gpus.rsplit(":", 1)[-1]
        if not count.isdigit():
            raise BindError(f"SLURM_GPUS_PER_TASK={slurm_gpus!r} has no GPU count")
        gpus_per_rank = int(count)
    if threads_per_rank is None:
        threads_per_rank = _int(env, _THREADS_ENV) or _int(env, "SLURM_CPUS_PER_TASK")
    for name, value in (("gpus_per_rank", gpus_per_rank), ("threads_per_rank",
                        threads_per_rank), ("cpu_devices", cpu_devices)):
        if value is not None and value < (0 if name == "gpus_per_rank" else 1):
            raise BindError(f"{name} must be positive, got {value}")
    gpus = visible_gpus(env, node_gpus)
    if platform == "auto":
        cpu_only = env.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
        platform = "cpu" if cpu_only or gpus_per_rank == 0 or not gpus else "gpu"
    if platform not in ("cpu", "gpu"):
        raise BindError(f"platform must be 'auto', 'cpu' or 'gpu', got {platform!r}")
    n, i = local.local_size, local.local_rank
    out: dict[str, str] = {}
    if platform == "gpu":
        per_rank = gpus_per_rank or len(gpus) // n
        if per_rank < 1:
            raise BindError(f"{len(gpus)} GPU(s) visible for {n} rank(s) on this node: "
                            "fewer GPUs than ranks (run fewer ranks per node, or use CPU)")
        if len(gpus) >= n * per_rank:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * per_rank:(i + 1) * per_rank])
        elif len(gpus) != per_rank or "CUDA_VISIBLE_DEVICES" not in env:
            raise BindError(f"{n} rank(s) x {per_rank} GPU(s) each need {n * per_rank} "
                            f"GPUs, but {len(gpus)} are visible ({','.join(gpus)})")
        else:  # the launcher gave this rank exactly its GPUs: keep them
            out["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        return Binding(local, "gpu", tuple(out.items()),
                       _core_slice(cores, i, n, len(cores) // n))
    threads = threads_per_rank or max(1, len(cores) // n)
    out.update(thread_env(threads, env))
    if cpu_devices is not None:
        out["XLA_FLAGS"] = _with_flag(out.get("XLA_FLAGS", env.get("XLA_FLAGS", "")),
                                      _DEVICE_COUNT_FLAG, str(cpu_devices))
    return Binding(local, "cpu", tuple(sorted(out.items())),
                   _core_slice(cores, i, n, threads))


def bind_local_devices(
    *,
    platform: str = "auto",
    gpus_per_rank: int | None = None,
    threads_per_rank: int | None = None,
    cpu_devices: int | None = None,
    verbose: bool = False,
) -> Binding:
    """Restricts this process to its share of the node's devices; call before JAX starts.

    For a script started by any launcher (mpirun, srun, mpiexec.hydra): reads the local
    rank (Note: Local rank detection), then sets `CUDA_VISIBLE_DEVICES` (GPU) or the
    thread settings, CPU device count and core affinity (CPU) of this process (Note:
    Device binding). Importing JAX before is fine; creating its backends (any
    computation, `jax.devices()`) is not.

    Args:
      platform: 'auto', 'gpu' or 'cpu' (see `plan_binding`).
      gpus_per_rank: GPUs per rank (default: shared evenly).
      threads_per_rank: CPU threads per rank (default: the cores shared evenly).
      cpu_devices: CPU devices per rank, if given.
      verbose: print the binding to stderr.

    Returns:
      The Binding applied.

    Raises:
      BindError: when JAX's backends already exist, or the binding cannot be decided.
    """
    if "jax" in sys.modules:  # JAX not imported: its backends cannot exist yet
        from jaxpp_mpi._src import compat

        if compat.jax_backends_initialized():
            raise BindError("bind_local_devices() must run before JAX initialises its "
                            "backends (before the first jax.devices() or computation); "
                            "call it at the top of the script")
    binding = plan_binding(
        detect_local_rank(os.environ), os.environ, cores=sorted(os.sched_getaffinity(0)),
        node_gpus=count_node_gpus(), platform=platform, gpus_per_rank=gpus_per_rank,
        threads_per_rank=threads_per_rank, cpu_devices=cpu_devices)
    os.environ.update(dict(binding.env))
    if binding.cores is not None:
        os.sched_setaffinity(0, binding.cores)
    if verbose:
        print(f"jaxpp_mpi: {binding.describe()}", file=sys.stderr, flush=True)
    return binding


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxpp_mpi.launch [options] -- PROGRAM ARGS`: bind, then exec PROGRAM."""
    parser = argparse.ArgumentParser(
        prog="python -m jaxpp_mpi.launch",
        description="Bind this rank to its devices (from the launcher's local rank), then "
                    "run PROGRAM in its place; e.g. under srun or mpirun on every rank.")
    parser.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
    parser.add_argument("--gpus-per-rank", type=int, default=None)
    parser.add_argument("--threads-per-rank", type=int, default=None)
    parser.add_argument("--cpu-devices", type=int, default=None)
    parser.add_argument("--verbose", action="store_true", help="print the binding")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no PROGRAM given")
    try:
        bind_local_devices(platform=args.platform, gpus_per_rank=args.gpus_per_rank,
                           threads_per_rank=args.threads_per_rank,
                           cpu_devices=args.cpu_devices, verbose=args.verbose)
    except BindError as e:
        print(f"jaxpp_mpi.launch: {e}", file=sys.stderr, flush=True)
        return 2
    os.execvp(command[0], command)
    return 127  # not reached
