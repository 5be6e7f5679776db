"""`jaxpp_mpi.process_allgather` (Note: reading values), with ranks that are threads of
this process, against the values each rank placed; implicit reads never send a message
(Note: implicit reads are local); and JaxPP's cross-group names against the plain JAX
operations they compute."""

from __future__ import annotations

import collections
import operator

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
def bytes_between_threads(monkeypatch):
    """The bytes exchanged over the thread ranks' allgather, counted per call (the MPI
    layer's own Allgatherv is checked under mpirun by tests/mpi/test_read_results_mpi.py)."""
    calls = []

    def allgather_bytes(data, sizes, comm):
        got = comm.allgather(data)
        assert [len(b) for b in got] == sizes
        if comm.Get_rank() == 0:
            calls.append(sizes)
        return [np.frombuffer(b, np.uint8) for b in got]

    monkeypatch.setattr(fetch, "_allgather_bytes", allgather_bytes)
    return calls


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


def _counting(comm):
    """Counts the object allgathers `comm` makes."""
    counts = [0]
    gather = comm.allgather

    def counted(obj):
        counts[0] += 1
        return gather(obj)

    comm.allgather = counted
    return counts


def test_a_whole_tree_in_one_metadata_and_one_byte_exchange(bytes_between_threads):
    def rank(r, comm):
        mesh = _mesh(r, comm)
        tree = {"x": _held_on(mesh, 2), "scalar": _held_on(mesh, (1, 2), np.float32(1.5), P()),
                "count": _held_on(mesh, 0, np.int32(7), P()),
                "everywhere": _held_on(mesh, (0, 1, 2), VALUE + 1),
                "small": [_held_on(mesh, 1, np.full(3, k, np.int8), P()) for k in range(3)]}
        counts = _counting(comm)
        got = jaxpp_mpi.process_allgather(tree)
        return got, counts[0]

    for got, gathers in _results(on_thread_ranks(3, rank)):
        assert gathers == 2  # the metadata's, then the bytes' (counted below)
        np.testing.assert_array_equal(got["x"], VALUE)
        np.testing.assert_array_equal(got["everywhere"], VALUE + 1)
        assert got["scalar"] == np.float32(1.5) and got["scalar"].dtype == np.float32
        assert got["count"] == 7 and got["count"].dtype == np.int32
        for k, small in enumerate(got["small"]):
            np.testing.assert_array_equal(small, np.full(3, k, np.int8))
        assert all(isinstance(v, np.ndarray) for v in jax.tree.leaves(got))
    # one byte exchange: group 0 sends the count, group 1 the scalar and the small ones,
    # group 2 x; the array every group holds is not sent
    assert bytes_between_threads == [[4, 4 + 3 * 3, VALUE.nbytes]]


