"""Ending the whole MPI job when one rank raises: the abort-on-exception hook and how it
ends the job, MPI started or not (no JAX or MPI import; mpi4py only if already loaded).

Note: abort before the mesh.
  A rank that raises while its peers wait in a collective must end the job, or the job
  hangs. Under a plain `mpirun -n N python train.py` (or `srun`), without a hook it
  does: Python prints the traceback and runs its exit handlers, and mpi4py's handler
  calls `MPI_Finalize`, which in Open MPI waits for every rank to finalize too; the
  peers wait in their collective (a `make_mpmd_mesh`), so the failing rank never exits
  and the launcher never sees a failed rank. (`python -m mpi4py`, which launch/jpprun
  uses, turns that `MPI_Finalize` into `MPI_Abort`.) So `import jaxpp_mpi` installs the
  hooks of `Note: abort on exception` (runtime/failure.py) itself, before any mesh,
  whenever the launcher's environment says the job has several ranks
  (`env.launcher_world_size`) and JAXPP_MPI_ABORT_ON_EXCEPTION is not `0`. The hook
  ends the job with `abort_job`: `MPI_Abort` on `MPI_COMM_WORLD` once MPI is
  initialised; before that, the process exits at once with status 1, skipping the exit
  handlers, which every launcher sees as a failed rank (Open MPI's prterun ends the job
  at once; srun does with `--kill-on-bad-exit`, else the peers' deadlines do, `Note:
  deadlines`). An error that every rank raises alike (`raised_on_every_rank`, e.g.
  arguments of `make_mpmd_mesh` that differ across ranks) waits JAXPP_MPI_WATCHDOG_GRACE
  seconds between its report and the abort, so every rank's report gets out.

Note: bounded abort.
  `MPI_Abort` does not return: Open MPI's rank asks its launcher daemon to end the job
  and waits. When a host's link is down, the launcher (prterun) waits for that host's
  daemon, which cannot answer, until TCP gives up (minutes: seen > 150 s), and the
  ranks it has not killed wait with it. So every path that ends the job over MPI
  (`end_job`, `bounded`: the abort hook, the watchdog, the deadlines) first starts a
  timer: if the process still runs JAXPP_MPI_ABORT_WAIT seconds (10) after its
  `MPI_Abort`, it says so and exits by itself with the abort's status (`os._exit`, no
  exit handlers: they would wait in `MPI_Finalize`). jpprun bounds the launcher the
  same way (`Note: Watching the launcher` in launch/launcher_watch.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.launch.env import BindError, detect_local_rank, launcher_world_size

__all__ = ["abort_job", "abort_wait_s", "bounded", "end_job", "install_abort_on_exception",
           "install_at_import", "job_rank", "prefixed", "raised_on_every_rank"]

_EVERY_RANK = "_jaxpp_mpi_raised_on_every_rank"
_installed = False


def prefixed(rank: int | str, text: str) -> str:
    """`text` with every line prefixed `[rank r] `."""
    return "".join(f"[rank {rank}] {line}\n" for line in text.splitlines())


def raised_on_every_rank(error: BaseException) -> BaseException:
    """Marks `error` as one that every rank raises alike (`Note: abort before the mesh`):
    the hook lets the peers print theirs before it aborts. Returns `error`."""
    setattr(error, _EVERY_RANK, True)
    return error


def _mpi_world():
    """mpi4py's COMM_WORLD when MPI is initialised and not finalised, else None (never
    imports mpi4py)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return None
    return mpi.COMM_WORLD


def job_rank() -> int | str:
    """This process's rank in the job: MPI's when it runs, else the launcher's ('?'
    when neither says)."""
    world = _mpi_world()
    if world is not None:
        return int(world.Get_rank())
    try:
        rank = detect_local_rank(os.environ).rank
    except BindError:
        rank = None
    return "?" if rank is None else rank


