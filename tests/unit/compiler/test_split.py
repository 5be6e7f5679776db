"""The split pass against un-pipelined JAX: tasks replayed in order equal the body."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from jaxpp_mpi import mark_stage_end, treduce
from jaxpp_mpi._src.compiler.split import (
    BWD,
    BWD_I,
    BWD_W,
    FWD,
    SplitError,
    fuse_tasks,
    split_body,
)
from jaxpp_mpi._src.primitives.treduce import find_treduce_eqns


@dataclasses.dataclass(frozen=True)
class Sched:
    num_stages: int


def mlp_loss(params, mb, *, mark=mark_stage_end):
    x, y = mb
    for w in params:
        x = mark(jnp.tanh(x @ w))
    return jnp.mean((x - y) ** 2), jnp.sum(x)


def make_problem(num_stages=3, num_microbatches=4, jit_model=False):
    k = jax.random.split(jax.random.key(0), num_stages + 2)
    params = [jax.random.normal(k[i], (8, 8)) / 3 for i in range(num_stages)]
    xs = jax.random.normal(k[-2], (num_microbatches, 2, 8))
    ys = jax.random.normal(k[-1], (num_microbatches, 2, 8))
    loss = jax.jit(mlp_loss) if jit_model else mlp_loss

    def step(params, batch):
        grad_fn = partial(jax.value_and_grad(loss, has_aux=True), params)
        return treduce(grad_fn, batch, schedule=Sched(num_stages))

    return step, params, (xs, ys)


def body_of(step, *args):
    closed = jax.make_jaxpr(step)(*args)
    [(_, eqn)] = find_treduce_eqns(closed)
    invariant_vals = [_eval_outer(closed, v, args) for v in eqn.invars]
    return eqn.params["body"], invariant_vals


def _eval_outer(closed, var, args):
    env = dict(zip(closed.jaxpr.invars, jax.tree.leaves(args)))
    return env[var]


def replay(split, invariants, i):
    """Runs the split tasks for microbatch i in order; returns the body outputs."""
    env = {}

    def read(ref):
        kind = ref[0]
        return {"mb": lambda: np.int32(i), "inv": lambda: invariants[ref[1]],
                "val": lambda: env[ref[1]], "lit": lambda: ref[1]}[kind]()

    for task in split.tasks:
        outs = jex_core.jaxpr_as_fun(task.jaxpr)(*[read(r) for r in task.ins])
        env.update(zip(task.outs, outs))
    return [read(r) for r in split.body_outputs]


def count_prims(task, name):
    return sum(e.primitive.name == name for e in task.jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("partial_bwd", [False, True])
@pytest.mark.parametrize("jit_model", [False, True])
def test_replayed_tasks_equal_body_bitwise(num_stages, partial_bwd, jit_model):
    step, params, batch = make_problem(num_stages, jit_model=jit_model)
    body, invariants = body_of(step, params, batch)
    split = split_body(body, num_stages, partial_bwd=partial_bwd)
    for i in range(2):
        want = jex_core.jaxpr_as_fun(body)(np.int32(i), *invariants)
        got = replay(split, invariants, i)
        for g, w in zip(got, want):
            if jit_model:  # the reference runs the model as one compiled call, the
                # inlined replay op by op: XLA's fusion may differ in the last ulp.
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
            else:
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("partial_bwd", [False, True])
@pytest.mark.parametrize("fresh", [False, True])
def test_fused_last_stage_replays_like_its_parts_bitwise(partial_bwd, fresh):
    """`fuse_tasks` (`Note: back-to-back tasks`): the last stage's FWD and its backward
    (BWD, or BWD_I with W left apart) as one task compute what the two compute in turn;
    also when the backward's jaxpr has variables of its own (`fresh`: rebuilt by a pass,
    as `replicas.localize_split` does)."""
    step, params, batch = make_problem(3)
    body, invariants = body_of(step, params, batch)
    split = split_body(body, 3, partial_bwd=partial_bwd)
    a, b = split.task((FWD, 2)), split.task((BWD_I if partial_bwd else BWD, 2))
    if fresh:
        structs = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in b.jaxpr.in_avals]
        b = dataclasses.replace(b, jaxpr=jax.make_jaxpr(jex_core.jaxpr_as_fun(b.jaxpr))(*structs))
        assert not set(b.jaxpr.jaxpr.invars) & set(a.jaxpr.jaxpr.outvars)
    read_elsewhere = {r[1] for t in split.tasks if t.key not in (a.key, b.key)
                      for r in t.ins if r[0] == "val"}
    read_elsewhere |= {r[1] for r in split.body_outputs if r[0] == "val"}
    fused = fuse_tasks(a, b, keep=read_elsewhere & set(a.outs))
    assert not set(fused.outs) - set(a.outs) - set(b.outs)
    assert len(fused.outs) < len(a.outs) + len(b.outs)  # the residuals stay inside
    tasks = [fused if t.key == a.key else t for t in split.tasks if t.key != b.key]
    together = dataclasses.replace(split, tasks=tuple(tasks))
    for i in range(2):
        want = replay(split, invariants, i)
        got = replay(together, invariants, i)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_each_stage_task_holds_its_own_matmuls():
    step, params, batch = make_problem(3)
    body, _ = body_of(step, params, batch)
    split = split_body(body, 3)
    for s in range(3):
        assert count_prims(split.task((FWD, s)), "dot_general") == 1
    # Backward: dW and dx per stage, but stage 0 needs no dx (the batch is not differentiated).
    assert count_prims(split.task((BWD, 2)), "dot_general") == 2
    assert count_prims(split.task((BWD, 1)), "dot_general") == 2
    assert count_prims(split.task((BWD, 0)), "dot_general") == 1
    # The loss and its own backward: the forward part in FWD(2), the seed in BWD(2).
    assert split.value_task[split.body_outputs[0][1]] == (FWD, 2)


def test_invariants_are_used_by_their_stages_only():
    step, params, batch = make_problem(3)
    body, invariants = body_of(step, params, batch)
    split = split_body(body, 3)
    used = {t.key: {r[1] for r in t.ins if r[0] == "inv"} for t in split.tasks}
    # invariants: W0, W1, W2, xs, ys (make_jaxpr order of first use may differ: look up)
    shapes = [np.shape(v) for v in invariants]
    w_idx = [j for j, s in enumerate(shapes) if s == (8, 8)]
    assert len(w_idx) == 3
    for s in range(3):
        tasks_using = {k for k, inv in used.items() if w_idx[s] in inv}
        assert {k[1] for k in tasks_using} == {s}, tasks_using


def test_partial_bwd_splits_input_and_weight_gradients():
    step, params, batch = make_problem(3)
    body, _ = body_of(step, params, batch)
    split = split_body(body, 3, partial_bwd=True)
    assert split.task((BWD, 1)) is None
    assert count_prims(split.task((BWD_I, 1)), "dot_general") == 1  # dx
    assert count_prims(split.task((BWD_W, 1)), "dot_general") == 1  # dW
    assert split.task((BWD_I, 0)) is None  # nothing upstream of stage 0 needs a gradient
    grads = split.body_outputs[2:]
    assert {split.value_task[r[1]][0] for r in grads} == {BWD_W}


def test_wrong_number_of_marks_is_reported():
    step, params, batch = make_problem(3)
    body, _ = body_of(step, params, batch)
    with pytest.raises(SplitError, match="3 stage marks .* schedule has 4 stages"):
        split_body(body, 4)


def test_mark_inside_control_flow_is_rejected():
    def loss(w, mb):
        x = jax.lax.cond(mb[0, 0] > 0, lambda x: mark_stage_end(x @ w), lambda x: x, mb)
        return jnp.sum(mark_stage_end(x))

    def step(w, xs):
        return treduce(partial(jax.value_and_grad(loss), w), xs, schedule=Sched(2))

    body, _ = body_of(step, jnp.ones((4, 4)), jnp.ones((2, 4, 4)))
    with pytest.raises(ValueError, match="inside a `cond`"):
        split_body(body, 2)