def test_bfloat16_bits_survive():
    value = jnp.asarray(np.linspace(-3, 3, 7), jnp.bfloat16)

    def rank(r, comm):
        return jaxpp_mpi.process_allgather(_held_on(_mesh(r, comm), 1, value, P()))

    for got in _results(on_thread_ranks(2, rank)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(got.view(np.uint16), np.asarray(value).view(np.uint16))


def test_held_everywhere_sends_no_bytes(bytes_between_threads):
    def rank(r, comm):
        x = _held_on(_mesh(r, comm), (0, 1))
        return jaxpp_mpi.process_allgather([x, x])

    for got in _results(on_thread_ranks(2, rank)):
        np.testing.assert_array_equal(np.stack(got), np.stack([VALUE, VALUE]))
    assert bytes_between_threads == []


def test_ranks_passing_different_trees_raise_alike():
    def rank(r, comm):
        mesh = _mesh(r, comm)
        x = _held_on(mesh, 0) if r == 0 else _held_on(mesh, 0, VALUE[:2])
        return jaxpp_mpi.process_allgather({"x": x})

    outcomes = on_thread_ranks(2, rank)
    messages = {str(e) for _, e in outcomes}
    assert all(isinstance(e, ValueError) for _, e in outcomes) and len(messages) == 1
    assert "the ranks passed different trees: rank 0 has 1 leaves, rank 1 1; at leaf 0 " \
           "rank 0 has ((4, 3)" in messages.pop()


def test_a_deleted_replica_on_the_holder_raises_on_every_rank():
    def rank(r, comm):
        x = _held_on(_mesh(r, comm), 1)
        x.delete()
        return jaxpp_mpi.process_allgather(x)

    outcomes = on_thread_ranks(2, rank)
    assert all(isinstance(e, RuntimeError) for _, e in outcomes), outcomes
    assert all(str(e).startswith("rank 1: jaxpp_mpi.process_allgather: leaf 0, MpmdArray(")
               and "was deleted (donated" in str(e) for _, e in outcomes)


def test_values_without_numpy_form_raise_on_every_rank():
    def rank(r, comm):
        mesh = _mesh(r, comm)
        unused = MpmdArray([], MpmdSharding(mesh, (), P()), shape=(2,), dtype=np.float32)
        with pytest.raises(TypeError, match="no group holds the value"):
            jaxpp_mpi.process_allgather(unused)
        key = jax.random.key(0)
        sharding = MpmdSharding(mesh, 0, P())
        held = [jax.device_put(key, sharding.sharding_for(0))] if r == 0 else []
        keys = MpmdArray._trusted(held, sharding, key.shape, key.dtype)
        with pytest.raises(TypeError, match="PRNG keys has no numpy value"):
            jaxpp_mpi.process_allgather([_held_on(mesh, 1), keys])
        return True

    assert all(_results(on_thread_ranks(2, rank)))


def test_other_leaves_are_refused_before_any_message():
    def rank(r, comm):
        mesh = _mesh(r, comm)
        comm.allgather = None  # any collective would fail here
        with pytest.raises(TypeError, match=r"leaf 1 is a ndarray, which each process "):
            jaxpp_mpi.process_allgather([_held_on(mesh, 0), VALUE])
        assert jaxpp_mpi.process_allgather({}) == {}
        return True

    assert all(_results(on_thread_ranks(2, rank)))


def test_implicit_reads_never_send_a_message():
    """Held here: the value, no message; held elsewhere: an immediate RuntimeError
    naming shape, dtype, holders and both ways to read it; format and str: the repr."""

    def rank(r, comm):
        mesh = _mesh(r, comm)
        comm.allgather = None  # any collective would fail here
        mine = _held_on(mesh, r, VALUE + r)
        np.testing.assert_array_equal(np.asarray(mine), VALUE + r)
        np.testing.assert_array_equal(np.stack(list(mine)), VALUE + r)
        count = _held_on(mesh, r, np.int32(7 + r), P())
        assert (int(count), float(count), bool(count), operator.index(count)) == (
            7 + r, 7.0 + r, True, 7 + r)
        assert f"{count}" == str(count) == str(7 + r)
        other = _held_on(mesh, 1 - r, np.int32(3), P())
        rows = _held_on(mesh, 1 - r)
        reads = [np.asarray, float, int, bool, complex, operator.index, lambda _: list(rows)]
        for read in reads:
            with pytest.raises(RuntimeError) as info:
                read(other)
            text = str(info.value)
            shape = "(4, 3) and dtype float32" if read is reads[-1] else "() and dtype int32"
            assert f"shape {shape} held by groups ({1 - r},)" in text
            assert "x.to_mpmd_local_array" in text and "jaxpp_mpi.process_allgather(x)" in text
        assert f"{other}" == str(other) == repr(other) and len(_held_on(mesh, 1 - r)) == 4
        return True

    assert all(_results(on_thread_ranks(2, rank)))


def test_both_exchanges_wait_under_a_deadline_named_for_the_read(monkeypatch):
    """The metadata allgather and the bytes' exchange each wait under the deadline of
    `Note: deadlines`, labelled so that a rank left waiting names the read."""
    import contextlib

    from jaxpp_mpi._src.runtime import agree

    labels = []

    @contextlib.contextmanager
    def recording(label, comm=None, **_):
        labels.append(label)
        yield

    monkeypatch.setattr(agree, "deadline", recording)
    monkeypatch.setattr(fetch, "deadline", recording)

    def rank(r, comm):
        return jaxpp_mpi.process_allgather([_held_on(_mesh(r, comm), 0)])

    _results(on_thread_ranks(2, rank))
    assert len(labels) == 4 and len(set(labels)) == 1, labels
    assert labels[0].startswith("jaxpp_mpi.process_allgather of 1 array(s) (collective: "
                                "every rank of the pipeline calls it")


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
