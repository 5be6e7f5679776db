"""Test-only pause points inside a save, so that a test can kill a rank exactly there.

`JAXPP_MPI_CHECKPOINT_PAUSE_AT` (base/variables.py) names one point; a rank reaching it
prints `jaxpp_mpi checkpoint paused at POINT (rank R, pid P)` and sleeps until killed:
  write    a writer rank, its first leaf file of a save begun but not synced, no
           `.written-RANK` mark yet (Note: Background saves in checkpoint/background.py)
  rename   rank 0, the manifest written and synced, before the rename into place
  delete   rank 0, an old step renamed aside and partly removed (checkpoint/manager.py)
Unset (the normal case) every point is a no-op.
"""

from __future__ import annotations

import functools
import os
import sys
import time

from jaxpp_mpi._src.base.variables import variable

__all__ = ["PAUSE_VARIABLE", "pause_point"]

PAUSE_VARIABLE = "JAXPP_MPI_CHECKPOINT_PAUSE_AT"


@functools.cache
def _paused_at() -> str | None:
    return variable(PAUSE_VARIABLE).parse(os.environ)


def pause_point(point: str, rank: int) -> None:
    """Sleeps for good when `JAXPP_MPI_CHECKPOINT_PAUSE_AT` names `point`; else returns."""
    if _paused_at() != point:
        return
    sys.stdout.write(f"jaxpp_mpi checkpoint paused at {point} (rank {rank}, pid "
                     f"{os.getpid()})\n")
    sys.stdout.flush()
    while True:
        time.sleep(3600)
