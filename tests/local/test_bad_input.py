"""Bad input in local mode (one process, 8 CPU devices): each rejected before compiling,
with an exception that names what is wrong and what to do.

The stage-count, microbatch-count (interleaved), schedule-size and no-treduce errors are
in test_step.py; the cross-rank cases in tests/mpi/test_bad_input_mpi.py.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpp_mpi as jp

D, ROWS, N = 8, 6, 4  # feature size, rows per microbatch (not a multiple of 4), microbatches


@functools.cache
def mesh(data: int = 1) -> jp.MpmdMesh:
    """2 groups of `data` devices each, on a 'data' axis."""
    return jp.MpmdMesh(jax.make_mesh((2, data), ("stage", "data")), "stage")


def model(num_stages: int = 2, n: int = N):
    """Numpy params (one (D, D) weight per stage) and an (inputs, targets) batch."""
    rng = np.random.default_rng(0)
    params = [rng.normal(size=(D, D)).astype(np.float32) for _ in range(num_stages)]
    batch = tuple(rng.normal(size=(n, ROWS, D)).astype(np.float32) for _ in range(2))
    return params, batch


def loss_fn(params, mb):
    x, y = mb
    for w in params:
        x = jp.mark_stage_end(jnp.tanh(x @ w))
    return jnp.mean((x - y) ** 2)


def step_fn(schedule, extra=None):
    """An SGD step; `extra(params, batch)`, when given, is a third result."""

    def step(params, batch, *unused):
        losses, grads = jp.treduce(partial(jax.value_and_grad(loss_fn), params), batch,
                                   schedule=schedule)
        out = ([p - 0.1 * g for p, g in zip(params, grads)], losses)
        return out if extra is None else (*out, extra(params, batch))

    return step


def compile_step(*args: Any, schedule=None, data: int = 1, extra=None, **kwargs: Any):
    schedule = schedule or jp.Std1F1B(2)
    fn = jp.mpmd_jit_with_loop(step_fn(schedule, extra), mpmd_mesh=mesh(data), **kwargs)
    return fn.compile(*(args or model(schedule.num_stages)))


# ------------------------------------------------------------------ argument leaves


@pytest.mark.parametrize("leaf, message", [
    ("adam", r"argument args\[2\] is a str \('adam'\), not an array"),
    (object(), r"argument args\[2\] is an object of type object, not an array"),
    (np.array(["a", "b"]), r"argument args\[2\] is a numpy value of dtype <U1"),
    ({"lr": [0.1, print]}, r"argument args\[2\]\['lr'\]\[1\] is an object of type "
                           "builtin_function_or_method"),
], ids=["str", "object", "str_array", "nested_function"])
def test_non_array_argument(leaf, message):
    """A leaf that is not an array is rejected like jax.jit does, naming its path and how
    to pass such values (a closure)."""
    with pytest.raises(TypeError, match=message) as info:
        compile_step(*model(), leaf)
    assert "functools.partial" in str(info.value)


# ------------------------------------------------------------------ shardings


@pytest.mark.parametrize("spec, message", [
    (P(None, "data"), r"args\[1\]\[0\] has shape \(4, 6, 8\); its spec P\(None, 'data'\) "
                      r"splits dimension 1 \(size 6\) 4 ways .* make that dimension a "
                      "multiple of 4"),
    (P(None, "model"), r"args\[1\]\[0\]: spec P\(None, 'model'\) names \['model'\], not axes "
                       r"of the group mesh \{'data': 4\}"),
    (P(None, None, None, "data"), r"has shape \(4, 6, 8\), but its spec .* has 4 entries"),
], ids=["indivisible", "unknown_axis", "too_long"])
def test_input_spec_that_does_not_fit(spec, message):
    """in_shardings on the batch inputs that cannot lay them out on a 4-device group."""
    with pytest.raises(ValueError, match=message):
        compile_step(data=4, in_shardings=(None, (spec, None)))


def test_output_spec_that_does_not_divide():
    """out_shardings splitting the 6 rows of a returned batch over a 4-device group:
    rejected after tracing (before compiling), naming the result."""
    with pytest.raises(ValueError, match=r"result\[2\]\[0\] has shape \(4, 6, 8\); its spec "
                                         r"P\(None, 'data'\) splits dimension 1"):
        compile_step(data=4, extra=lambda p, b: b, out_shardings=(None, None, P(None, "data")))


# ------------------------------------------------------------------ results


def test_result_that_is_not_an_array():
    """A str result: JAX's TypeError, naming the result component."""
    with pytest.raises(TypeError, match=r"returned a value of type <class 'str'> at output "
                                        r"component \[2\], which is not a valid JAX type"):
        compile_step(extra=lambda p, b: "done")


# ------------------------------------------------------------------ microbatch counts


@pytest.mark.parametrize("schedule, n, reason", [
    (jp.ZeroBubble(2), 1, "needs at least num_stages=2 microbatches"),
    (jp.DualPipeV(4, 2), 3, "needs at least num_stages=4 microbatches"),
], ids=["ZeroBubble", "DualPipeV"])
def test_too_few_microbatches_for_the_schedule(schedule, n, reason):
    """Schedules whose warm-up needs more microbatches than given: CompileError naming
    the count and the schedule's reason."""
    with pytest.raises(jp.CompileError, match=f"the schedule rejects {n} microbatches") as e:
        compile_step(*model(schedule.num_stages, n), schedule=schedule)
    assert reason in str(e.value)
