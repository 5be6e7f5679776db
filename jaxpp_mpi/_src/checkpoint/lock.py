"""One save at a time per checkpoint path: the save lock beside the checkpoint.

Note: Save lock.
  Two saves to one path at once (two jobs started on the same folder, say) would undo
  each other: each removes the temp dirs it takes for stale (Note: Atomic commit, step
  1), so one's ranks would find their files gone mid-write. So rank 0 of a save takes
  `.NAME.lock`, beside NAME, before step 1 and keeps it until the rename is done or the
  save failed; `recover` takes it too before it renames anything. The lock is an
  exclusive, non-blocking `flock` on that file, which the operating system drops when
  its process ends, however it ends: a dead writer's lock is free at once, and its file
  is simply taken over. The file holds its writer as JSON (host, pid, when it took the
  lock), so a save that finds the lock held is refused with a `CheckpointError` naming
  that writer, raised on every rank (rank 0 broadcasts it like any step-1 error), and
  changes nothing on disk: the other save goes on and its checkpoint is the one that
  appears, whole. A writer removes the file, then unlocks it; a save that locked a file
  already removed (opened just before) finds it no longer at the path and tries again.
  On a file system without `flock` the lock is the file's existence (created with
  O_EXCL): a lock left by a process of this host that no longer runs (its pid gone, or
  now another process's) is stale and taken over; one from another host holds until it
  is removed by hand, as the refusal says.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import fcntl
import json
import os
import socket
import time

from jaxpp_mpi._src.checkpoint.format import CheckpointError

__all__ = ["SaveLock", "acquire", "lock_path", "release"]

_MAX_HOLDER_BYTES = 4096
_TRIES = 5


@dataclasses.dataclass
class SaveLock:
    """A save lock this process holds (`acquire`)."""

    path: str
    fd: int
    flock: bool


def lock_path(target: str) -> str:
    """The lock file of the checkpoint path `target` (absolute)."""
    parent, name = os.path.split(target)
    return os.path.join(parent, f".{name}.lock")


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _holder_text(target: str) -> bytes:
    pid = os.getpid()
    now = datetime.datetime.now(datetime.UTC)
    return json.dumps({"host": socket.gethostname(), "pid": pid, "start": _start_ticks(pid),
                       "since": now.isoformat(timespec="seconds"), "time": time.time(),
                       "path": target}).encode()


def _read_holder(path: str) -> dict | None:
    """The writer recorded in lock file `path`, or None (missing, empty or unreadable)."""
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(_MAX_HOLDER_BYTES).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _gone(holder: dict | None) -> bool:
    """True when `holder` ran on this host and runs no more (its pid gone or reused)."""
    if not holder or holder.get("host") != socket.gethostname():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    start = holder.get("start")
    return isinstance(start, int) and _start_ticks(pid) not in (None, start)


def _busy(target: str, path: str, holder: dict | None, by_hand: bool) -> CheckpointError:
    if holder is None:
        who = "a writer that has not recorded itself yet"
    else:
        when = holder.get("since", "?")
        age = holder.get("time")
        ago = f", {time.time() - age:.0f} s ago" if isinstance(age, (int, float)) else ""
        who = (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} "
               f"(since {when}{ago})")
    hint = (f"; if that writer is gone, remove {path} by hand" if by_hand else "")
    return CheckpointError(
        f"another save to {target} is in progress: its lock {path} is held by {who}. "
        "Two saves to one path at once would remove each other's files, so this one is "
        "refused and changed nothing: wait for that save to finish, or save to another "
        f"path{hint}")


def acquire(target: str) -> SaveLock:
    """Takes the save lock of checkpoint path `target` (see Note: Save lock).

    Args:
      target: the checkpoint directory's absolute path (its parent must exist).

    Returns:
      The lock, to hand to `release`.

    Raises:
      CheckpointError: another writer holds it, named.
    """
    path = lock_path(target)
    for _ in range(_TRIES):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _busy(target, path, _read_holder(path), by_hand=False) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            return _acquire_exclusive(target, path)
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:  # removed by its last writer after we opened it: open it again
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, _holder_text(target))
        return SaveLock(path, fd, flock=True)
    raise CheckpointError(f"could not take the save lock {path} of {target} in {_TRIES} "
                          "tries: other saves keep taking it; save once at a time")


def _acquire_exclusive(target: str, path: str) -> SaveLock:
    """`acquire` on a file system without flock: the lock is the file's existence."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_holder(path)
            if not _gone(holder):
                raise _busy(target, path, holder, by_hand=True) from None
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            continue
        os.write(fd, _holder_text(target))
        return SaveLock(path, fd, flock=False)
    raise _busy(target, path, _read_holder(path), by_hand=True)


def release(lock: SaveLock) -> None:
    """Removes the lock file, then drops the lock (see Note: Save lock)."""
    try:
        os.unlink(lock.path)
    except FileNotFoundError:
        pass
    finally:
        if lock.flock:
            try:
                fcntl.flock(lock.fd, fcntl.LOCK_UN)
            except OSError:
                pass
        os.close(lock.fd)
