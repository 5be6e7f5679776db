"""Failing fast under MPI: the abort-on-exception hook and the step watchdog.

Note: abort on exception.
  An MPI job whose rank raises while its peers wait in a receive hangs forever unless
  someone aborts it. In MPI mode jaxpp_mpi installs `sys.excepthook` and
  `threading.excepthook` wrappers (once, when the first MPI-mode mesh hands its
  communicator to `runtime.mpi.adopt_comm`; opt out with JAXPP_MPI_ABORT_ON_EXCEPTION=0):
  the traceback is printed once, every line prefixed with `[rank r]`, then `MPI_Abort`
  ends every rank with a non-zero status.

Note: watchdog.
  A stalled peer (a stuck stage, a lost node that the launcher does not notice) would
  leave every other rank blocked in MPI. Each MPI executor has a watchdog thread that
  knows, for the step in flight, the instruction Python is dispatching (`pc`; a
  message chain whose inputs are ready runs inline, so a blocked receive holds Python
  at its instruction) and, per message instruction, the `order` array its chain
  returned (ready once its MPI calls are done). When a step runs past its deadline,
  the watchdog prints which instruction this rank is blocked on, waits a grace period
  (so the other ranks, whose deadlines expire at about the same time, print theirs),
  then aborts the job. Deadline: JAXPP_MPI_STEP_TIMEOUT seconds, or automatically
  `first_steps_timeout_s` for the first steps and then `max(auto_floor_s, auto_factor
  * slowest step seen)`.

  One daemon thread per process looks at every live executor's Watchdog (weakly held)
  every `_POLL_S`, and never touches MPI. It only ever asks `is_ready()` of the chains'
  `order` arrays, which nothing deletes or donates: asking it of a step's results while
  the next step donates them crashed the process (seen in CI: a segfault in `is_ready`).
  A step is done when its last chain is; a group with no messages has nothing to watch.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from jaxpp_mpi._src.config import Options
from jaxpp_mpi._src.schedules.tasks import describe_label as describe_task

__all__ = ["Watchdog", "describe_task", "install_abort_on_exception"]

_installed = False


def _prefixed(rank: int, text: str) -> str:
    return "".join(f"[rank {rank}] {line}\n" for line in text.splitlines())


def install_abort_on_exception(rank: int, abort: Callable[[int], None]) -> None:
    """Installs the hooks of `Note: abort on exception` (only the first call does).

    Args:
      rank: this process's rank, for the prefix.
      abort: ends the whole job with the given status (e.g. `comm.Abort`).
    """
    global _installed
    if _installed:
        return
    _installed = True
    previous_thread_hook = threading.excepthook

    def hook(exc_type, exc, tb) -> None:
        if issubclass(exc_type, SystemExit):
            return
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        sys.stderr.write(_prefixed(rank, text))
        sys.stderr.write(f"[rank {rank}] jaxpp_mpi: aborting the MPI job after an "
                         f"uncaught {exc_type.__name__} on rank {rank}\n")
        sys.stderr.flush()
        abort(1)

    def thread_hook(args) -> None:
        if args.exc_type is SystemExit:
            previous_thread_hook(args)
            return
        hook(args.exc_type, args.exc_value, args.exc_traceback)

    sys.excepthook = hook
    threading.excepthook = thread_hook


_POLL_S = 0.25
_watched: weakref.WeakSet[Watchdog] = weakref.WeakSet()
_monitor: threading.Thread | None = None
_monitor_lock = threading.Lock()


def _monitor_loop() -> None:
    while True:
        time.sleep(_POLL_S)
        with _monitor_lock:
            watchdogs = list(_watched)
        for wd in watchdogs:
            wd.check()


class Watchdog:
    """The step watchdog of one MPI executor (see `Note: watchdog`).

    Args:
      rank: this process's rank.
      options: the deadline settings.
      describe: `describe(k)` names instruction k for the report.
      num_instrs: the program's instruction count on this rank.
      abort: ends the whole job with the given status.
    """

    def __init__(self, rank: int, options: Options, describe: Callable[[int], str],
                 num_instrs: int, abort: Callable[[int], None]):
        self.rank = rank
        self.options = options
        self.describe = describe
        self.num_instrs = num_instrs
        self.abort = abort
        self.pc = num_instrs  # the instruction Python is dispatching
        self.marks: list[Any] = [None] * num_instrs  # per message: its order array
        self._lock = threading.Lock()
        self._step = 0
        self._start: float | None = None
        self._done: Any = None
        self._durations: list[float] = []
        self._fired = False

    def deadline_s(self) -> float:
        """The current step's deadline in seconds."""
        o = self.options
        if o.step_timeout_s is not None:
            return o.step_timeout_s
        if len(self._durations) < o.first_steps:
            return o.first_steps_timeout_s
        return max(o.auto_floor_s, o.auto_factor * max(self._durations))

    def step_started(self) -> None:
        """Called by the executor before it dispatches a step."""
        global _monitor
        with self._lock:
            self._step += 1
            self._start = time.monotonic()
            self._done = None
            self.pc = 0
        with _monitor_lock:
            if self not in _watched:
                _watched.add(self)
                if _monitor is None:
                    _monitor = threading.Thread(target=_monitor_loop, daemon=True,
                                                name="jaxpp_mpi-watchdog")
                    _monitor.start()

    def step_dispatched(self, last_order: Any) -> None:
        """Called once the step is dispatched; it is done when `last_order` (the `order`
        array of its last message chain, or None) is ready."""
        with self._lock:
            self.pc = self.num_instrs
            self._done = last_order

    def step_abandoned(self) -> None:
        """Called when dispatching the step raised: nothing more to watch for it."""
        with self._lock:
            self._start = None
            self.pc = self.num_instrs

    def check(self) -> None:
        """One look (from the monitor thread): record a finished step's time, or report
        and abort when the step in flight is past its deadline."""
        with self._lock:
            if self._start is None or self._fired:
                return
            elapsed = time.monotonic() - self._start
            if self.pc == self.num_instrs and (self._done is None or _ready(self._done)):
                self._durations.append(elapsed)
                self._start = None
                return
            deadline = self.deadline_s()
            if elapsed <= deadline:
                return
            self._fired = True
            report = self._report(elapsed, deadline)
        sys.stderr.write(_prefixed(self.rank, report))
        sys.stderr.flush()
        time.sleep(self.options.watchdog_grace_s)
        self.abort(1)
    def _blocked_at(self) -> int | None:
        if self.pc < self.num_instrs:
            return self.pc
        for k, mark in enumerate(self.marks):
            if mark is not None and not _ready(mark):
                return k
        return None

    def _report(self, elapsed: float, deadline: float) -> str:
        k = self._blocked_at()
        where = ("all of its messages are done; it is waiting for its last tasks"
                 if k is None else
                 f"it is blocked in {self.describe(k)} [instruction {k + 1} of "
                 f"{self.num_instrs}]")
        how = ("JAXPP_MPI_STEP_TIMEOUT" if self.options.step_timeout_s is not None
               else "automatic; set JAXPP_MPI_STEP_TIMEOUT to change it")
        return (f"jaxpp_mpi watchdog: step {self._step} has run for {elapsed:.1f} s, past "
                f"its deadline of {deadline:.1f} s ({how}); on rank {self.rank} {where}.\n"
                f"aborting the MPI job in {self.options.watchdog_grace_s:g} s\n")


def _ready(x: Any) -> bool:
    try:
        return x.is_ready()
    except Exception:  # noqa: BLE001 - a deleted/donated array is done with
        return True
