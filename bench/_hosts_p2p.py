"""A rank of bench/hosts.py's bandwidth run: bench/p2p.py's ping-pong (the runtime's
message chains against mpi4py's Send/Recv, taking turns rep by rep) between the two
ranks, one on each host, at the sizes given; rank 0 writes the rows as JSON.

    (started by bench/hosts.py) python bench/_hosts_p2p.py OUT.json REPS SIZE_MIB...
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from p2p import bench_size  # noqa: E402

from jaxpp_mpi._src.mpi import collectives  # noqa: E402
from jaxpp_mpi._src.mpi.heap import tune_heap  # noqa: E402


def main(out: str, reps: int, sizes_mib: list[int]) -> None:
    tune_heap()  # as the MPI executor does (Note: large buffers)
    comm = collectives.world_dup()
    rows = [bench_size(comm, mib << 20, reps, paths=("jaxpp_mpi", "mpi4py"))
            for mib in sizes_mib]
    if comm.rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3:]])
