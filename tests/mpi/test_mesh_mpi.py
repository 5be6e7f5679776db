"""MpmdMesh / MpmdArray under mpirun: one group per rank, errors raised on every rank.

Runs with each rank's own device count K (1 by default; 2 with
XLA_FLAGS=--xla_force_host_platform_device_count=2 set before launch/jpprun).
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import jaxpp_mpi
from jaxpp_mpi._src.arrays.array import MpmdArray, mpmd_array_from_local
from jaxpp_mpi._src.arrays.make_mesh import make_mpmd_mesh
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()


@pytest.fixture(scope="module")
def mesh() -> MpmdMesh:
    return make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage")


def _raises_everywhere(fn, exc, match: str) -> None:
    """`fn` raises `exc` matching `match` on this rank, and did so on every rank."""
    try:
        fn()
    except exc as e:
        ok = bool(re.search(match, str(e)))
        msg = str(e)
    else:
        ok, msg = False, "no exception"
    results = WORLD.allgather((ok, msg))
    assert all(r[0] for r in results), results


@pytest.mark.mpi(min_size=2)
def test_make_mpmd_mesh(mesh):
    assert not mesh.is_local
    assert mesh.mpmd_dim == SIZE and mesh.my_mpmd_axis_index == RANK
    assert mesh.local_groups == (RANK,)
    assert mesh.group_shape == {"data": K} and mesh.group_size == K
    own = mesh.group_mesh(RANK)
    assert own.axis_names == ("data",)
    assert list(own.devices.flat) == jax.local_devices()
    assert mesh.lowering_mesh() == mesh.my_mpmd_group_mesh  # MPMD axis of size 1
    assert dict(mesh.mpmd_submesh((RANK,)).jax_mesh.shape) == {"stage": 1, "data": K}
    other = (RANK + 1) % SIZE
    with pytest.raises(ValueError, match=f"group {other} lives on MPI rank {other}"):
        mesh.group_mesh(other)
    with pytest.raises(ValueError, match=f"group {other} lives on MPI rank {other}"):
        mesh.unstack[other]


@pytest.mark.mpi(min_size=2)
def test_views_put_together_are_the_whole_mesh(mesh):
    # Each rank knows its own devices' coordinates; together they are the global mesh
    # make_mpmd_mesh((SIZE, K), ...) describes: rank r's j-th local device at (r, j).
    assert mesh.mpmd_axis == 0
    mine = {d.id: mesh.device_coords[d] for d in jax.local_devices()}
    assert set(mesh.device_mpmd_idx.values()) == {RANK} and len(mesh.device_coords) == K
    coords = [c for part in WORLD.allgather(sorted(mine.values())) for c in part]
    assert sorted(coords) == sorted(np.ndindex(SIZE, K))
    assert [mine[d.id] for d in jax.local_devices()] == [(RANK, j) for j in range(K)]
    own = mesh.unstack[RANK]
    assert own == mesh.my_mpmd_group_mesh == mesh.jax_mesh
    assert own.axis_names == ("stage", "data") and list(own.devices.flat) == jax.local_devices()
    assert mesh.mpmd_idx_for_mesh == {own: RANK, mesh.group_mesh(RANK): RANK}


@pytest.mark.mpi(min_size=2)
def test_submesh_of_even_ranks(mesh):
    evens = list(range(0, SIZE, 2))
    sub = mesh.mpmd_submesh(evens)
    assert sub.mpmd_dim == len(evens) and not sub.is_local
    # JaxPP's submesh of those groups: devices where this rank holds them all (one group
    # of its own), else the same metadata on every rank.
    if evens == [RANK]:
        assert sub.jax_mesh == mesh.my_mpmd_group_mesh
    else:
        assert sub.jax_mesh == AbstractMesh((len(evens), K), ("stage", "data"))
    if RANK in evens:
        assert sub.my_mpmd_axis_index == RANK // 2 and sub.local_groups == (RANK // 2,)
        assert sub.my_mpmd_group_mesh == mesh.my_mpmd_group_mesh == sub.lowering_mesh()
        assert sub.group_mesh(RANK // 2) == mesh.group_mesh(RANK)
        assert [sub.device_coords[d] for d in jax.local_devices()] == [
            (RANK // 2, j) for j in range(K)]
    else:
        assert sub.my_mpmd_axis_index is None and sub.local_groups == ()
        with pytest.raises(ValueError, match=f"holds no devices on this rank \\({RANK}\\)"):
            sub.lowering_mesh()
    with pytest.raises(ValueError, match="no communicator"):
        sub.comm
    assert mesh.mpmd_submesh(range(SIZE)).comm is mesh.comm


@pytest.mark.mpi(min_size=2)
def test_comm_is_a_congruent_duplicate(mesh):
    assert mesh.comm is not WORLD
    assert mesh.comm != WORLD
    assert MPI.Comm.Compare(mesh.comm, WORLD) == MPI.CONGRUENT
    assert mesh.comm.rank == RANK and mesh.comm.size == SIZE


@pytest.mark.mpi(min_size=2)
def test_wrong_rank_count_raises_everywhere():
    _raises_everywhere(
        lambda: make_mpmd_mesh((SIZE + 1, K), ("stage", "data"), "stage"),
        ValueError,
        rf"mesh wants {SIZE + 1} groups \(axis 'stage'\) but the job has {SIZE} ranks: "
        rf"run with mpirun -n {SIZE + 1}",
    )


@pytest.mark.mpi(min_size=2)
def test_wrong_device_count_raises_everywhere():
    _raises_everywhere(
        lambda: make_mpmd_mesh((SIZE, K + 1), ("stage", "data"), "stage"),
        ValueError,
        rf"each rank needs {K + 1} devices .*this rank has {K}: set "
        r"XLA_FLAGS=--xla_force_host_platform_device_count",
    )


@pytest.mark.mpi(min_size=2)
def test_local_style_mesh_under_mpi_raises_everywhere():
    if K < 2:
        jmesh = Mesh(np.array(jax.local_devices()), ("data",))
        # Explicit comm with an MPMD axis absent is fine (MPI mode) ...
        mm = MpmdMesh(jmesh, "stage", comm=WORLD)
        assert mm.mpmd_dim == SIZE and mm.comm is WORLD
        return
    # ... but an MPMD axis spanning several local groups is not, with K >= 2.
    jmesh = Mesh(np.array(jax.local_devices()[:2]), ("stage",))
    _raises_everywhere(lambda: MpmdMesh(jmesh, "stage"), ValueError,
                       rf"puts all 2 MPMD groups .* MPI job has {SIZE} ranks")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("owners", ["first", "last", "all", "even"])
def test_array_addressability(mesh, owners):
    ids = {"first": (0,), "last": (SIZE - 1,), "all": tuple(range(SIZE)),
           "even": tuple(range(0, SIZE, 2))}[owners]
    spec = P("data") if K > 1 else P()
    sharding = MpmdSharding(mesh, ids, spec)
    value = np.arange(4 * K * 3, dtype=np.float32).reshape(4 * K, 3)
    a = mpmd_array_from_local(mesh, value, sharding)
    owned = RANK in ids
    assert a.mpmd_idxs == frozenset(ids)
    assert a.is_partially_addressable == owned
    assert a.is_mpmd_replicated == (len(ids) > 1)
    assert a.shape == value.shape and a.dtype == np.float32
    # The value's sharding, known on every rank (JaxPP's): on the submesh of its groups.
    assert a.sharding == NamedSharding(mesh.mpmd_submesh(ids).jax_mesh, spec)
    np.testing.assert_array_equal(jaxpp_mpi.process_allgather(a), value)  # every rank
    if owned:
        local = a.to_mpmd_local_array
        assert isinstance(local, jax.Array)
        assert local.sharding.device_set == set(jax.local_devices())
        assert local.sharding == sharding.sharding_for(RANK)
        assert (a.sharding == local.sharding) == (len(ids) == 1)
        assert (a.first_mpmd_replica is local) == (RANK == min(ids))
    else:
        assert a.to_mpmd_local_array is None and a.first_mpmd_replica is None
        with pytest.raises(ValueError, match="shape and dtype must be given"):
            MpmdArray([], sharding)
    a.block_until_ready()
    a.delete()
    assert a.is_deleted()


@pytest.mark.mpi(min_size=2)
def test_a_cuda_mpi_problem_on_one_rank_raises_on_every_rank(monkeypatch):
    import jaxpp_mpi._src.arrays.make_mesh as make_mesh_mod

    problem = "MPI4JAX_USE_CUDA_MPI=1 makes mpi4jax hand GPU buffers to MPI"
    monkeypatch.setattr(make_mesh_mod, "cuda_mpi_problem",
                        lambda platforms: problem if RANK == 1 else None)
    _raises_everywhere(lambda: make_mpmd_mesh((SIZE, K), ("stage", "data"), "stage"),
                       ValueError, re.escape(problem) + r" \(rank\(s\) \[1\]\)$")


def test_query_cuda_support_agrees_with_ompi_info():
    """The library's own answer against `ompi_info`'s, for the Open MPI this job runs."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from jaxpp_mpi._src.mpi.cuda_mpi import query_cuda_support

    if not MPI.Get_library_version().startswith("Open MPI"):
        assert query_cuda_support() in (None, 0, 1)  # MPICH 4 answers too
        return
    ompi_info = shutil.which("ompi_info", path=f"{Path(sys.executable).parent}:"
                             f"{os.environ.get('PATH', '')}")
    assert ompi_info, "ompi_info not found beside python or on PATH"
    out = subprocess.run([ompi_info, "--parsable", "-l", "9", "--all"], capture_output=True,
                         text=True, timeout=60).stdout
    built = re.search(r"mpi_built_with_cuda_support:value:(\w+)", out)
    assert built, out[-2000:]
    assert query_cuda_support() == (built.group(1) == "true")
