"""Not a test: 2 pipeline replicas of a 2-stage MLP on 4 ranks, with one fault on rank 3
(replica 1, group 1), for tests/jobs/test_replica_jobs.py.

Usage: replica_faults.py FAULT [TAG]. FAULT: none (3 steps, then every rank prints
"rank r finished"), raise (rank 3's stage 1 raises in step 1), stall (rank 3's stage 1
sleeps 600 s in step 1). TAG is ignored: the test puts a unique word on every rank's
command line to find any rank left running. With FAULT_STAMP set, rank 3 prints
"fault at <epoch seconds>" when the fault happens. The job must end promptly (or
finish, for none), never hang: a stalled replica leaves the other one waiting in its
AllReduce, which the step watchdog must end.
"""

from __future__ import annotations

import os
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from faults import probed_loss, wait_for  # this folder is sys.path[0]
from mpi4py import MPI

import jaxpp_mpi

FAULT = sys.argv[1]
RANK = MPI.COMM_WORLD.rank
FAULTY_RANK = 3  # replica 1, group 1
REPLICAS = 2


def in_stage_1(x) -> None:
    """A host callback inside stage 1's executable: the fault, on rank 3 only."""
    if RANK != FAULTY_RANK or FAULT == "none":
        return
    if os.environ.get("FAULT_STAMP"):
        print(f"fault at {time.time()}", flush=True)
    if FAULT == "raise":
        raise FloatingPointError("deliberate failure in stage 1 of replica 1 on rank 3")
    if FAULT == "stall":
        time.sleep(600)


def main() -> None:
    groups = MPI.COMM_WORLD.size // REPLICAS
    mesh = jaxpp_mpi.make_mpmd_mesh((REPLICAS, groups, 1), ("replica", "stage", "data"),
                                    "stage", replica_axis_name="replica")
    params = [jnp.eye(8) * 0.5 for _ in range(groups)]

    def step(params, batch):
        grad = partial(jax.value_and_grad(probed_loss(in_stage_1)), params)
        return jaxpp_mpi.treduce(grad, batch, schedule=jaxpp_mpi.Std1F1B(groups))

    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    batch = np.ones((4, 2, 8), np.float32)  # 2 microbatches per replica
    for _ in range(3):
        wait_for(pipelined(params, batch))
    print(f"rank {RANK} finished", flush=True)


if __name__ == "__main__":
    main()
