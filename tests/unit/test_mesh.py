"""MpmdMesh and make_mpmd_mesh in one process: local mode, and MPI mode with a fake comm."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from jaxpp_mpi._src import mesh as mesh_mod
from jaxpp_mpi._src.launch.env import WORLD_SIZE_VARS
from jaxpp_mpi._src.mesh import MpmdMesh, make_mpmd_mesh


@dataclasses.dataclass(frozen=True)
class FakeComm:
    """Stands in for an MPI communicator: MpmdMesh only asks for rank and size."""

    rank: int
    size: int

    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size


LOCAL_LAYOUTS = [
    ((4, 2), ("stage", "data"), "stage"),
    ((2, 2, 2), ("stage", "data", "model"), "stage"),
    ((2, 4), ("data", "stage"), "stage"),  # MPMD axis not first
]


def _mesh(shape, names) -> Mesh:
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def test_eight_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("shape,names,axis", LOCAL_LAYOUTS)
def test_local_mode_groups(shape, names, axis):
    jmesh = _mesh(shape, names)
    mm = MpmdMesh(jmesh, axis)
    pos = names.index(axis)
    n = shape[pos]
    assert mm.is_local and mm.comm is None and mm.my_mpmd_axis_index is None
    assert mm.mpmd_dim == n
    assert mm.local_groups == tuple(range(n))
    rest = tuple(x for x in names if x != axis)
    assert mm.group_axis_names == rest
    assert mm.group_shape == {x: s for x, s in zip(names, shape) if x != axis}
    assert mm.group_size == 8 // n
    for i in range(n):
        g = mm.group_mesh(i)
        assert g.axis_names == rest
        np.testing.assert_array_equal(g.devices, np.take(jmesh.devices, i, axis=pos))
        assert mm.devices_of(i) == tuple(np.take(jmesh.devices, i, axis=pos).flat)
    assert [g.devices.tolist() for g in mm.unstack] == [
        mm.group_mesh(i).devices.tolist() for i in range(n)]
    assert mm.lowering_mesh() == mm.group_mesh(0)
    # Groups partition the devices.
    all_ids = sorted(d.id for i in range(n) for d in mm.devices_of(i))
    assert all_ids == list(range(8))


def test_local_submesh():
    jmesh = _mesh((4, 2), ("stage", "data"))
    mm = MpmdMesh(jmesh, "stage")
    sub = mm.mpmd_submesh([1, 3])
    assert sub.axis_names == ("stage", "data")
    assert dict(sub.shape) == {"stage": 2, "data": 2}
    np.testing.assert_array_equal(sub.devices, jmesh.devices[[1, 3]])
    assert dict(mm.mpmd_submesh((2,)).shape) == {"stage": 1, "data": 2}
    with pytest.raises(ValueError, match="distinct"):
        mm.mpmd_submesh([1, 1])
    with pytest.raises(ValueError, match="distinct"):
        mm.mpmd_submesh([])
    with pytest.raises(ValueError, match="out of range: the mesh has 4 groups"):
        mm.mpmd_submesh([4])


def test_group_mesh_keeps_axis_types():
    jmesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("stage", "data"),
                 axis_types=(AxisType.Explicit, AxisType.Explicit))
    mm = MpmdMesh(jmesh, "stage")
    assert mm.group_mesh(1).axis_types == (AxisType.Explicit,)


def test_index_errors():
    mm = MpmdMesh(_mesh((4, 2), ("stage", "data")), "stage")
    with pytest.raises(ValueError, match=r"MPMD index 4 is out of range.*0\.\.3"):
        mm.group_mesh(4)
    with pytest.raises(ValueError, match="out of range"):
        mm.devices_of(-1)
    with pytest.raises(TypeError, match="must be an int"):
        mm.group_mesh("0")


def test_equality_and_hash():
    a = MpmdMesh(_mesh((4, 2), ("stage", "data")), "stage")
    b = MpmdMesh(_mesh((4, 2), ("stage", "data")), "stage")
    c = MpmdMesh(_mesh((2, 4), ("stage", "data")), "stage")
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    with pytest.raises(AttributeError):
        a.mpmd_dim = 3
    assert "MpmdMesh(local, 'stage': 4, group={'data': 2})" == repr(a)


def test_missing_mpmd_axis_in_one_process():
    with pytest.raises(ValueError, match=r"mpmd_axis_name 'stages' is not an axis of the mesh"):
        MpmdMesh(_mesh((4, 2), ("stage", "data")), "stages")


def test_local_mesh_under_multi_rank_job_raises(monkeypatch):
    monkeypatch.setattr(mesh_mod, "_mpi_world_size", lambda: 4)
    with pytest.raises(ValueError, match="puts all 4 MPMD groups .* MPI job has 4 ranks"):
        MpmdMesh(_mesh((4, 2), ("stage", "data")), "stage")


def test_local_mesh_with_multi_rank_comm_raises():
    with pytest.raises(ValueError, match="MPI job has 2 ranks"):
        MpmdMesh(_mesh((4, 2), ("stage", "data")), "stage", comm=FakeComm(0, 2))


def test_local_mesh_with_single_rank_comm_is_local():
    comm = FakeComm(0, 1)
    mm = MpmdMesh(_mesh((4, 2), ("stage", "data")), "stage", comm=comm)
    assert mm.is_local and mm.comm is comm and mm.mpmd_dim == 4


def test_foreign_devices_raise(monkeypatch):
    foreign = {jax.devices()[5]}
    monkeypatch.setattr(mesh_mod, "_is_addressable", lambda d: d not in foreign)
    with pytest.raises(ValueError, match="belong to other processes.*multi-controller"):
        MpmdMesh(_mesh((4, 2), ("stage", "data")), "stage")
    with pytest.raises(ValueError, match="MPI mode the mesh must be this rank's group mesh"):
        MpmdMesh(_mesh((1, 8), ("stage", "data")), "stage", comm=FakeComm(0, 2))


# -- MPI mode in one process, with a fake communicator --------------------------------


@pytest.mark.parametrize("with_axis", [True, False])
def test_mpi_mode(with_axis):
    devices = np.array(jax.devices()[2:4])
    jmesh = (Mesh(devices.reshape(1, 2), ("stage", "data")) if with_axis
             else Mesh(devices, ("data",)))
    comm = FakeComm(rank=1, size=4)
    mm = MpmdMesh(jmesh, "stage", comm=comm)
    assert not mm.is_local and mm.comm is comm
    assert mm.mpmd_dim == 4 and mm.my_mpmd_axis_index == 1
    assert mm.local_groups == (1,)
    assert mm.group_axis_names == ("data",)
    assert mm.group_shape == {"data": 2} and mm.group_size == 2
    own = mm.group_mesh(1)
    assert own.axis_names == ("data",)
    assert list(own.devices) == list(devices)
    assert mm.lowering_mesh() == own
    assert mm.devices_of(1) == tuple(devices)
    with pytest.raises(ValueError, match="group 0 lives on MPI rank 0; this is rank 1"):
        mm.group_mesh(0)
    with pytest.raises(ValueError, match="group 3 lives on MPI rank 3"):
        mm.devices_of(3)
    with pytest.raises(ValueError, match="only a local-mode mesh"):
        mm.unstack
    sub = mm.mpmd_submesh((1,))
    assert dict(sub.shape) == {"stage": 1, "data": 2}
    with pytest.raises(ValueError, match="spans several MPI ranks"):
        mm.mpmd_submesh((0, 1))
    with pytest.raises(ValueError, match="lives on MPI rank 0"):
        mm.mpmd_submesh((0,))
    assert "mpi, rank=1" in repr(mm)


def test_mpi_mode_equality_depends_on_rank():
    jmesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("stage", "data"))
    a = MpmdMesh(jmesh, "stage", comm=FakeComm(0, 2))
    b = MpmdMesh(jmesh, "stage", comm=FakeComm(0, 2))
    c = MpmdMesh(jmesh, "stage", comm=FakeComm(1, 2))
    assert a == b and hash(a) == hash(b) and a != c


# -- make_mpmd_mesh -------------------------------------------------------------------


@pytest.mark.parametrize("shape,names,axis", LOCAL_LAYOUTS)
def test_make_mpmd_mesh_local(shape, names, axis):
    mm = make_mpmd_mesh(shape, names, axis)
    assert mm.is_local and mm.mpmd_dim == shape[names.index(axis)]
    assert dict(mm.jax_mesh.shape) == dict(zip(names, shape))
    assert all(t == AxisType.Auto for t in mm.jax_mesh.axis_types)


def test_make_mpmd_mesh_uses_first_devices():
    mm = make_mpmd_mesh((2, 2), ("stage", "data"), "stage")
    assert sorted(d.id for d in mm.jax_mesh.devices.flat) == [0, 1, 2, 3]
    mm = make_mpmd_mesh((2, 2), ("stage", "data"), "stage", devices=jax.devices()[4:])
    assert sorted(d.id for d in mm.jax_mesh.devices.flat) == [4, 5, 6, 7]


def test_make_mpmd_mesh_axis_types():
    types = (AxisType.Explicit, AxisType.Explicit)
    mm = make_mpmd_mesh((4, 2), ("stage", "data"), "stage", axis_types=types)
    assert mm.jax_mesh.axis_types == types


def test_make_mpmd_mesh_too_big_for_one_process():
    with pytest.raises(ValueError, match=r"mesh wants 4 groups but the job has 1 rank: run "
                                         r"with mpirun -n 4.*provide 16 devices.*has 8"):
        make_mpmd_mesh((4, 4), ("stage", "data"), "stage")


@pytest.mark.parametrize("args,message", [
    (((4, 2), ("stage",), "stage"), "differ in length"),
    (((4, 2), ("stage", "data"), "pp"), "'pp' is not one of the axis names"),
    (((4, 0), ("stage", "data"), "stage"), "must be positive"),
    (((4, 2), ("stage", "stage"), "stage"), "must be distinct"),
])
def test_make_mpmd_mesh_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        make_mpmd_mesh(*args)


def test_make_mpmd_mesh_mpi_mode_with_comm():
    comm = FakeComm(rank=2, size=4)
    mm = make_mpmd_mesh((4, 2), ("stage", "data"), "stage", comm=comm,
                        devices=jax.devices()[6:8])
    assert not mm.is_local and mm.my_mpmd_axis_index == 2 and mm.mpmd_dim == 4
    assert dict(mm.jax_mesh.shape) == {"stage": 1, "data": 2}
    assert mm.devices_of(2) == tuple(jax.devices()[6:8])


def test_make_mpmd_mesh_wrong_rank_count():
    with pytest.raises(ValueError, match=r"mesh wants 4 groups \(axis 'stage'\) but the job "
                                         r"has 3 ranks: run with mpirun -n 4"):
        make_mpmd_mesh((4, 2), ("stage", "data"), "stage", comm=FakeComm(0, 3))


def test_make_mpmd_mesh_wrong_device_count():
    with pytest.raises(ValueError, match=r"each rank needs 2 devices \(group \{'data': 2\}\), "
                                         r"this rank has 8: set XLA_FLAGS=--xla_force_host"):
        make_mpmd_mesh((4, 2), ("stage", "data"), "stage", comm=FakeComm(0, 4))


def test_make_mpmd_mesh_under_multi_rank_job_checks_rank_count(monkeypatch):
    # A 4-rank job whose mesh wants 2 groups: refused before any communicator is made.
    monkeypatch.setattr(mesh_mod, "_mpi_world_size", lambda: 4)
    monkeypatch.setattr(mesh_mod, "_default_comm", lambda: pytest.fail("dup called"))
    with pytest.raises(ValueError, match="mesh wants 2 groups .* job has 4 ranks"):
        make_mpmd_mesh((2, 4), ("stage", "data"), "stage")


def test_local_mode_does_not_import_mpi(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from jaxpp_mpi._src.mesh import make_mpmd_mesh\n"
        "mm = make_mpmd_mesh((4, 2), ('stage', 'data'), 'stage')\n"
        "assert mm.is_local, mm\n"
        "assert not any(m.startswith('mpi4py') for m in sys.modules), 'mpi4py imported'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in WORLD_SIZE_VARS}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
