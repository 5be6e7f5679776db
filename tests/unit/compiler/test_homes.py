"""Outer homes: optimizer updates, a global-norm clip and a tied weight."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from jaxpp_mpi import mark_stage_end, treduce
from jaxpp_mpi._src.compiler.homes import assign_outer_homes
from jaxpp_mpi._src.primitives.treduce import find_treduce_eqns


@dataclasses.dataclass(frozen=True)
class Sched:
    num_stages: int


def loss(params, mb):
    w0, w1 = params
    return jnp.sum(mark_stage_end(jnp.tanh(mark_stage_end(mb @ w0) @ w1)))


def traced(step, *args):
    closed = jax.make_jaxpr(step)(*args)
    [(k, eqn)] = find_treduce_eqns(closed)
    return closed.jaxpr, k, eqn


W = (jnp.ones((4, 4)), jnp.ones((4, 8)))
XS = jnp.ones((2, 3, 4))


def grads_step(post):
    def step(params, xs):
        losses, grads = treduce(partial(jax.value_and_grad(loss), params), xs, Sched(2))
        return post(params, grads, losses)

    return step


def plan_for(step, invariant_groups_of, *args):
    jaxpr, k, eqn = traced(step, *args)
    inv_groups = [invariant_groups_of(v) for v in eqn.invars]
    # loop outputs: losses (stage 1), grad w0 (stage 0), grad w1 (stage 1)
    return jaxpr, k, eqn, assign_outer_homes(jaxpr, k, inv_groups, [1, 0, 1])


def by_shape(jaxpr, eqn):
    w0, w1, xs = jaxpr.invars
    return {w0: frozenset({0}), w1: frozenset({1}), xs: frozenset({0})}


def test_sgd_update_stays_with_its_stage():
    step = grads_step(lambda p, g, losses: (
        jax.tree.map(lambda w, g: w - 0.1 * g, p, g), jnp.mean(losses)))
    jaxpr = traced(step, W, XS)[0]
    groups = by_shape(jaxpr, None)
    _, _, _, plan = plan_for(step, lambda v: groups[v], W, XS)
    assert plan.input_owner == (0, 1, 0)
    assert plan.output_group == (0, 1, 1)  # new w0, new w1, mean loss (on the last stage)
    assert plan.input_needed == (frozenset({0}), frozenset({1}), frozenset({0}))


def test_global_norm_clip_crosses_groups_on_scalars_only():
    def post(p, g, losses):
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
        scale = jnp.minimum(1.0, 1.0 / norm)
        return jax.tree.map(lambda w, g: w - scale * g, p, g)

    step = grads_step(post)
    jaxpr = traced(step, W, XS)[0]
    groups = by_shape(jaxpr, None)
    jaxpr, k, _, plan = plan_for(step, lambda v: groups[v], W, XS)
    assert plan.output_group == (0, 1)
    for i, eqn in enumerate(jaxpr.eqns[k + 1:], start=k + 1):
        gs = plan.eqn_groups[i]
        assert len(gs) == 1
        # every eqn on a (4,8) or (4,4) tensor runs where that tensor's gradient lives
        big = [v for v in eqn.outvars if v.aval.shape in ((4, 4), (4, 8))]
        for v in big:
            assert gs == ((0,) if v.aval.shape == (4, 4) else (1,))


def test_tied_weight_is_owned_by_its_update_and_sent_to_the_other_user():
    step = grads_step(lambda p, g, losses: jax.tree.map(lambda w, g: w - g, p, g))
    jaxpr = traced(step, W, XS)[0]
    w0, w1, xs = jaxpr.invars
    groups = {w0: frozenset({0, 1}), w1: frozenset({1}), xs: frozenset({0})}
    _, _, _, plan = plan_for(step, lambda v: groups[v], W, XS)
    assert plan.input_owner[0] == 0 and plan.input_needed[0] == frozenset({0, 1})


def test_pre_loop_cast_runs_on_every_group_that_needs_it():
    def step(params, xs):
        params = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), params)
        losses, grads = treduce(partial(jax.value_and_grad(loss), params), xs, Sched(2))
        return grads

    jaxpr, k, eqn = traced(step, W, XS)
    pre_outs = {v: i for i, e in enumerate(jaxpr.eqns[:k]) for v in e.outvars}
    inv_groups = []
    for v in eqn.invars:
        if v.aval.shape == (4, 4):
            inv_groups.append(frozenset({0, 1}))  # pretend both stages read w0
        elif v.aval.shape == (4, 8):
            inv_groups.append(frozenset({1}))
        else:
            inv_groups.append(frozenset({0}))
    plan = assign_outer_homes(jaxpr, k, inv_groups, [1, 0, 1])
    for v, i in pre_outs.items():
        if v.aval.shape == (4, 4):
            assert plan.eqn_groups[i] == (0, 1)
    assert plan.input_owner[0] == 0 and plan.input_needed[0] == frozenset({0, 1})
