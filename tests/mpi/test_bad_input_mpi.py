"""Bad input under mpirun: every rank raises the same clear exception before any message.

Each test hands `mpmd_jit_with_loop` (or `make_mpmd_mesh`) one kind of bad input, on
every rank or on rank 1 only, and checks on every rank that the call raised the expected
exception type with the expected message; an allgather afterwards proves that no rank
went on to a message (a rank left waiting would hang the allgather until the harness's
timeout). Mesh errors of the right shape on every rank (wrong rank count, wrong device
count) are in test_mesh_mpi.py; the local-mode checks in tests/local/test_bad_input.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import schedule
from mpi4py import MPI

import jaxpp_mpi

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
N = 2 * SIZE  # microbatches: the shapes of the MPI parity tests, so compiles hit the cache


@pytest.fixture(scope="module")
def mesh() -> jaxpp_mpi.MpmdMesh:
    return jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")


def raises_everywhere(fn: Callable[[], Any], exc: type[BaseException], *fragments: str):
    """Asserts that `fn()` raises `exc` on this rank with every regex of `fragments` in
    its message, and that the same held on every rank."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    missing = [f for f in fragments if not re.search(f, msg)]
    results = WORLD.allgather((RANK, missing, f"{type(info.value).__name__}: {msg}"))
    assert all(not r[1] for r in results), results


def mlp(num_stages: int, num_microbatches: int = N, rows: int = 4, width: int = 16):
    """`models.mlp` built with numpy (no XLA compile for the data): one tanh layer per
    stage, squared-error loss; returns (params, (inputs, targets), loss_fn)."""
    rng = np.random.default_rng(num_stages)
    params = [(rng.normal(size=(width, width)).astype(np.float32) * 0.4,
               np.full((width,), 0.01 * s, np.float32)) for s in range(num_stages)]
    batch = tuple(rng.normal(size=(num_microbatches, rows, width)).astype(np.float32)
                  for _ in range(2))

    def loss_fn(params, mb):
        x, y = mb
        for w, b in params:
            x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ w + b))
        return jnp.mean((x - y) ** 2), {"max": jnp.max(x)}

    return params, batch, loss_fn


def sgd_step(loss_fn, sched):
    """A step returning the SGD-updated params and the per-microbatch losses."""

    def step(params, batch, *unused):
        grad_fn = partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, _), grads = jaxpp_mpi.treduce(grad_fn, batch, schedule=sched)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), losses

    return step


def compile_mlp(mesh, sched, num_stages: int, num_microbatches: int = N, extra: tuple = (),
                loss=None):
    params, batch, loss_fn = mlp(num_stages, num_microbatches)
    step = jaxpp_mpi.mpmd_jit_with_loop(sgd_step(loss or loss_fn, sched), mpmd_mesh=mesh)
    return step.compile(params, batch, *extra)


# ------------------------------------------------------------------ mesh and schedule


@pytest.mark.mpi(min_size=2)
def test_schedule_for_another_rank_count(mesh):
    """A schedule built for SIZE + 1 groups on a SIZE-rank job: CompileError naming both."""
    raises_everywhere(
        lambda: compile_mlp(mesh, jaxpp_mpi.Std1F1B(SIZE + 1), SIZE + 1),
        jaxpp_mpi.CompileError, rf"mpmd_dim={SIZE + 1}", rf"mesh has {SIZE} MPMD groups",
        rf"Std1F1B\({SIZE}\)")


@pytest.mark.mpi(min_size=2)
def test_device_count_wrong_on_one_rank():
    """Rank 1 offers twice the devices of a group: every rank raises, naming rank 1."""
    devices = jax.local_devices() * (2 if RANK == 1 else 1)
    raises_everywhere(
        lambda: jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage", comm=WORLD,
                                         devices=devices),
        ValueError, rf"each rank needs {K} devices", rf"rank\(s\) \[1\] have \[{2 * K}\]",
        "xla_force_host_platform_device_count")


@pytest.mark.mpi(min_size=2)
def test_stage_marks_differ_from_schedule(mesh):
    """One mark too many on every rank: CompileError naming both counts."""
    raises_everywhere(
        lambda: compile_mlp(mesh, jaxpp_mpi.Std1F1B(SIZE), SIZE + 1), jaxpp_mpi.CompileError,
        rf"has {SIZE + 1} stage marks", rf"schedule has {SIZE} stages")


@pytest.mark.mpi(min_size=2)
def test_stage_marks_differ_on_rank_1_only(mesh):
    """Rank 1's loss marks its last stage twice (same arguments everywhere): the ranks
    that traced fine raise too, naming rank 1 and its error."""
    _, _, loss_fn = mlp(SIZE, N)

    def loss(params, mb):
        value, aux = loss_fn(params, mb)
        return (jaxpp_mpi.mark_stage_end(value) if RANK == 1 else value), aux

    raises_everywhere(
        lambda: compile_mlp(mesh, jaxpp_mpi.Std1F1B(SIZE), SIZE, loss=loss),
        jaxpp_mpi.CompileError, r"rank\(s\) \[1\] failed to trace it",
        rf"Rank 1: SplitError: .*has {SIZE + 1} stage marks")


@pytest.mark.mpi(min_size=2)
def test_different_arithmetic_on_rank_1_only(mesh):
    """Rank 1's loss scales by another constant: same shapes, same program, different
    computation. Every rank refuses it before any message, naming the first differing
    line of the traced step (`Note: step fingerprints`)."""
    _, _, loss_fn = mlp(SIZE, N)

    def loss(params, mb):
        value, aux = loss_fn(params, mb)
        return value * (1.0 if RANK != 1 else 1.5), aux

    raises_everywhere(
        lambda: compile_mlp(mesh, jaxpp_mpi.Std1F1B(SIZE), SIZE, loss=loss), ValueError,
        r"traced different code", r"rank 1 differs from rank 0 first in the traced step")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["zerobubble", "interleaved"])
