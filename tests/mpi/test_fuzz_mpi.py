"""Fuzz under mpirun: random schedules, microbatch counts and MLP shapes either run and
match `jax.jit`, or are rejected with the same documented exception on every rank.

Hypothesis draws the cases with `derandomize=True` and no example database, so every
rank draws the same cases in the same order and makes the same decisions. Whether a
case is valid is decided by the schedule's own contract (it builds, its `mpmd_dim` is
the number of ranks, its `tasks(n)` accepts the count), independently of the compiler.
A hang in any case fails the test at its timeout, which aborts the whole job.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import assert_close_to_reference
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi.schedules import SCHEDULE_NAMES

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()

# One stage per group for these; several for the others (DualPipeV: exactly two).
ONE_STAGE = {"gpipe": jaxpp_mpi.GPipe, "1f1b": jaxpp_mpi.Std1F1B,
             "eager1f1b": jaxpp_mpi.Eager1F1B, "zerobubble": jaxpp_mpi.ZeroBubble}
MANY_STAGES = {"interleaved": jaxpp_mpi.Interleaved1F1B, "kimik2": jaxpp_mpi.KimiK2,
               "dualpipev": jaxpp_mpi.DualPipeV}
assert set(ONE_STAGE) | set(MANY_STAGES) == set(SCHEDULE_NAMES)


@pytest.fixture(scope="module")
def mesh() -> jaxpp_mpi.MpmdMesh:
    return jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")


def make_schedule(name: str, stages_per_group: int):
    """The named schedule over SIZE * stages_per_group stages. The one-stage schedules
    then have mpmd_dim = num_stages, which is the wrong group count when
    stages_per_group > 1: a case the compiler must reject."""
    num_stages = SIZE * stages_per_group
    if name in ONE_STAGE:
        return ONE_STAGE[name](num_stages)
    return MANY_STAGES[name](num_stages, SIZE)


def expected_error(name: str, stages_per_group: int, num_microbatches: int) -> str | None:
    """Why the schedule's contract rejects this case (None when it accepts it)."""
    try:
        sched = make_schedule(name, stages_per_group)
    except ValueError as e:
        return str(e)
    if sched.mpmd_dim != SIZE:
        return f"mpmd_dim={sched.mpmd_dim}"
    try:
        sched.tasks(num_microbatches)
    except ValueError as e:
        return str(e)
    return None


def mlp(num_stages: int, num_microbatches: int, width: int, rows: int):
    """A tanh MLP, one layer per stage (numpy data: no XLA compile to build it)."""
    rng = np.random.default_rng(1000 * num_stages + 10 * width + rows)
    params = [rng.normal(size=(width, width)).astype(np.float32) * (1.5 / np.sqrt(width))
              for _ in range(num_stages)]
    batch = tuple(rng.normal(size=(num_microbatches, rows, width)).astype(np.float32)
                  for _ in range(2))

    def loss_fn(params, mb):
        x, y = mb
        for w in params:
            x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ w))
        return jnp.mean((x - y) ** 2)

    return params, batch, loss_fn


def sgd_step(loss_fn, sched):
    def step(params, batch):
        losses, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(loss_fn), params), batch,
                                          schedule=sched)
        return [p - 0.1 * g for p, g in zip(params, grads)], losses

    return step


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@settings(max_examples=15, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck), print_blob=False)
@given(name=st.sampled_from(SCHEDULE_NAMES), num_microbatches=st.integers(1, 8),
       stages_per_group=st.integers(1, 2), width=st.sampled_from([8, 16]),
       rows=st.sampled_from([2, 4]))
def test_random_schedules_run_like_jit_or_are_rejected(mesh, name, num_microbatches,
                                                       stages_per_group, width, rows):
    """A random case either matches jax.jit (rtol 1e-5) on every leaf this rank holds,
    or, exactly when the schedule's contract rejects it, raises a ValueError (a
    CompileError or the schedule's own error) with the same message on every rank."""
    why = expected_error(name, stages_per_group, num_microbatches)
    params, batch, loss_fn = mlp(SIZE * stages_per_group, num_microbatches, width, rows)
    outcome, detail = "ran", ""
    try:
        sched = make_schedule(name, stages_per_group)
        step = sgd_step(loss_fn, sched)
        out = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)(params, batch)
    except ValueError as e:
        outcome, detail = type(e).__name__, str(e)
    everyone = WORLD.allgather((outcome, detail))
    assert all(r == everyone[0] for r in everyone), everyone
    case = f"{name} x{stages_per_group} n={num_microbatches}"
    if why is None:
        assert outcome == "ran", f"{case}: valid, but rejected: {detail}"
        compared = assert_close_to_reference(jax.jit(step)(params, batch), out)
        assert WORLD.allreduce(compared) > 0
    else:
        assert outcome != "ran", f"{case}: the schedule rejects it ({why}), yet it ran"
        # The message says what is wrong: the schedule (or its count) and the reason.
        assert why in detail or f"{num_microbatches} microbatches" in detail, (case, detail)
