"""MpmdSharding and MpmdArray in one process: local mode, and MPI mode with a fake comm."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpp_mpi import make_mpmd_mesh
from jaxpp_mpi._src.arrays.array import MpmdArray, mpmd_array_from_local
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding


class FakeComm:
    """Stands in for an MPI communicator: MpmdMesh only asks for rank and size."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size


@pytest.fixture
def mesh42() -> MpmdMesh:
    return make_mpmd_mesh((4, 2), ("stage", "data"), "stage")


@pytest.fixture
def mesh222() -> MpmdMesh:
    return make_mpmd_mesh((2, 2, 2), ("stage", "data", "model"), "stage")


def _submesh(mesh: MpmdMesh, ids: tuple[int, ...]) -> Mesh:
    """The whole mesh's slice at groups `ids` (MPMD axis first), built here directly."""
    jm = mesh.jax_mesh
    return Mesh(np.take(jm.devices, list(ids), axis=0), jm.axis_names)


def _value(shape=(8, 6), dtype=np.float32) -> np.ndarray:
    return np.arange(np.prod(shape), dtype=dtype).reshape(shape)


# -- MpmdSharding ---------------------------------------------------------------------


def test_sharding_normalises_ids(mesh42):
    s = MpmdSharding(mesh42, frozenset({3, 0}), P("data"))
    assert s.mesh_ids == (0, 3)
    assert MpmdSharding(mesh42, 2, P()).mesh_ids == (2,)
    assert MpmdSharding(mesh42, [3, 0, 3], P("data")) == s
    assert hash(MpmdSharding(mesh42, (0, 3), P("data"))) == hash(s)
    assert MpmdSharding(mesh42, (0,), None).spec == P()
    assert repr(s) == "MpmdSharding(groups=(0, 3), spec=P('data'))"
    assert repr(MpmdSharding(mesh42, 1, P(None, "data"))) == (
        "MpmdSharding(groups=(1,), spec=P(None, 'data'))")
    with pytest.raises(AttributeError):
        s.spec = P()


@pytest.mark.parametrize("ids,spec,error,message", [
    ((0, 4), P(), ValueError, r"mesh_ids \(0, 4\) out of range: the mesh has 4 groups"),
    ((-1,), P(), ValueError, "out of range"),
    ((0,), P("model"), ValueError, r"names axes \['model'\] that the group mesh lacks"),
    ((0,), P("data", "data"), ValueError, "more than once"),
    (("0",), P(), TypeError, "must be MPMD indexes"),
    ((0,), ("data",), TypeError, "must be a jax.sharding.PartitionSpec"),
])
def test_sharding_errors(mesh42, ids, spec, error, message):
    with pytest.raises(error, match=message):
        MpmdSharding(mesh42, ids, spec)


def test_sharding_for_and_submesh_sharding(mesh222):
    s = MpmdSharding(mesh222, (0, 1), P("data", "model"))
    for i in (0, 1):
        ns = s.sharding_for(i)
        assert isinstance(ns, NamedSharding)
        # The group's mesh with every axis, the MPMD axis of size 1 (as JaxPP's).
        assert ns.mesh == mesh222.unstack[i] and ns.spec == P("data", "model")
        assert ns.mesh == mesh222.mpmd_submesh([i]).jax_mesh
    whole = s.sharding
    assert whole.mesh == _submesh(mesh222, (0, 1))
    assert dict(whole.mesh.shape) == {"stage": 2, "data": 2, "model": 2}
    assert whole.spec == P("data", "model")
    assert s.local_mesh_ids == (0, 1)


def test_unused_value_sharding(mesh42):
    """JaxPP's `MpmdSharding(mesh, set(), spec)` for a value no group holds: metadata."""
    s = MpmdSharding(mesh42, set(), P("stage", "data"))
    assert s.mesh_ids == () and s.local_mesh_ids == () and s.spec == P(None, "data")
    a = MpmdArray([], s, shape=(4, 2), dtype=np.float32)
    assert not a.is_partially_addressable and a.mpmd_idxs == frozenset()
    with pytest.raises(ValueError, match="held by no group"):
        s.sharding
    with pytest.raises(RuntimeError, match=r"np.asarray of an MpmdArray of shape \(4, 2\) "
                                           r"and dtype float32 held by groups \(\)"):
        np.asarray(a)


