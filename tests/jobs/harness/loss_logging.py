"""The loss-logging loop of JAX's multi-process code, on a pipelined step under MPI.

Every rank runs STEPS steps of a 1F1B MLP step and logs the loss where it is held
(`float(np.asarray(loss)) if loss.is_partially_addressable else None`: no message);
then a rank that does not hold the loss reads it implicitly and must get an error at
once; then every rank reads it explicitly (`jaxpp_mpi.process_allgather`) and compares
it with `jax.jit` of the same step. It does so on a mesh of every rank of the job, then
on meshes of 2 ranks (the job split in pairs, each pair its own pipeline). One JSON line
per rank and mesh reports what it saw.

Run: launch/jpprun -n N python tests/jobs/harness/loss_logging.py STEPS (N even)
"""

from __future__ import annotations

import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import jaxpp_mpi


def main(steps: int) -> int:
    world = MPI.COMM_WORLD
    run(world, steps)
    if world.size > 2:
        run(world.Split(world.rank // 2, world.rank), steps)
    return 0


def run(comm, steps: int) -> None:
    """The loop on a pipeline of `comm`'s ranks, one group each; prints its report."""
    mesh = jaxpp_mpi.make_mpmd_mesh((comm.size, 1), ("stage", "data"), "stage", comm=comm)
    groups = mesh.mpmd_dim
    keys = jax.random.split(jax.random.PRNGKey(0), groups + 2)
    params = [jax.random.normal(k, (16, 16)) * 0.4 for k in keys[:groups]]
    batch = (jax.random.normal(keys[-2], (2 * groups, 4, 16)),
             jax.random.normal(keys[-1], (2 * groups, 4, 16)))

    def loss_fn(params, mb):
        x, y = mb
        for w in params:
            x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ w))
        return jnp.mean((x - y) ** 2)

    def step(params, batch, schedule):
        grad_fn = functools.partial(jax.value_and_grad(loss_fn), params)
        if schedule is None:
            parts = [grad_fn((batch[0][i], batch[1][i])) for i in range(batch[0].shape[0])]
            loss = sum(p[0] for p in parts)
            grads = jax.tree.map(lambda *g: sum(g), *(p[1] for p in parts))
        else:
            loss, grads = jaxpp_mpi.treduce(grad_fn, batch, schedule=schedule,
                                            operation=jaxpp_mpi.Add)
        return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), loss

    pipelined = jaxpp_mpi.mpmd_jit_with_loop(
        functools.partial(step, schedule=jaxpp_mpi.Std1F1B(groups)), mpmd_mesh=mesh)
    reference = jax.jit(functools.partial(step, schedule=None))

    p, loss = pipelined(params, batch)  # compiles
    want_p, want_loss = reference(params, batch)
    logged, start = [], time.perf_counter()
    for _ in range(steps):
        p, loss = pipelined(p, batch)
        want_p, want_loss = reference(want_p, batch)
        value = float(np.asarray(loss)) if loss.is_partially_addressable else None
        logged.append(value)
    loop_s = time.perf_counter() - start

    raised, raise_s = None, None
    if not loss.is_partially_addressable:
        start = time.perf_counter()
        try:
            float(loss)
        except RuntimeError as e:
            raised = str(e)
        raise_s = time.perf_counter() - start

    everywhere = float(jaxpp_mpi.process_allgather(loss))
    print(json.dumps({
        "ranks": groups, "rank": mesh.my_mpmd_axis_index,
        "job_rank": MPI.COMM_WORLD.rank, "held": loss.is_partially_addressable,
        "logged": logged, "loop_s": loop_s, "raised": raised, "raise_s": raise_s,
        "everywhere": everywhere, "want": float(want_loss),
        "shown": f"{loss:.4f}",
    }), flush=True)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