def _exit_now(status: int) -> None:
    """Exits this process at once with `status`, its output flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
            pass
    os._exit(status)


def abort_wait_s() -> float:
    """JAXPP_MPI_ABORT_WAIT: how long `end_job` waits for `MPI_Abort` (`Note: bounded
    abort`); its default when the variable is malformed (reported where the options are
    read)."""
    try:
        return config.parse_options(os.environ).abort_wait_s
    except ValueError:
        return config.Options().abort_wait_s


def end_job(abort: Callable[[int], None], status: int, rank: int | str | None = None,
            wait_s: float | None = None) -> None:
    """Ends the whole job with `abort(status)` (e.g. `comm.Abort`), and this process by
    itself if it still runs `wait_s` seconds later (`Note: bounded abort`). Never returns.

    Args:
      abort: ends the whole job with the given status.
      status: the job's exit status.
      rank: this process's rank, for the message (None: `job_rank()`).
      wait_s: the wait; None: `abort_wait_s()` (JAXPP_MPI_ABORT_WAIT).
    """
    wait = abort_wait_s() if wait_s is None else wait_s

    def give_up() -> None:
        who = job_rank() if rank is None else rank
        sys.stderr.write(f"[rank {who}] jaxpp_mpi: the job has not ended {wait:g} s after "
                         f"this rank's MPI_Abort (its launcher may be waiting for a lost "
                         f"host); exiting rank {who} with status {status}\n")
        _exit_now(status)

    timer = threading.Timer(wait, give_up)
    timer.daemon = True
    timer.start()
    try:
        abort(status)
    finally:  # an abort that returned or raised has not ended this process
        _exit_now(status)


def bounded(abort: Callable[[int], None], rank: int | str | None = None
            ) -> Callable[[int], None]:
    """`abort` (an MPI communicator's `Abort`) as `end_job` calls it: this process exits
    by itself if the job has not ended JAXPP_MPI_ABORT_WAIT seconds later (`Note:
    bounded abort`)."""

    def abort_bounded(status: int) -> None:
        end_job(abort, status, rank)

    return abort_bounded


def abort_job(status: int) -> None:
    """Ends the whole job with `status` (`Note: abort before the mesh`): `MPI_Abort` on
    `MPI_COMM_WORLD` when MPI is initialised (`end_job`: bounded), else an immediate exit
    of this process."""
    world = _mpi_world()
    if world is not None:
        end_job(world.Abort, status)
    _exit_now(status)


def _grace_s() -> float:
    try:
        return config.parse_options(os.environ).watchdog_grace_s
    except ValueError:  # a malformed variable: the default
        return config.Options().watchdog_grace_s


def install_abort_on_exception(rank: int | None,
                               abort: Callable[[int], None] = abort_job) -> bool:
    """Installs `sys.excepthook` and `threading.excepthook` wrappers that print an
    uncaught exception's traceback once, every line prefixed `[rank r]`, then end the
    job with `abort(1)` (`Note: abort on exception` in runtime/failure.py). Only the
    first call installs them.

    Args:
      rank: this process's rank for the prefix; None: `job_rank()` when it fires.
      abort: ends the whole job with the given status (e.g. `comm.Abort`).

    Returns:
      Whether this call installed them.
    """
    global _installed
    if _installed:
        return False
    _installed = True
    previous_thread_hook = threading.excepthook

    def hook(exc_type, exc, tb) -> None:
        if issubclass(exc_type, SystemExit):
            return
        who = job_rank() if rank is None else rank
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(prefixed(who, text))
        sys.stderr.write(f"[rank {who}] jaxpp_mpi: aborting the MPI job after an "
                         f"uncaught {exc_type.__name__} on rank {who}\n")
        sys.stderr.flush()
        if getattr(exc, _EVERY_RANK, False):
            time.sleep(_grace_s())  # the peers raise it too: let them print theirs
        abort(1)

    def thread_hook(args) -> None:
        if args.exc_type is SystemExit:
            previous_thread_hook(args)
            return
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook
    return True


def install_at_import() -> bool:
    """The hooks at `import jaxpp_mpi` (`Note: abort before the mesh`): installed when
    the launcher started several ranks and JAXPP_MPI_ABORT_ON_EXCEPTION is not `0`.
    Never raises (a malformed variable is reported where the options are read).

    Returns:
      Whether they were installed.
    """
    try:
        enabled = config.parse_options(os.environ).abort_on_exception
    except ValueError:  # a malformed variable: the default, on
        enabled = True
    try:
        several = launcher_world_size(os.environ) > 1
    except BindError:
        several = False
    return enabled and several and install_abort_on_exception(None)
