"""Not a test: a pipelined 2-stage MLP step with one injected fault on rank 1, for
tests/jobs/test_faults.py and bench/faults.py. Usage: faults.py FAULT, FAULT one of
none, stage-exception, trace-exception, stall, sigkill (in step 1), stall-step6 (stage 1
stalls in step 6 of 8 back-to-back steps), stall-between (rank 1 stalls before calling
step 6 of 8), stall-between-0 (rank 0 does), stall-trace (rank 1 stalls while tracing),
and, without any step, rank 1 stalling before: stall-should-stop
(`PreemptionGuard.should_stop`), stall-save (`checkpoint.save`), stall-reshard
(`spmd_to_mpmd_reshard`), stall-export (`trace.export`), stall-user (a user's bcast
under `jaxpp_mpi.launch.deadline`). The job must end promptly (or finish, for `none`),
never hang. replica_faults.py imports its loss (`probed_loss`) and `wait_for`."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from mpi4py import MPI

import jaxpp_mpi
import jaxpp_mpi.launch
import jaxpp_mpi.trace
from jaxpp_mpi import checkpoint

FAULT = sys.argv[1]
RANK = MPI.COMM_WORLD.rank


def stamp() -> None:
    """For bench/faults.py: when the fault happens (seconds since the epoch)."""
    if os.environ.get("JAXPP_MPI_FAULT_STAMP"):
        print(f"fault at {time.time()}", flush=True)


STEPS = 8 if FAULT in ("stall-step6", "stall-between", "stall-between-0") else 3
step_now = [0]  # the step the host loop is in (it waits for each step's results)


def stall(rank: int = 1) -> None:
    """Rank `rank` (1 unless given) stalls here for 10 minutes; the others go on."""
    if RANK == rank:
        stamp()
        time.sleep(600)


def outside_the_step(mesh) -> None:
    """Rank 1 stalls before a collective outside the step; rank 0 waits in it."""
    stall()
    if FAULT == "stall-should-stop":
        with jaxpp_mpi.PreemptionGuard(mesh) as guard:
            guard.should_stop()
    elif FAULT == "stall-save":
        path = os.path.join(tempfile.gettempdir(), f"jaxpp_mpi_fault_{os.getpid()}")
        checkpoint.save(path, {"w": np.ones(4, np.float32)}, step=1, mesh=mesh)
    elif FAULT == "stall-reshard":
        target = jaxpp_mpi.MpmdSharding(mesh, [0], PartitionSpec())
        jaxpp_mpi.spmd_to_mpmd_reshard(mesh, {"w": jnp.ones(4)}, {"w": target})
    elif FAULT == "stall-export":
        path = os.path.join(tempfile.gettempdir(), f"jaxpp_mpi_fault_{os.getpid()}.json")
        jaxpp_mpi.trace.export(path, [], mesh)
    elif FAULT == "stall-user":
        with jaxpp_mpi.launch.deadline("loss broadcast", mesh.comm):
            mesh.comm.bcast(1.0, root=1)


def on_rank_1_in_stage_1(x):
    """Runs inside stage 1's executable (a host callback), on every rank that runs it."""
    if RANK != 1:
        return
    if FAULT == "stall-step6":
        if step_now[0] == 6:
            stall()
        return
    stamp()
    if FAULT == "stage-exception":
        raise FloatingPointError("deliberate NaN check failure in stage 1 on rank 1")
    if FAULT == "stall":
        time.sleep(600)
    if FAULT == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)


def probed_loss(in_stage_1: Callable[[jax.Array], None]):
    """The MLP's loss, `tanh(x @ w)` per stage, with `in_stage_1(x)` called from inside
    stage 1's executable (a host callback, on every rank that runs it)."""

    def loss_fn(params, x):
        for s, w in enumerate(params):
            x = jnp.tanh(x @ w)
            if s == 1:
                jax.debug.callback(in_stage_1, x)
            x = jaxpp_mpi.mark_stage_end(x)
        return jnp.mean(x ** 2)

    return loss_fn


def wait_for(out) -> None:
    """Blocks until this rank's parts of a step's outputs are computed."""
    for x in jax.tree.leaves(out):
        if x.is_partially_addressable:
            np.asarray(x.first_mpmd_replica)


def main() -> None:
    size = MPI.COMM_WORLD.size
    mesh = jaxpp_mpi.make_mpmd_mesh((size, 1), ("stage", "data"), "stage")
    params = [jnp.eye(8) * 0.5 for _ in range(size)]
    if FAULT in ("stall-should-stop", "stall-save", "stall-reshard", "stall-export",
                 "stall-user"):
        outside_the_step(mesh)

    def step(params, batch):
        if FAULT == "trace-exception" and RANK == 1:
            stamp()
            raise ValueError("deliberate exception while tracing on rank 1")
        if FAULT == "stall-trace":
            stall()
        grad = partial(jax.value_and_grad(probed_loss(on_rank_1_in_stage_1)), params)
        return jaxpp_mpi.treduce(grad, batch, schedule=jaxpp_mpi.Std1F1B(size))

    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    batch = np.ones((4, 2, 8), np.float32)
    for k in range(1, STEPS + 1):
        step_now[0] = k
        if FAULT == "stall-between" and k == 6:
            stall()
        if FAULT == "stall-between-0" and k == 6:
            stall(0)
        wait_for(pipelined(params, batch))
    print(f"rank {RANK} finished", flush=True)


if __name__ == "__main__":
    main()