def test_sharding_for_non_member(mesh42):
    with pytest.raises(ValueError, match="group 1 does not hold this value"):
        MpmdSharding(mesh42, (0, 3), P()).sharding_for(1)


# -- MpmdArray, local mode ------------------------------------------------------------


def test_single_group_array(mesh42):
    s = MpmdSharding(mesh42, (2,), P("data"))
    value = _value()
    a = mpmd_array_from_local(mesh42, value, s)
    assert a.mpmd_idxs == frozenset({2})
    assert a.is_partially_addressable and not a.is_mpmd_replicated
    local = a.to_mpmd_local_array
    assert isinstance(local, jax.Array)
    assert local.sharding.device_set == set(mesh42.devices_of(2))
    assert local.sharding.is_equivalent_to(s.sharding_for(2), 2)
    assert a.first_mpmd_replica is local
    assert a.local_arrays == {2: local}
    assert a.shape == (8, 6) and a.dtype == np.float32 and a.ndim == 2
    assert a.size == 48 and a.nbytes == 192
    assert a.aval == jax.core.ShapedArray((8, 6), jnp.float32)
    assert a.spec == P("data") and a.mpmd_sharding is s
    assert a.sharding.mesh == _submesh(mesh42, (2,))
    np.testing.assert_array_equal(np.asarray(a), value)
    assert np.asarray(a, dtype=np.int32).dtype == np.int32
    assert a.block_until_ready() is a
    assert repr(a) == "MpmdArray(shape=(8, 6), dtype=float32, groups=(2,), spec=P('data'))"


def test_replicated_array(mesh222):
    s = MpmdSharding(mesh222, (0, 1), P(None, "model"))
    value = _value((4, 6))
    a = mpmd_array_from_local(mesh222, value, s)
    assert a.is_mpmd_replicated and a.mpmd_idxs == frozenset({0, 1})
    local = a.to_mpmd_local_array
    assert isinstance(local, list) and len(local) == 2
    for idx, arr in zip((0, 1), local):
        assert arr.sharding.device_set == set(mesh222.devices_of(idx))
        np.testing.assert_array_equal(np.asarray(arr), value)
    assert a.first_mpmd_replica is local[0]
    # The whole sharding spans both groups' devices, unlike a replica's.
    assert a.sharding.device_set == set(mesh222.devices_of(0)) | set(mesh222.devices_of(1))
    assert a.sharding != local[0].sharding


def test_scalar_and_python_values(mesh42):
    a = mpmd_array_from_local(mesh42, 3.0, MpmdSharding(mesh42, (1,), P()))
    assert a.shape == () and a.dtype == np.float32  # canonicalised, like device_put
    b = mpmd_array_from_local(mesh42, jnp.ones((2, 2), jnp.bfloat16),
                              MpmdSharding(mesh42, (0, 1), P()))
    assert b.dtype == jnp.bfloat16


def test_delete(mesh42):
    a = mpmd_array_from_local(mesh42, _value(), MpmdSharding(mesh42, (0, 3), P("data")))
    replicas = a.partially_addressable_arrays
    assert not a.is_deleted()
    a.delete()
    assert a.is_deleted() and all(r.is_deleted() for r in replicas)
    assert "deleted" in repr(a)
    a.delete()  # idempotent


def test_donated_replica_counts_as_deleted(mesh42):
    a = mpmd_array_from_local(mesh42, _value(), MpmdSharding(mesh42, (0, 1), P()))
    a.partially_addressable_arrays[1].delete()
    assert a.is_deleted()


