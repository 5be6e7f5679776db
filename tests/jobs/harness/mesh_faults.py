"""Not a test: a fault before or inside `make_mpmd_mesh`, for tests/jobs/test_mesh_faults.py.

Usage: mesh_faults.py FAULT, FAULT one of
  raise-before-mesh: rank 1 raises once MPI runs, while rank 0 is in make_mpmd_mesh;
  raise-before-mpi: rank 1 raises before it starts MPI, while rank 0 is in make_mpmd_mesh;
  stall-before-mesh: rank 1 stalls while rank 0 is in make_mpmd_mesh;
  mismatch: a job of 2 replicas x 2 groups whose rank 3 asks for 4 groups instead.
Every rank prints `rank r builds its mesh` before make_mpmd_mesh and `rank r built ...`
after it; the job must end promptly, never hang.
"""

from __future__ import annotations

import os
import sys
import time

import jaxpp_mpi

FAULT = sys.argv[1]
# the launcher's rank: rank 1 of `raise-before-mpi` must not start MPI to learn it
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or 0)


def main() -> None:
    if RANK == 1 and FAULT == "raise-before-mpi":
        time.sleep(3)  # rank 0 is in make_mpmd_mesh by now
        raise RuntimeError("deliberate failure on rank 1 before MPI starts")
    from mpi4py import MPI  # starts MPI

    world = MPI.COMM_WORLD
    assert world.rank == RANK
    waits = FAULT in ("raise-before-mesh", "stall-before-mesh")
    if RANK == 1 and waits:
        world.recv(source=0, tag=7)  # rank 0 goes on into make_mpmd_mesh
        time.sleep(1)
        if FAULT == "stall-before-mesh":
            time.sleep(600)
        raise RuntimeError("deliberate failure on rank 1 before make_mpmd_mesh")
    print(f"rank {RANK} builds its mesh", flush=True)
    if RANK == 0 and waits:
        world.send("in make_mpmd_mesh", dest=1, tag=7)
    if FAULT == "mismatch" and RANK == 3:
        mesh = jaxpp_mpi.make_mpmd_mesh((4, 1), ("stage", "data"), "stage")
    elif FAULT == "mismatch":
        mesh = jaxpp_mpi.make_mpmd_mesh((2, 2, 1), ("replica", "stage", "data"), "stage",
                                        replica_axis_name="replica")
    else:
        mesh = jaxpp_mpi.make_mpmd_mesh((2, 1), ("stage", "data"), "stage")
    print(f"rank {RANK} built {mesh}", flush=True)


if __name__ == "__main__":
    main()
