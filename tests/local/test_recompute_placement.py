"""Recomputed residuals whose inputs sit on another group or come from another task
(`Note: recomputed residuals` in compiler/recompute.py), in local mode against `jax.jit`.

A backward task runs cheap forward eqns again instead of reading their results; each
such eqn needs its own inputs in the backward task: a free value (the labels' slice of
the microbatch), a value of another stage's forward task (a skip connection, a weight
cast made where the first stage uses it), a value carried through a mark (an integer,
boolean, bfloat16 or key value), a loop operand. The first case is the mixed-precision
step users write first: float32 master weights cast to bfloat16 at the top of the loss,
4 layers in 2 stages on 2 devices per group, SGD with momentum, params donated, a
bfloat16 copy of the new params returned (results within 1e-3, bfloat16 compute).

Each case is also checked structurally, without XLA: every value a task reads is made
by a task that exports it (or computed in the task itself).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from fuzz.programs import Program, check, init, make_step, meshes
from jax.sharding import PartitionSpec as P

import jaxpp_mpi
from jaxpp_mpi._src.compiler.split import split_body
from jaxpp_mpi._src.compiler.trace_step import trace_step

WIDTH = 8


def _mixed_precision_loss(params, mb):
    """The loss as users write it: the whole tree cast to bfloat16 before any mark."""
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    x, y = mb
    x = jax.lax.with_sharding_constraint(x.astype(jnp.bfloat16), P("data"))
    for i, layer in enumerate(p16):
        x = jnp.tanh(x @ layer["w"] + layer["b"])
        x = jax.lax.with_sharding_constraint(x, P("data"))
        if i % 2 == 1:
            x = jaxpp_mpi.mark_stage_end(x)
    return jnp.mean((x.astype(jnp.float32) - y) ** 2)


def _mixed_precision_step():
    opt = optax.sgd(0.1, momentum=0.9)
    sched = jaxpp_mpi.Std1F1B(2)

    def step(params, opt_state, batch):
        loss, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(_mixed_precision_loss),
                                                params), batch, schedule=sched)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)

    rng = np.random.default_rng(0)
    params = [{"w": (rng.normal(size=(WIDTH, WIDTH)) * 0.4).astype(np.float32),
               "b": np.zeros(WIDTH, np.float32)} for _ in range(4)]
    batch = tuple(rng.normal(size=(4, 4, WIDTH)).astype(np.float32) for _ in range(2))
    return step, opt, params, batch


def test_mixed_precision_step_as_users_write_it():
    step, opt, params, batch = _mixed_precision_step()
    mpmd_mesh, group0 = meshes(2)
    opt_state = opt.init(params)
    with jax.set_mesh(group0):
        reference = jax.jit(step)(params, opt_state, batch)
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh, donate_argnums=(0, 1))
    got = pipelined(jax.tree.map(jnp.array, params), jax.tree.map(jnp.array, opt_state), batch)
    ref_leaves, got_leaves = jax.tree.leaves(reference), jax.tree.leaves(got)
    assert len(ref_leaves) == len(got_leaves)
    for a, b in zip(ref_leaves, got_leaves):
        a, b = np.asarray(a), np.asarray(b)
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=1e-3,
                                   atol=1e-3)


# Each: the inputs of a recomputed residual come from elsewhere. The recomputed eqns are
# cheap ones: casts, the loss's subtraction and square, a select on a crossing mask, the
# skip's add, a layer norm's centred values, a softmax's exp.
CASES = {
    # the loss term's labels: a free value (the microbatch's slice), in every backward
    "labels_free_value": Program(layers=("dense", "dense"), marks=(1, 2), cast="loss"),
    "labels_split_backward": Program(schedule="zerobubble", layers=("norm", "gelu"),
                                     marks=(1, 2), cast="loss"),
    "labels_two_stages_per_group": Program(schedule="interleaved", layers=("dense",) * 4,
                                           marks=(1, 2, 3, 4), cast="loss", devices=2,
                                           constrain=True),
    # a cast and an add reading another group's forward value directly (not marked)
    "skip_from_another_group": Program(layers=("dense", "norm", "dense"), marks=(1, 3),
                                       skips=((0, (1, 2)),), cast="loss"),
    # the tied embedding's bfloat16 cast is made by stage 0 and read by the last stage
    "tied_cast_across_groups": Program(schedule="dualpipev", microbatches=4,
                                       layers=("softmax", "dense"), marks=(0, 1, 1, 2),
                                       embed="tied", loss="xent", cast="loss"),
    # the whole tree cast before the loop: the bfloat16 weights are loop operands
    "cast_before_the_loop": Program(layers=("gelu", "norm"), marks=(1, 2), cast="step",
                                    optimizer="momentum", bf16_copy=True, donate=True),
    # integer, boolean, bfloat16 and key values made by stage 0, used by stage 1's
    # cheap eqns (a select, a conversion) that its backward runs again
    "crossing_values": Program(schedule="eager1f1b", layers=("dense", "dense", "dense"),
                               marks=(1, 3), extras=(("bool", 0, 2), ("int", 0, 1),
                                                     ("bf16", 0, 2), ("key", 0, 1))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_task_input_is_made_and_exported(name):
    """Structural (no XLA): every value a task reads is exported by the task making it."""
    prog = CASES[name]
    step, opt = make_step(prog)
    params, batch = init(prog)
    traced = trace_step(step, (params, jax.eval_shape(opt.init, params), batch),
                        mesh=meshes(prog.devices)[0])
    sched = jaxpp_mpi.schedules.schedule_by_name(prog.schedule, 2)
    split = split_body(traced.loop.params["body"], sched.num_stages,
                       partial_bwd=sched.is_partial_bwd)
    exported = {name for t in split.tasks for name in t.outs}
    recomputed = 0
    for task in split.tasks:
        for ref in task.ins:
            if ref[0] == "val":
                assert ref[1] in split.value_task and ref[1] in exported, (task.key, ref)
        own = {v for e in task.jaxpr.jaxpr.eqns for v in e.outvars}
        recomputed += task.key[0].name != "FWD" and any(
            split.value_task.get(n) not in (None, task.key)
            for n, e in split.value_eqns.items() if set(e.outvars) & own)
    assert recomputed, "the case recomputes residuals in some backward task"


@pytest.mark.parametrize("name", list(CASES))
def test_recomputed_inputs_from_elsewhere_match_jit(name):
    check(CASES[name])
