"""Writing a checkpoint directory atomically from one or many MPI ranks.

Note: Atomic commit.
  A checkpoint directory appears at its path only once complete (format: Note:
  Checkpoint format in checkpoint/format.py):
  0. rank 0 takes the save lock of NAME (Note: Save lock in checkpoint/lock.py), held
     until step 3 is done or the save failed: a save finding it held is refused;
  1. rank 0 creates `.NAME.tmp-TOKEN/` next to the target NAME (removing stale temp
     dirs of the same target first) and broadcasts its name, or its error;
  2. every rank writes the .npy files of the leaves it owns into it, one leaf per
     round; after each round the ranks allgather (error, bytes), so a failure on one
     rank stops every rank at the same point and raises there too;
  3. rank 0 writes manifest.json last, syncs the directory and renames it to NAME. An
     existing NAME (replaced only when `overwrite`, and only if it is a checkpoint) is
     first renamed to `.NAME.old-TOKEN`, then deleted; rank 0 broadcasts the outcome.
  A crash before the rename leaves NAME as it was, plus a temp dir that the next save to
  NAME removes; a crash between the two renames leaves no NAME but the previous
  checkpoint at `.NAME.old-TOKEN` and the new, complete one (manifest written) at
  `.NAME.tmp-TOKEN`. `recover` (run by rank 0 before every save, and by
  `checkpoint.find` before a resume, under the save lock) renames the newest complete one
  of those (highest step; the temp dir on a tie) to NAME. On an error rank 0 removes the
  temp dir and every rank raises.

  Never backwards: with `overwrite`, a save whose step is lower than the step of the
  checkpoint at NAME is refused (CheckpointError on every rank, NAME unchanged): a run
  that failed to resume must not replace newer progress.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from jaxpp_mpi._src.base.types import Comm
from jaxpp_mpi._src.checkpoint import format as fmt
from jaxpp_mpi._src.checkpoint import leaf_files
from jaxpp_mpi._src.checkpoint import lock as save_lock
from jaxpp_mpi._src.checkpoint.format import CheckpointError, Manifest
from jaxpp_mpi._src.checkpoint.pause import pause_point
from jaxpp_mpi._src.runtime import agree
from jaxpp_mpi._src.runtime.failure import deadline, record_work

__all__ = ["Ranks", "commit_checkpoint", "complete", "finish_commit", "fsync_dir", "recover",
           "start_commit"]

Producer = Callable[[], np.ndarray]
T = TypeVar("T")

IO_BYTES_PER_S = 100e6
"""A slow file system's throughput: a rank waiting for a peer that writes (or reads) N
bytes waits at least `work_factor` x N / this, on top of its deadline, so a large leaf
on slow storage is not taken for a stall."""


def _rank_failed(failed: list[int], messages: Sequence[str | None]) -> CheckpointError:
    return CheckpointError(f"rank {failed[0]} failed: {messages[failed[0]]}")


class Ranks:
    """The processes taking part in a checkpoint operation: the ranks of an MPI
    communicator, or this process alone (`comm=None`).

    Each method is the checkpoint's use of `jaxpp_mpi._src.runtime.agree` (Note: raise on every
    rank): a failing rank raises its own error, the others a `CheckpointError` naming
    the first failing rank. Every collective waits under the deadline `label` (`Note:
    deadlines` in runtime/failure.py). Only mpi4py's object collectives of a
    communicator handed in are used; nothing here imports MPI.

    Args:
      comm: the communicator, or None for this process alone.
      label: what the ranks are doing, for the deadline's report ("checkpoint save").
    """

    def __init__(self, comm: Comm = None, label: str = "checkpoint collective"):
        self.comm = comm
        self.label = label
        self.rank = 0 if comm is None else int(comm.Get_rank())
        self.size = 1 if comm is None else int(comm.Get_size())

    def bcast(self, obj: Any) -> Any:
        """`obj` of rank 0, on every rank."""
        return agree.bcast(obj, self.comm, label=self.label)

    def allgather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order."""
        return agree.allgather(obj, self.comm, self.label)

    def barrier(self) -> None:
        """Waits until every rank has reached this point."""
        if self.comm is not None:
            with deadline(self.label, self.comm):
                self.comm.Barrier()

    def expect_io(self, nbytes: int) -> None:
        """Lets this operation's collectives wait for a peer reading or writing `nbytes`
        (at `IO_BYTES_PER_S`) besides the deadline (`Note: deadlines`)."""
        record_work(self.label, nbytes / IO_BYTES_PER_S)

    def allgather_or_raise(self, value: Any, error: BaseException | None) -> list[Any]:
        """Every rank's `value`, after raising on every rank if any rank's `error` is
        set (one allgather for both)."""
        return agree.allgather_or_raise(value, error, self.comm, _rank_failed,
                                        label=self.label)

    @staticmethod
    def raise_gathered(messages: Sequence[str | None], error: BaseException | None) -> None:
        """Raises on every rank if any of `messages` (gathered or broadcast `describe`s
        of the ranks' errors) is set; `error` is this rank's own."""
        agree.raise_gathered(messages, error, _rank_failed)

    def run(self, fn: Callable[[], T]) -> T:
        """`fn()` on every rank; if it raises on any rank, every rank raises."""
        return agree.run(fn, self.comm, _rank_failed, label=self.label)

    def check_same(self, text: str, what: str) -> None:
        """Raises on every rank unless `text` is the same on every rank."""
        agree.check_same(text, self.comm, lambda differ: CheckpointError(
            f"ranks {differ} passed a different {what} than rank 0"), self.label)


