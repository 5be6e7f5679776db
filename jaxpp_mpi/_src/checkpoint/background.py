"""A save's background part on one rank: its leaf files written, and on rank 0 the commit.

Note: Background saves.
  An asynchronous save (checkpoint/async_save.py) is the commit of Note: Atomic commit
  with steps 2 and 3 moved off the calling thread, and with no MPI call off it:
  0-1. in the call, collectively: rank 0 takes the save lock and makes the temp dir;
       every rank takes its host copies (Note: Host copies) and returns;
  2. each writing rank's writer threads (as many as the cores this process may run on,
     at most 4, at most one per leaf) write its files (Note: Direct writes), then the
     rank marks them written: `.written-RANK` in the temp dir, made by a rename, holding
     its byte count or its error;
  3. rank 0's committer thread waits until every writing rank has marked its files, or
     until the ranks' agreement (below) says how the writes went; then, when all
     succeeded, it removes the marks, writes the manifest last and renames the temp dir
     into place (`finish_commit`), else it removes the temp dir; it releases the lock,
     and after a commit runs the save's follow-up (a CheckpointManager removes its old
     steps there, so a step is removed only once a newer one is committed).
  The marks are a file-system handshake (the ranks write one shared temp dir already),
  so no thread but the caller's ever talks MPI: no MPI thread level is needed, and no
  background collective spins on a core that the step needs. Marks are polled every
  `POLL_S` seconds.

  The outcome reaches every rank at the next collective point the caller makes: the
  next save, `AsyncSave.wait` or `CheckpointManager.wait` (`settle` in async_save.py):
  each rank waits for its own writes, the ranks allgather their write errors, rank 0
  hands that verdict to its committer (which then needs no marks), waits for it and
  broadcasts the outcome; every rank raises alike (Note: raise on every rank). At
  interpreter exit a save never settled is waited for on each rank (its own part; the
  commit on rank 0) and an error is printed, rank-prefixed, and ends the process with
  status 1: no collective runs there, so each rank reports what it knows.

  A crash anywhere leaves what Note: Atomic commit leaves: no manifest, or a complete
  temp dir beside a missing target, which `recover` renames into place.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Sequence

from jaxpp_mpi._src.checkpoint import lock as save_lock
from jaxpp_mpi._src.checkpoint.commit import finish_commit
from jaxpp_mpi._src.checkpoint.format import CheckpointError, Manifest
from jaxpp_mpi._src.checkpoint.host_buffers import BufferPool, LeafCopy
from jaxpp_mpi._src.checkpoint.leaf_files import write_buffer
from jaxpp_mpi._src.checkpoint.pause import pause_point
from jaxpp_mpi._src.runtime import agree

__all__ = ["Background", "writer_threads"]

POLL_S = 0.02
MAX_WRITER_THREADS = 4


def writer_threads(leaves: int) -> int:
    """Writer threads for `leaves` files: the cores this process may run on (a rank
    bound to one core gets one), at most `MAX_WRITER_THREADS` and one per leaf."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WRITER_THREADS, cores, leaves))


def _mark_name(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f".written-{rank}")


