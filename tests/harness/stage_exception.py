"""A pipelined step whose stage-1 code raises on rank 1 (a user's NaN check), for
tests/unit/test_mpi_harness.py: the job must end promptly with that traceback."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxpp_mpi


def check_finite(x):
    if MPI.COMM_WORLD.rank == 1:
        raise FloatingPointError("deliberate NaN check failure in stage 1 on rank 1")


def loss_fn(params, x):
    for s, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if s == 1:
            jax.debug.callback(check_finite, x)
        x = jaxpp_mpi.mark_stage_end(x)
    return jnp.mean(x ** 2)


def main() -> None:
    size = MPI.COMM_WORLD.size
    mesh = jaxpp_mpi.make_mpmd_mesh((size, 1), ("stage", "data"), "stage")
    params = [jnp.eye(8) * 0.5 for _ in range(size)]

    def step(params, batch):
        grad = partial(jax.value_and_grad(loss_fn), params)
        return jaxpp_mpi.treduce(grad, batch, schedule=jaxpp_mpi.Std1F1B(size))

    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    out = pipelined(params, np.ones((4, 2, 8), np.float32))
    for x in jax.tree.leaves(out):
        if x.is_partially_addressable:
            np.asarray(x.first_mpmd_replica)
    print(f"rank {MPI.COMM_WORLD.rank} finished", flush=True)


if __name__ == "__main__":
    main()
