"""Each distinct executable compiled once across the ranks, under mpirun (`Note: shared
compiles` in shared_compiles.py): the MLP's groups update equal-shaped layers by SGD, so
their updates are one module (and with 4 ranks the middle stages' tasks are too); the
ranks compile each distinct module once, and the step computes bit for bit what it
computes with every rank compiling all of its own, and what `jax.jit` computes."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from models import assert_close_to_reference, held_values, mlp, schedule
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi._src.base import config

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()


@pytest.fixture(scope="module")
def mesh() -> jaxpp_mpi.MpmdMesh:
    return jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")


def sgd_problem(width: int):
    """An SGD step of `models.mlp` over SIZE stages: (step, params, batch)."""
    params, batch, loss_fn = mlp(SIZE, 2 * SIZE, width=width)
    sched = schedule("1f1b", SIZE)

    def step(params, batch):
        grad_fn = lambda p, mb: jax.value_and_grad(lambda q: loss_fn(q, mb)[0])(p)
        losses, grads = jaxpp_mpi.treduce(lambda mb: grad_fn(params, mb), batch,
                                          schedule=sched)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), losses

    return step, params, batch


def run_steps(step, params, batch, steps: int = 3):
    out = None
    for _ in range(steps):
        out = step(params, batch)
        params = out[0]
    return out


@pytest.mark.mpi(min_size=2)
def test_identical_modules_are_compiled_once_across_the_ranks(mesh, no_persistent_cache,
                                                               monkeypatch):
    step, params, batch = sgd_problem(24)
    shared = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(params, batch)
    reports = WORLD.allgather(dict(shared.shared_report))
    distinct = reports[0]["distinct"]
    assert all(r["distinct"] == distinct for r in reports), reports
    needed = sum(r["needed"] for r in reports)
    assert sum(r["compiled"] for r in reports) == distinct < needed, reports
    # Each module reaches every rank needing it but its compiler (where that needs it).
    helped = sum(r["helped"] for r in reports)
    assert sum(r["received"] for r in reports) == needed - distinct + helped, reports

    options = config.options()
    monkeypatch.setattr(config, "options",
                        lambda: dataclasses.replace(options, shared_compiles=False))
    alone = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(params, batch)
    mine = alone.shared_report
    assert mine["compiled"] == mine["needed"] and mine["received"] == 0, dict(mine)

    with_sharing = held_values(run_steps(shared, params, batch))
    without = held_values(run_steps(alone, params, batch))
    for k, (a, b) in enumerate(zip(with_sharing, without)):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b, err_msg=f"leaf {k}")
    reference = run_steps(jax.jit(step), params, batch)
    assert assert_close_to_reference(reference, run_steps(shared, params, batch))


@pytest.mark.mpi(min_size=2)
def test_a_compile_failing_on_one_rank_raises_on_every_rank(mesh, no_persistent_cache,
                                                             monkeypatch):
    """Rank 1's XLA compiles fail: every rank raises, naming rank 1, before any message
    (a rank left behind would hang the allgather below until the harness's timeout)."""
    step, params, batch = sgd_problem(20)
    if RANK == 1:
        def failing(self, *args, **kwargs):
            raise RuntimeError("injected compile failure")

        monkeypatch.setattr(jax.stages.Lowered, "compile", failing)
    with pytest.raises(jaxpp_mpi.CompileError) as info:
        jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(params, batch)
    monkeypatch.undo()
    message = str(info.value)
    results = WORLD.allgather(("rank(s) [1] failed" in message
                               and "injected compile failure" in message, message))
    assert all(ok for ok, _ in results), results
