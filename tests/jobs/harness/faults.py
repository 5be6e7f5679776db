"""Not a test: a pipelined 2-stage MLP step with one injected fault on rank 1, for
tests/unit/test_faults.py. Usage: faults.py {none,stage-exception,trace-exception,stall,
sigkill} — the job must end promptly (or finish, for `none`), never hang."""

from __future__ import annotations

import os
import signal
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxpp_mpi

FAULT = sys.argv[1]
RANK = MPI.COMM_WORLD.rank


def stamp() -> None:
    """For bench/faults.py: when the fault happens (seconds since the epoch)."""
    if os.environ.get("JAXPP_MPI_FAULT_STAMP"):
        print(f"fault at {time.time()}", flush=True)


def on_rank_1_in_stage_1(x):
    """Runs inside stage 1's executable (a host callback), on every rank that runs it."""
    if RANK != 1:
        return
    stamp()
    if FAULT == "stage-exception":
        raise FloatingPointError("deliberate NaN check failure in stage 1 on rank 1")
    if FAULT == "stall":
        time.sleep(600)
    if FAULT == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def loss_fn(params, x):
    for s, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if s == 1:
            jax.debug.callback(on_rank_1_in_stage_1, x)
        x = jaxpp_mpi.mark_stage_end(x)
    return jnp.mean(x ** 2)


def main() -> None:
    size = MPI.COMM_WORLD.size
    mesh = jaxpp_mpi.make_mpmd_mesh((size, 1), ("stage", "data"), "stage")
    params = [jnp.eye(8) * 0.5 for _ in range(size)]

    def step(params, batch):
        if FAULT == "trace-exception" and RANK == 1:
            stamp()
            raise ValueError("deliberate exception while tracing on rank 1")
        grad = partial(jax.value_and_grad(loss_fn), params)
        return jaxpp_mpi.treduce(grad, batch, schedule=jaxpp_mpi.Std1F1B(size))

    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    batch = np.ones((4, 2, 8), np.float32)
    for _ in range(3):
        out = pipelined(params, batch)
        for x in jax.tree.leaves(out):
            if x.is_partially_addressable:
                np.asarray(x.first_mpmd_replica)
    print(f"rank {RANK} finished", flush=True)


if __name__ == "__main__":
    main()
