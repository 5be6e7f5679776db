"""Not a test: for tests/jobs/test_bad_variables.py. Builds this rank's group of a 2-group
MPI-mode mesh, the first thing a pipelined program does; a malformed `JAXPP_MPI_*`
variable must stop every rank there (`config.parse_options`, on every rank alike)."""

from __future__ import annotations

from mpi4py import MPI

import jaxpp_mpi

RANK = MPI.COMM_WORLD.rank

if __name__ == "__main__":
    print(f"rank {RANK} building its mesh", flush=True)
    jaxpp_mpi.make_mpmd_mesh((MPI.COMM_WORLD.size, 1), ("stage", "data"), "stage")
    print(f"rank {RANK} past its mesh", flush=True)
