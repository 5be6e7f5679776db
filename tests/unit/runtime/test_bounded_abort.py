"""An abort that does not end the job in time ends its process (`Note: bounded abort` in
launch/abort.py); each case runs in a child process, which it ends."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

CHILD = """
import sys, time
from jaxpp_mpi._src.launch.abort import bounded
how = sys.argv[1]
def abort(status):
    if how == "blocks":
        time.sleep(60)  # MPI_Abort waiting for a launcher that waits for a lost host
    elif how == "raises":
        raise RuntimeError("MPI is gone")
bounded(abort, rank=3)(7)
print("not reached", flush=True)
"""


@pytest.mark.parametrize("how, at_least_s", [("blocks", 0.5), ("returns", 0.0),
                                             ("raises", 0.0)])
def test_the_rank_exits_with_the_abort_status(how, at_least_s):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True,
                          timeout=30, env={"JAXPP_MPI_ABORT_WAIT": "0.5", "PATH": ""})
    took = time.monotonic() - start
    assert proc.returncode == 7, proc
    assert "not reached" not in proc.stdout
    assert at_least_s <= took < 15, took
    if how == "blocks":
        assert ("[rank 3] jaxpp_mpi: the job has not ended 0.5 s after this rank's "
                "MPI_Abort") in proc.stderr, proc.stderr
