"""Resharding and mpmd_init in local mode (one process, every group's devices here)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import assert_close_to_reference, bits, make_step, mlp, random_array, schedule

import jaxpp_mpi
from jaxpp_mpi import MpmdSharding
from jaxpp_mpi._src.reshard import reshard
from jaxpp_mpi._src.reshard.init import group_init_jaxprs

DTYPES = ["float32", "bfloat16", "int32"]
PROPERTY = settings(max_examples=15, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def mesh_of(groups: int, k: int) -> jaxpp_mpi.MpmdMesh:
    return jaxpp_mpi.make_mpmd_mesh((groups, k), ("stage", "data"), "stage")


def spmd_spec(ndim: int, dim, with_data: bool) -> P:
    """The MPMD axis on `dim` (with 'data' after it when `with_data`), else replicated."""
    axis = ("stage", "data") if with_data else "stage"
    return P(*[axis if i == dim else None for i in range(ndim)])


@st.composite
def leaf_case(draw, groups: int, k: int) -> dict:
    """One leaf: dtype, shape, source and target SPMD specs, owners, in-group spec."""
    ndim = draw(st.integers(0, 3))
    dim = st.sampled_from([None, *range(ndim)])
    src, dst, inner = draw(dim), draw(dim), draw(dim)
    src_data = k > 1 and src is not None and draw(st.booleans())
    dst_data = k > 1 and dst is not None and draw(st.booleans())
    shape = []
    for i in range(ndim):
        factor = groups if i in (src, dst) else 1
        if k > 1 and (i == inner or (i == src and src_data) or (i == dst and dst_data)):
            factor *= k
        shape.append(draw(st.integers(1, 2)) * factor)
    owners = draw(st.lists(st.integers(0, groups - 1), min_size=1,
                           max_size=min(3, groups), unique=True))
    return {
        "dtype": draw(st.sampled_from(DTYPES)), "shape": tuple(shape),
        "src": spmd_spec(ndim, src, src_data), "dst": spmd_spec(ndim, dst, dst_data),
        "owners": tuple(owners),
        "inner": P(*["data" if i == inner else None for i in range(ndim)]),
        "numpy_input": src is None and draw(st.booleans()),
    }


@st.composite
def cases(draw):
    groups, k = draw(st.sampled_from([(2, 1), (2, 2), (4, 2), (3, 1)]))
    leaves = draw(st.lists(leaf_case(groups, k), min_size=1, max_size=3))
    return groups, k, leaves, draw(st.integers(0, 2 ** 31))


@PROPERTY
@given(cases())
def test_round_trip_returns_the_same_bytes(case):
    groups, k, leaves, seed = case
    mesh = mesh_of(groups, k)
    values = [random_array(seed + i, c["shape"], c["dtype"]) for i, c in enumerate(leaves)]
    inputs = [v if c["numpy_input"] else jax.device_put(v, NamedSharding(mesh.jax_mesh, c["src"]))
              for v, c in zip(values, leaves)]
    targets = [MpmdSharding(mesh, c["owners"], c["inner"]) for c in leaves]
    tree = {"leaves": inputs}
    mpmd = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, tree, {"leaves": targets})["leaves"]
    for x, c in zip(inputs, leaves):
        assert c["numpy_input"] or x.is_deleted()
    for arr, v, t in zip(mpmd, values, targets):
        assert arr.mpmd_idxs == frozenset(t.mesh_ids) and arr.shape == v.shape
        for g, replica in arr.local_arrays.items():
            assert replica.sharding.is_equivalent_to(t.sharding_for(g), v.ndim)
            np.testing.assert_array_equal(bits(replica), bits(v))
    back = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, mpmd, [c["dst"] for c in leaves])
    for out, v, c, arr in zip(back, values, leaves, mpmd):
        assert arr.is_deleted()
        assert out.sharding.is_equivalent_to(NamedSharding(mesh.jax_mesh, c["dst"]), v.ndim)
        assert out.dtype == v.dtype
        np.testing.assert_array_equal(bits(out), bits(v))


def test_batches_bound_the_bytes_in_flight():
    """8 arrays of 1 KiB with a 2.5 KiB threshold: 4 batches of 2, at most threshold +
    the largest array created and held at once; one unbounded batch holds all 8 KiB."""
    mesh = mesh_of(4, 1)
    values = [random_array(i, (16, 16), "float32") for i in range(8)]
    targets = [MpmdSharding(mesh, i % 4, P()) for i in range(8)]
    inputs = [jnp.asarray(v) for v in values]
    threshold, largest = 2560, 1024
    out = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, inputs, targets, threshold=threshold)
    stats = reshard.last_stats
    assert stats.threshold == threshold and len(stats.batches) == 4
    assert 0 < stats.peak_in_flight_bytes <= threshold + largest
    assert all(x.is_deleted() for x in inputs)
    # Blocked over the 4 groups' devices, a whole array takes 1 KiB there too (laid out
    # with P(), it would take 4 KiB: one copy per device).
    back = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, out, [P("stage")] * 8, threshold=threshold)
    assert len(reshard.last_stats.batches) == 4
    assert reshard.last_stats.peak_in_flight_bytes <= threshold + largest
    for v, b in zip(values, back):
        np.testing.assert_array_equal(bits(b), bits(v))
    jaxpp_mpi.spmd_to_mpmd_reshard(mesh, back, targets, threshold=1 << 40)
    assert reshard.last_stats.peak_in_flight_bytes == 8 * 1024
    assert len(reshard.last_stats.batches) == 1


def test_default_threshold_is_positive_and_used():
    mesh = mesh_of(2, 1)
    jaxpp_mpi.spmd_to_mpmd_reshard(mesh, [jnp.ones(4)], [MpmdSharding(mesh, 1, P())])
    assert reshard.last_stats.threshold > 0


def test_none_sharding_passes_the_leaf_through():
    mesh = mesh_of(2, 1)
    x, y = jnp.ones(3), jnp.zeros(2)
    out = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, (x, y), (None, MpmdSharding(mesh, 0, P())))
    assert out[0] is x and not x.is_deleted() and y.is_deleted()


def _bad_calls(mesh):
    sh = MpmdSharding(mesh, 0, P())
    mpmd = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, [jnp.ones(4)], [sh])
    deleted = jnp.ones(2)
    deleted.delete()
    to_mpmd, to_spmd = jaxpp_mpi.spmd_to_mpmd_reshard, jaxpp_mpi.mpmd_to_spmd_reshard
    return [
        (lambda: to_mpmd(mesh, {"a": jnp.ones(2)}, {"b": sh}), "differ in structure"),
        (lambda: to_mpmd(mesh, [jnp.ones(2), 3.0], [sh, sh]), "expected a jax.Array"),
        (lambda: to_mpmd(mesh, [deleted], [sh]), "has been deleted"),
        (lambda: to_mpmd(mesh, [mpmd[0]], [sh]), "already an MpmdArray"),
        (lambda: to_mpmd(mesh, [jnp.ones(3)], [P()]), "expected an MpmdSharding"),
        (lambda: to_mpmd(mesh, [jnp.ones((2, 2))], [MpmdSharding(mesh, 0, P(None, None, None))]),
         "cannot lay out"),
        (lambda: to_mpmd(mesh, [jnp.ones(2)], [sh], threshold=0), "threshold"),
        (lambda: to_spmd(mesh, [mpmd[0]], [P("nope")]), "nope"),
        (lambda: to_spmd(mesh, [jnp.ones(4)], [P()]), "expected an MpmdArray"),
        (lambda: to_spmd(mesh, mpmd, [P(), P()]), "differ in structure"),
    ]


@pytest.mark.parametrize("k", [1, 2])
def test_bad_input_raises_before_anything_moves(k):
    mesh = mesh_of(2, k)
    calls = _bad_calls(mesh)
    if k > 1:  # 3 rows do not split over 2 devices
        calls.append((lambda: jaxpp_mpi.spmd_to_mpmd_reshard(
            mesh, [jnp.ones(3)], [MpmdSharding(mesh, 0, P("data"))]), "cannot lay out"))
    for call, match in calls:
        with pytest.raises(ValueError, match=match):
            call()


def test_compiled_in_shardings_feed_the_reshard():
    """The JaxPP flow: init in SPMD, reshard to compile(...).in_shardings, train one step,
    reshard the new params back; all equal to jax.jit."""
    mesh = mesh_of(2, 1)
    sched = schedule("1f1b", 2)
    params, batch, loss_fn = mlp(sched.num_stages, 4)
    step, opt = make_step(loss_fn, sched)
    opt_state = opt.init(params)
    reference = jax.jit(step)(opt_state, params, batch)
    compiled = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(opt_state, params,
                                                                          batch)
    (state_sh, params_sh, _), _ = compiled.in_shardings
    copies = jax.tree.map(jnp.copy, (opt_state, params))
    mpmd_state, mpmd_params = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, copies,
                                                             (state_sh, params_sh))
    for arr, sh in zip(jax.tree.leaves(mpmd_params), jax.tree.leaves(params_sh)):
        assert arr.mpmd_idxs == frozenset(sh.mesh_ids)
    out = compiled(mpmd_state, mpmd_params, batch)
    assert_close_to_reference(reference, out)
    new_params = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, out[1], jax.tree.map(lambda _: P(), out[1]))
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(new_params))
    assert_close_to_reference(reference[1], new_params)


def _init(key, scale):
    ks = jax.random.split(key, 4)
    return {
        "w": [jax.random.normal(ks[i], (8, 4)) * scale for i in range(2)],
        "big": jax.random.uniform(ks[2], (96, 80)),
        "bits": jax.random.bits(ks[3], (6,)),
        "skip": jnp.ones(3),
    }


def test_mpmd_init_computes_only_owned_values_and_matches_the_full_init():
    mesh = mesh_of(2, 2)
    shardings = {
        "w": [MpmdSharding(mesh, 0, P("data")), MpmdSharding(mesh, (0, 1), P(None, "data"))],
        "big": MpmdSharding(mesh, 1, P()),
        "bits": MpmdSharding(mesh, 1, P("data")),
        "skip": None,
    }
    key = jax.random.PRNGKey(7)
    out = jaxpp_mpi.mpmd_init(_init, shardings, key, 2.0)
    assert out["skip"] is None
    names = [("w", 0), ("w", 1), ("big",), ("bits",)]
    pick = lambda tree, name: tree[name[0]] if len(name) == 1 else tree[name[0]][name[1]]
    # The whole init_fn, laid out as group 0 holds its results: bit-identical.
    group_sh = {"w": [NamedSharding(mesh.group_mesh(0), P("data")),
                      NamedSharding(mesh.group_mesh(0), P(None, "data"))],
                "big": NamedSharding(mesh.group_mesh(0), P()),
                "bits": NamedSharding(mesh.group_mesh(0), P()),
                "skip": NamedSharding(mesh.group_mesh(0), P())}
    full = jax.jit(_init, out_shardings=group_sh)(key, 2.0)
    for name in names[:2]:
        np.testing.assert_array_equal(bits(pick(out, name).local_arrays[0]),
                                      bits(pick(full, name)))
    # Group 1's: the random bits exactly, floats up to rounding (XLA vectorises the
    # computation of a sharded result differently, which may move the last bit).
    np.testing.assert_array_equal(np.asarray(out["bits"]), np.asarray(full["bits"]))
    for name in names:
        np.testing.assert_allclose(np.asarray(pick(out, name)), np.asarray(pick(full, name)),
                                   rtol=1e-6)
    jaxprs = group_init_jaxprs(_init, shardings, key, 2.0)
    assert sorted(jaxprs) == [0, 1]
    for g, (jaxpr, outputs, _) in jaxprs.items():
        shapes = {tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.outvars}
        assert ((96, 80) in shapes) == (g == 1)  # only group 1 draws the big array
        assert len(outputs) == (2 if g == 0 else 3)


def test_mpmd_init_rejects_a_mismatched_tree():
    mesh = mesh_of(2, 1)
    with pytest.raises(ValueError, match="differ in structure"):
        jaxpp_mpi.mpmd_init(lambda k: (k, k), (MpmdSharding(mesh, 0, P()),),
                            jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="MpmdSharding or None"):
        jaxpp_mpi.mpmd_init(lambda k: k, P(), jax.random.PRNGKey(0))


def test_optax_state_round_trips():
    """Nested optimizer state (scalars included) survives spmd -> mpmd -> spmd."""
    mesh = mesh_of(2, 1)
    params = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(4)}
    state = optax.adam(1e-3).init(params)
    want = [np.asarray(x) for x in jax.tree.leaves(state)]
    shardings = jax.tree.map(lambda _: MpmdSharding(mesh, (0, 1), P()), state)
    mpmd = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, state, shardings)
    back = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, mpmd, jax.tree.map(lambda _: None, state))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for got, w in zip(jax.tree.leaves(back), want):
        np.testing.assert_array_equal(np.asarray(got), w)