def test_microbatch_count_rejected(mesh, name):
    """ZeroBubble with fewer microbatches than stages; interleaved 1F1B with 2 * SIZE + 1,
    which its rounds of equal size (n // SIZE = 2 of them) cannot split: CompileError
    naming the count and the schedule."""
    sched = schedule(name, SIZE)
    n = SIZE - 1 if name == "zerobubble" else 2 * SIZE + 1
    raises_everywhere(
        lambda: compile_mlp(mesh, sched, sched.num_stages, n), jaxpp_mpi.CompileError,
        rf"the schedule rejects {n} microbatches", re.escape(repr(sched)))


# ------------------------------------------------------------------ arguments


@pytest.mark.mpi(min_size=2)
def test_microbatch_sizes_differ_between_leaves(mesh):
    """treduce over inputs of N microbatches and targets of N - 1: ValueError naming both."""
    params, (x, y), loss_fn = mlp(SIZE, N)
    step = jaxpp_mpi.mpmd_jit_with_loop(sgd_step(loss_fn, jaxpp_mpi.Std1F1B(SIZE)),
                                        mpmd_mesh=mesh)
    raises_everywhere(lambda: step.compile(params, (x, y[:-1])), ValueError,
                      "all leaves of xs must have the same size along axis 0",
                      rf"xs\[0\]: {N}, xs\[1\]: {N - 1}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["rows", "dtype", "microbatches"])
def test_arguments_differ_on_rank_1(mesh, what):
    """Rank 1 passes a batch with other rows, another dtype or fewer microbatches: every
    rank raises before tracing, naming the first differing leaf on both ranks."""
    params, (x, y), loss_fn = mlp(SIZE, N)
    changed = {"rows": (x[:, :2], f"float32[{N}, 2, 16]"),
               "dtype": (x.astype(jnp.bfloat16), f"bfloat16[{N}, 4, 16]"),
               "microbatches": (x[:-1], f"float32[{N - 1}, 4, 16]")}
    if RANK == 1:
        x = changed[what][0]
    step = jaxpp_mpi.mpmd_jit_with_loop(sgd_step(loss_fn, jaxpp_mpi.Std1F1B(SIZE)),
                                        mpmd_mesh=mesh)
    raises_everywhere(
        lambda: step.compile(params, (x, y)), jaxpp_mpi.CompileError,
        "the ranks called the step with different arguments",
        re.escape(f"rank 0 passes args[1][0] float32[{N}, 4, 16], rank 1 passes "
                  f"args[1][0] {changed[what][1]}"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("leaf", ["str", "object"])
def test_non_array_leaf(mesh, leaf):
    """A str or an object among the arguments: TypeError naming it (typed PRNG keys are
    arrays: tests/mpi/test_random_mpi.py)."""
    value = {"str": "adam", "object": object()}[leaf]
    message = {"str": r"args\[2\] is a str \('adam'\), not an array",
               "object": r"args\[2\] is an object of type object, not an array"}[leaf]
    raises_everywhere(lambda: compile_mlp(mesh, jaxpp_mpi.Std1F1B(SIZE), SIZE,
                                          extra=(value,)), TypeError, message)


@pytest.mark.mpi(min_size=2)
def test_non_array_leaf_on_rank_1_only(mesh):
    """Rank 1 passes a str where the others pass an array: every rank raises."""
    extra = ("adam",) if RANK == 1 else (np.float32(1.0),)
    raises_everywhere(
        lambda: compile_mlp(mesh, jaxpp_mpi.Std1F1B(SIZE), SIZE, extra=extra),
        jaxpp_mpi.CompileError,
        r"rank\(s\) \[1\] failed the argument check",
        r"Rank 1: TypeError: argument args\[2\] is a str")


@pytest.mark.mpi(min_size=2)
def test_mpmd_array_on_the_wrong_group(mesh):
    """Stage 0's updated weight (an MpmdArray on group 0) passed as the last stage's
    weight, read on group SIZE - 1: ValueError naming the argument and both groups."""
    params, batch, loss_fn = mlp(SIZE)
    step = jaxpp_mpi.mpmd_jit_with_loop(sgd_step(loss_fn, jaxpp_mpi.Std1F1B(SIZE)),
                                        mpmd_mesh=mesh)
    new_params, _ = step(params, batch)
    swapped = new_params[::-1]
    raises_everywhere(lambda: step(swapped, batch), ValueError,
                      rf"argument args\[0\]\[0\]\[0\] is an MpmdArray held by groups "
                      rf"\[{SIZE - 1}\], but this step reads it on group 0",
                      r"compiled.in_shardings")


# ------------------------------------------------------------------ results


@pytest.mark.mpi(min_size=2)
def test_result_that_cannot_be_placed(mesh):
    """A step returning a str: TypeError from tracing, on every rank."""
    params, batch, loss_fn = mlp(SIZE, N)
    inner = sgd_step(loss_fn, jaxpp_mpi.Std1F1B(SIZE))
    step = jaxpp_mpi.mpmd_jit_with_loop(lambda p, b: (*inner(p, b), "done"),
                                        mpmd_mesh=mesh)
    raises_everywhere(lambda: step.compile(params, batch), TypeError,
                      r"returned a value of type <class 'str'> at output component \[2\]")
