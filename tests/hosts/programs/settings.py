"""Prints, as one JSON line per rank, what this rank runs with after `import jaxpp_mpi`
(and, with `--bind`, after `bind_local_devices()`): host, ranks, cores, thread settings
(tests/hosts/test_launch_hosts.py)."""

import json
import os
import socket
import sys

import jaxpp_mpi  # noqa: F401  (applies the settings at import)
from jaxpp_mpi.launch import bind_local_devices

if "--bind" in sys.argv:
    bind_local_devices()
from mpi4py import MPI  # noqa: E402

row = {
    "rank": MPI.COMM_WORLD.Get_rank(),
    "host": socket.gethostname(),
    "local_rank": int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"]),
    "local_size": int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"]),
    "cores": sorted(os.sched_getaffinity(0)),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "threads": os.environ.get("JAXPP_MPI_THREADS_PER_RANK"),
    "step_timeout": os.environ.get("JAXPP_MPI_STEP_TIMEOUT"),
}
rows = MPI.COMM_WORLD.gather(row)
if rows:
    for r in rows:
        print("settings " + json.dumps(r), flush=True)
