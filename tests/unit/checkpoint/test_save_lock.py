"""The save lock in one process (`Note: Save lock` in checkpoint/lock.py): `find` does not
move a save in progress, and on a file system without flock the lock file decides.
tests/jobs/test_concurrent_saves.py saves from two processes, and two MPI jobs, at once."""

from __future__ import annotations

import errno
import json
import os
import socket

import numpy as np
import pytest

from jaxpp_mpi import checkpoint as ck
from jaxpp_mpi._src.checkpoint import lock as save_lock


def _second_tree() -> dict:
    return {"a": np.full(3, -1, np.int32), "slow": np.full(4, -1.0, np.float32)}


def _leftovers(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".ckpt"))


def test_find_does_not_move_a_save_in_progress(tmp_path):
    """An interrupted save left `.ckpt.old-*` and no ckpt; while another writer holds
    the lock, `find` refuses rather than renaming under it."""
    path = str(tmp_path / "ckpt")
    ck.save(path, _second_tree(), step=2)
    os.rename(path, str(tmp_path / ".ckpt.old-aa"))
    held = save_lock.acquire(path)
    try:
        with pytest.raises(ck.CheckpointError, match=f"pid {os.getpid()}"):
            ck.find(path)
    finally:
        save_lock.release(held)
    assert ck.find(path).step == 2


@pytest.fixture
def no_flock(monkeypatch):
    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "no locks here")

    monkeypatch.setattr(save_lock.fcntl, "flock", refuse)


def _dead_pid() -> int:
    """A pid no process has: above the kernel's largest."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1


@pytest.mark.parametrize(("host", "alive", "taken"), [
    ("here", False, True), ("here", True, False), ("elsewhere", False, False)])
def test_without_flock_the_lock_file_decides(tmp_path, no_flock, host, alive, taken):
    """Without flock: a lock of a dead process of this host is stale and taken over; a
    live writer's, or another host's, is refused (the latter: remove it by hand)."""
    path = str(tmp_path / "ckpt")
    pid = os.getpid() if alive else _dead_pid()
    name = socket.gethostname() if host == "here" else "another-host.example"
    with open(save_lock.lock_path(path), "w") as f:
        json.dump({"host": name, "pid": pid, "since": "2026-01-01T00:00:00+00:00"}, f)
    if taken:
        ck.save(path, _second_tree(), step=2)
        assert ck.read_manifest(path).step == 2
        assert _leftovers(tmp_path) == []
        return
    hint = "remove .* by hand" if host != "here" else f"pid {pid} on host {name}"
    with pytest.raises(ck.CheckpointError, match=hint):
        ck.save(path, _second_tree(), step=2)
    assert not os.path.exists(path)
