"""JaxPP's call surface on one compiled step (the `mlp` of tests/models.py, 2 groups of 2
devices), against `jax.jit` of the same step: keyword and static arguments,
`donate_argnames`, `in_specs` naming the MPMD axis, `compiled.in_shardings` fed back,
`compiler_options` and `closed_jaxpr`."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from jax.sharding import PartitionSpec as P
from models import mlp

import jaxpp_mpi as jp

RTOL, ATOL = 1e-5, 1e-6
OPTIONS = {"xla_cpu_enable_fast_math": False}

PARAMS, BATCH, LOSS = mlp(2, 4)


def step(params, scale, *, batch, lr):
    """An SGD step: `scale` (positional) and `lr` (keyword) are static Python floats."""
    grad_fn = partial(jax.value_and_grad(LOSS, has_aux=True), params)
    (losses, _), grads = jp.treduce(grad_fn, batch, schedule=jp.Std1F1B(2))
    return jax.tree.map(lambda p, g: p - lr * scale * g, params, grads), losses


reference = jax.jit(step, static_argnums=1, static_argnames="lr")


def copies(tree):
    return jax.tree.map(jnp.copy, tree)


def assert_close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def mesh():
    return jp.MpmdMesh(jax.make_mesh((2, 2), ("stage", "data")), "stage")


@pytest.fixture(scope="module")
def fn(mesh):
    """JaxPP's spelling: mesh positional, `in_specs` with the MPMD axis inside an entry
    (`("data", "stage")`: the rows of every weight split over "data")."""
    return jp.mpmd_jit_with_loop(
        step,
        mesh,
        static_argnums=1,
        static_argnames="lr",
        donate_argnames="params",
        in_specs=(P(("data", "stage")),),
        compiler_options=OPTIONS,
    )


def test_keyword_and_static_arguments_match_jit(fn):
    """`step(params, 2.0, batch=..., lr=...)` as jax.jit runs it; the keyword order does
    not matter and the same static values hit the cache."""
    want = reference(PARAMS, 2.0, batch=BATCH, lr=0.1)
    assert_close(fn(copies(PARAMS), 2.0, batch=BATCH, lr=0.1), want)
    assert_close(fn(copies(PARAMS), 2.0, lr=0.1, batch=BATCH), want)
    assert len(fn._cache) == 1


def test_in_shardings_is_args_and_kwargs_and_feeds_back(fn, mesh):
    """`compiled.in_shardings` is `(args, kwargs)` like jax.jit's compiled
    `input_shardings`; the MPMD axis of `in_specs` is dropped (weights split over
    "data" only); placing the inputs with it and calling the compiled step (dynamic
    arguments only) gives jax.jit's result."""
    compiled = fn.compile(PARAMS, 2.0, batch=BATCH, lr=0.1)
    jitted = reference.lower(PARAMS, 2.0, batch=BATCH, lr=0.1).compile()
    assert jax.tree.structure(compiled.in_shardings) == jax.tree.structure(jitted.input_shardings)
    (param_sh,), kwargs_sh = compiled.in_shardings
    assert [s.spec for s in jax.tree.leaves(param_sh)] == [P("data")] * 4
    assert [s.mesh_ids for s in jax.tree.leaves(kwargs_sh["batch"])] == [(0,), (1,)]
    args, kwargs = jp.spmd_to_mpmd_reshard(
        mesh, copies(((PARAMS,), {"batch": BATCH})), compiled.in_shardings
    )
    assert_close(compiled(*args, **kwargs), reference(PARAMS, 2.0, batch=BATCH, lr=0.1))
    with pytest.raises(
        ValueError,
        match=r"compiled for 1 positional argument\(s\) and "
        r"keyword argument\(s\) \['batch'\].*dynamic "
        "arguments only",
    ):
        compiled(PARAMS, 2.0, batch=BATCH)


def test_donate_argnames(fn):
    """The params named in `donate_argnames` are consumed when they live where the step
    reads them (a previous step's results); using them again is a clear error."""
    params, _ = fn(copies(PARAMS), 2.0, batch=BATCH, lr=0.1)
    want = reference(reference(PARAMS, 2.0, batch=BATCH, lr=0.1)[0], 2.0, batch=BATCH, lr=0.1)
    assert_close(fn(params, 2.0, batch=BATCH, lr=0.1), want)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    with pytest.raises(
        ValueError,
        match=r"argument args\[0\]\[0\]\[0\] has been deleted "
        r"\(donated to an earlier step",
    ):
        fn(params, 2.0, batch=BATCH, lr=0.1)


def test_closed_jaxpr_is_the_traced_step(fn):
    """`.closed_jaxpr` takes the flat dynamic arguments (static ones are constants in
    it) and evaluates to jax.jit's result."""
    closed = fn.compile(PARAMS, 2.0, batch=BATCH, lr=0.1).closed_jaxpr
    leaves = jax.tree.leaves(((PARAMS,), {"batch": BATCH}))
    assert [a.shape for a in closed.in_avals] == [x.shape for x in leaves]
    got = jex_core.jaxpr_as_fun(closed)(*leaves)
    assert_close(got, jax.tree.leaves(reference(PARAMS, 2.0, batch=BATCH, lr=0.1)))


def test_compiler_options_reach_every_executable(mesh):
    """An option XLA does not know fails the compile naming it: the options are passed to
    the stage executables (the valid ones above compile and match jax.jit)."""
    bad = jp.mpmd_jit_with_loop(
        step,
        mesh,
        static_argnums=1,
        static_argnames="lr",
        compiler_options={"xla_no_such_option": 1},
    )
    with pytest.raises(Exception, match="xla_no_such_option"):
        bad.compile(PARAMS, 2.0, batch=BATCH, lr=0.1)
