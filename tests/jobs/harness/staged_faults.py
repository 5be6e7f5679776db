"""Not a test: a pipelined 2-stage MLP step with staged messages (the test sets
JAXPP_MPI_STAGED_MESSAGES=1) whose sender or receiver thread fails on rank 1 in step 2,
for tests/jobs/test_staged_faults.py. Usage: staged_faults.py none|sender|receiver. The
job must end promptly (or finish, for none), never hang."""

from __future__ import annotations

import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from faults import probed_loss, wait_for  # this folder is sys.path[0]
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi._src.mpi import staged

FAULT = sys.argv[1]
RANK = MPI.COMM_WORLD.rank
step_now = [0]


def inject() -> None:
    """From step 2 on, rank 1's `FAULT` thread raises at its next message."""
    if RANK != 1 or FAULT == "none":
        return

    def failing(*args, **kwargs):
        if step_now[0] >= 2:
            raise OSError(f"deliberate failure in the staged {FAULT} thread on rank 1")
        return real(*args, **kwargs)

    if FAULT == "sender":
        real = staged._host
        staged._host = failing
    else:
        real = staged.StagedRecvs._deliver
        staged.StagedRecvs._deliver = lambda self, *a: failing(self, *a)


def main() -> None:
    size = MPI.COMM_WORLD.size
    mesh = jaxpp_mpi.make_mpmd_mesh((size, 1), ("stage", "data"), "stage")
    params = [jnp.eye(8) * 0.5 for _ in range(size)]

    def step(params, batch):
        grad = partial(jax.value_and_grad(probed_loss(lambda x: None)), params)
        return jaxpp_mpi.treduce(grad, batch, schedule=jaxpp_mpi.Std1F1B(size))

    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    batch = np.ones((4, 2, 8), np.float32)
    inject()
    for k in range(1, 4):
        step_now[0] = k
        wait_for(pipelined(params, batch))
    print(f"rank {RANK} finished", flush=True)


if __name__ == "__main__":
    main()
