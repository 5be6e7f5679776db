"""MpmdMesh and make_mpmd_mesh in one process: local mode, and MPI mode with a fake comm."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxpp_mpi._src.arrays import comms as comms_mod
from jaxpp_mpi._src.arrays import make_mesh as make_mesh_mod
from jaxpp_mpi._src.arrays import mesh as mesh_mod
from jaxpp_mpi._src.arrays.make_mesh import make_mpmd_mesh
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.launch.env import WORLD_SIZE_VARS


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
    # JaxPP's lowering mesh: group 0 with every axis, the MPMD axis of size 1.
    assert mm.lowering_mesh() == mm.unstack[0] == mm.mpmd_submesh([0]).jax_mesh
    # Groups partition the devices.
    all_ids = sorted(d.id for i in range(n) for d in mm.devices_of(i))
    assert all_ids == list(range(8))


def test_local_submesh(monkeypatch):
    monkeypatch.setattr(comms_mod, "_default_comm", lambda: pytest.fail("dup called"))
    jmesh = _mesh((4, 2), ("stage", "data"))
    mm = MpmdMesh(jmesh, "stage")
    sub = mm.mpmd_submesh([3, 1])
    assert isinstance(sub, MpmdMesh) and sub.is_local and sub.mpmd_dim == 2
    assert sub.jax_mesh.axis_names == ("stage", "data")
    assert dict(sub.jax_mesh.shape) == {"stage": 2, "data": 2}
    np.testing.assert_array_equal(sub.jax_mesh.devices, jmesh.devices[[3, 1]])
    assert sub == MpmdMesh(Mesh(jmesh.devices[[3, 1]], ("stage", "data")), "stage")
    assert sub.group_mesh(0) == mm.group_mesh(3) and sub.group_mesh(1) == mm.group_mesh(1)
    assert sub.mpmd_submesh([1]) == mm.mpmd_submesh((1,))
    one = mm.mpmd_submesh((2,))  # one group, still local: no communicator is made
    assert one.is_local and one.mpmd_dim == 1 and one.comm is None
    assert dict(one.jax_mesh.shape) == {"stage": 1, "data": 2}
    assert one.devices_of(0) == tuple(jmesh.devices[2])
    assert mm.mpmd_submesh(range(4)) == mm
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
    monkeypatch.setattr(comms_mod, "_mpi_world_size", lambda: 4)
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
    assert mm.lowering_mesh() == mm.my_mpmd_group_mesh
    assert dict(mm.lowering_mesh().shape) == {"stage": 1, "data": 2}
    assert mm.devices_of(1) == tuple(devices)
    with pytest.raises(ValueError, match="group 0 lives on MPI rank 0; this is rank 1"):
        mm.group_mesh(0)
    with pytest.raises(ValueError, match="group 3 lives on MPI rank 3"):
        mm.devices_of(3)
    sub = mm.mpmd_submesh((1,))
    assert dict(sub.jax_mesh.shape) == {"stage": 1, "data": 2}
    assert "mpi, rank=1" in repr(mm)


def test_mpi_mode_equality_depends_on_rank():
    jmesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("stage", "data"))
    a = MpmdMesh(jmesh, "stage", comm=FakeComm(0, 2))
    b = MpmdMesh(jmesh, "stage", comm=FakeComm(0, 2))
    c = MpmdMesh(jmesh, "stage", comm=FakeComm(1, 2))
    assert a == b and hash(a) == hash(b) and a != c


# -- JaxPP's views: mpmd_axis, unstack, device maps, submeshes, `with` ----------------


@pytest.mark.parametrize("shape,names,axis", LOCAL_LAYOUTS)
def test_local_views(shape, names, axis):
    jmesh = _mesh(shape, names)
    mm = MpmdMesh(jmesh, axis)
    pos = names.index(axis)
    assert mm.mpmd_axis == pos
    assert len(mm.device_coords) == len(mm.device_mpmd_idx) == 8
    for coord, device in np.ndenumerate(jmesh.devices):
        assert mm.device_coords[device] == coord
        assert mm.device_mpmd_idx[device] == coord[pos]
    assert len(mm.unstack) == mm.mpmd_dim
    for i, m in enumerate(mm.unstack):
        assert m.axis_names == names and m.axis_types == jmesh.axis_types
        np.testing.assert_array_equal(m.devices, np.take(jmesh.devices, [i], axis=pos))
        assert mm.mpmd_idx_for_mesh[m] == i == mm.mpmd_idx_for_mesh[mm.group_mesh(i)]
    assert len(mm.mpmd_idx_for_mesh) == 2 * mm.mpmd_dim
    assert mm.mpmd_idx_for_mesh.get(jmesh) is None
    with pytest.raises(ValueError, match="my_mpmd_group_mesh needs an MPI-mode mesh"):
        mm.my_mpmd_group_mesh


def test_views_as_in_jaxpp_test():
    # JaxPP's tests/test_mpmd_mesh.py, on CPU devices.
    devices = jax.devices()
    names = ("stage", "data", "sequence", "tensor", "expert")
    mm = MpmdMesh(Mesh(np.array(devices).reshape((4, 2, 1, 1, 1)), names), "stage")
    assert mm.mpmd_axis == 0
    assert mm.device_coords[devices[0]] == (0, 0, 0, 0, 0)
    assert mm.device_coords[devices[1]] == (0, 1, 0, 0, 0)
    assert mm.device_coords[devices[7]] == (3, 1, 0, 0, 0)
    for idx, m in enumerate(mm.unstack):
        assert m.axis_names == names and m.devices.shape == (1, 2, 1, 1, 1)
        np.testing.assert_array_equal(
            m.device_ids, np.arange(2 * idx, 2 * idx + 2).reshape(1, 2, 1, 1, 1))


def test_unknown_device_lookup():
    mm = MpmdMesh(_mesh((2, 2), ("stage", "data")), "stage")
    with pytest.raises(KeyError, match="not a device of this mesh"):
        mm.device_coords[jax.devices()[5]]
    assert jax.devices()[5] not in mm.device_mpmd_idx


def test_context_manager_is_jaxpp_mesh_stack():
    a = MpmdMesh(_mesh((4, 2), ("stage", "data")), "stage")
    b = MpmdMesh(_mesh((2, 4), ("stage", "data")), "stage")
    before = list(MpmdMesh.mesh_stack)
    with a as entered:
        assert entered is a and MpmdMesh.mesh_stack[-1] is a
        with b:
            assert MpmdMesh.mesh_stack[-2:] == [a, b]
        assert MpmdMesh.mesh_stack[-1] is a
        # Like JaxPP's, it sets no JAX mesh: jit and device_put are unaffected.
        assert jax.sharding.get_abstract_mesh().empty
        np.testing.assert_array_equal(jax.jit(lambda x: 2 * x)(np.arange(3)), [0, 2, 4])
    assert MpmdMesh.mesh_stack == before
    with pytest.raises(ZeroDivisionError), a:
        1 / 0
    assert MpmdMesh.mesh_stack == before
    a.__enter__()
    with pytest.raises(RuntimeError, match="not the innermost mesh entered"):
        b.__exit__(None, None, None)
    a.__exit__(None, None, None)
    assert MpmdMesh.mesh_stack == before


@pytest.mark.parametrize("names,shape", [(("stage", "data"), (1, 2)),
                                         (("data", "stage"), (2, 1)),
                                         (("data",), (2,))])
def test_mpi_mode_views(names, shape):
    devices = jax.devices()[2:4]
    jmesh = Mesh(np.array(devices).reshape(shape), names)
    mm = MpmdMesh(jmesh, "stage", comm=FakeComm(rank=1, size=4))
    pos = names.index("stage") if "stage" in names else 0
    full = ("data",)[:pos] + ("stage",) + ("data",)[pos:]
    assert mm.mpmd_axis == pos
    # Coordinates in the whole (4-group) mesh; only this rank's devices are known.
    want = {d: (1, j) if pos == 0 else (j, 1) for j, d in enumerate(devices)}
    assert dict(mm.device_coords) == want
    assert dict(mm.device_mpmd_idx) == {d: 1 for d in devices}
    with pytest.raises(KeyError, match="knows only its own group's devices"):
        mm.device_coords[jax.devices()[0]]
    own = Mesh(np.array(devices).reshape((1, 2) if pos == 0 else (2, 1)), full)
    assert mm.my_mpmd_group_mesh == own
    assert len(mm.unstack) == 4 and mm.unstack[1] == own and mm.unstack[-3] == own
    with pytest.raises(ValueError, match="group 0 lives on MPI rank 0; this is rank 1"):
        mm.unstack[0]
    with pytest.raises(ValueError, match="group 0 lives on MPI rank 0"):
        list(mm.unstack)
    with pytest.raises(IndexError):
        mm.unstack[4]
    assert mm.unstack[1:2] == [own]
    assert mm.mpmd_idx_for_mesh == {own: 1, mm.group_mesh(1): 1}


def test_mpi_submesh_member():
    devices = jax.devices()[2:4]
    comm = FakeComm(rank=1, size=4)
    mm = MpmdMesh(Mesh(np.array(devices), ("data",)), "stage", comm=comm)
    sub = mm.mpmd_submesh([2, 1])
    assert not sub.is_local and sub.mpmd_dim == 2
    assert sub.my_mpmd_axis_index == 1 and sub.local_groups == (1,)
    # Two groups: JaxPP's mesh of both, as metadata (no rank holds both).
    assert sub.jax_mesh == AbstractMesh((2, 2), ("stage", "data"))
    assert sub.my_mpmd_group_mesh == mm.my_mpmd_group_mesh == sub.lowering_mesh()
    assert sub.group_mesh(1) == mm.group_mesh(1)
    assert sub.group_shape == {"data": 2} and sub.group_size == 2
    assert dict(sub.device_coords) == {d: (1, j) for j, d in enumerate(devices)}
    with pytest.raises(ValueError, match="group 0 lives on MPI rank 2; this is rank 1"):
        sub.group_mesh(0)
    with pytest.raises(ValueError, match=r"submesh of MPI ranks \[2, 1\].*no communicator"):
        sub.comm
    assert "groups on ranks [2, 1]" in repr(sub)
    assert sub == mm.mpmd_submesh((2, 1)) and sub != mm.mpmd_submesh((1, 2))
    # Back to every rank in order: a communicator again.
    again = sub.mpmd_submesh([1, 0]).mpmd_submesh([0])
    assert again.mpmd_dim == 1 and again.my_mpmd_axis_index == 0
    with pytest.raises(ValueError, match="no communicator"):
        again.comm
    with pytest.raises(ValueError, match="no communicator"):
        mm.mpmd_submesh([0, 1]).comm  # ranks 0 and 1 in order, but not every rank
    whole = mm.mpmd_submesh([0, 1, 2, 3])
    assert whole.comm is comm and whole.my_mpmd_axis_index == 1
    assert whole.jax_mesh == AbstractMesh((4, 2), ("stage", "data"))
    assert again.jax_mesh == mm.my_mpmd_group_mesh  # this rank's one group


def test_mpi_submesh_non_member():
    mm = MpmdMesh(Mesh(np.array(jax.devices()[2:4]), ("data",)), "stage",
                  comm=FakeComm(rank=1, size=4))
    sub = mm.mpmd_submesh([0, 2])
    assert sub.mpmd_dim == 2 and sub.my_mpmd_axis_index is None
    assert sub.local_groups == () and sub.group_shape == {"data": 2}
    assert len(sub.device_coords) == 0 and sub.mpmd_idx_for_mesh == {}
    no_devices = r"holds no devices on this rank \(1\): its groups live on MPI ranks \[0, 2\]"
    with pytest.raises(ValueError, match=no_devices):
        sub.my_mpmd_group_mesh
    with pytest.raises(ValueError, match=no_devices):
        sub.lowering_mesh()
    # Its mesh as metadata, as every rank sees it (JaxPP's tests read it everywhere).
    assert sub.jax_mesh == AbstractMesh((2, 2), ("stage", "data"))
    assert sub.mpmd_submesh([1]).jax_mesh == AbstractMesh((1, 2), ("stage", "data"))
    with pytest.raises(ValueError, match="group 1 lives on MPI rank 2; this is rank 1, "
                                         "which holds none of the groups"):
        sub.group_mesh(1)
    with pytest.raises(ValueError, match="lives on MPI rank 0"):
        sub.unstack[0]
    assert sub.mpmd_submesh([1]).local_groups == ()
    assert "groups on ranks [0, 2]" in repr(sub)


@pytest.mark.parametrize("idxs,message", [
    ([1, 1], "distinct"), ([], "distinct"), ([4], "out of range"), (["0"], "must be an int")])
def test_submesh_bad_indexes_in_mpi_mode(idxs, message):
    mm = MpmdMesh(Mesh(np.array(jax.devices()[:2]), ("data",)), "stage",
                  comm=FakeComm(rank=0, size=4))
    with pytest.raises((ValueError, TypeError), match=message):
        mm.mpmd_submesh(idxs)


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
    monkeypatch.setattr(comms_mod, "_mpi_world_size", lambda: 4)
    monkeypatch.setattr(comms_mod, "_default_comm", lambda: pytest.fail("dup called"))
    # the ranks' arguments agree (a stand-in without allgather: this rank's alone), and
    # MPI is never started in the test process
    monkeypatch.setattr(make_mesh_mod, "_world_comm", lambda: object())
    with pytest.raises(ValueError, match="mesh wants 2 groups .* job has 4 ranks"):
        make_mpmd_mesh((2, 4), ("stage", "data"), "stage")


def test_local_mode_does_not_import_mpi(tmp_path):
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from jaxpp_mpi._src.arrays.make_mesh import make_mpmd_mesh\n"
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


# --- MPI4JAX_USE_CUDA_MPI against an MPI that cannot move GPU buffers --------------------
# (the decision itself: tests/unit/test_cuda_mpi.py)

def test_make_mpmd_mesh_refuses_gpu_buffers_for_an_mpi_without_cuda(monkeypatch):
    import jaxpp_mpi._src.arrays.make_mesh as make_mesh_mod

    seen = []
    monkeypatch.setattr(make_mesh_mod, "cuda_mpi_problem",
                        lambda platforms: seen.append(list(platforms)) or "no CUDA here")
    with pytest.raises(ValueError, match="^no CUDA here$"):
        make_mpmd_mesh((4, 2), ("stage", "data"), "stage", comm=FakeComm(2, 4),
                       devices=jax.devices()[6:8])
    assert seen == [["cpu", "cpu"]]