def test_constructor_validation(mesh42):
    s = MpmdSharding(mesh42, (0, 1), P("data"))
    value = _value()
    r0 = jax.device_put(value, s.sharding_for(0))
    r1 = jax.device_put(value, s.sharding_for(1))
    MpmdArray([r0, r1], s)  # ok
    with pytest.raises(ValueError, match=r"local arrays 0 and 1 are both on group 0's"):
        MpmdArray([r0, r0], s)
    r3 = jax.device_put(value, NamedSharding(mesh42.group_mesh(3), P("data")))
    with pytest.raises(ValueError, match=r"local array 1 is on group 3's devices, but "
                                         r".* places the array on groups \(0, 1\)"):
        MpmdArray([r0, r3], s)
    across = jax.device_put(value, NamedSharding(Mesh(np.array(jax.devices()[1:3]), ("x",)),
                                                 P("x")))
    with pytest.raises(ValueError, match=r"local array 0 is on devices \[1, 2\], not on "
                                         r"the devices of one group .*group 0: \[0, 1\], "
                                         r"group 1: \[2, 3\]"):
        MpmdArray([across], s)
    one_device = jax.device_put(value, jax.devices()[0])
    with pytest.raises(ValueError, match=r"local array 0 is on devices \[0\], not on"):
        MpmdArray([one_device], s)
    with pytest.raises(ValueError, match=r"replica for group 0 is float32\[8, 6\], expected "
                                         r"float32\[6, 8\]"):
        MpmdArray([r0, r1], s, shape=(6, 8))
    with pytest.raises(ValueError, match="expected int32"):
        MpmdArray([r0, r1], s, dtype=np.int32)
    other = jax.device_put(value.astype(np.int32), s.sharding_for(1))
    with pytest.raises(ValueError, match="replica for group 1 is int32"):
        MpmdArray([r0, other], s)
    replicated = jax.device_put(value, NamedSharding(mesh42.group_mesh(1), P()))
    with pytest.raises(ValueError, match=r"laid out as .* not as P\('data'\)"):
        MpmdArray([r0, replicated], s)
    with pytest.raises(TypeError, match="local array 0 must be a jax.Array"):
        MpmdArray([value, r1], s)
    with pytest.raises(TypeError, match="must be an MpmdSharding"):
        MpmdArray([r0], s.sharding_for(0))


def test_replicas_in_any_order(mesh42):
    """Each local array is matched to its group by its devices, as JaxPP does."""
    s = MpmdSharding(mesh42, (0, 3), P("data"))
    value = _value()
    r0, r3 = (jax.device_put(value, s.sharding_for(i)) for i in (0, 3))
    a = MpmdArray([r3, r0], s)
    assert a.partially_addressable_arrays == [r0, r3]
    assert a.local_arrays == {0: r0, 3: r3}
    assert a.first_mpmd_replica is r0


# -- partially addressable and metadata-only arrays, local mode ------------------------


def test_partially_addressable_local(mesh42):
    """Replicas for some of the groups only (JaxPP's single-process case)."""
    s = MpmdSharding(mesh42, (0, 2, 3), P("data"))
    value = _value()
    r2 = jax.device_put(value, s.sharding_for(2))
    a = MpmdArray([r2], s)
    assert a.is_partially_addressable and a.is_mpmd_replicated
    assert a.mpmd_idxs == frozenset({0, 2, 3})
    assert a.partially_addressable_arrays == [r2] and a.local_arrays == {2: r2}
    assert a.to_mpmd_local_array is r2  # one replica held: the array itself
    assert a.first_mpmd_replica is None  # group 0's replica is not held
    assert a.shape == (8, 6) and a.dtype == np.float32
    assert a.sharding.mesh == _submesh(mesh42, (0, 2, 3))
    np.testing.assert_array_equal(np.asarray(a), value)
    r3 = jax.device_put(value, s.sharding_for(3))
    b = MpmdArray([r3, r2], s)
    assert b.to_mpmd_local_array == [r2, r3] and b.local_arrays == {2: r2, 3: r3}
    b.delete()
    assert b.is_deleted() and r2.is_deleted() and r3.is_deleted()


def test_metadata_only_local(mesh42):
    s = MpmdSharding(mesh42, (0, 2), P("data"))
    with pytest.raises(ValueError, match="shape and dtype must be given"):
        MpmdArray([], s, shape=(8, 6))
    a = MpmdArray([], s, shape=(8, 6), dtype=np.float32)
    assert not a.is_partially_addressable and a.is_mpmd_replicated
    assert a.partially_addressable_arrays == [] and a.local_arrays == {}
    assert a.to_mpmd_local_array is None and a.first_mpmd_replica is None
    assert a.aval == jax.core.ShapedArray((8, 6), jnp.float32)
    assert a.sharding.mesh == _submesh(mesh42, (0, 2))
    assert len(a) == 8 and a.block_until_ready() is a
    message = (r"of an MpmdArray of shape \(8, 6\) and dtype float32 held by groups "
               r"\(0, 2\): this process holds no replica of it \(metadata only.*"
               r"mpmd_array_from_local")
    for convert in (np.asarray, list, bool):
        with pytest.raises(RuntimeError, match=message):
            convert(a)
    assert f"{a:.3f}" == repr(a)  # as a jax.Array on other processes' devices formats
    assert not a.is_deleted()
    a.delete()
    assert a.is_deleted()


