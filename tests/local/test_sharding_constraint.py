"""`with_sharding_constraint` inside a pipelined step, in local mode, Auto and Explicit axes.

The mesh is 2 groups x 2 devices, axes ("stage", "data"). The step constrains every
stage's activation to be split over "data", either with a `NamedSharding` on the user's
whole mesh or with a bare `PartitionSpec`, with or without `jax.set_mesh(mesh)` around
compile and call. The reference is the same step under plain `jax.jit` on one group's
mesh, the constraint on that mesh.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from models import (
    assert_close_to_reference,
    constrained_mlp_loss,
    data_constraint,
    make_step,
    mlp,
    run_steps,
    schedule,
)

import jaxpp_mpi as jp
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.retarget import group_mesh, retarget_jaxpr, trace_mesh

ROWS, WIDTH = 4, 16  # per microbatch; "data" splits the rows in two
AXES = ("stage", "data")
AUTO = (AxisType.Auto, AxisType.Auto)


def _mesh(axis_types: str) -> Mesh:
    """The user's mesh: `jax.make_mesh`'s default (Explicit) axes, or Auto axes."""
    devices = jax.devices()[:4]
    if axis_types == "explicit":
        mesh = jax.make_mesh((2, 2), AXES, devices=devices)
        assert set(mesh.axis_types) == {AxisType.Explicit}
        return mesh
    return jax.make_mesh((2, 2), AXES, axis_types=AUTO, devices=devices)


def _reference(sched, opt_state, params, batch, mesh: Mesh):
    """Three steps under jax.jit on group 0's devices, the constraint on that group."""
    group0 = Mesh(mesh.devices[0], ("data",), axis_types=(AxisType.Auto,))
    step, _ = make_step(constrained_mlp_loss(data_constraint("named", group0)), sched)
    return run_steps(jax.jit(step), opt_state, params, batch)


def _dot_rows(hlo: str) -> set[int]:
    """The leading dimension of every f32[rows, WIDTH] dot in an optimized HLO text."""
    return {int(m) for m in re.findall(rf"= f32\[(\d+),{WIDTH}\]\S* dot\(", hlo)}


