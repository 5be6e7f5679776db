"""Options read once from the environment, then passed down explicitly.

The variables (`JAXPP_MPI_STEP_TIMEOUT` and the others), their defaults, the values they
take and what they mean are defined once, in variables.py, which parses them
(`Note: variable values`); docs/reliability.md's table is generated from there (base/cli.py).
`parse_options` checks every variable that jaxpp_mpi's Python reads, the launchers'
included, so that a bad value raises on every rank alike when the options are first
asked for (an MPI-mode mesh, or the first compile), before any step.

JAXPP_MPI_DEADLINE unset follows JAXPP_MPI_STEP_TIMEOUT: its number of seconds, `off`
(deadlines off too) or `auto` (300 s, and for the collective after a rank's own long
work, tracing or compiling, at least 5 x the slowest such work this rank has seen;
`Note: deadlines` in runtime/failure.py). A timeout of 0 seconds is `off`.
JAXPP_MPI_STAGED_MESSAGES: see `stages_messages`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping

from jaxpp_mpi._src.base.variables import AUTO, OFF, VariableError, parse_all

__all__ = ["Options", "VariableError", "options", "parse_options", "stages_messages"]


@dataclasses.dataclass(frozen=True)
class Options:
    """jaxpp_mpi's run-time options (the variables: variables.py).

    Attributes:
      step_timeout_s: a fixed watchdog deadline, or None for the automatic one.
      watchdog: whether the watchdog runs at all.
      watchdog_grace_s: pause between a watchdog report and the abort.
      abort_on_exception: whether MPI mode installs the abort-on-exception hook.
      abort_wait_s: how long a rank ending the job waits for `MPI_Abort` before it
        exits by itself (`Note: bounded abort` in launch/abort.py).
      heap_tuning: whether the MPI executor applies `Note: large buffers`.
      first_steps: how many steps the automatic deadline learns from.
      first_steps_timeout_s: the automatic deadline while it is learning.
      auto_factor: the automatic deadline is this many times the slowest first step...
      auto_floor_s: ...but never less than this.
      deadlines: whether collectives outside the step have a deadline at all.
      deadline_s: their fixed deadline, or None for the automatic one.
      auto_deadline_s: the automatic deadline...
      work_factor: ...or this many times the slowest local work before the collective
        (tracing, compiling), when longer.
      replica_bucket_bytes: the largest all-reduce across pipeline replicas, in bytes.
      posted_sends: whether MPI mode posts its sends where the platform allows (CPU).
      staged_messages: JAXPP_MPI_STAGED_MESSAGES: "auto", "1" or "0" (see
        `stages_messages`).
      cuda_mpi: whether mpi4jax hands device buffers to MPI (MPI4JAX_USE_CUDA_MPI, read
        as mpi4jax reads it).
      shared_compiles: whether ranks that need the same executable compile it once.
      program_cache: JAXPP_MPI_PROGRAM_CACHE: "auto", "off" or a directory (`Note:
        program cache` in compiler/program_cache.py).
    """

    step_timeout_s: float | None = None
    watchdog: bool = True
    watchdog_grace_s: float = 5.0
    abort_on_exception: bool = True
    abort_wait_s: float = 10.0
    heap_tuning: bool = True
    first_steps: int = 3
    first_steps_timeout_s: float = 300.0
    auto_factor: float = 20.0
    auto_floor_s: float = 60.0
    deadlines: bool = True
    deadline_s: float | None = None
    auto_deadline_s: float = 300.0
    work_factor: float = 5.0
    replica_bucket_bytes: int = 64 << 20
    posted_sends: bool = True
    staged_messages: str = "auto"
    cuda_mpi: bool = False
    shared_compiles: bool = True
    program_cache: str = "auto"


def stages_messages(options: Options, platform: str) -> bool:
    """Whether MPI mode stages the messages of a group on `platform` (`Note: staged
    messages` in mpi/staged.py), as JAXPP_MPI_STAGED_MESSAGES says: `auto` off CPU
    unless MPI takes device buffers (MPI4JAX_USE_CUDA_MPI), `1` everywhere, `0` never.
    (The runtime also needs MPI_THREAD_MULTIPLE: `staged.stages_messages`.)"""
    if options.staged_messages == "auto":
        return platform != "cpu" and not options.cuda_mpi
    return options.staged_messages == "1"


def _timeout(value: str | float) -> tuple[bool, float | None]:
    """(enabled, fixed seconds or None for automatic) from a timeout's parsed value."""
    if value == OFF or value == 0:
        return False, None
    if value == AUTO:
        return True, None
    return True, float(value)


def parse_options(env: Mapping[str, str]) -> Options:
    """The options set by `env` (an environment mapping), every variable that
    jaxpp_mpi's Python reads checked (`variables.parse_all`).

    Raises:
      VariableError: (a ValueError) naming the first variable whose value is malformed,
        its value and what it takes.
    """
    v = parse_all(env)
    watchdog, step_timeout = _timeout(v["JAXPP_MPI_STEP_TIMEOUT"])
    if v["JAXPP_MPI_DEADLINE"] is None:  # follows the step timeout
        deadlines, deadline = watchdog, step_timeout
    else:
        deadlines, deadline = _timeout(v["JAXPP_MPI_DEADLINE"])
    return Options(
        step_timeout_s=step_timeout,
        watchdog=watchdog,
        auto_floor_s=v["JAXPP_MPI_WATCHDOG_FLOOR"],
        deadlines=deadlines,
        deadline_s=deadline,
        watchdog_grace_s=v["JAXPP_MPI_WATCHDOG_GRACE"],
        abort_on_exception=v["JAXPP_MPI_ABORT_ON_EXCEPTION"],
        abort_wait_s=v["JAXPP_MPI_ABORT_WAIT"],
        heap_tuning=v["JAXPP_MPI_HEAP_TUNING"],
        replica_bucket_bytes=int(v["JAXPP_MPI_REPLICA_BUCKET_MB"] * (1 << 20)),
        posted_sends=v["JAXPP_MPI_POSTED_SENDS"],
        staged_messages=v["JAXPP_MPI_STAGED_MESSAGES"],
        # mpi4jax's own reading (decorators._is_truthy: lower-cased, not stripped)
        cuda_mpi=env.get("MPI4JAX_USE_CUDA_MPI", "").lower() in ("1", "true", "on"),
        shared_compiles=v["JAXPP_MPI_SHARED_COMPILES"],
        program_cache=v["JAXPP_MPI_PROGRAM_CACHE"],
    )


@functools.cache
def options() -> Options:
    """The process's options, read from `os.environ` on first use."""
    return parse_options(os.environ)
