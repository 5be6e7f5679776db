"""Stopping cleanly on preemption: every rank agrees to stop after the same step.

Note: preemption.
  SLURM preempts a job with SIGTERM (`scancel --signal=TERM`, or `--signal=USR1@60`
  ahead of the time limit), and the signal may reach one rank before the others, or
  only some of them. `PreemptionGuard` catches the signals (the handler only sets a
  flag) and `should_stop()`, called by every rank at the same point of the training
  loop, turns the flags into one decision with a max-allreduce over the mesh's
  communicator: all ranks stop after the same step, write their checkpoint, and exit 0;
  the next run of the same command restores it. The allreduce is a host-side collective
  of one integer and waits for no device work; it waits under the deadline "preemption
  agreement (PreemptionGuard.should_stop)" (`Note: deadlines` in failure.py), so a rank
  that never reaches it ends the job instead of hanging it.

  Keep the guard open over the whole run, the final save included (a SIGTERM during
  that save then only sets the flag). With a `checkpoint.CheckpointManager` saving in
  the background, the final save is `manager.save(step, state, force=True)` then
  `manager.wait()`: the save still in flight is committed first (the next save waits
  for it, Note: Background saves in checkpoint/background.py), then the final step, so
  the job exits with its newest step on disk; the signal handler never touches a save
  (the background writers run on, and a signal only sets the flag). A SIGTERM to the
  launcher reaches the ranks as SIGUSR1 through `launch/jpprun` (Open MPI's mpirun
  would kill the ranks on SIGTERM but forwards SIGUSR1) and as SIGTERM through the
  SLURM template (docs/reliability.md).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any

__all__ = ["PreemptionGuard"]

_LABEL = "preemption agreement (PreemptionGuard.should_stop)"


class PreemptionGuard:
    """Catches preemption signals and decides, on all ranks alike, when to stop.

    Example:
      manager = checkpoint.CheckpointManager(run_dir, mesh=mesh, save_interval_steps=100)
      with jaxpp_mpi.PreemptionGuard(mesh) as guard:
          for step in range(start, num_steps):
              state = train_step(state, batch)
              manager.save(step + 1, state)  # every 100th step, in the background
              if guard.should_stop():
                  manager.save(step + 1, state, force=True)  # after the one in flight
                  break
      manager.wait()

    Args:
      mpmd_mesh: the job's `MpmdMesh` (MPI mode: every rank of the job decides, every
        pipeline replica included, so all stop after the same step; local mode: this
        process alone).
      signals: the signals meaning "stop after this step" (default SIGTERM and SIGUSR1).
    """

    def __init__(self, mpmd_mesh: Any,
                 signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1)):
        self._comm = None if mpmd_mesh.is_local else mpmd_mesh.job_comm
        self._signals = tuple(signals)
        self._previous: dict[signal.Signals, Any] = {}
        self.received: signal.Signals | None = None  # the first signal caught here
        self.stopped = False  # set once should_stop() has returned True

    def __enter__(self) -> PreemptionGuard:
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._catch)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def should_stop(self) -> bool:
        """True on every rank iff some rank caught a signal (collective in MPI mode:
        every rank must call it at the same point of the loop)."""
        mine = int(self.received is not None)
        if self._comm is None:
            decided = bool(mine)
        else:
            from jaxpp_mpi._src.mpi import collectives
            from jaxpp_mpi._src.runtime.failure import deadline

            with deadline(_LABEL, self._comm):
                decided = bool(collectives.allreduce_max_int(mine, self._comm))
        self.stopped = self.stopped or decided
        return decided
