"""Binds this MPI rank to its share of the node's devices before JAX starts (no JAX import).

The rank's place on its node comes from its launcher's environment (Note: Local rank
detection in env.py); what it gets follows.

Note: Device binding.
  GPUs: rank `local_rank` gets GPUs `[local_rank * K, (local_rank + 1) * K)` of those
  visible on its node (`CUDA_VISIBLE_DEVICES`, or every GPU of the node), written back
  as `CUDA_VISIBLE_DEVICES`; when `CUDA_VISIBLE_DEVICES` lists exactly K the launcher
  has already bound this rank (e.g. `srun --gpus-per-task=K`) and they are kept.
  CPU: T compute threads (the thread settings jpprun exports too, `env.thread_env`)
  and, when `local_size * T` cores fit in this process's affinity mask, the core slice
  `[local_rank * T, (local_rank + 1) * T)`; when they do not fit (oversubscribed, or the
  launcher already bound the rank to fewer cores) the mask is left as it is. Optionally
  the CPU device count (`--xla_force_host_platform_device_count`). All of it must happen
  before JAX creates its backends, which read these settings once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence

from jaxpp_mpi._src.launch.env import (
    GPUS_PER_RANK_ENV,
    BindError,
    LocalRank,
    count_node_gpus,
    detect_local_rank,
    env_int,
    thread_env,
    threads_from_env,
    visible_gpus,
)

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


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
        gpus_per_rank = env_int(env, GPUS_PER_RANK_ENV)
    slurm_gpus = env.get("SLURM_GPUS_PER_TASK", "")  # e.g. "2" or "a100:2"
    if gpus_per_rank is None and slurm_gpus:
        count = slurm_gpus.rsplit(":", 1)[-1]
        if not count.isdigit():
            raise BindError(f"SLURM_GPUS_PER_TASK={slurm_gpus!r} has no GPU count")
        gpus_per_rank = int(count)
    if threads_per_rank is None:
        threads_per_rank = threads_from_env(env)
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
    rank (Note: Local rank detection in env.py), then sets `CUDA_VISIBLE_DEVICES` (GPU) or the
    thread settings, CPU device count and core affinity (CPU) of this process (Note:
    Device binding). Importing JAX before is fine; creating its backends (any
    computation, `jax.devices()`) is not. What `import jaxpp_mpi` applied by itself
    (Note: Settings at import in auto.py) is undone first: this call decides instead.

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
        from jaxpp_mpi._src.base import compat
        if compat.jax_backends_initialized():
            raise BindError("bind_local_devices() must run before JAX initialises its "
                            "backends (before the first jax.devices() or computation); "
                            "call it at the top of the script")
    from jaxpp_mpi._src.launch import auto  # auto plans with this module: imported here

    auto.undo_auto_settings()
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
    """`python -m jaxpp_mpi.launch [options] -- PROGRAM ARGS`: bind, then exec PROGRAM.

    Args:
      argv: the options and the program (default `sys.argv[1:]`).

    Returns:
      2 when the binding cannot be decided; otherwise PROGRAM replaces this process.
    """
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
