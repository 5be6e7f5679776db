"""examples/train.py's `fused_attention` (attention by `jax.nn.dot_product_attention`,
cuDNN's fused kernel on a GPU, bench/gpu.py's `--fused-attention`): the block computes
what the explicit softmax(q k^T) v computes, and a pipelined step of the model matches
`jax.jit` of the same step (on CPU, XLA's implementation of the same function)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import assert_close_to_reference, make_step, run_steps, schedule, train, transformer

import jaxpp_mpi as jp


def test_fused_block_equals_the_explicit_one():
    cfg = train.ModelConfig(vocab=16, hidden=16, heads=4, seq=8, layers=1, mlp_ratio=2)
    block = train.init_params(jax.random.PRNGKey(0), cfg, std=0.3)["blocks"][0]
    h = jax.random.normal(jax.random.PRNGKey(1), (3, 8, 16), jnp.float32)
    explicit = jax.jit(lambda p, h: train.block(p, h, 4))(block, h)
    fused = jax.jit(lambda p, h: train.block(p, h, 4, fused_attention=True))(block, h)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(explicit), rtol=1e-5, atol=1e-5)
    # causal: the first position attends to itself only, so a later token cannot move it
    later = h.at[:, 1:].add(1.0)
    moved = jax.jit(lambda p, h: train.block(p, h, 4, fused_attention=True))(block, later)
    np.testing.assert_allclose(np.asarray(moved[:, 0]), np.asarray(fused[:, 0]), rtol=1e-6)


@pytest.mark.parametrize("name", ["1f1b", "zerobubble"])
def test_pipelined_step_with_fused_attention_matches_jit(name):
    sched = schedule(name, 2)
    params, batch, loss_fn = transformer(sched.num_stages, 4, fused_attention=True)
    step, optimizer = make_step(loss_fn, sched)
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    reference = run_steps(jax.jit(step), optimizer.init(params), params, batch, steps=2)
    got = run_steps(jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh), optimizer.init(params),
                    params, batch, steps=2)
    assert assert_close_to_reference(reference, got) == len(jax.tree.leaves(reference))
