"""Results keep `jax.jit`'s weak types: a weakly typed scalar in the state (a Python
float learning rate, flax's `step=0`) fed back neither recompiles the step nor promotes
another leaf differently from `jax.jit` (bf16 weights times a weak float stay bf16)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

import jaxpp_mpi


def step(state, batch):
    w, lr, count = state  # lr: a Python float, count: a Python int (both weak)

    def loss(w, x):
        x = jaxpp_mpi.mark_stage_end(x * w[0])
        x = jaxpp_mpi.mark_stage_end(x * w[1])
        return jnp.mean(x.astype(jnp.float32) ** 2)

    losses, g = jaxpp_mpi.treduce(partial(jax.value_and_grad(loss), w), batch,
                                  schedule=jaxpp_mpi.Std1F1B(2))
    return (w - lr * g, lr * 1, count + 1, 7), losses


def test_weak_results_feed_back_like_jax_jit():
    mesh = jaxpp_mpi.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data"),
                                            devices=jax.devices()[:2]), "stage")
    state = (jnp.ones((2, 4), jnp.bfloat16), 0.1, 0)
    batch = jnp.ones((2, 3, 4), jnp.bfloat16)
    pipelined, reference = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh), jax.jit(step)
    got, want = state, state
    for _ in range(3):
        (*got, _lit), _ = pipelined(tuple(got[:3]), batch)
        (*want, lit), _ = reference(tuple(want[:3]), batch)
        for a, b in zip(got, want):
            assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
        assert _lit.weak_type == lit.weak_type
    assert len(pipelined._cache) == 1  # fed back, the step did not recompile
    assert got[0].dtype == jnp.bfloat16
    assert int(got[2].first_mpmd_replica) == int(want[2]) == 3