def fsync_dir(path: str) -> None:
    """Syncs directory `path` (its entries: files created, renamed, removed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_checkpoint(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, fmt.MANIFEST))


def complete(path: str) -> Manifest | None:
    """The manifest of `path` when it is a complete checkpoint (manifest readable, every
    leaf file present), else None."""
    try:
        text = fmt.read_json_file(os.path.join(path, fmt.MANIFEST), "manifest")
        manifest = Manifest.from_json(text, f"{path}/{fmt.MANIFEST}")
        if all(os.path.isfile(leaf_files.resolve_inside(path, leaf.file))
               for leaf in manifest.leaves):
            return manifest
    except (CheckpointError, OSError, ValueError):
        pass
    return None


def _interrupted(target: str) -> list[tuple[int, int, str]]:
    """(step, 1 for a temp dir / 0 for an old one, path) of every complete checkpoint an
    interrupted save left beside `target`."""
    parent, name = os.path.split(target)
    found = []
    for kind, pattern in ((1, ".tmp-"), (0, ".old-")):
        for d in glob.glob(os.path.join(parent, glob.escape(f".{name}{pattern}") + "*")):
            manifest = complete(d)
            if manifest is not None:
                step = manifest.step if manifest.step is not None else -1
                found.append((step, kind, d))
    return found


def recover(target: str, *, locked: bool = False) -> Manifest | None:
    """Completes a save interrupted between its two renames (see Note: Atomic commit);
    returns the manifest of the checkpoint now at `target`, or None if there is none.

    Rank 0 only (file system work): when `target` is missing, the newest complete one of
    `.NAME.tmp-*` and `.NAME.old-*` (highest step; the temp dir on a tie) is renamed to
    `target`, under the save lock (Note: Save lock).

    Args:
      target: the checkpoint's absolute path.
      locked: the caller holds the save lock already (a save's step 1).

    Raises:
      CheckpointError: another save holds the lock while there is something to rename.
    """
    if os.path.lexists(target):
        return complete(target)
    if not _interrupted(target):
        return None
    lock = None if locked else save_lock.acquire(target)
    try:
        found = _interrupted(target)  # again, under the lock
        if os.path.lexists(target) or not found:
            return complete(target) if os.path.lexists(target) else None
        os.rename(max(found)[2], target)
        fsync_dir(os.path.dirname(target))
        return complete(target)
    finally:
        if lock is not None:
            save_lock.release(lock)


def _prepare(target: str, overwrite: bool, step: int | None) -> str:
    """Rank 0, step 1 of Note: Atomic commit; returns the temp dir."""
    parent, name = os.path.split(target)
    current = recover(target, locked=True)
    for old in glob.glob(os.path.join(parent, glob.escape(f".{name}.old-") + "*")):
        shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(target):
        if not overwrite:
            raise CheckpointError(f"{target} exists; pass overwrite=True to replace it")
        if not _is_checkpoint(target):
            raise CheckpointError(f"{target} exists and is not a checkpoint; not replacing it")
        if (current is not None and step is not None and current.step is not None
                and current.step > step):
            raise CheckpointError(
                f"{target} holds step {current.step}, newer than the step {step} being "
                "saved: not replacing newer progress with older (resume from it with "
                "checkpoint.find, or save to another path)")
    for stale in glob.glob(os.path.join(parent, glob.escape(f".{name}.tmp-") + "*")):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(parent, f".{name}.tmp-{secrets.token_hex(6)}")
    os.makedirs(os.path.join(tmp, "arrays"))
    return tmp


def finish_commit(tmp: str, target: str, manifest: Manifest) -> None:
    """Rank 0, step 3 of Note: Atomic commit: the manifest into `tmp`, synced, then `tmp`
    renamed to `target`."""
    with open(os.path.join(tmp, fmt.MANIFEST), "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.join(tmp, "arrays"))
    fsync_dir(tmp)
    pause_point("rename", 0)
    parent, name = os.path.split(target)
    if os.path.lexists(target):
        old = os.path.join(parent, f".{name}.old-{secrets.token_hex(6)}")
        os.rename(target, old)
        os.rename(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, target)
    fsync_dir(parent)


def _write_leaf(tmp: str, leaf: fmt.LeafEntry, produce: Producer) -> int:
    value = np.asarray(produce())
    if value.shape != leaf.shape or value.dtype != leaf.np_dtype:
        raise CheckpointError(
            f"{fmt.format_key_path(leaf.path)} is {value.dtype.name}{list(value.shape)}, "
            f"the manifest says {leaf.dtype}{list(leaf.shape)}")
    return leaf_files.write_npy(os.path.join(tmp, leaf.file), fmt.to_storage(value))


def commit_checkpoint(
    path: str,
    manifest: Manifest,
    mine: Sequence[tuple[int, Producer]],
    ranks: Ranks,
    *,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[int, int]:
    """Writes a checkpoint atomically from every rank (see Note: Atomic commit).

    Args:
      path: the checkpoint directory to create.
      manifest: the manifest, the same on every rank; leaf i goes to `leaf_file(i)`.
      mine: (leaf index, function returning its value) for the leaves this rank writes;
        across ranks every leaf is written exactly once.
      ranks: the ranks taking part.
      overwrite: replace an existing checkpoint at `path`.
      progress: called on every rank after each round with (arrays, bytes) written so
        far by all ranks.

    Returns:
      (arrays, bytes) written by all ranks together.

    Raises:
      CheckpointError (or the failing rank's own error): on every rank, if any failed;
      `path` is then unchanged.
    """
    target = os.path.abspath(path)
    tmp, lock = start_commit(target, overwrite, manifest.step, ranks)
    try:
        return _write_and_finish(target, tmp, manifest, mine, ranks, progress)
    finally:
        if lock is not None:
            save_lock.release(lock)


def start_commit(target: str, overwrite: bool, step: int | None,
                 ranks: Ranks) -> tuple[str, save_lock.SaveLock | None]:
    """Steps 0 and 1 of Note: Atomic commit, collective over `ranks`: rank 0 takes the
    save lock of `target` and makes the temp dir; every rank learns its name.

    Returns:
      (the temp dir, the lock on rank 0 / None elsewhere); the caller releases the lock
      once the rename is done or the save failed.

    Raises:
      CheckpointError (rank 0's own error there): on every rank, when the lock is held,
      `target` may not be replaced, or the temp dir cannot be made.
    """
    tmp, error, lock = None, None, None
    if ranks.rank == 0:
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            lock = save_lock.acquire(target)
            tmp = _prepare(target, overwrite, step)
        except Exception as e:  # noqa: BLE001 - sent to every rank, raised there
            error = e
            if lock is not None:
                save_lock.release(lock)
                lock = None
    tmp, message = ranks.bcast((tmp, agree.describe(error)))
    ranks.raise_gathered([message], error)
    return tmp, lock


def _write_and_finish(target: str, tmp: str, manifest: Manifest,
                      mine: Sequence[tuple[int, Producer]], ranks: Ranks,
                      progress: Callable[[int, int], None] | None) -> tuple[int, int]:
    """Steps 2 and 3 of Note: Atomic commit (`commit_checkpoint`'s)."""
    try:
        arrays = total = 0
        ranks.expect_io(max((leaf.nbytes for leaf in manifest.leaves), default=0))
        rounds = max(ranks.allgather(len(mine)))
        for r in range(rounds):
            wrote, error = None, None
            if r < len(mine):
                i, produce = mine[r]
                try:
                    wrote = _write_leaf(tmp, manifest.leaves[i], produce)
                except Exception as e:  # noqa: BLE001 - raised on every rank below
                    error = e
            written = [w for w in ranks.allgather_or_raise(wrote, error) if w is not None]
            arrays += len(written)
            total += sum(written)
            if progress is not None:
                progress(arrays, total)
        error = None
        if ranks.rank == 0:
            try:
                finish_commit(tmp, target, manifest)
            except Exception as e:  # noqa: BLE001 - sent to every rank, raised there
                error = e
        ranks.raise_gathered([ranks.bcast(agree.describe(error))], error)
        return arrays, total
    except Exception:
        if ranks.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
