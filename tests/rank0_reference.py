"""An MPI test's `jax.jit` reference, computed once per job: on rank 0, sent to every rank.

Every rank of `jpprun -n N pytest --with-mpi` would otherwise compile and run the same
single-process `jax.jit` step, N times at once on a machine of fewer cores than ranks
(an 8-stage transformer's reference: ~9 s of CPU each). The reference stays what it
was, independent of the code under test: plain `jax.jit` in one process, its leaves
sent as numpy arrays with mpi4py (pickled, small). The other ranks wait without
spinning (a non-blocking barrier polled with sleeps), leaving the cores to rank 0.
A failure on rank 0 is raised on every rank, so no rank waits for a reference that
never comes (the MPI harness in tests/conftest.py then ends the job).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from mpi4py import MPI

POLL_S = 0.005


def on_rank_0(compute: Callable[[], Any], comm=None) -> Any:
    """`compute()`'s result, its jax.Array leaves as numpy, on every rank of `comm` (the
    world by default), computed on rank 0 only. Collective: every rank calls it, in the
    same order.

    Raises:
      RuntimeError: on every rank, if `compute` raised on rank 0 (its message quoted).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    result, error = None, None
    if comm.rank == 0:
        try:
            result = jax.tree.map(_portable, compute())
        except Exception as e:  # every rank learns of it below
            error = f"{type(e).__name__}: {e}"
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)
    result, error = comm.bcast((result, error), root=0)
    if error is not None:
        raise RuntimeError(f"the jax.jit reference failed on rank 0: {error}")
    return result


def _portable(leaf: Any) -> Any:
    """A jax.Array as numpy (what pickles); any other leaf as it is."""
    return np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf
