"""Not a test: ranks pass a message round a ring every 50 ms for up to 60 s, then print
`ring finished`; after 20 rounds each rank writes DIR/ready-ring-RANK, so that
tests/hosts/test_host_faults.py knows the job runs before it kills a host (MPI only, no
JAX: what ends this job is the launcher's business).

    ring.py DIR
"""

import sys
import time
from pathlib import Path

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
start = time.monotonic()
rounds = 0
while time.monotonic() - start < 60:
    comm.sendrecv(rounds, dest=(rank + 1) % size, source=(rank - 1) % size)
    rounds += 1
    if rounds == 20:
        (Path(sys.argv[1]) / f"ready-ring-{rank}").write_text("")
    time.sleep(0.05)
print(f"rank {rank} ring finished", flush=True)