# -- conversions, against numpy --------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_scalar_conversions(mesh42, dtype):
    value = np.array(3.25).astype(dtype)
    a = mpmd_array_from_local(mesh42, value, MpmdSharding(mesh42, (1, 3), P()))
    assert f"{a:.3f}" == f"{value:.3f}"
    assert f"{a}" == f"{value}" and f"{a:>8}" == f"{value:>8}"
    assert int(a) == int(value) and float(a) == float(value)
    assert complex(a) == complex(value) and bool(a) == bool(value)
    if dtype == np.int32:
        assert operator.index(a) == 3 and [10, 20, 30, 40][a] == 40
        assert list(range(a)) == [0, 1, 2]
    else:
        with pytest.raises(TypeError, match="Only integer scalar arrays"):
            operator.index(a)
    with pytest.raises(TypeError, match="len\\(\\) of unsized object"):
        len(a)
    with pytest.raises(TypeError, match="iteration over a 0-d array"):
        iter(a)


def test_vector_conversions(mesh42):
    value = np.array([1.5, -2.0, 0.25], np.float32)
    a = mpmd_array_from_local(mesh42, value, MpmdSharding(mesh42, (2,), P()))
    assert len(a) == 3
    rows = list(a)
    assert all(isinstance(r, jax.Array) and r.shape == () for r in rows)
    np.testing.assert_array_equal([np.asarray(r) for r in rows], value)
    assert f"{a}" == f"{value}"
    for convert in (int, float, complex):
        with pytest.raises(TypeError, match="Only scalar arrays"):
            convert(a)
    with pytest.raises(ValueError, match="truth value of an array with more than one"):
        bool(a)
    one = mpmd_array_from_local(mesh42, np.array([7], np.int32), MpmdSharding(mesh42, 0, P()))
    assert len(one) == 1 and bool(one) and [int(r) for r in one] == [7]
    copied = np.array(a, copy=True)
    copied[0] = 9.0
    np.testing.assert_array_equal(np.asarray(a), value)
    assert np.asarray(a, dtype=np.float64).dtype == np.float64


def test_conversions_read_the_lowest_held_replica(mesh42):
    """Replicas are equal by construction; a conversion reads the lowest held group's."""
    s = MpmdSharding(mesh42, (1, 2), P())
    r1 = jax.device_put(np.float32(1.0), s.sharding_for(1))
    r2 = jax.device_put(np.float32(2.0), s.sharding_for(2))
    assert float(MpmdArray([r2, r1], s)) == 1.0
    assert f"{MpmdArray([r2], s):.1f}" == "2.0"


def test_from_local_checks_mesh(mesh42, mesh222):
    with pytest.raises(ValueError, match="another mesh"):
        mpmd_array_from_local(mesh222, _value(), MpmdSharding(mesh42, (0,), P()))


# -- MpmdArray, MPI mode (fake comm: this process is rank 1 of 4) ---------------------


@pytest.fixture
def mpi_mesh() -> MpmdMesh:
    devices = np.array(jax.devices()[2:4]).reshape(1, 2)
    return MpmdMesh(Mesh(devices, ("stage", "data")), "stage", comm=FakeComm(1, 4))


def test_mpi_not_owned(mpi_mesh):
    s = MpmdSharding(mpi_mesh, (0, 2), P("data"))
    a = mpmd_array_from_local(mpi_mesh, _value(), s)
    assert a.partially_addressable_arrays == []
    assert not a.is_partially_addressable and a.is_mpmd_replicated
    assert a.to_mpmd_local_array is None and a.first_mpmd_replica is None
    assert a.shape == (8, 6) and a.dtype == np.float32
    assert a.block_until_ready() is a
    # Reading the value raises here, at once (tests/unit/test_fetch.py); the metadata is
    # known everywhere, and formatting never communicates.
    assert len(a) == 8
    assert f"{a:.3f}" == repr(a) == str(a)  # as a jax.Array on other processes' devices
    assert a.sharding == NamedSharding(AbstractMesh((2, 2), ("stage", "data")), P("data"))
    assert a.sharding.mesh == mpi_mesh.mpmd_submesh([0, 2]).jax_mesh
    for read in (np.asarray, float, list):
        with pytest.raises(RuntimeError, match=r"held by groups \(0, 2\), not by this rank's "
                                               r"group \(1\): an implicit read never sends"):
            read(a)
    assert "groups=(0, 2)" in repr(a)
    a.delete()
    assert a.is_deleted()


