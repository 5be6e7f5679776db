"""Restaging a traced step (`Note: restaging`): against the step written that way."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpp_mpi
from jaxpp_mpi._src.compiler.build import build_step
from jaxpp_mpi._src.compiler.split import split_body
from jaxpp_mpi._src.planner.restage import (
    count_marks,
    keep_marks,
    loop_eqn,
    microbatched,
    restage,
)
from jaxpp_mpi.schedules import Std1F1B, ZeroBubble

WIDTH, LAYERS = 8, 4


def _step(marked_after, sched, jit_layers=False):
    """An MLP step whose layers in `marked_after` end with a stage mark."""

    def layer(w, x):
        return jnp.tanh(x @ w)

    layer = jax.jit(layer) if jit_layers else layer

    def loss(params, mb):
        x, y = mb
        for i, w in enumerate(params):
            x = layer(w, x)
            if i in marked_after:
                x = jaxpp_mpi.mark_stage_end(x)
        return jnp.mean((x - y) ** 2)

    def step(params, batch):
        losses, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(loss), params), batch,
                                          schedule=sched)
        return losses, grads

    return step


def _args(num_microbatches=4, rows=2):
    k = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = [jax.random.normal(k[i], (WIDTH, WIDTH)) / 3 for i in range(LAYERS)]
    batch = (jax.random.normal(k[-2], (num_microbatches, rows, WIDTH)),
             jax.random.normal(k[-1], (num_microbatches, rows, WIDTH)))
    return params, batch


def _body(step, args):
    closed = jax.make_jaxpr(step)(*args)
    return loop_eqn(closed.jaxpr)[1].params["body"]


@pytest.mark.parametrize("jit_layers", [False, True])
def test_marks_are_counted_through_calls(jit_layers):
    assert count_marks(_body(_step(range(LAYERS), Std1F1B(4), jit_layers), _args())) == 4


@pytest.mark.parametrize("keep", [(1, 3), (0, 3), (2, 3)])
def test_kept_marks_split_as_the_step_marked_there(keep):
    fine = _body(_step(range(LAYERS), Std1F1B(4)), _args())
    coarse = _body(_step(keep, Std1F1B(2)), _args())
    kept = keep_marks(fine, keep)
    assert count_marks(kept) == 2
    for partial_bwd in (False, True):
        a = split_body(kept, 2, partial_bwd=partial_bwd)
        b = split_body(coarse, 2, partial_bwd=partial_bwd)
        assert [t.key for t in a.tasks] == [t.key for t in b.tasks]
        for ta, tb in zip(a.tasks, b.tasks):
            assert str(ta.jaxpr) == str(tb.jaxpr), ta.key


def test_unknown_marks_are_refused():
    with pytest.raises(ValueError, match="do not exist"):
        keep_marks(_body(_step(range(LAYERS), Std1F1B(4)), _args()), (1, 4))


def test_restaged_step_is_the_step_written_for_that_split():
    """Same program as the step marked after layers 1 and 3, under another schedule."""
    args = _args()
    leaves, tree = jax.tree.flatten(args)

    def built(step):
        return build_step(lambda *xs: step(*jax.tree.unflatten(tree, xs)), leaves, 2)

    restaged = restage(_step(range(LAYERS), Std1F1B(4)), ZeroBubble(2), (1, 3))
    assert str(built(restaged).program) == str(built(_step((1, 3), ZeroBubble(2))).program)


def test_restaged_step_computes_the_same():
    args = _args()
    step = _step(range(LAYERS), Std1F1B(4))
    want = jax.jit(step)(*args)
    got = jax.jit(restage(step, Std1F1B(2), (1, 3)))(*args)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert restage(step).__name__ == step.__name__


def test_microbatched_keeps_the_rows_in_order():
    batch = {"x": np.arange(4 * 3 * 2).reshape(4, 3, 2)}
    out = microbatched(batch, 6)
    assert out["x"].shape == (6, 2, 2)
    np.testing.assert_array_equal(out["x"].reshape(12, 2), batch["x"].reshape(12, 2))
    abstract = microbatched(jax.ShapeDtypeStruct((4, 3, 2), jnp.float32), 2)
    assert abstract.shape == (2, 6, 2)
    with pytest.raises(ValueError, match="do not divide"):
        microbatched(batch, 5)
    with pytest.raises(ValueError, match="no row dimension"):
        microbatched(np.zeros(4), 2)
