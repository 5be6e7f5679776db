"""Options read once from the environment, then passed down explicitly.

Variables:
  JAXPP_MPI_STEP_TIMEOUT: the watchdog's deadline per step in seconds; `auto` (default)
    derives it from the first steps (see `Note: watchdog`); `0` or `off` disables it.
  JAXPP_MPI_WATCHDOG_FLOOR: the automatic step deadline's floor in seconds once it has
    learnt from the first steps (default 60; tests set it low).
  JAXPP_MPI_WATCHDOG_GRACE: seconds between a watchdog report and the abort, so every
    rank's report gets out (default 5).
  JAXPP_MPI_DEADLINE: the deadline in seconds of every collective outside the step
    (`Note: deadlines` in runtime/failure.py); unset: JAXPP_MPI_STEP_TIMEOUT's value
    when it is a number (`off` there turns deadlines off too), else `auto`: 300 s, and
    for the collective after a rank's own long work (tracing, compiling) at least 5 x
    the slowest such work this rank has seen; `0` or `off` disables them.
  JAXPP_MPI_ABORT_ON_EXCEPTION: `1` (default): in MPI mode an uncaught exception on any
    rank prints its traceback prefixed with the rank and aborts the whole job; `0`
    leaves `sys.excepthook` alone.
  JAXPP_MPI_HEAP_TUNING: `1` (default): the MPI executor keeps large host buffers in the
    C heap (see `Note: large buffers` in mpi/heap.py); `0` leaves glibc's defaults.
  JAXPP_MPI_POSTED_SENDS: `1` (default): on CPU, MPI mode posts its sends (non-blocking,
    `Note: posted sends` in mpi/posted.py) and lowers for them; `0`: blocking sends
    (message chains), as on other platforms.
  JAXPP_MPI_STAGED_MESSAGES: `auto` (default): a non-CPU group's messages are *staged*
    (copied through host memory by a sender and a receiver thread, off the dispatching
    thread: `Note: staged messages` in mpi/staged.py) unless MPI4JAX_USE_CUDA_MPI is
    true (MPI then takes device buffers: message chains); CPU groups keep posted
    sends. `1`: staged on every platform, CPU included; `0`: never (chains, and posted
    sends on CPU). Staging needs MPI_THREAD_MULTIPLE; with less it falls back to `0`'s
    path with a warning.
  JAXPP_MPI_REPLICA_BUCKET_MB: with pipeline replicas, the most MiB of loop outputs
    (gradients) one all-reduce across replicas carries (default 64, chosen by
    bench/replicas.py; `0`: one all-reduce per task's results; `Note: replica
    reductions` in ir/passes.py).
  JAXPP_MPI_SHARED_COMPILES: `1` (default): in MPI mode ranks that need the same
    executable compile it once between them (`Note: shared compiles` in
    shared_compiles.py); `0`: every rank compiles all of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Mapping

__all__ = ["Options", "options", "parse_options", "stages_messages"]


@dataclasses.dataclass(frozen=True)
class Options:
    """jaxpp_mpi's run-time options (see the module docstring for the variables).

    Attributes:
      step_timeout_s: a fixed watchdog deadline, or None for the automatic one.
      watchdog: whether the watchdog runs at all.
      watchdog_grace_s: pause between a watchdog report and the abort.
      abort_on_exception: whether MPI mode installs the abort-on-exception hook.
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
    """

    step_timeout_s: float | None = None
    watchdog: bool = True
    watchdog_grace_s: float = 5.0
    abort_on_exception: bool = True
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


# The largest value each numeric variable takes (a bigger one is a typo, and a deadline
# or grace period that never ends is a hang): 30 days for deadlines, 10 minutes for the
# grace between a watchdog's report and the abort, 1 TiB for a replica bucket.
_MAX_SECONDS = 30 * 24 * 3600.0
_MAXIMA = {"JAXPP_MPI_WATCHDOG_GRACE": 600.0, "JAXPP_MPI_REPLICA_BUCKET_MB": float(1 << 20)}
_UNITS = {"JAXPP_MPI_REPLICA_BUCKET_MB": "MiB"}


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    """A finite number from 0 to the variable's maximum (`_MAXIMA`, else 30 days in
    seconds), or `default` when unset or empty.

    Raises:
      ValueError: naming the variable, its value and the range it takes.
    """
    raw = env.get(name, "").strip()
    if not raw:
        return default
    top = _MAXIMA.get(name, _MAX_SECONDS)
    unit = _UNITS.get(name, "seconds")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (0 <= value <= top):  # also refuses nan and inf
        raise ValueError(f"{name}={raw!r}: use a number of {unit} from 0 to {top:g}")
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "1").strip().lower() or "1"
    if raw not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"{name}={raw!r}: use 1 or 0")
    return raw in ("1", "true", "yes", "on")


_STAGED = {"auto": "auto", "1": "1", "true": "1", "yes": "1", "on": "1",
           "0": "0", "false": "0", "no": "0", "off": "0"}


def _staged(env: Mapping[str, str]) -> str:
    """JAXPP_MPI_STAGED_MESSAGES as "auto", "1" or "0"."""
    raw = env.get("JAXPP_MPI_STAGED_MESSAGES", "auto").strip().lower() or "auto"
    if raw not in _STAGED:
        raise ValueError(f"JAXPP_MPI_STAGED_MESSAGES={raw!r}: use auto, 1 or 0")
    return _STAGED[raw]


def stages_messages(options: Options, platform: str) -> bool:
    """Whether MPI mode stages the messages of a group on `platform` (`Note: staged
    messages` in mpi/staged.py), as JAXPP_MPI_STAGED_MESSAGES says: `auto` off CPU
    unless MPI takes device buffers (MPI4JAX_USE_CUDA_MPI), `1` everywhere, `0` never.
    (The runtime also needs MPI_THREAD_MULTIPLE: `staged.stages_messages`.)"""
    if options.staged_messages == "auto":
        return platform != "cpu" and not options.cuda_mpi
    return options.staged_messages == "1"


def _timeout(env: Mapping[str, str], name: str) -> tuple[bool, float | None]:
    """(enabled, fixed seconds or None for automatic) from a timeout variable."""
    raw = env.get(name, "auto").strip().lower() or "auto"
    if raw in ("0", "off", "none"):
        return False, None
    if raw == "auto":
        return True, None
    return True, _float(env, name, 0.0)


def parse_options(env: Mapping[str, str]) -> Options:
    """The options set by `env` (an environment mapping).

    Raises:
      ValueError: naming the variable whose value is malformed.
    """
    watchdog, step_timeout = _timeout(env, "JAXPP_MPI_STEP_TIMEOUT")
    if env.get("JAXPP_MPI_DEADLINE", "").strip():
        deadlines, deadline = _timeout(env, "JAXPP_MPI_DEADLINE")
    else:  # follows the step timeout
        deadlines, deadline = watchdog, step_timeout
    return Options(
        step_timeout_s=step_timeout,
        watchdog=watchdog,
        auto_floor_s=_float(env, "JAXPP_MPI_WATCHDOG_FLOOR", 60.0),
        deadlines=deadlines,
        deadline_s=deadline,
        watchdog_grace_s=_float(env, "JAXPP_MPI_WATCHDOG_GRACE", 5.0),
        abort_on_exception=_flag(env, "JAXPP_MPI_ABORT_ON_EXCEPTION"),
        heap_tuning=_flag(env, "JAXPP_MPI_HEAP_TUNING"),
        replica_bucket_bytes=int(_float(env, "JAXPP_MPI_REPLICA_BUCKET_MB", 64.0) * (1 << 20)),
        posted_sends=_flag(env, "JAXPP_MPI_POSTED_SENDS"),
        staged_messages=_staged(env),
        # mpi4jax's own reading (decorators._is_truthy: lower-cased, not stripped)
        cuda_mpi=env.get("MPI4JAX_USE_CUDA_MPI", "").lower() in ("1", "true", "on"),
        shared_compiles=_flag(env, "JAXPP_MPI_SHARED_COMPILES"),
    )


@functools.cache
def options() -> Options:
    """The process's options, read from `os.environ` on first use."""
    return parse_options(os.environ)
