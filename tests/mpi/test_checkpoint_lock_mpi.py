"""A save to a checkpoint path whose save lock another writer holds (`Note: Save lock` in
checkpoint/lock.py) is refused on every rank alike, naming that writer, and changes
nothing; once the lock is free the same save completes and restores on every rank.

Runs under `launch/jpprun -n 2` and `-n 4`. The other writer is rank 0 itself, through
a lock file descriptor of its own (two `flock`s on one file conflict even in one
process); tests/jobs/test_concurrent_saves.py runs two real jobs at once.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi import checkpoint
from jaxpp_mpi._src.checkpoint import lock as save_lock

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size


def _tree() -> dict:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.int32(7)}


@pytest.mark.mpi(min_size=2)
def test_a_save_under_a_held_lock_is_refused_on_every_rank(tmp_path_factory):
    mesh = jaxpp_mpi.make_mpmd_mesh((SIZE, 1), ("stage", "data"), "stage")
    root = WORLD.bcast(str(tmp_path_factory.mktemp("lock")) if RANK == 0 else None, root=0)
    path = os.path.join(root, "ckpt")
    held = save_lock.acquire(os.path.abspath(path)) if RANK == 0 else None
    writer = WORLD.bcast(os.getpid() if RANK == 0 else None, root=0)
    try:
        with pytest.raises(checkpoint.CheckpointError) as info:
            checkpoint.save(path, _tree(), step=1, mesh=mesh)
        text = str(info.value)
    finally:
        if held is not None:
            save_lock.release(held)
    who = f"pid {writer} on host {socket.gethostname()}"
    refused = WORLD.allgather("another save to" in text and who in text
                              and not os.path.exists(path))
    assert all(refused), (refused, text)
    checkpoint.save(path, _tree(), step=1, mesh=mesh)
    got = checkpoint.restore(path, _tree(), mesh=mesh)
    ok = (np.array_equal(got["w"], _tree()["w"]) and int(got["n"]) == 7
          and not os.path.exists(save_lock.lock_path(os.path.abspath(path))))
    assert all(WORLD.allgather(ok))
