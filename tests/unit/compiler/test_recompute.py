"""Backward tasks recompute cheap residuals (`Note: recomputed residuals` in compiler/recompute.py).

Structural: what crosses from a stage's forward task to its backward task, with and
without the pass. Results against jax.jit are the parity tests' (tests/local,
tests/mpi), which run with it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import mlp, schedule, transformer

import jaxpp_mpi
from jaxpp_mpi._src.compiler.split import BWD, BWD_I, BWD_W, FWD, split_body
from jaxpp_mpi._src.compiler.trace_step import trace_step


def _body(loss_fn, params, batch, sched):
    def step(params, batch):
        grad = functools.partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        return jaxpp_mpi.treduce(grad, batch, schedule=sched)

    return trace_step(step, (params, batch)).loop.params["body"]


def _residuals(split, stage: int) -> dict[str, object]:
    """The values the backward tasks of `stage` read from its forward task."""
    out = {}
    for kind in (BWD, BWD_I, BWD_W):
        task = split.task((kind, stage))
        if task is None:
            continue
        for ref in task.ins:
            if ref[0] == "val" and split.value_task[ref[1]] == (FWD, stage):
                out[ref[1]] = split.value_avals[ref[1]]
    return out


def _nbytes(avals) -> int:
    return sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals)


@pytest.mark.parametrize("name", ["1f1b", "zerobubble"])
def test_transformer_stages_read_far_fewer_bytes(name):
    sched = schedule(name, 2)
    params, batch, loss_fn = transformer(sched.num_stages, 2, d=32, seq=16)
    body = _body(loss_fn, params, batch, sched)
    kept = split_body(body, 2, partial_bwd=sched.is_partial_bwd, recompute=False)
    shrunk = split_body(body, 2, partial_bwd=sched.is_partial_bwd)
    for s in range(2):
        before, after = _residuals(kept, s), _residuals(shrunk, s)
        assert _nbytes(after.values()) < 0.75 * _nbytes(before.values()), s
        # the causal mask broadcast to the scores' shape is recomputed, not kept
        assert any(a.dtype == jnp.bool_ for a in before.values())
        assert not any(a.dtype == jnp.bool_ for a in after.values())


def test_only_cheap_residuals_are_recomputed():
    """A residual made by a dot (the MLP's pre-activation) stays; its tanh (elementwise,
    as large as the dot's result that is read anyway) is recomputed from it."""
    sched = schedule("gpipe", 2)
    params, batch, loss_fn = mlp(2, 2)
    body = _body(loss_fn, params, batch, sched)
    kept = split_body(body, 2, recompute=False)
    shrunk = split_body(body, 2)
    for s in range(2):
        before, after = _residuals(kept, s), _residuals(shrunk, s)
        assert _nbytes(after.values()) <= _nbytes(before.values())
        assert after, "a dot's result stays a residual"


def test_the_residual_order_does_not_read_variables_printed_forms(monkeypatch):
    """A jaxpr variable prints with its address, which differs between processes, so
    an order that read it would let ranks recompute different residuals."""
    from jax._src import core

    sched = schedule("1f1b", 2)
    params, batch, loss_fn = transformer(sched.num_stages, 2, d=32, seq=16)
    body = _body(loss_fn, params, batch, sched)
    want = split_body(body, 2)

    def printed(self):
        raise AssertionError("a variable's printed form was read")

    monkeypatch.setattr(core.Var, "__repr__", printed)
    monkeypatch.setattr(core.Var, "__str__", printed, raising=False)
    got = split_body(body, 2)
    for s in range(2):
        assert _residuals(got, s) == _residuals(want, s)
