"""Recomputed residuals whose inputs sit on another rank's group or come from another task
(`Note: recomputed residuals` in compiler/recompute.py), across ranks, against `jax.jit`.

The mixed-precision step users write first: float32 master weights cast to bfloat16 at
the top of the loss (before the first mark), two layers per rank, activations split over
the group's "data" axis by `with_sharding_constraint`, SGD with momentum, params
donated, a bfloat16 copy of the new params returned. Its backward tasks run the loss's
subtraction again, which reads the labels' slice (a free value), and the weights' casts.
Under ZeroBubble the backward is split in two, and a skip connection from the first
stage (read directly, not through a mark) feeds cheap eqns of the last one.

Run at `-n 2` with 2 devices per rank (`sharded_groups` in the name: the Makefile's
several-device run). The reference, on every rank, is the same step under `jax.jit` on
this rank's devices; results within 1e-3 (bfloat16 compute), the bfloat16 copy within
one bfloat16 step.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from models import held_values
from mpi4py import MPI

import jaxpp_mpi

WORLD = MPI.COMM_WORLD
SIZE = WORLD.size
K = jax.local_device_count()
WIDTH, ROWS, MICROBATCHES = 8, 2 * K, 4


def _loss(params, mb, *, skip: bool):
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    x, y = mb
    x = jax.lax.with_sharding_constraint(x.astype(jnp.bfloat16), P("data"))
    first = None
    for i, layer in enumerate(p16):
        x = jnp.tanh(x @ layer["w"] + layer["b"])
        x = jax.lax.with_sharding_constraint(x, P("data"))
        first = x if first is None else first
        if i % 2 == 1:
            x = jaxpp_mpi.mark_stage_end(x)
    if skip:
        x = x + first * 0.5  # the first stage's value, read by the last stage
    return jnp.mean((x.astype(jnp.float32) - y) ** 2)


def _step(sched, skip: bool):
    opt = optax.sgd(0.1, momentum=0.9)

    def step(params, opt_state, batch):
        loss, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(partial(_loss, skip=skip)),
                                                params), batch, schedule=sched)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)

    return step, opt


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["1f1b", "zerobubble"])
def test_recompute_placement_sharded_groups(name):
    mesh = jaxpp_mpi.make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage",
                                    axis_types=(AxisType.Auto, AxisType.Auto))
    sched = jaxpp_mpi.schedules.schedule_by_name(name, SIZE)
    step, opt = _step(sched, skip=name == "zerobubble")
    rng = np.random.default_rng(SIZE)
    params = [{"w": (rng.normal(size=(WIDTH, WIDTH)) * 0.4).astype(np.float32),
               "b": np.zeros(WIDTH, np.float32)} for _ in range(2 * SIZE)]
    batch = tuple(rng.normal(size=(MICROBATCHES, ROWS, WIDTH)).astype(np.float32)
                  for _ in range(2))
    opt_state = opt.init(params)
    devices = Mesh(np.array(jax.local_devices()), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(devices):
        reference = jax.jit(step)(params, opt_state, batch)
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh, donate_argnums=(0, 1))
    got = pipelined(jax.tree.map(jnp.array, params), jax.tree.map(jnp.array, opt_state), batch)
    compared = 0
    for k, (a, b) in enumerate(zip(held_values(reference), held_values(got))):
        if b is None:
            continue  # held by the other rank
        assert (a.dtype, a.shape) == (b.dtype, b.shape), k
        # A bfloat16 result may round the other way: one bfloat16 step.
        tol = 2.0 ** -7 if a.dtype == jnp.bfloat16 else 1e-3
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=tol,
                                   atol=tol, err_msg=f"leaf {k}")
        compared += 1
    assert WORLD.allreduce(compared) >= len(jax.tree.leaves(reference))
