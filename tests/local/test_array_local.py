"""MpmdArrays a compiled step returns and takes, in local mode, against `jax.jit`.

A step's results convert and format as the same step's `jax.jit` results do
(`f"{loss:.3f}"`, `float`, `int`, `bool`, `len`, iteration; `process_allgather` of the
whole tree), and an argument held on only some of its groups (partially addressable)
gives `jax.jit`'s results.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import models
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpp_mpi
from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.sharding import MpmdSharding

GROUPS, MICROBATCHES = 2, 4
RTOL, ATOL = 1e-5, 1e-6


@functools.cache
def mesh() -> jaxpp_mpi.MpmdMesh:
    return jaxpp_mpi.MpmdMesh(jax.make_mesh((GROUPS, 1), ("stage", "data")), "stage")


def _step(loss_fn):
    """A training step whose results are a scalar loss, an int index, per-microbatch
    losses and the updated params (plain SGD)."""

    def step(params, batch):
        grad_fn = functools.partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, _), grads = jaxpp_mpi.treduce(
            grad_fn, batch, schedule=models.schedule("1f1b", GROUPS))
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return jnp.mean(losses), jnp.argmax(losses).astype(jnp.int32), losses, new

    return step


@pytest.fixture(scope="module")
def runs():
    params, batch, loss_fn = models.mlp(GROUPS, MICROBATCHES)
    step = _step(loss_fn)
    reference = jax.jit(step)(params, batch)
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh())
    return params, batch, pipelined, reference, pipelined(params, batch)


def test_results_convert_like_jax_jit(runs):
    _, _, _, (ref_loss, ref_idx, ref_losses, _), (loss, idx, losses, _) = runs
    assert isinstance(loss, MpmdArray) and loss.shape == ()
    assert f"{loss:.3f}" == f"{ref_loss:.3f}"
    assert f"step 3: loss {loss:.4f}" == f"step 3: loss {ref_loss:.4f}"
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL, atol=ATOL)
    assert complex(loss) == pytest.approx(complex(ref_loss), rel=RTOL)
    assert bool(loss) == bool(ref_loss)
    assert int(idx) == int(ref_idx) and operator.index(idx) == int(ref_idx)
    assert list(range(MICROBATCHES))[idx] == int(ref_idx)
    assert len(losses) == len(ref_losses) == MICROBATCHES
    rows = list(losses)
    assert all(isinstance(r, jax.Array) and r.shape == () for r in rows)
    np.testing.assert_allclose([float(r) for r in rows], np.asarray(ref_losses),
                               rtol=RTOL, atol=ATOL)
    with pytest.raises(TypeError, match="Only scalar arrays"):
        float(losses)
    with pytest.raises(TypeError, match="len\\(\\) of unsized object"):
        len(loss)


def test_partially_addressable_argument(runs):
    """A weight held only by the group that does not read it: the step copies it over."""
    _, batch, pipelined, (_, _, _, ref_new), (_, _, _, new) = runs
    reference = jax.jit(_step(models.mlp(GROUPS, MICROBATCHES)[2]))(ref_new, batch)
    # Stage 1's weight, re-held on groups (0, 1) with only group 0's replica here.
    w1 = new[1][0]
    value = np.asarray(w1)
    sharding = MpmdSharding(mesh(), (0, 1), P())
    partial_w1 = MpmdArray([jax.device_put(value, sharding.sharding_for(0))], sharding)
    assert partial_w1.local_arrays.keys() == {0} and partial_w1.first_mpmd_replica is not None
    args = [list(layer) for layer in new]
    args[1][0] = partial_w1
    args = [tuple(layer) for layer in args]
    got = pipelined(args, batch)
    np.testing.assert_allclose(float(got[0]), float(reference[0]), rtol=RTOL, atol=ATOL)
    for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(reference[3])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


def test_process_allgather_reads_the_whole_tree_like_jax_jit(runs):
    """The explicit read in local mode: every leaf of a step's results as numpy, equal to
    `jax.jit`'s, with the same tree structure; no message (one process)."""
    _, _, _, reference, got = runs
    values = jaxpp_mpi.process_allgather(got)
    assert jax.tree.structure(values) == jax.tree.structure(reference)
    for a, b in zip(jax.tree.leaves(values), jax.tree.leaves(reference)):
        assert isinstance(a, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, np.asarray(b), rtol=RTOL, atol=ATOL)
    loss = got[0]
    assert float(jaxpp_mpi.process_allgather(loss)) == float(loss)
