"""The call surface under mpirun: keyword and static arguments against `jax.jit` on every
rank, and a call that fails its check on some ranks only raising on every rank before
any message (Note: checking a call on every rank, in compiled.py)."""

from __future__ import annotations

import re
from functools import partial

import jax
import numpy as np
import pytest
from models import assert_close_to_reference
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi import CompileError

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()


def everywhere(fn, exc: type[BaseException], pattern: str) -> None:
    """`fn()` raises `exc` matching `pattern` on this rank, and so it did on every rank;
    the allgather also proves no rank went on into a step."""
    with pytest.raises(exc) as info:
        fn()
    ok = bool(re.search(pattern, str(info.value)))
    results = WORLD.allgather((RANK, ok, f"{type(info.value).__name__}: {info.value}"))
    assert all(r[1] for r in results), results


def mlp():
    rng = np.random.default_rng(SIZE)
    params = [
        (rng.normal(size=(16, 16)).astype(np.float32) * 0.4, np.full((16,), 0.01 * s, np.float32))
        for s in range(SIZE)
    ]
    batch = tuple(rng.normal(size=(2 * SIZE, 4, 16)).astype(np.float32) for _ in range(2))

    def loss_fn(params, mb):
        x, y = mb
        for w, b in params:
            x = jaxpp_mpi.mark_stage_end(jax.numpy.tanh(x @ w + b))
        return jax.numpy.mean((x - y) ** 2)

    def step(params, *, batch, lr):
        loss, grads = jaxpp_mpi.treduce(
            partial(jax.value_and_grad(loss_fn), params), batch, schedule=jaxpp_mpi.Std1F1B(SIZE)
        )
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

    return params, batch, step


PARAMS, BATCH, STEP = mlp()
REFERENCE = jax.jit(STEP, static_argnames="lr")


@pytest.fixture(scope="module")
def fn():
    mesh = jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")
    return jaxpp_mpi.mpmd_jit_with_loop(STEP, mesh, static_argnames="lr", donate_argnames="params")


@pytest.mark.mpi(min_size=2)
def test_keyword_and_static_arguments(fn):
    """Two steps, the batch by keyword, lr static: each rank's leaves equal jax.jit's."""
    out = fn(PARAMS, batch=BATCH, lr=0.1)
    out = fn(out[0], lr=0.1, batch=BATCH)
    want = REFERENCE(REFERENCE(PARAMS, batch=BATCH, lr=0.1)[0], batch=BATCH, lr=0.1)
    assert assert_close_to_reference(want, out) > 0


@pytest.mark.mpi(min_size=2)
def test_donated_input_reused_on_one_rank(fn):
    """Rank 1 passes params an earlier step consumed (donated), the others fresh ones:
    every rank raises, and the next good step runs on every rank."""
    consumed = fn(PARAMS, batch=BATCH, lr=0.1)[0]
    fresh = fn(consumed, batch=BATCH, lr=0.1)[0]
    again = consumed if RANK == 1 else fresh
    everywhere(
        lambda: fn(again, batch=BATCH, lr=0.1),
        ValueError,
        r"failed the check on rank\(s\) \[1\].*has been deleted \(donated",
    )
    assert fn(fresh, batch=BATCH, lr=0.1)[1].shape == (2 * SIZE,)  # per-microbatch losses


@pytest.mark.mpi(min_size=2)
def test_static_values_differ_between_ranks(fn):
    """lr=0.1 (compiled before) on rank 0, 0.2 elsewhere: the others compile while rank 0
    runs; and on a fresh step, the differing static value is named."""
    lr = 0.1 if RANK == 0 else 0.2
    everywhere(
        lambda: fn(PARAMS, batch=BATCH, lr=lr),
        CompileError,
        r"rank\(s\) \[1.*\] compiled the step for new arguments while rank\(s\) \[0\]",
    )
    fresh = jaxpp_mpi.mpmd_jit_with_loop(STEP, fn.mpmd_mesh, static_argnames="lr")
    everywhere(
        lambda: fresh(PARAMS, batch=BATCH, lr=lr),
        CompileError,
        r"rank 0 passes static kwargs\['lr'\] = 0.1, rank 1 passes static "
        r"kwargs\['lr'\] = 0.2",
    )
