"""Tests for `treduce`, `treduce_i` and the `treduce_p` loop primitive."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpp_mpi._src.primitives.stage_marks import mark_stage_end, stage_end_p
from jaxpp_mpi._src.primitives.treduce import (
    Add,
    Concat,
    Max,
    find_treduce_eqns,
    nested_treduce_errors,
    treduce,
    treduce_i,
    treduce_p,
)


@dataclasses.dataclass(frozen=True)
class Sched:
    """Stand-in for a schedule: frozen, hashable, with `num_stages`."""

    num_stages: int


SCHED = Sched(3)


def reference_treduce_i(fun, length, operation):
    """The sequential reduce of the API reference, in plain Python."""
    out = fun(0)
    ops = jax.tree.broadcast(operation, out, is_leaf=lambda x: isinstance(x, type))
    ops = jax.tree.map(lambda o: o() if isinstance(o, type) else o, ops,
                       is_leaf=lambda x: isinstance(x, type))
    state = jax.tree.map(lambda op, a: op.state(length, a), ops, out)
    for i in range(1, length):
        state = jax.tree.map(lambda op, s, v, i=i: op.update(s, v, i), ops, state, fun(i))
    return state


def reference_treduce(fun, xs, axis, operation):
    n = jax.tree.leaves(xs)[0].shape[axis]
    take = lambda i: jax.tree.map(lambda x: jnp.take(x, i, axis=axis), xs)
    return reference_treduce_i(lambda i: fun(take(i)), n, operation)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------- semantics

XS = {
    "a": jnp.arange(4 * 3 * 2, dtype=jnp.float32).reshape(4, 3, 2) / 7.0,
    "b": (jnp.arange(4 * 3, dtype=jnp.int32).reshape(4, 3) % 5),
}


def _fun(w, x):
    v = jnp.sin(x["a"] * w) @ jnp.ones((2,))
    return (v * x["b"], jnp.max(x["b"])), jnp.sum(v)


OPERATIONS = [
    (Concat(), Add),
    ((Concat(axis=1), Concat()), Max()),
    ((Concat(axis=-1), Add()), Concat()),
    Add,
    Max,
    ((Max, Add), Max),
]


@pytest.mark.parametrize("operation", OPERATIONS, ids=str)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_treduce_matches_python_loop(operation, jit):
    w = jnp.float32(1.3)
    run = lambda w, xs: treduce(partial(_fun, w), xs, SCHED, operation=operation)
    ref = lambda w, xs: reference_treduce(partial(_fun, w), xs, 0, operation)
    if jit:
        run, ref = jax.jit(run), jax.jit(ref)
    assert_trees_equal(run(w, XS), ref(w, XS))


@pytest.mark.parametrize("axis", [1, -1])
def test_treduce_axis(axis):
    xs = (jnp.arange(2 * 5, dtype=jnp.float32).reshape(2, 5),
          jnp.arange(3 * 5, dtype=jnp.float32).reshape(3, 5))
    fun = lambda x: (x[0] * 2.0, jnp.sum(x[1]))
    got = jax.jit(lambda xs: treduce(fun, xs, SCHED, axis=axis))(xs)
    assert_trees_equal(got, reference_treduce(fun, xs, axis, (Concat(), Add)))
    assert got[0].shape == (5, 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_treduce_i(jit):
    table = jnp.arange(12.0).reshape(6, 2)
    fun = lambda i: {"row": table[i] ** 2, "i": i, "s": jnp.sum(table[i])}
    op = {"row": Concat(axis=1), "i": Concat(), "s": Max}
    run = lambda: treduce_i(fun, 6, SCHED, operation=op)
    got = jax.jit(run)() if jit else run()
    assert_trees_equal(got, reference_treduce_i(fun, 6, op))
    np.testing.assert_array_equal(got["i"], np.arange(6))


def test_single_microbatch():
    got = treduce(lambda x: (x, x * 2), jnp.ones((1, 3)), SCHED)
    assert got[0].shape == (1, 3) and got[1].shape == (3,)


def test_integer_and_closed_over_values_are_invariants():
    tokens = jnp.arange(8, dtype=jnp.int32).reshape(4, 2)
    emb = jnp.arange(10.0)

    def step(emb, tokens):
        return treduce(lambda t: jnp.sum(emb[t]), tokens, SCHED, operation=Add)

    np.testing.assert_array_equal(jax.jit(step)(emb, tokens), jnp.sum(emb[tokens]))
    jaxpr = jax.make_jaxpr(step)(emb, tokens)
    (_, eqn), = find_treduce_eqns(jaxpr)
    assert set(eqn.invars) == set(jaxpr.jaxpr.invars)


# ---------------------------------------------------------------- training step


def _mlp_loss(params, batch):
    x, y = batch
    h = mark_stage_end(jnp.tanh(x @ params["w0"] + params["b0"]))
    h = mark_stage_end(jnp.tanh(h @ params["w1"]))
    loss = mark_stage_end(jnp.mean((h @ params["w2"] - y) ** 2))
    return loss, {"pos": jnp.sum(y > 0), "loss": loss}


def _params_and_batch(num_microbatches=5):
    k = jax.random.split(jax.random.key(1), 6)
    params = {
        "w0": jax.random.normal(k[0], (8, 16)) * 0.3,
        "b0": jax.random.normal(k[1], (16,)) * 0.1,
        "w1": jax.random.normal(k[2], (16, 16)) * 0.3,
        "w2": jax.random.normal(k[3], (16, 4)) * 0.3,
    }
    batch = (jax.random.normal(k[4], (num_microbatches, 3, 8)),
             jax.random.normal(k[5], (num_microbatches, 3, 4)))
    return params, batch


def _step(params, batch):
    vg = jax.value_and_grad(_mlp_loss, has_aux=True)
    return treduce(partial(vg, params), batch, SCHED)


def _step_by_hand(params, batch):
    vg = jax.value_and_grad(_mlp_loss, has_aux=True)
    n = batch[0].shape[0]
    results = [vg(params, jax.tree.map(lambda x, i=i: x[i], batch)) for i in range(n)]
    losses = jnp.stack([r[0][0] for r in results])
    aux = jax.tree.map(lambda *a: jnp.stack(a), *[r[0][1] for r in results])
    grads = results[0][1]
    for r in results[1:]:
        grads = jax.tree.map(jnp.add, grads, r[1])
    return (losses, aux), grads


@pytest.mark.parametrize("num_microbatches", [1, 2, 5])
def test_value_and_grad_step_bitwise_under_jit(num_microbatches):
    params, batch = _params_and_batch(num_microbatches)
    got = jax.jit(_step)(params, batch)
    want = jax.jit(_step_by_hand)(params, batch)
    assert_trees_equal(got, want)


def test_value_and_grad_step_eager():
    # Eagerly the body runs op by op from its jaxpr while the hand loop runs
    # jnp's jitted helpers (e.g. jnp.mean), so only closeness is expected.
    params, batch = _params_and_batch(3)
    got, want = _step(params, batch), _step_by_hand(params, batch)
    jax.tree.map(partial(np.testing.assert_allclose, rtol=1e-6), got, want)


def test_step_jaxpr_has_one_treduce_with_params_and_batch():
    params, batch = _params_and_batch(4)

    def train_step(params, batch):
        (losses, _), grads = _step(params, batch)
        new = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return new, jnp.mean(losses)

    jaxpr = jax.make_jaxpr(train_step)(params, batch)
    found = find_treduce_eqns(jaxpr)
    assert len(found) == 1
    _, eqn = found[0]
    assert set(jaxpr.jaxpr.invars) <= set(eqn.invars)  # all params and the batch
    assert eqn.params["num_microbatches"] == 4
    assert eqn.params["schedule"] == SCHED
    body = eqn.params["body"]
    assert body.consts == [] or body.consts == ()
    assert len(body.jaxpr.invars) == 1 + len(eqn.invars)
    assert body.jaxpr.invars[0].aval.shape == () and body.jaxpr.invars[0].aval.dtype == jnp.int32
    assert [v.aval for v in body.jaxpr.invars[1:]] == [v.aval for v in eqn.invars]
    # ((loss, {loss, pos}), grads): Concat for the first three leaves, Add for grads.
    assert eqn.params["ops"] == (Concat(),) * 3 + (Add(),) * 4
    marks = [e.params["direction"] for e in body.jaxpr.eqns if e.primitive is stage_end_p]
    assert marks == ["fwd"] * 3 + ["bwd"] * 3
    assert nested_treduce_errors(jaxpr) == []


def test_treduce_under_outer_jit_is_reported_nested():
    params, batch = _params_and_batch(2)
    jaxpr = jax.make_jaxpr(jax.jit(_step))(params, batch)
    assert find_treduce_eqns(jaxpr) == []
    (msg,) = nested_treduce_errors(jaxpr)
    assert "nested" in msg and "top level" in msg


def test_ops_hashable_and_class_or_instance():
    assert hash(Add()) == hash(Add()) and Add() == Add()
    assert Concat(1) == Concat(axis=1) and Concat(0) != Concat(1)
    a = treduce(lambda x: x, jnp.arange(3.0)[:, None], SCHED, operation=Add)
    b = treduce(lambda x: x, jnp.arange(3.0)[:, None], SCHED, operation=Add())
    assert_trees_equal(a, b)


# ---------------------------------------------------------------------- errors


def test_error_length():
    with pytest.raises(ValueError, match="at least one microbatch"):
        treduce_i(lambda i: i, 0, SCHED)
    with pytest.raises(ValueError, match="at least one microbatch"):
        treduce(lambda x: x, jnp.ones((0, 2)), SCHED, operation=Add)


def test_error_operation_not_prefix():
    with pytest.raises(ValueError, match="prefix"):
        treduce(lambda x: (x, x, x), jnp.ones((2, 3)), SCHED, operation=(Add, Add))


def test_error_non_op_leaf():
    with pytest.raises(TypeError, match="Op instances"):
        treduce(lambda x: (x, x), jnp.ones((2, 3)), SCHED, operation=(Add, "sum"))


def test_error_xs_axis():
    with pytest.raises(ValueError, match=r"axis=2 is out of range for xs\[1\]"):
        treduce(lambda x: x, (jnp.ones((2, 3, 4)), jnp.ones((2, 3))), SCHED, axis=2)
    with pytest.raises(ValueError, match="same size along axis 0"):
        treduce(lambda x: x, {"a": jnp.ones((2, 3)), "b": jnp.ones((3, 3))}, SCHED)
    with pytest.raises(ValueError, match="at least one array"):
        treduce(lambda x: 1.0, (), SCHED)


def test_error_concat_axis():
    with pytest.raises(ValueError, match=r"Concat\(axis=3\) is out of range"):
        treduce(lambda x: x, jnp.ones((2, 3)), SCHED, operation=Concat(3))


def test_error_unhashable_schedule():
    with pytest.raises(TypeError, match="hashable"):
        treduce(lambda x: x, jnp.ones((2, 3)), [1, 2], operation=Add)


def test_error_grad_through_treduce():
    xs = jnp.ones((3, 2))
    f = lambda w: jnp.sum(treduce(lambda x: x * w, xs, SCHED, operation=Add))
    with pytest.raises(NotImplementedError, match="gradient inside the loop body"):
        jax.grad(f)(jnp.float32(2.0))
    with pytest.raises(NotImplementedError, match="gradient inside the loop body"):
        jax.jit(jax.grad(f))(jnp.float32(2.0))


def test_error_vmap_of_treduce():
    f = lambda w: treduce(lambda x: x * w, jnp.ones((3, 2)), SCHED, operation=Add)
    with pytest.raises(NotImplementedError, match="vmap"):
        jax.vmap(f)(jnp.ones(4))


def test_treduce_p_params_are_hashable():
    run = lambda xs: treduce(lambda x: x, xs, SCHED, operation=Concat())
    jaxpr = jax.make_jaxpr(run)(jnp.ones((2, 3)))
    (_, eqn), = find_treduce_eqns(jaxpr)
    assert eqn.primitive is treduce_p
    for key in ("num_microbatches", "schedule", "ops", "body"):
        hash(eqn.params[key])
