"""A directory of checkpoints, one per step: save every K steps, keep the last N, resume
from the newest complete one.

Note: Checkpoint steps.
  A `CheckpointManager` over DIR keeps step S in DIR/S (decimal, no padding), each a
  checkpoint directory written and committed exactly as `checkpoint.save` writes one
  (Note: Atomic commit; its own save lock DIR/.S.lock), so `load_whole`, `restore`
  and the reshard CLI read DIR/S as any checkpoint. A step exists once its directory
  holds a complete checkpoint (manifest and every leaf file); the newest such step is
  the one to resume from. No other file says which step is newest: the renames that
  commit a step are the only record, so no pointer can disagree with the steps.

  After step S is committed, rank 0 removes the steps the policy no longer keeps (the
  `max_to_keep` newest, and every multiple of `keep_period`), each first renamed to
  DIR/.T.del-TOKEN, then removed: a crash mid-way leaves a name no step has. On
  construction rank 0 cleans up what crashes leave: a complete temp dir of a missing
  step is renamed into place (`recover`), other temp dirs, replaced steps
  (`.T.old-*`), half-removed steps (`.T.del-*`) and stale lock files are removed, each
  under that step's save lock (a save of another job in progress is left alone).

  Saves never go backwards: saving a step below the newest one in DIR is refused on
  every rank (resume from the newest, or use another directory); saving the newest
  step again is skipped.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Iterable

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.base.types import PyTree
from jaxpp_mpi._src.checkpoint import lock as save_lock
from jaxpp_mpi._src.checkpoint import store
from jaxpp_mpi._src.checkpoint.async_save import host_buffer_pool, save_async, wait_for_saves
from jaxpp_mpi._src.checkpoint.commit import complete, fsync_dir, recover
from jaxpp_mpi._src.checkpoint.format import CheckpointError
from jaxpp_mpi._src.checkpoint.pause import pause_point
from jaxpp_mpi._src.checkpoint.snapshot import ranks_of

__all__ = ["CheckpointManager", "steps_to_remove"]

_STEP = re.compile(r"[0-9]+")
_LEFTOVER = re.compile(r"\.([0-9]+)\.(tmp|old|del)-[0-9a-f]+")
_LOCK = re.compile(r"\.([0-9]+)\.lock")


def steps_to_remove(steps: Iterable[int], max_to_keep: int | None,
                    keep_period: int | None) -> list[int]:
    """The steps the policy does not keep: all but the `max_to_keep` newest (None: keep
    all) and the multiples of `keep_period` (None: none kept for good)."""
    steps = sorted(set(steps))
    if max_to_keep is None:
        return []
    keep = set(steps[-max_to_keep:]) if max_to_keep else set()
    return [s for s in steps if s not in keep and not (keep_period and s % keep_period == 0)]


class CheckpointManager:
    """Checkpoints of a training run in one directory, a step each (Note: Checkpoint
    steps); saves are asynchronous by default (Note: Background saves); collective in
    MPI mode: every rank builds and calls it alike.

    Construction is collective in MPI mode (every rank of the job calls it): rank 0
    cleans up what a crash left. So are `save`, `wait`, `all_steps`, `latest_step`,
    `restore` and `close`.

    Example:
      manager = checkpoint.CheckpointManager(run_dir, mesh=mesh, save_interval_steps=100,
                                             max_to_keep=3)
      first = 0
      if (latest := manager.latest_step()) is not None:
          state = manager.restore(like, shardings=shardings)
          first = latest
      for step in range(first, num_steps):
          state = train_step(state, batch)
          manager.save(step + 1, state)
      manager.close()

    Args:
      directory: the run's checkpoint directory (created on the first save).
      mesh: the MPMD mesh (needed in an MPI job of several ranks).
      save_interval_steps: `save` writes only steps that are multiples of this.
      max_to_keep: how many of the newest steps to keep (None: all).
      keep_period: steps that are multiples of this are kept for good, besides.
      async_saves: write in the background (`save_async`); False: `save` returns once
        the step is committed.

    Raises:
      ValueError: a count below its minimum.
    """

    def __init__(self, directory: str, *, mesh: MpmdMesh | None = None,
                 save_interval_steps: int = 1, max_to_keep: int | None = None,
                 keep_period: int | None = None, async_saves: bool = True):
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps={save_interval_steps} must be >= 1")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep={max_to_keep} must be >= 1 (None keeps all)")
        if keep_period is not None and keep_period < 1:
            raise ValueError(f"keep_period={keep_period} must be >= 1")
        self.directory = os.path.abspath(directory)
        self.mesh = mesh
        self.save_interval_steps = save_interval_steps
        self.max_to_keep, self.keep_period = max_to_keep, keep_period
        self.async_saves = async_saves
        self._last: int | None = None  # the step of this manager's last save
        ranks = self._ranks("clean-up")
        ranks.run(lambda: self._clean_up() if ranks.rank == 0 else None)

    def _ranks(self, what: str):
        return ranks_of(self.mesh, f"checkpoint manager {what} of {self.directory}")

    def step_path(self, step: int) -> str:
        """The directory of `step` (a checkpoint: `load_whole`, the reshard CLI...)."""
        return os.path.join(self.directory, str(int(step)))

    # -- which steps exist ------------------------------------------------------------

    def _complete_steps(self) -> list[int]:
        """The complete steps on disk (this process's look; rank 0's is the job's)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names
                      if _STEP.fullmatch(n) and complete(os.path.join(self.directory, n)))

    def all_steps(self) -> list[int]:
        """The complete steps in the directory, oldest first; collective in MPI mode
        (rank 0 looks, every rank gets its answer). A save in flight is not one yet."""
        ranks = self._ranks("look-up")
        return ranks.bcast(ranks.run(
            lambda: self._complete_steps() if ranks.rank == 0 else None))

    def latest_step(self) -> int | None:
        """The newest complete step, or None; collective in MPI mode (as `all_steps`)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    # -- saving -----------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` writes (local: the same answer on every rank)."""
        return step % self.save_interval_steps == 0 and step != self._last

    def save(self, step: int, tree: PyTree, *, force: bool = False) -> bool:
        """Saves `tree` as `step` when `step` is a multiple of `save_interval_steps` (or
        `force`); collective in MPI mode (every rank calls it at every step alike).

        The save in flight is waited for first (its failure raised here, on every rank).
        Asynchronously (the default) it returns once this rank holds host copies of
        what it writes; the step is committed in the background, then older steps
        beyond the policy are removed.

        Args:
          step: the training step (e.g. steps done so far).
          tree: the pytree to save (as `checkpoint.save` takes it).
          force: save even off the interval (a final or preemption save).

        Returns:
          True when this call saved the step; False when it skipped it (off the
          interval, or the newest step already).

        Raises:
          CheckpointError: on every rank: the previous save failed, the directory holds
            a newer step, or the save itself is refused (as `checkpoint.save`).
        """
        if step == self._last or not (force or step % self.save_interval_steps == 0):
            return False
        try:
            wait_for_saves()
        except CheckpointError:
            self._last = None  # that save failed: its step may be saved again
            raise
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                self._last = step
                return False
            raise CheckpointError(
                f"{self.directory} holds step {latest}, newer than the step {step} being "
                "saved: not saving older progress beside newer (resume from the newest "
                "with restore(), or use another directory)")
        path = self.step_path(step)
        self._last = step
        if self.async_saves:
            save_async(path, tree, step, mesh=self.mesh, overwrite=True,
                       after_commit=lambda: self._remove_old(step))
            return True
        store.save(path, tree, step, mesh=self.mesh, overwrite=True)
        ranks = self._ranks("clean-up")
        ranks.run(lambda: self._remove_old(step) if ranks.rank == 0 else None)
        return True

    def wait(self) -> None:
        """Waits until the save in flight is committed and old steps are removed; raises
        its failure on every rank; collective in MPI mode."""
        wait_for_saves()

    def close(self) -> None:
        """`wait`, and drops the host buffers kept for the next save (Note: Host copies);
        collective in MPI mode."""
        self.wait()
        host_buffer_pool().clear()

    # -- restoring --------------------------------------------------------------------

    def restore(self, like: PyTree, step: int | None = None, *,
                shardings: PyTree = None) -> PyTree:
        """Restores `step` (None: the newest complete one) into a pytree placed like
        `like`, as `checkpoint.restore` does; collective in MPI mode. A save in flight
        is waited for first.

        Raises:
          CheckpointError: on every rank: no step to restore, or the step does not
            match `like`.
        """
        wait_for_saves()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"{self.directory} holds no complete step to restore")
        return store.restore(self.step_path(step), like, shardings=shardings, mesh=self.mesh)

    # -- rank 0's file work -----------------------------------------------------------

    def _remove_old(self, newest: int) -> None:
        """Rank 0, after `newest` is committed: removes the steps the policy drops."""
        for step in steps_to_remove(self._complete_steps(), self.max_to_keep,
                                    self.keep_period):
            if step < newest:
                self._remove_step(step)

    def _remove_step(self, step: int) -> None:
        target = self.step_path(step)
        try:
            lock = save_lock.acquire(target)
        except CheckpointError:
            return  # another job saves it right now: leave it
        try:
            gone = os.path.join(self.directory, f".{step}.del-{secrets.token_hex(6)}")
            os.rename(target, gone)
            fsync_dir(self.directory)
            files = sorted(os.scandir(os.path.join(gone, "arrays")), key=lambda e: e.name)
            if files:
                os.unlink(files[0].path)
            pause_point("delete", 0)
            shutil.rmtree(gone, ignore_errors=True)
        finally:
            save_lock.release(lock)

    def _clean_up(self) -> None:
        """Rank 0, at construction: what crashes left (Note: Checkpoint steps)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            m = _LEFTOVER.fullmatch(name)
            if m and m.group(2) == "del":
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        steps = {int(m.group(1)) for n in names
                 if (m := _LEFTOVER.fullmatch(n) or _LOCK.fullmatch(n))}
        for step in sorted(steps):
            target = self.step_path(step)
            try:
                lock = save_lock.acquire(target)
            except CheckpointError:
                continue  # a save in progress (another job's)
            try:
                recover(target, locked=True)
                for name in os.listdir(self.directory):
                    m = _LEFTOVER.fullmatch(name)
                    if m and int(m.group(1)) == step:
                        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
            finally:
                save_lock.release(lock)
