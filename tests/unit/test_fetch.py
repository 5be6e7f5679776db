"""Reading an MpmdArray's value on every rank (Note: reading values), with ranks that are
threads of this process, against the value each rank placed; and JaxPP's cross-group
names against the plain JAX operations they compute."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from thread_comm import on_thread_ranks

import jaxpp_mpi
from jaxpp_mpi._src.arrays.array import MpmdArray, mpmd_array_from_local
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding
from jaxpp_mpi._src.driver import fetch

VALUE = np.arange(12, dtype=np.float32).reshape(4, 3)


@pytest.fixture(autouse=True)
def broadcast_between_threads(monkeypatch):
    """The bytes broadcast over the thread ranks' allgather (the MPI layer's own is
    checked under mpirun by tests/mpi/test_jaxpp_programs_mpi.py)."""
    monkeypatch.setattr(fetch, "_broadcast_bytes",
                        lambda data, comm, root: comm.allgather(data)[root])


def _mesh(rank: int, comm) -> MpmdMesh:
    """Rank `rank`'s group mesh: 2 of this process's devices, MPMD axis of size 1."""
    devices = np.array(jax.devices()[2 * rank:2 * rank + 2]).reshape(1, 2)
    return MpmdMesh(Mesh(devices, ("stage", "data")), "stage", comm=comm)


def _held_on(mesh: MpmdMesh, groups, value=VALUE, spec=None) -> MpmdArray:
    spec = P("data") if spec is None else spec
    return mpmd_array_from_local(mesh, value, MpmdSharding(mesh, groups, spec))


def _results(outcomes):
    errors = [e for _, e in outcomes if e is not None]
    assert not errors, errors
    return [r for r, _ in outcomes]


def test_every_rank_reads_the_holders_value():
    def rank(r, comm):
        mesh = _mesh(r, comm)
        x = _held_on(mesh, 2)
        scalar = _held_on(mesh, (1, 2), np.float32(1.5), P())
        count = _held_on(mesh, 0, np.int32(7), P())
        return (np.asarray(x), [np.asarray(row) for row in x], float(scalar), int(count),
                bool(count), operator_index(count), np.asarray(x, dtype=np.int32).dtype)

    for got in _results(on_thread_ranks(3, rank)):
        np.testing.assert_array_equal(got[0], VALUE)
        np.testing.assert_array_equal(np.stack(got[1]), VALUE)
        assert got[2:6] == (1.5, 7, True, 7) and got[6] == np.int32


def operator_index(x):
    import operator

    return operator.index(x)


def test_bfloat16_bits_survive():
    value = jnp.asarray(np.linspace(-3, 3, 7), jnp.bfloat16)

    def rank(r, comm):
        return np.asarray(_held_on(_mesh(r, comm), 1, value, P()))

    for got in _results(on_thread_ranks(2, rank)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got.view(np.uint16), np.asarray(value).view(np.uint16))


def test_held_everywhere_reads_without_a_message():
    def rank(r, comm):
        x = _held_on(_mesh(r, comm), (0, 1))
        comm.allgather = None  # any collective would fail here
        return np.asarray(x)

    for got in _results(on_thread_ranks(2, rank)):
        np.testing.assert_array_equal(got, VALUE)


def test_each_rank_reading_its_own_array_sends_no_value(monkeypatch):
    """Rank r reads the array of group r, on every rank at once (what a test of each
    group's result does): one allgather, no broadcast, each its own replica."""
    monkeypatch.setattr(fetch, "_broadcast_bytes", None)  # any broadcast would fail

    def rank(r, comm):
        mesh = _mesh(r, comm)
        layers = [_held_on(mesh, g, VALUE + g) for g in range(3)]
        return np.asarray(layers[r])

    for r, got in enumerate(_results(on_thread_ranks(3, rank))):
        np.testing.assert_array_equal(got, VALUE + r)


def test_ranks_reading_different_arrays_raise_alike():
    def rank(r, comm):
        mesh = _mesh(r, comm)
        x = _held_on(mesh, 0) if r == 0 else _held_on(mesh, 0, VALUE[:2])
        return np.asarray(x)

    outcomes = on_thread_ranks(2, rank)
    messages = {str(e) for _, e in outcomes}
    assert all(isinstance(e, ValueError) for _, e in outcomes) and len(messages) == 1
    assert "the ranks read different arrays: rank 0 reads ((4, 3)" in messages.pop()


def test_a_deleted_replica_on_the_holder_raises_on_every_rank():
    def rank(r, comm):
        x = _held_on(_mesh(r, comm), 1)
        x.delete()
        return np.asarray(x)

    outcomes = on_thread_ranks(2, rank)
    assert all(isinstance(e, RuntimeError) for _, e in outcomes), outcomes
    assert all("rank 1, which holds it, cannot read its replica" in str(e)
               for _, e in outcomes)


def test_metadata_errors_need_no_message():
    def rank(r, comm):
        mesh = _mesh(r, comm)
        comm.allgather = None
        unused = MpmdArray([], MpmdSharding(mesh, (), P()), shape=(2,), dtype=np.float32)
        with pytest.raises(TypeError, match="no group holds the value"):
            np.asarray(unused)
        key = jax.random.key(0)
        sharding = MpmdSharding(mesh, 0, P())
        held = [jax.device_put(key, sharding.sharding_for(0))] if r == 0 else []
        keys = MpmdArray._trusted(held, sharding, key.shape, key.dtype)
        with pytest.raises(TypeError, match="PRNG keys has no numpy value"):
            np.asarray(keys)
        assert f"{_held_on(mesh, 1 - r, VALUE, P())}".startswith("MpmdArray(")  # repr
        return True

    assert all(_results(on_thread_ranks(2, rank)))


# -- JaxPP's private views ---------------------------------------------------------------


def test_private_views_in_local_mode():
    mesh = jaxpp_mpi.make_mpmd_mesh((4, 2), ("stage", "data"), "stage")
    x = _held_on(mesh, (3, 1))
    held = x._partially_addressable_arrays
    assert isinstance(held, collections.OrderedDict) and list(held) == [1, 3]
    assert [a.sharding for a in held.values()] == [x.mpmd_sharding.sharding_for(1),
                                                    x.mpmd_sharding.sharding_for(3)]
    assert x._mpmd_local_sharding.mesh == mesh.lowering_mesh() == mesh.unstack[0]
    assert x._mpmd_local_sharding.spec == P("data")


# -- cross_mpmd_stack, place_with --------------------------------------------------------


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cross_mpmd_stack_is_jnp_stack(axis):
    parts = [jnp.full((2, 3), i, jnp.float32) for i in range(3)]
    np.testing.assert_array_equal(jaxpp_mpi.cross_mpmd_stack(parts, axis=axis),
                                  jnp.stack(parts, axis=axis))
    jitted = jax.jit(lambda *p: jaxpp_mpi.cross_mpmd_stack(p, axis))(*parts)
    np.testing.assert_array_equal(jitted, jnp.stack(parts, axis=axis))


@pytest.mark.parametrize("parts,error,message", [
    ([], TypeError, "at least one value"),
    ([jnp.zeros(2), jnp.zeros(2, jnp.int32)], TypeError, "same dtype"),
    ([jnp.zeros(2), jnp.zeros(3)], ValueError, "same shape"),
])
def test_cross_mpmd_stack_errors(parts, error, message):
    with pytest.raises(error, match=message):
        jaxpp_mpi.cross_mpmd_stack(parts)
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        jaxpp_mpi.cross_mpmd_stack([jnp.zeros(2)], axis=3)


def test_place_with_is_the_value():
    x, y = jnp.arange(3.0), jnp.ones(5)
    assert jaxpp_mpi.place_with(x, y) is x
    np.testing.assert_array_equal(jax.jit(jaxpp_mpi.place_with)(x, y), x)
    assert jaxpp_mpi.api.place_with is jaxpp_mpi.place_with
    assert jaxpp_mpi.api.cross_mpmd_stack is jaxpp_mpi.cross_mpmd_stack