class Background:
    """One save's work on this rank after the call returned (see Note: Background saves).

    Args:
      target: the checkpoint's absolute path.
      tmp: the save's temp dir.
      manifest: the manifest rank 0 writes last.
      copies: this rank's leaves as host copies (empty on a rank that writes none).
      rank: this rank among the writing ranks.
      writing_ranks: how many ranks mark their files (0 on a rank that does not write).
      commits: this rank commits (rank 0).
      lock: the save lock (rank 0), released by the committer.
      pool: where the written buffers go back.
      error: an error that happened before the writes (a failed copy): the rank marks
        it instead of writing.
      after_commit: run by the committer after a commit.
    """

    def __init__(self, *, target: str, tmp: str, manifest: Manifest,
                 copies: Sequence[LeafCopy], rank: int, writing_ranks: int, commits: bool,
                 lock: save_lock.SaveLock | None, pool: BufferPool,
                 error: BaseException | None = None,
                 after_commit: Callable[[], None] | None = None):
        self.target, self.tmp, self.manifest = target, tmp, manifest
        self.copies, self.rank, self.writing_ranks = list(copies), rank, writing_ranks
        self.commits, self._lock, self._pool = commits, lock, pool
        self._after_commit = after_commit
        self.write_error: BaseException | None = error
        self.commit_error: BaseException | None = None
        self.written = threading.Event()  # this rank's files are written (or failed)
        self.finished = threading.Event()  # and, on rank 0, committed (or given up)
        self._verdict: tuple[bool, str | None] | None = None
        self._wake = threading.Event()
        self._next = 0  # the next copy a writer thread takes
        self._next_lock = threading.Lock()
        self._paused = False
        self._left = 0  # writer threads still running

    @property
    def nbytes(self) -> int:
        """Bytes this rank writes."""
        return sum(c.size for c in self.copies)

    def start(self) -> None:
        """Starts the writer threads (and the committer, on rank 0)."""
        if self.writing_ranks:
            threads = writer_threads(len(self.copies))
            self._left = threads
            for n in range(threads):
                threading.Thread(target=self._write, daemon=True,
                                 name=f"jaxpp_mpi-checkpoint-writer-{n}").start()
        else:
            self.written.set()
        if self.commits:
            threading.Thread(target=self._commit, daemon=True,
                             name="jaxpp_mpi-checkpoint-commit").start()
        elif not self.writing_ranks:
            self.finished.set()

    def decide(self, ok: bool, reason: str | None) -> None:
        """Rank 0, at the ranks' agreement: every rank's writes succeeded (`ok`), or
        `reason` says which failed; the committer needs no marks after this."""
        self._verdict = (ok, reason)
        self._wake.set()

    # -- writer threads ---------------------------------------------------------------

    def _take(self) -> LeafCopy | None:
        with self._next_lock:
            if self.write_error is not None or self._next >= len(self.copies):
                return None
            self._next += 1
            return self.copies[self._next - 1]

    def _pause_once(self) -> None:
        with self._next_lock:
            first, self._paused = not self._paused, True
        if first:
            pause_point("write", self.rank)

    def _write(self) -> None:
        try:
            while (copy := self._take()) is not None:
                file = os.path.join(self.tmp, self.manifest.leaves[copy.index].file)
                write_buffer(file, copy.buffer, copy.size, self._pause_once)
        except BaseException as e:  # noqa: BLE001 - reported through the mark and settle
            with self._next_lock:
                self.write_error = self.write_error or e
        with self._next_lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._mark()

    def _mark(self) -> None:
        """Marks this rank's files written (or failed), then frees its buffers."""
        try:
            text = json.dumps({"rank": self.rank, "bytes": self.nbytes,
                               "error": agree.describe(self.write_error)})
            part = _mark_name(self.tmp, self.rank) + ".part"
            with open(part, "w", encoding="utf-8") as f:
                f.write(text)
            os.rename(part, _mark_name(self.tmp, self.rank))
        except OSError as e:  # rank 0 then learns it at the agreement
            self.write_error = self.write_error or e
        self._pool.give([c.buffer for c in self.copies])
        self.copies = []
        self.written.set()
        self._wake.set()
        if not self.commits:
            self.finished.set()

    # -- the committer (rank 0) -------------------------------------------------------

    def _marks(self) -> tuple[bool, str | None] | None:
        """(all succeeded, the first failure) once every writing rank has marked its
        files, else None."""
        reason = None
        for r in range(self.writing_ranks):
            try:
                with open(_mark_name(self.tmp, r), encoding="utf-8") as f:
                    mark = json.loads(f.read(1 << 16))
            except FileNotFoundError:
                return None
            except (OSError, ValueError) as e:
                mark = {"error": f"unreadable mark of rank {r}: {e}"}
            if mark.get("error") and reason is None:
                reason = f"rank {r} failed: {mark['error']}"
        return reason is None, reason

    def _commit(self) -> None:
        committed = False
        try:
            while True:
                outcome = self._verdict
                if outcome is None and self.written.is_set():
                    outcome = self._marks()
                if outcome is not None:
                    break
                self._wake.wait(POLL_S)
                self._wake.clear()
            ok, reason = outcome
            if not ok or self.write_error is not None:
                raise CheckpointError(reason or f"rank {self.rank} failed: "
                                      f"{agree.describe(self.write_error)}")
            for r in range(self.writing_ranks):
                try:
                    os.unlink(_mark_name(self.tmp, r))
                except FileNotFoundError:
                    pass
            finish_commit(self.tmp, self.target, self.manifest)
            committed = True
        except BaseException as e:  # noqa: BLE001 - reported at settle
            self.commit_error = e
            shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            if self._lock is not None:
                save_lock.release(self._lock)
                self._lock = None
        if committed and self._after_commit is not None:
            try:
                self._after_commit()
            except BaseException as e:  # noqa: BLE001 - reported at settle
                self.commit_error = CheckpointError(
                    f"{self.target} was saved, but what follows the save failed: "
                    f"{agree.describe(e)}")
        self.finished.set()
