"""Not a test: one of the two MPI jobs of tests/jobs/test_concurrent_saves.py.

    launch/jpprun -n 2 python tests/jobs/harness/concurrent_saves.py hold DIR
    launch/jpprun -n 2 python tests/jobs/harness/concurrent_saves.py second DIR

`hold` saves `tree("hold")` to DIR/ckpt (step 1); one of its leaves comes from slow
storage, which answers only once DIR/go exists, so the save is still in progress when
`second` starts. `second` saves `tree("second")` to the same path (step 2, overwrite) and
expects every rank to be refused (`Note: Save lock`); it exits 0 only then. Each rank
prints one line: "rank R: saved" / "rank R: refused: MESSAGE".
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi import checkpoint

WAIT_S = 200


def tree(which: str) -> dict:
    """The values each job saves (the test rebuilds them to compare)."""
    scale = 1.0 if which == "hold" else -1.0
    return {f"w{i}": np.arange(64, dtype=np.float32) * scale + i for i in range(3)}


class SlowLeaf:
    """A leaf read from storage that answers once `go` exists (at most WAIT_S s)."""

    shape, dtype = (8,), np.dtype("float32")

    def __init__(self, go: str, value: float):
        self.go, self.value = go, value

    def __array__(self, dtype=None, copy=None):
        end = time.monotonic() + WAIT_S
        while not os.path.exists(self.go) and time.monotonic() < end:
            time.sleep(0.05)
        return np.full(8, self.value, np.float32)


def main(role: str, directory: str) -> int:
    size = MPI.COMM_WORLD.size
    mesh = jaxpp_mpi.make_mpmd_mesh((size, 1), ("stage", "data"), "stage")
    rank = MPI.COMM_WORLD.rank
    path = os.path.join(directory, "ckpt")
    if role == "hold":
        values = {**tree("hold"), "slow": SlowLeaf(os.path.join(directory, "go"), 5.0)}
        checkpoint.save(path, values, step=1, mesh=mesh)
        print(f"rank {rank}: saved", flush=True)
        return 0
    try:
        checkpoint.save(path, {**tree("second"), "slow": np.zeros(8, np.float32)}, step=2,
                        mesh=mesh, overwrite=True)
    except checkpoint.CheckpointError as e:
        print(f"rank {rank}: refused: {e}", flush=True)
        return 0
    print(f"rank {rank}: saved", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
