"""Asynchronous saves: `save_async` returns once this rank holds host copies of what it
writes; the files are written in the background (Note: Background saves in
checkpoint/background.py), one save in flight at a time, its outcome raised on every
rank at the next save or wait."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.base.types import PyTree
from jaxpp_mpi._src.checkpoint.background import Background
from jaxpp_mpi._src.checkpoint.commit import IO_BYTES_PER_S, Ranks, start_commit
from jaxpp_mpi._src.checkpoint.host_buffers import BufferPool, copy_to_host
from jaxpp_mpi._src.checkpoint.snapshot import describe_save
from jaxpp_mpi._src.runtime import agree
from jaxpp_mpi._src.runtime.failure import deadline_s

__all__ = ["AsyncSave", "host_buffer_pool", "save_async", "wait_for_saves"]

_in_flight: list[AsyncSave] = []  # saves not yet settled, oldest first (at most one)
_pool = BufferPool()
_exit_hook = False


def host_buffer_pool() -> BufferPool:
    """This process's host buffers kept between saves (Note: Host copies)."""
    return _pool


class AsyncSave:
    """A save in flight (`save_async`): `done()` looks, `wait()` waits and raises.

    Attributes:
      path: the checkpoint directory being written.
      step: the step in its manifest.
      nbytes: bytes the whole checkpoint holds (every rank's leaves).
    """

    def __init__(self, path: str, step: int | None, ranks: Ranks,
                 background: Background | None, nbytes: int):
        self.path, self.step, self.nbytes = path, step, nbytes
        self._ranks, self._background = ranks, background
        self._settled = False

    def done(self) -> bool:
        """True once this rank's part is over: its files written and, on rank 0, the
        checkpoint committed or given up (local: no message; `wait` says how it went)."""
        return self._background is None or self._background.finished.is_set()

    def error(self) -> BaseException | None:
        """What failed as this rank sees it so far (local: no message): its own write,
        or on rank 0 the commit (which names a peer's failed write); None while running
        or when nothing failed here. `wait` raises the job's outcome on every rank."""
        b = self._background
        return None if b is None else (b.write_error or b.commit_error)

    def wait(self) -> None:
        """Waits until the save is committed on every rank; collective in MPI mode (every
        rank calls it). Saves begun before it are waited for first.

        Raises:
          CheckpointError (or the failing rank's own error): on every rank, when a write
            or the commit failed on any rank; the checkpoint at `path` is then as before.
        """
        while not self._settled and _in_flight:
            _settle(_in_flight[0])


def _settle(handle: AsyncSave) -> None:
    """Waits for `handle`'s background part and raises its outcome on every rank
    (collective; Note: Background saves)."""
    _in_flight.remove(handle)
    handle._settled = True
    ranks, background = handle._ranks, handle._background
    local = None
    if background is not None:
        background.written.wait()
        local = background.write_error
    ranks.expect_io(handle.nbytes)
    messages = ranks.allgather(agree.describe(local))
    outcome = None
    if background is not None and background.commits:
        failed = next((f"rank {r} failed: {m}" for r, m in enumerate(messages) if m), None)
        background.decide(failed is None, failed)
        background.finished.wait()
        outcome = background.commit_error
    message = ranks.bcast(agree.describe(outcome))
    ranks.raise_gathered(messages, local)
    ranks.raise_gathered([message], outcome)


def wait_for_saves() -> None:
    """Waits for every asynchronous save of this process and raises the first failure on
    every rank; collective in MPI mode while a save is in flight (every rank has the
    same saves in flight, so every rank calls it alike)."""
    while _in_flight:
        _settle(_in_flight[0])


def save_async(
    path: str,
    tree: PyTree,
    step: int | None = None,
    *,
    mesh: MpmdMesh | None = None,
    overwrite: bool = False,
    after_commit: Callable[[], None] | None = None,
) -> AsyncSave:
    """Saves like `checkpoint.save`, but returns once this rank holds a host copy of the
    leaves it writes; the files are written and committed in the background;
    collective in MPI mode: every rank calls it alike.

    Every rank calls it with the same tree. Arrays may be donated, deleted or changed as
    soon as it returns. A save still in flight is waited for first, and its failure
    raised here, on every rank (this save then does not start). The files, their
    atomic commit and the save lock are those of `checkpoint.save` (Note: Atomic
    commit, Note: Background saves).

    Example:
      pending = checkpoint.save_async(ckpt, {"params": params}, step=step)
      params = train_step(params, batch)   # donates params: safe
      pending.wait()                       # every rank: raises if the save failed

    Args:
      path: the checkpoint directory (created; its parent too).
      tree: the pytree to save; dict keys must be str or int.
      step: the training step, kept in the manifest.
      mesh: the MPMD mesh; needed only when the tree holds no MpmdArray in an MPI job.
      overwrite: replace an existing checkpoint at `path`, unless it holds a newer step.
      after_commit: run on rank 0, off the calling thread, once the checkpoint is in
        place (a failure there is raised like the save's).

    Returns:
      The save in flight: `wait()` on every rank (or the next save) raises its outcome.

    Raises:
      CheckpointError: on every rank: the previous save failed, an unsupported or
        deleted leaf, ranks passing different trees, `path` existing (or holding a
        newer step), another save holding its lock.
    """
    wait_for_saves()
    described = describe_save(path, tree, step, mesh)
    manifest, ranks, writers = described.manifest, described.ranks, described.writers
    target = os.path.abspath(path)
    tmp, lock = start_commit(target, overwrite, step, ranks)
    copies, error = [], None
    if writers is not None:
        try:
            copies = copy_to_host(manifest, described.mine, _pool)
        except Exception as e:  # noqa: BLE001 - marked, then raised on every rank at settle
            error = e
    background = None
    if writers is not None or ranks.rank == 0:
        background = Background(
            target=target, tmp=tmp, manifest=manifest, copies=copies,
            rank=ranks.rank, writing_ranks=0 if writers is None else writers.size,
            commits=ranks.rank == 0, lock=lock, pool=_pool, error=error,
            after_commit=after_commit)
        background.start()
    handle = AsyncSave(path, step, ranks, background,
                       sum(leaf.nbytes for leaf in manifest.leaves))
    _in_flight.append(handle)
    _install_exit_hook()
    return handle


def _install_exit_hook() -> None:
    global _exit_hook
    if not _exit_hook:
        atexit.register(_finish_at_exit)
        _exit_hook = True


def _finish_at_exit() -> None:
    """At exit: waits for this rank's part of every save never settled; prints a failure
    and ends the process with status 1 (Note: Background saves)."""
    failed = False
    for handle in list(_in_flight):
        background = handle._background
        if background is None:
            continue
        limit = (deadline_s(handle._ranks.label) or 300.0) + 5 * handle.nbytes / IO_BYTES_PER_S
        error = None
        if not background.finished.wait(limit):
            error = f"not finished {limit:.0f} s after exit began"
        elif background.write_error is not None or background.commit_error is not None:
            error = agree.describe(background.write_error or background.commit_error)
        if error is not None:
            failed = True
            sys.stderr.write(f"[rank {handle._ranks.rank}] jaxpp_mpi checkpoint: the "
                             f"asynchronous save of {handle.path} (step {handle.step}), "
                             f"never waited for, failed: {error}\n")
    _in_flight.clear()
    if failed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
