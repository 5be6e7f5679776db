"""The per-rank settings `import jaxpp_mpi` applies by itself, however the ranks started.

Note: Settings at import.
  A rank started by a plain `mpirun -n N python train.py` or `srun` gets none of what
  `launch/jpprun` exports to its ranks (Note: Launcher settings in jpprun.py); on CPU,
  without the one-thread XLA flags, zero-bubble schedules ran about 1.5x slower. So
  `import jaxpp_mpi` applies them itself (importing JAX starts no backend; XLA reads
  `XLA_FLAGS` once, when the first device is asked for), when all of these hold:
  - `JAXPP_MPI_AUTO_SETTINGS` is not `0`/`off` (`env.auto_settings_enabled`);
  - a launcher placed this process beside other ranks on its node (local size > 1,
    Note: Local rank detection in env.py); a rank alone on its node keeps every core,
    unless the launcher bound it to one core (Open MPI's plain `mpirun` binds a lone rank
    of a host to a core, as it binds the ranks of a host of several, e.g. the one rank on
    the first of hosts given 1, 2 and 1 ranks): then it gets the one-thread XLA flags
    and thread counts, the same as every other rank of the job, and its mask is kept;
  - the rank's backend is the CPU (`backend_platform`): `JAX_PLATFORMS` names `cpu`
    first, or, without it, no NVIDIA GPU is visible or no GPU plugin of JAX is installed.
    GPU ranks are left as they are: the flags change only XLA's CPU backend, which runs
    none of their step, and a GPU rank's host threads gain nothing from being held to
    one core; GPUs are bound by `bind_local_devices` (jpprun and launch/slurm/train.sbatch
    run it on every rank).
  What it applies is `plan_binding`'s CPU binding (Note: Device binding in bind.py) for
  T threads per rank, T = `env.threads_from_env` or else 1 (jpprun's default), where it
  does not override the user or the launcher:
  - `XLA_FLAGS` gains the one-thread flags when T = 1 (`env.thread_env`, the list jpprun
    exports, Note: one-thread XLA flags), except a flag the user's `XLA_FLAGS` already
    sets either way; `OMP_NUM_THREADS` and `JAXPP_MPI_THREADS_PER_RANK` only where unset;
  - the affinity mask becomes the core slice `[local_rank * T, (local_rank + 1) * T)` of
    the mask only when the launcher did not bind the rank (its mask still holds every core
    the node gives the job, `env.count_node_cores`) and the node's ranks fit in it; a mask
    already narrower (Open MPI's default `--bind-to core`, srun's `--cpu-bind`) is kept.
  Under jpprun all of it is there already and nothing changes, so both launches give a
  rank the same settings (tests/jobs/test_auto_settings.py). If JAX's backends already
  exist (the script asked for devices before importing jaxpp_mpi), nothing changes and
  rank 0 warns once, naming what is missing and the fixes. An explicit
  `bind_local_devices()` first undoes what was applied here, then decides itself.
  On every platform, in a job of several ranks, it also installs the abort-on-exception
  hook, so that a rank failing before the mesh exists ends the job under any launcher
  (`Note: abort before the mesh` in abort.py; JAXPP_MPI_ABORT_ON_EXCEPTION=0: not).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Mapping, Sequence

from jaxpp_mpi._src.launch.abort import install_at_import
from jaxpp_mpi._src.launch.bind import plan_binding
from jaxpp_mpi._src.launch.env import (
    AUTO_SETTINGS_ENV,
    BindError,
    LocalRank,
    auto_settings_enabled,
    count_node_cores,
    count_node_gpus,
    detect_local_rank,
    gpu_plugin_installed,
    threads_from_env,
    visible_gpus,
)


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    """What `import jaxpp_mpi` changes on this rank (nothing, when `changes` is False).

    Attributes:
      local: the rank's place on its node, None when the settings are switched off.
      env: environment entries to set, only those whose value changes.
      cores: the new affinity mask, or None to leave the mask as it is.
      cores_before: the mask the plan started from.
      reason: why nothing is planned (empty when something may be).
    """

    local: LocalRank | None
    env: tuple[tuple[str, str], ...] = ()
    cores: tuple[int, ...] | None = None
    cores_before: tuple[int, ...] = ()
    reason: str = ""

    @property
    def changes(self) -> bool:
        """Whether anything is to be set."""
        return bool(self.env) or self.cores is not None

    def describe(self, env: Mapping[str, str]) -> str:
        """What is to be set, relative to `env`, e.g. `XLA_FLAGS += --a=false, cores 1`."""
        parts = []
        for key, value in self.env:
            if key == "XLA_FLAGS":
                given = env.get(key, "").split()
                added = [f for f in value.split() if f not in given]
                parts.append("XLA_FLAGS += " + " ".join(added))
            else:
                parts.append(f"{key}={value}")
        if self.cores is not None:
            parts.append("affinity: core(s) " + ",".join(map(str, self.cores))
                         + " of " + ",".join(map(str, self.cores_before)))
        return ", ".join(parts)


def backend_platform(env: Mapping[str, str], gpus: Sequence[str], gpu_plugin: bool) -> str:
    """The kind of backend JAX will give this process's devices: 'cpu' or 'gpu'.

    Args:
      env: the environment (`JAX_PLATFORMS`: its first entry is JAX's default backend).
      gpus: the GPUs this process may use (`env.visible_gpus`).
      gpu_plugin: whether a GPU plugin of JAX is installed (`env.gpu_plugin_installed`).

    Returns:
      'cpu' when `JAX_PLATFORMS` names cpu first, or, without `JAX_PLATFORMS`, when no GPU
      is visible or no GPU plugin is installed; else 'gpu' (any accelerator).
    """
    platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",")
                 if p.strip()]
    if platforms:
        return "cpu" if platforms[0] == "cpu" else "gpu"
    return "gpu" if gpus and gpu_plugin else "cpu"


def plan_auto_settings(
    env: Mapping[str, str],
    *,
    cores: Sequence[int],
    node_cores: int,
    platform: str,
) -> AutoSettings:
    """Decides what `import jaxpp_mpi` sets on this rank (pure: every fact is an argument).

    See Note: Settings at import.

    Args:
      env: the environment the rank started with.
      cores: the cores in the rank's affinity mask.
      node_cores: the cores the node gives the job (`env.count_node_cores`): a mask with
        fewer was bound by the launcher.
      platform: the rank's backend, 'cpu' or 'gpu' (`backend_platform`).

    Returns:
      The AutoSettings; `changes` is False when there is nothing to do.

    Raises:
      BindError: a bad `JAXPP_MPI_AUTO_SETTINGS` or thread count, or a launcher's
        variables that are incomplete or inconsistent.
    """
    cores = tuple(sorted(cores))
    if not auto_settings_enabled(env):
        return AutoSettings(None, cores_before=cores, reason=f"{AUTO_SETTINGS_ENV} is off")
    local = detect_local_rank(env)
    bound_to_one = (len(cores) == 1 < node_cores and (local.size or 1) > 1
                    and threads_from_env(env) is None)  # a lone rank of a job, see the Note
    if local.local_size < 2 and not bound_to_one:
        return AutoSettings(local, cores_before=cores, reason="no other rank on this node")
    if platform != "cpu":
        return AutoSettings(local, cores_before=cores, reason=f"a {platform} rank")
    threads = threads_from_env(env) or 1
    binding = plan_binding(local, env, cores=cores, node_gpus=0, platform="cpu",
                           threads_per_rank=threads)
    # XLA_FLAGS as merged by thread_env (the user's flags kept); other entries only if unset.
    changed = tuple((key, value) for key, value in binding.env
                    if (key == "XLA_FLAGS" or key not in env) and env.get(key) != value)
    bound_by_launcher = len(cores) < node_cores
    pinned = None
    if binding.cores is not None and not bound_by_launcher and binding.cores != cores:
        pinned = binding.cores
    return AutoSettings(local, changed, pinned, cores)


def speaks_for_job(local: LocalRank | None) -> bool:
    """Whether this rank is the one that warns for the whole job (its rank 0)."""
    if local is None:
        return True
    return (local.rank if local.rank is not None else local.local_rank) == 0


def too_late_warning(settings: AutoSettings, env: Mapping[str, str]) -> str:
    """The warning for settings that can no longer apply: what is missing and the fixes.

    Args:
      settings: the planned settings (`changes` True).
      env: the environment they were planned from.

    Returns:
      One message.
    """
    local = settings.local
    beside = f" beside {local.local_size - 1} other rank(s) on its node" if local else ""
    return (f"jaxpp_mpi: JAX's backends were created before `import jaxpp_mpi`, so this "
            f"rank runs without the per-rank CPU settings it needs{beside}: "
            f"{settings.describe(env)}. Zero-bubble and other pipelined steps may run much "
            "slower. Fix: import jaxpp_mpi before anything asks JAX for devices, or export "
            "these settings before launching, or start the job with launch/jpprun "
            f"({AUTO_SETTINGS_ENV}=0 silences this).")


@dataclasses.dataclass(frozen=True)
class _Applied:
    """What `apply_auto_settings` changed in this process, for `undo_auto_settings`."""

    env_before: dict[str, str | None]
    env_after: dict[str, str]
    cores_before: tuple[int, ...]
    cores_after: tuple[int, ...] | None


_applied: _Applied | None = None


def _backends_started() -> bool:
    if "jax" not in sys.modules:  # JAX not imported: its backends cannot exist yet
        return False
    from jaxpp_mpi._src.base import compat
    return compat.jax_backends_initialized()


def apply_auto_settings() -> AutoSettings | None:
    """Applies this rank's settings (Note: Settings at import); `import jaxpp_mpi` calls it.

    Installs the abort hook (`abort.install_at_import`), reads this process's facts,
    plans with `plan_auto_settings` and applies the plan to
    `os.environ` and the affinity mask, unless JAX's backends already exist: then it
    changes nothing and rank 0 warns (`too_late_warning`). A launcher environment it
    cannot read is a warning too, never an error: importing jaxpp_mpi must not fail.

    Returns:
      The settings planned, or None when none could be applied.
    """
    global _applied
    install_at_import()  # the abort hook, on every platform
    if not hasattr(os, "sched_getaffinity"):  # not Linux: nothing to bind with
        return None
    try:
        gpus = visible_gpus(os.environ, count_node_gpus())
        platform = backend_platform(os.environ, gpus, bool(gpus) and gpu_plugin_installed())
        settings = plan_auto_settings(os.environ, cores=os.sched_getaffinity(0),
                                      node_cores=count_node_cores(), platform=platform)
    except BindError as e:
        warnings.warn(f"jaxpp_mpi: per-rank settings not applied: {e} ({AUTO_SETTINGS_ENV}=0 "
                      "silences this)", RuntimeWarning, stacklevel=2)
        return None
    if not settings.changes:
        return settings
    if _backends_started():
        if speaks_for_job(settings.local):
            warnings.warn(too_late_warning(settings, os.environ), RuntimeWarning,
                          stacklevel=2)
        return None
    env_before = {key: os.environ.get(key) for key, _ in settings.env}
    os.environ.update(dict(settings.env))
    if settings.cores is not None:
        os.sched_setaffinity(0, settings.cores)
    _applied = _Applied(env_before, dict(settings.env), settings.cores_before, settings.cores)
    return settings


def undo_auto_settings() -> None:
    """Restores what `apply_auto_settings` changed and nobody changed since.

    For `bind_local_devices`, which decides the rank's binding itself.
    """
    global _applied
    if _applied is None:
        return
    for key, value in _applied.env_after.items():
        if os.environ.get(key) != value:  # changed since: the newer value stays
            continue
        before = _applied.env_before[key]
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before
    after = _applied.cores_after
    if after is not None and tuple(sorted(os.sched_getaffinity(0))) == after:
        os.sched_setaffinity(0, _applied.cores_before)
    _applied = None