def test_mpi_not_owned_needs_shape_and_dtype(mpi_mesh):
    s = MpmdSharding(mpi_mesh, (0,), P())
    with pytest.raises(ValueError, match="shape and dtype must be given"):
        MpmdArray([], s, shape=(2,))
    a = MpmdArray([], s, shape=(2,), dtype=jnp.bfloat16)
    assert a.aval == jax.core.ShapedArray((2,), jnp.bfloat16)


def test_mpi_owned(mpi_mesh):
    s = MpmdSharding(mpi_mesh, (1, 3), P("data"))
    a = mpmd_array_from_local(mpi_mesh, _value(), s)
    local = a.to_mpmd_local_array
    assert isinstance(local, jax.Array) and a.is_partially_addressable
    assert local.sharding.device_set == set(jax.devices()[2:4])
    assert a.first_mpmd_replica is local  # rank 1 is the lowest owner
    assert a.sharding.mesh == mpi_mesh.mpmd_submesh([1, 3]).jax_mesh
    assert local.sharding == s.sharding_for(1) == NamedSharding(mpi_mesh.lowering_mesh(),
                                                                  P("data"))
    assert a._mpmd_local_sharding == s.sharding_for(1)
    np.testing.assert_array_equal(np.asarray(local), _value())
    with pytest.raises(ValueError, match=r"on rank 1 needs 1 local array\(s\)"):
        MpmdArray([local, local], s)
    # A holding rank holds its replica (see Note: Array placement).
    with pytest.raises(ValueError, match=r"on rank 1 needs 1 local array\(s\) .*got 0: a "
                                         r"rank holds its group's replica exactly when"):
        MpmdArray([], s, shape=(8, 6), dtype=np.float32)
    elsewhere = jax.device_put(_value(), NamedSharding(
        Mesh(np.array(jax.devices()[:2]), ("data",)), P("data")))
    with pytest.raises(ValueError, match=r"local array 0 is on devices \[0, 1\], not on the "
                                         r"devices of one group .* on rank 1 \(group 1: "
                                         r"\[2, 3\]\)"):
        MpmdArray([elsewhere], s)
    value = np.float32(2.5)
    b = mpmd_array_from_local(mpi_mesh, value, MpmdSharding(mpi_mesh, (1, 3), P()))
    assert f"{b:.3f}" == f"{value:.3f}"
    one = mpmd_array_from_local(mpi_mesh, value, MpmdSharding(mpi_mesh, 1, P()))
    assert one.sharding == one.to_mpmd_local_array.sharding  # JaxPP's one-group case


def test_mpi_owned_not_first(mpi_mesh):
    a = mpmd_array_from_local(mpi_mesh, _value(), MpmdSharding(mpi_mesh, (0, 1), P()))
    assert a.is_partially_addressable and a.to_mpmd_local_array is not None
    assert a.first_mpmd_replica is None
    assert a._partially_addressable_arrays == {1: a.to_mpmd_local_array}
    np.testing.assert_array_equal(np.asarray(a.to_mpmd_local_array), _value())


def test_array_module_imports_nothing_above_its_layer():
    """Implicit reads are local (Note: implicit reads are local), so `arrays/array.py`
    imports nothing from a higher layer, at module level or inside a function."""
    import ast
    from pathlib import Path

    import jaxpp_mpi._src.arrays.array as module

    above = ("compiler", "runtime", "driver", "frontend", "reshard", "checkpoint", "planner")
    tree = ast.parse(Path(module.__file__).read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    upward = [m for m in imported if m.startswith("jaxpp_mpi._src.")
              and m.split(".")[2] in above]
    assert not upward, upward