# A NamedSharding naming an Explicit axis is rejected by JAX itself (see
# test_explicit_named_sharding_says_what_to_do).
# "user_mesh": compiled and called under `jax.set_mesh(mesh)`, as a bare PartitionSpec
# under plain jax.jit needs; without it, the step is traced under the MPMD mesh anyway.
@pytest.mark.parametrize(("axis_types", "kind", "context"), [
    ("auto", "named", None), ("auto", "bare", None), ("explicit", "bare", None),
    ("auto", "named", "user_mesh"), ("explicit", "bare", "user_mesh"),
])
def test_constraint_is_honoured(axis_types, kind, context):
    mesh = _mesh(axis_types)
    sched = schedule("1f1b", 2)
    params, batch, _ = mlp(sched.num_stages, 4, width=WIDTH, rows=ROWS)
    step, optimizer = make_step(constrained_mlp_loss(data_constraint(kind, mesh)), sched)
    opt_state = optimizer.init(params)
    pipelined = jp.mpmd_jit_with_loop(step, mpmd_mesh=jp.MpmdMesh(mesh, "stage"))
    if context == "user_mesh":
        with jax.set_mesh(mesh):
            compiled = pipelined.compile(opt_state, params, batch)
            outs = run_steps(compiled, opt_state, params, batch)
    else:
        compiled = pipelined.compile(opt_state, params, batch)
        outs = run_steps(compiled, opt_state, params, batch)
    reference = _reference(sched, opt_state, params, batch, mesh)
    assert assert_close_to_reference(reference, outs) == len(jax.tree.leaves(reference))
    for g, forward in enumerate(("F0", "FB1")):  # group 1 runs its F and B as one
        # The constraint splits each forward matmul over "data": each device computes
        # half the rows (group 0's inputs are all replicated, so only it can do that).
        # FB1's backward also holds the weight gradient's f32[WIDTH, WIDTH] dot.
        rows = _dot_rows(compiled.as_text(g, forward)) - ({WIDTH} if g else set())
        assert rows == {ROWS // 2}, g


def test_explicit_named_sharding_says_what_to_do():
    mesh = _mesh("explicit")
    sched = schedule("1f1b", 2)
    params, batch, _ = mlp(sched.num_stages, 4, width=WIDTH, rows=ROWS)
    step, optimizer = make_step(constrained_mlp_loss(data_constraint("named", mesh)), sched)
    pipelined = jp.mpmd_jit_with_loop(step, mpmd_mesh=jp.MpmdMesh(mesh, "stage"))
    with pytest.raises(CompileError, match=r"Explicit mesh axis.*bare PartitionSpec"):
        pipelined.compile(optimizer.init(params), params, batch)


def _constraints(jaxpr: jex_core.Jaxpr) -> list[NamedSharding]:
    """The sharding of every sharding_constraint in `jaxpr` and its sub-jaxprs."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "sharding_constraint":
            out.append(e.params["sharding"])
        for sub in jex_core.jaxprs_in_params(e.params):
            out += _constraints(getattr(sub, "jaxpr", sub))
    return out


def test_retarget_reaches_every_sub_jaxpr():
    """Constraints inside jit, scan, cond, while, custom_jvp and remat all land on the
    group's mesh, the MPMD axis dropped; the rewritten step runs on group 1's devices
    and computes what the step computes."""
    mesh = _mesh("auto")
    on = lambda spec: lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    @jax.custom_jvp
    def smooth(x):
        return on(P("data"))(jnp.tanh(x))

    smooth.defjvp(lambda p, t: (smooth(p[0]), t[0] * (1 - jnp.tanh(p[0]) ** 2)))

    def fn(x):
        x = jax.jit(on(P(("stage", "data"))))(x)
        x, _ = jax.lax.scan(lambda c, _: (on(P(None, "data"))(c * 2.0), None), x, None, 2)
        x = jax.lax.cond(x[0, 0] > 0, on(P("data")), lambda v: on(P("data"))(-v), x)
        x = jax.lax.while_loop(lambda v: v[0, 0] < 100.0, lambda v: on(P("data"))(v + 50.0), x)
        x = jax.checkpoint(lambda v: on(P("data", None))(smooth(v)))(x)
        return jax.lax.with_sharding_constraint(x, P("data"))

    x = jnp.arange(4 * WIDTH, dtype=jnp.float32).reshape(4, WIDTH) / 100
    with jax.sharding.use_abstract_mesh(trace_mesh(mesh)):
        closed = jax.make_jaxpr(fn)(x)
    assert len(_constraints(closed.jaxpr)) >= 7
    rewritten = retarget_jaxpr(closed.jaxpr, mesh, "stage")
    group = group_mesh(mesh, "stage")
    specs = []
    for sharding in _constraints(rewritten):
        assert sharding.mesh == group
        specs.append(tuple(sharding.spec))
    # ("stage", "data") keeps ("data",), and P(("data",)) == P("data")
    assert {P(*spec) for spec in specs} == {P(None, "data"), P("data"), P("data", None)}
    group1 = Mesh(mesh.devices[1], ("data",), axis_types=(AxisType.Auto,))
    run = jex_core.jaxpr_as_fun(jex_core.ClosedJaxpr(rewritten, closed.consts))
    replicated = NamedSharding(group1, P())
    got = jax.jit(lambda v: run(v)[0], in_shardings=replicated)(x)
    assert set(got.sharding.device_set) == set(group1.devices.flat)
    with jax.set_mesh(mesh):  # the reference: fn as written, on the whole mesh
        want = jax.jit(fn)(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_retarget_leaves_a_step_without_shardings_alone():
    mesh = _mesh("auto")
    with jax.sharding.use_abstract_mesh(trace_mesh(mesh)):
        closed = jax.make_jaxpr(lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, 3))(
            jnp.ones(4))
    assert retarget_jaxpr(closed.jaxpr, mesh, "stage") is closed.jaxpr


@pytest.mark.parametrize(("other", "message"), [
    (("model", 2), "names axis 'model', which the mesh lacks"),
    (("data", 4), "has axis 'data' of size 4, but the mesh's 'data' has size 2"),
])
def test_retarget_rejects_a_sharding_no_group_can_apply(other, message):
    name, size = other
    foreign = jax.make_mesh((size,), (name,), axis_types=(AxisType.Auto,),
                            devices=jax.devices()[:size])
    fn = lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(foreign, P(name)))
    closed = jax.make_jaxpr(fn)(jnp.ones((8, 2)))
    with pytest.raises(CompileError, match=message):
        retarget_jaxpr(closed.jaxpr, _mesh("auto"), "stage")


# Constraints jax.jit accepts although they cannot split evenly, or name the MPMD axis:
# XLA pads the last shard (3 rows over "data" of 2, or over "stage" of 2), and the MPMD
# axis spreads the value across the groups' devices under jax.jit, while here each group
# holds it whole along that dimension. Either way the step computes what jax.jit computes
# on the user's whole mesh (`Note: sharding constraints`).
@pytest.mark.parametrize("spec", [P("data"), P(None, "data"), P("stage"), P(("stage", "data"))],
                         ids=["uneven-data", "uneven-data-width", "mpmd-axis", "both"])
def test_uneven_and_mpmd_axis_constraints_match_jit(spec):
    mesh = _mesh("auto")
    sched = schedule("1f1b", 2)
    params, batch, _ = mlp(sched.num_stages, 4, width=5, rows=3)
    constrain = lambda x: jax.lax.with_sharding_constraint(x, spec)
    step, optimizer = make_step(constrained_mlp_loss(constrain), sched)
    opt_state = optimizer.init(params)
    with jax.set_mesh(mesh):
        reference = run_steps(jax.jit(step), opt_state, params, batch)
    pipelined = jp.mpmd_jit_with_loop(step, mpmd_mesh=jp.MpmdMesh(mesh, "stage"))
    compiled = pipelined.compile(opt_state, params, batch)
    outs = run_steps(compiled, opt_state, params, batch)
    assert assert_close_to_reference(reference, outs) == len(jax.tree.leaves(reference))
    if spec == P("data"):  # as under jax.jit: each device computes 2 of the 3 rows, padded
        dots = re.findall(r"= f32\[(\d+),5\]\S* dot\(", compiled.as_text(0, "F0"))
        assert {int(rows) for rows in dots} == {2}
