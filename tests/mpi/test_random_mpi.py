"""Randomness across ranks (one group per rank): typed PRNG keys against single-process
`jax.jit` (`Note: keys as key data` in compiler/keys.py).

The models and steps are tests/local/test_random.py's: dropout in every stage, a typed
key in the state split every step, keys folded per microbatch and stage. Each rank
compares the leaves it holds (keys bit for bit) with the reference rank 0 computes
(tests/rank0_reference.py).
Runs under `launch/jpprun -n 2` and `-n 4`.
"""

from __future__ import annotations

import jax
import pytest
from local.test_random import (
    NUM_STEPS,
    SCHEDULES,
    assert_parity,
    crossing_loss,
    inner_key_loss,
    mlp_loss,
    pipelined,
    problem,
    reference,
    run,
)
from mpi4py import MPI
from rank0_reference import on_rank_0

import jaxpp_mpi
from jaxpp_mpi._src.ir.program import Aval, Recv, Send, SendRecv

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()


@pytest.fixture(scope="module")
def mesh():
    return jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sched_name", SCHEDULES)
def test_random_dropout_parity_mpi(mesh, sched_name):
    """3 steps with dropout in every stage and the state's key split every step match
    jax.jit on every rank; the rank holding the key (group 0's) sees jax.jit's bits."""
    sched = SCHEDULES[sched_name](SIZE)
    state, batch = problem(sched.num_stages, 2 * SIZE)
    keys = assert_parity(on_rank_0(lambda: run(reference(mlp_loss), state, batch)),
                         run(pipelined(mlp_loss, sched, mesh), state, batch))
    counts = WORLD.allgather(keys)
    assert sum(counts) == NUM_STEPS, counts  # the key is held, and checked, once


@pytest.mark.mpi(min_size=2)
def test_random_key_crosses_ranks(mesh):
    """A key made in stage 0 and used in stage 1 travels from rank 0 to rank 1 as its
    key data (uint32[2]); the masks drawn from it on rank 1 are jax.jit's."""
    sched = jaxpp_mpi.Std1F1B(SIZE)
    n = 2 * SIZE
    state, batch = problem(SIZE, n)
    step = pipelined(crossing_loss, sched, mesh)
    program = step.compile(state, batch).program()
    key_aval = Aval((2,), "uint32")
    g0, g1 = program.group(0), program.group(1)
    sent = [i for i in g0.instrs if isinstance(i, (Send, SendRecv))
            and g0.aval(i.buf if isinstance(i, Send) else i.send_buf) == key_aval]
    received = [i for i in g1.instrs if isinstance(i, (Recv, SendRecv)) and i.aval == key_aval]
    assert len(sent) == len(received) == n
    assert_parity(on_rank_0(lambda: run(reference(crossing_loss), state, batch)),
                  run(step, state, batch))


@pytest.mark.mpi(min_size=2)
def test_random_keys_made_inside_stages_mpi(mesh):
    """Keys from integer seeds and from a closed-over key constant, inside the stages."""
    sched = jaxpp_mpi.Std1F1B(SIZE)
    state, batch = problem(SIZE, 2 * SIZE, seed=1)
    assert_parity(on_rank_0(lambda: run(reference(inner_key_loss), state, batch)),
                  run(pipelined(inner_key_loss, sched, mesh), state, batch))
