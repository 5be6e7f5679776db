"""Failing fast under MPI: the abort-on-exception hook, the step watchdog, and the
deadline of every collective outside the step.

Note: abort on exception.
  An MPI job whose rank raises while its peers wait in a receive hangs forever unless
  someone aborts it. In MPI mode jaxpp_mpi installs `sys.excepthook` and
  `threading.excepthook` wrappers (once, when the first MPI-mode mesh hands its
  communicator to `runtime.mpi.adopt_comm`; opt out with JAXPP_MPI_ABORT_ON_EXCEPTION=0):
  the traceback is printed once, every line prefixed with `[rank r]`, then `MPI_Abort`
  ends every rank with a non-zero status. In a job whose launcher says it has several
  ranks, `import jaxpp_mpi` has installed them already, so that a rank failing before
  or inside `make_mpmd_mesh` ends the job too, MPI started or not (`Note: abort before
  the mesh` in launch/abort.py, where the hooks live).

Note: watchdog.
  A stalled peer (a stuck stage, a lost node that the launcher does not notice) would
  leave every other rank blocked in MPI. Each MPI executor has a watchdog thread that
  knows, for the step in flight, the instruction Python is dispatching (`pc`; a
  message chain whose inputs are ready runs inline, so a blocked receive holds Python
  at its instruction) and, per message instruction, the `order` array its chain
  returned (ready once its MPI calls are done). When a step runs past its deadline,
  the watchdog prints which instruction this rank is blocked on (a message names its
  peer and the peer's host: `Note: rank hosts` in runtime/hosts.py), waits a grace period
  (so the other ranks, whose deadlines expire at about the same time, print theirs),
  then aborts the job. Deadline: JAXPP_MPI_STEP_TIMEOUT seconds, or automatically
  `first_steps_timeout_s` for the first steps and then `max(auto_floor_s, auto_factor
  * slowest step seen)`.

  Step times are taken on the dispatching thread: when a step starts, the steps before
  it whose last chain is ready are recorded as done (start to now: an upper bound,
  which makes the deadline only more lenient), so back-to-back steps teach the
  deadline as well as spaced ones; the monitor's poll records a step that it sees
  finish first, more precisely.

  One daemon thread per process looks at every live executor's Watchdog (weakly held)
  every `_POLL_S`, and never touches MPI. It only ever asks `is_ready()` of the chains'
  `order` arrays, which nothing deletes or donates: asking it of a step's results while
  the next step donates them crashed the process (seen in CI: a segfault in `is_ready`).
  A step is done when its last chain is; a group with no messages has nothing to watch.

Note: deadlines.
  Outside a step a stalled or lost peer leaves the others blocked in a collective:
  `make_mpmd_mesh`'s argument agreement and communicators (arrays/make_mesh.py),
  program agreement and the compile barrier (agree.py), `PreemptionGuard.should_stop`,
  a checkpoint's and a reshard's collectives, the user's own MPI calls between steps.
  Each of these waits inside `deadline(label, comm)`, which registers (label, start,
  limit) with the watchdog's daemon thread (no second thread); past its limit the
  daemon prints `[rank r] jaxpp_mpi deadline: waiting in <label> for N s ...`, waits
  the grace period (so the other waiting ranks print theirs) and aborts the job, as the
  watchdog does. An agreement (agree.py) tells the deadline which peers it still waits
  for (`waiting_on`, from `Note: watched allgather` in mpi/gather.py), so the report
  names them and their hosts: `it waits for rank 1 on host h2`. The limit:
  JAXPP_MPI_DEADLINE seconds (unset: JAXPP_MPI_STEP_TIMEOUT's value when it is a
  number), else 300 s; a collective that follows long work waits at
  least `work_factor` (5) x the slowest such work recorded under its label with
  `record_work`: this rank's own (`agree.run` measures tracing and compiling, which its
  peers do too) or what a peer may be doing (a checkpoint's largest file at 100 MB/s).
  `jaxpp_mpi.launch.deadline` is the public form for the user's own collectives. Local
  mode (no communicator, or a one-rank job): no deadline.

  The step call agreement (`Note: checking a call on every rank` in driver/compiled.py)
  sits between two steps, so a link lost between steps stops the ranks there: its
  automatic deadline is the step's own (the watchdog's, learnt: max(60 s, 20 x the
  slowest step) once 3 steps ran), or `work_factor` x the longest this rank's loop
  spent between two calls when longer (`step_call_deadline_s`); a number given in
  JAXPP_MPI_DEADLINE or JAXPP_MPI_STEP_TIMEOUT applies as it is. A report names the
  peers this rank waits for and their hosts (rank 0 the ranks not arrived, the others
  rank 0), and where the communicator's ranks run when they span several hosts (`Note:
  rank hosts` in runtime/hosts.py); the abort is bounded (`Note: bounded abort` in
  launch/abort.py).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.base.config import Options
from jaxpp_mpi._src.launch.abort import bounded
from jaxpp_mpi._src.launch.abort import install_abort_on_exception as install_abort_on_exception
from jaxpp_mpi._src.launch.abort import prefixed as _prefixed
from jaxpp_mpi._src.runtime.hosts import describe_hosts, describe_peers, hosts_of
from jaxpp_mpi._src.schedules.tasks import describe_label as describe_task

__all__ = ["Watchdog", "deadline", "deadline_s", "describe_task",
           "install_abort_on_exception", "is_mpi", "record_work", "step_call_deadline_s"]

_POLL_S = 0.25
_watched: weakref.WeakSet[Watchdog] = weakref.WeakSet()
_monitor: threading.Thread | None = None
_monitor_lock = threading.Lock()


_waits: set[_Wait] = set()
_work: dict[str, float] = {}  # per label: the slowest local work before it, seconds


def _monitor_loop() -> None:
    while True:
        time.sleep(_POLL_S)
        with _monitor_lock:
            watchdogs = list(_watched)
            waits = list(_waits)
        for watched in (*watchdogs, *waits):
            try:
                watched.check()
            except Exception as e:  # noqa: BLE001 - one bad check must not end the watch
                print(f"jaxpp_mpi watchdog: a check failed ({type(e).__name__}: {e}); "
                      "the others go on", file=sys.stderr, flush=True)


def _abort_after(grace_s: float, abort: Callable[[int], None]) -> None:
    """Aborts with status 1 after `grace_s`, on a thread of its own: the monitor goes on
    watching the other waits meanwhile, and an abort that blocks cannot stop it."""
    def run() -> None:
        time.sleep(grace_s)
        abort(1)

    threading.Thread(target=run, daemon=True, name="jaxpp_mpi-abort").start()


def _ensure_monitor() -> None:
    """Starts the daemon thread (again, should it have ended); call with
    `_monitor_lock` held."""
    global _monitor
    if _monitor is None or not _monitor.is_alive():
        _monitor = threading.Thread(target=_monitor_loop, daemon=True,
                                    name="jaxpp_mpi-watchdog")
        _monitor.start()


def record_work(label: str, seconds: float) -> None:
    """Records `seconds` of work before the collective `label`, this rank's own or a
    peer's (see `Note: deadlines`): that collective's later deadlines are at least
    `work_factor` x the slowest recorded."""
    with _monitor_lock:
        _work[label] = max(_work.get(label, 0.0), seconds)


def deadline_s(label: str, options: Options | None = None) -> float | None:
    """The deadline in seconds of the collective `label` (None: no deadline).

    Args:
      label: where the rank waits, e.g. "program agreement".
      options: the settings (default: the process's).
    """
    o = options or config.options()
    if not o.deadlines:
        return None
    base = o.deadline_s if o.deadline_s is not None else o.auto_deadline_s
    with _monitor_lock:
        work = _work.get(label, 0.0)
    return max(base, o.work_factor * work)


def step_call_deadline_s(options: Options, step_deadline_s: float | None,
                         slowest_gap_s: float) -> float | None:
    """The deadline of a step call's agreement (`Note: deadlines`): the step's own
    learnt deadline, not the 300 s of other collectives, once the ranks run steps.

    Args:
      options: the settings.
      step_deadline_s: the watchdog's deadline for the coming step (None: no watchdog).
      slowest_gap_s: the longest this rank's loop has spent between two calls of the
        step (its own work there: a peer doing the same arrives that much later).

    Returns:
      None where the usual deadline applies (a JAXPP_MPI_DEADLINE or a number of
      JAXPP_MPI_STEP_TIMEOUT, deadlines off, no watchdog), else max(the step's
      deadline, `work_factor` x `slowest_gap_s`).
    """
    if not options.deadlines or options.deadline_s is not None or step_deadline_s is None:
        return None
    return max(step_deadline_s, options.work_factor * slowest_gap_s)


def is_mpi(comm: Any) -> bool:
    """Whether `comm` is an mpi4py communicator (a stand-in's `Abort` is its own)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and isinstance(comm, mpi.Comm)


class _Wait:
    """One collective in progress under a deadline (see `Note: deadlines`)."""

    def __init__(self, label: str, limit: float, rank: int, abort: Callable[[int], None],
                 grace: float, how: str, hosts: Sequence[str | None] = (),
                 waiting_on: Callable[[], Sequence[int]] | None = None):
        self.label, self.limit, self.rank, self.abort = label, limit, rank, abort
        self.grace, self.how, self.hosts, self.waiting_on = grace, how, hosts, waiting_on
        self.start = time.monotonic()
        self.fired = False

    def _who(self) -> str:
        """`it waits for rank 1 on host h2` (`waiting_on`'s ranks now), else that some
        peer has not arrived."""
        try:
            ranks = list(self.waiting_on()) if self.waiting_on is not None else []
        except Exception:  # noqa: BLE001 - the report goes out without the peers
            ranks = []
        if not ranks:
            return "a peer rank has not reached it"
        return f"it waits for {describe_peers(ranks, self.hosts)}"

    def check(self) -> None:
        """One look (from the monitor thread): report and abort when past the limit."""
        elapsed = time.monotonic() - self.start
        if self.fired or elapsed <= self.limit:
            return
        self.fired = True
        peers = describe_hosts(self.hosts)
        where = f"; where the ranks run: {peers}" if peers else ""
        sys.stderr.write(_prefixed(self.rank, (
            f"jaxpp_mpi deadline: waiting in {self.label} for {elapsed:.1f} s, past its "
            f"deadline of {self.limit:.1f} s ({self.how}); {self._who()} (stalled, or "
            f"lost{where}).\naborting the MPI job in {self.grace:g} s")))
        sys.stderr.flush()
        _abort_after(self.grace, self.abort)


def _world() -> Any:
    """COMM_WORLD when MPI is initialised in a job of several ranks, else None (never
    imports mpi4py itself)."""
    module = sys.modules.get("mpi4py.MPI")
    if module is None or not module.Is_initialized() or module.Is_finalized():
        return None
    world = module.COMM_WORLD
    return world if world.Get_size() > 1 else None


@contextlib.contextmanager
def deadline(label: str, comm: Any = None, *, seconds: float | None = None,
             abort: Callable[[int], None] | None = None,
             how: str | None = None,
             waiting_on: Callable[[], Sequence[int]] | None = None) -> Iterator[None]:
    """Runs the body, a collective that every rank reaches, under a deadline (see
    `Note: deadlines`): past it, this rank prints where it waits and aborts the job.

    Example:
      with jaxpp_mpi.launch.deadline("loss broadcast"):
          loss = comm.bcast(loss, root=last)

    Args:
      label: where the ranks wait, for the report (e.g. "loss broadcast").
      comm: the communicator of the collective (its rank names the report, its `Abort`
        ends the job); None: MPI_COMM_WORLD when MPI runs several ranks, else nothing
        is watched (one process waits on nobody).
      seconds: the deadline; None: `deadline_s(label)` (JAXPP_MPI_DEADLINE).
      abort: ends the job with a status (default `comm.Abort`, bounded: `Note:
        bounded abort`).
      how: where `seconds` comes from, for the report (default "given").
      waiting_on: the ranks of `comm` this rank waits for now (`Note: watched
        allgather` in mpi/gather.py), called by the watchdog's thread when the deadline
        passes, so it must not call MPI; the report names them and their hosts.
        None: the report says that some peer has not arrived.
    """
    if comm is None:
        comm = _world()
    if abort is None and is_mpi(comm):
        abort = bounded(comm.Abort, int(comm.Get_rank()))  # Note: bounded abort
    abort = abort or getattr(comm, "Abort", None)
    o = config.options()
    limit = seconds if seconds is not None else deadline_s(label, o)
    if comm is None or abort is None or limit is None:
        yield
        return
    base = o.deadline_s if o.deadline_s is not None else o.auto_deadline_s
    how = ((how or "given") if seconds is not None else
           f"{o.work_factor:g} x the slowest work before it" if limit > base else
           "JAXPP_MPI_DEADLINE" if o.deadline_s is not None else
           "automatic; set JAXPP_MPI_DEADLINE to change it")
    wait = _Wait(label, limit, int(comm.Get_rank()), abort, o.watchdog_grace_s, how,
                 hosts_of(comm), waiting_on)
    with _monitor_lock:
        _waits.add(wait)
        _ensure_monitor()
    try:
        yield
    finally:
        with _monitor_lock:
            _waits.discard(wait)


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
        self._pending: list[tuple[float, Any]] = []  # dispatched steps: (start, done)
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
        """Called by the executor before it dispatches a step; records the time of the
        steps before it that are done (see `Note: watchdog`)."""
        now = time.monotonic()
        with self._lock:
            self._record_done(now)
            self._step += 1
            self._start = now
            self._done = None
            self.pc = 0
        with _monitor_lock:
            if self not in _watched:
                _watched.add(self)
                _ensure_monitor()

    def step_dispatched(self, last_order: Any) -> None:
        """Called once the step is dispatched; it is done when `last_order` (the `order`
        array of its last message chain, or None) is ready."""
        with self._lock:
            self.pc = self.num_instrs
            self._done = last_order
            if self._start is not None:
                self._pending.append((self._start, last_order))

    def step_abandoned(self) -> None:
        """Called when dispatching the step raised: nothing more to watch for it."""
        with self._lock:
            self._start = None
            self.pc = self.num_instrs

    def _record_done(self, now: float) -> None:
        """Records the duration of each dispatched step now done (with `_lock` held)."""
        still = []
        for start, done in self._pending:
            if done is None or _ready(done):
                self._durations.append(now - start)
            else:
                still.append((start, done))
        self._pending = still

    def check(self) -> None:
        """One look (from the monitor thread): record a finished step's time, or report
        and abort when the step in flight is past its deadline."""
        with self._lock:
            if self._start is None or self._fired:
                return
            now = time.monotonic()
            elapsed = now - self._start
            if self.pc == self.num_instrs and (self._done is None or _ready(self._done)):
                self._record_done(now)
                self._start = None
                return
            deadline = self.deadline_s()
            if elapsed <= deadline:
                return
            self._fired = True
            report = self._report(elapsed, deadline)
        sys.stderr.write(_prefixed(self.rank, report))
        sys.stderr.flush()
        _abort_after(self.options.watchdog_grace_s, self.abort)

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
