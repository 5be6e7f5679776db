"""An MPI-mode mesh's communicators (arrays/comms.py) over a stand-in MPI job of threads.

Each thread is a world rank; `Split` behaves as MPI_Comm_split does (every rank of the
communicator calls it; ranks of one color form a communicator, ordered by key, then by
their old rank). The expected layout is Note: Pipeline replicas' formula, world rank =
replica x P + mpmd_idx, written out here by hand.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxpp_mpi._src.arrays import comms
from jaxpp_mpi._src.arrays.mesh import MpmdMesh


class _Job:
    """The shared state of one stand-in MPI job: a rendezvous per collective call."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)
        self.lock = threading.Lock()
        self.calls: dict[tuple, dict[int, tuple[int, int]]] = {}


class ThreadComm:
    """A communicator of `_Job` ranks `members` (world ranks, in rank order)."""

    def __init__(self, job: _Job, members: tuple[int, ...], world_rank: int, name: str):
        self.job, self.members, self.world_rank, self.name = job, members, world_rank, name
        self.splits = 0
        self.dups = 0

    def Get_rank(self) -> int:  # noqa: N802
        return self.members.index(self.world_rank)

    def Get_size(self) -> int:  # noqa: N802
        return len(self.members)

    def Split(self, color: int, key: int) -> ThreadComm:  # noqa: N802
        self.splits += 1
        call = (self.name, self.splits)
        with self.job.lock:
            self.job.calls.setdefault(call, {})[self.world_rank] = (color, key)
        self.job.barrier.wait()  # every rank of the job takes part in these tests
        mine = self.job.calls[call]
        members = tuple(sorted((w for w in mine if mine[w][0] == color),
                               key=lambda w: (mine[w][1], self.members.index(w))))
        return ThreadComm(self.job, members, self.world_rank, f"{self.name}/{call[1]}")

    def Dup(self) -> ThreadComm:  # noqa: N802
        self.dups += 1
        return ThreadComm(self.job, self.members, self.world_rank, f"{self.name}+dup")


def _run_ranks(size: int, fn) -> list:
    """Runs `fn(world_comm)` on `size` thread ranks; their results in world rank order."""
    job = _Job(size)
    world = [ThreadComm(job, tuple(range(size)), w, "world") for w in range(size)]
    results: list = [None] * size

    def rank(w: int) -> None:
        try:
            results[w] = fn(world[w])
        except BaseException as e:  # noqa: BLE001 - handed to the test below
            results[w] = e
            job.barrier.abort()

    threads = [threading.Thread(target=rank, args=(w,)) for w in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a stand-in rank hung"
    return results


@pytest.mark.parametrize("replicas,groups", [(2, 2), (3, 2), (2, 3), (4, 1)])
def test_open_comms_splits_the_job_into_replicas(replicas, groups):
    results = _run_ranks(replicas * groups, lambda c: (c, comms.open_comms(c, replicas)))
    for w, (world, opened) in enumerate(results):
        replica, mpmd_idx = divmod(w, groups)  # world rank = replica x P + mpmd_idx
        assert opened.job is world
        assert opened.replica_idx == replica
        assert opened.pipeline.members == tuple(replica * groups + i for i in range(groups))
        assert opened.pipeline.Get_rank() == mpmd_idx
        assert opened.replica.members == tuple(r * groups + mpmd_idx for r in range(replicas))
        assert opened.replica.Get_rank() == replica
        # reads of values go over a duplicate of the pipeline's communicator
        assert opened.values.members == opened.pipeline.members
        assert opened.values is not opened.pipeline and opened.pipeline.dups == 1
        assert world.dups == 0


def test_open_comms_with_one_replica_neither_splits_nor_dups_the_job():
    results = _run_ranks(3, lambda c: (c, comms.open_comms(c, 1)))
    for world, opened in results:
        assert opened.job is world and opened.pipeline is world
        assert opened.replica is None and opened.replica_idx == 0
        assert world.splits == 0 and world.dups == 1
        assert opened.values.members == world.members


def test_replica_count_that_does_not_divide_the_job_raises_before_any_split():
    worlds: list[ThreadComm] = []
    results = _run_ranks(3, lambda c: worlds.append(c) or comms.open_comms(c, 2))
    for world, error in zip(worlds, results):
        assert isinstance(error, ValueError), error
        assert str(error).startswith("num_replicas=2 does not divide the job's 3 ranks: "
                                     "run R x P ranks (mpirun -n 2*P)")
        assert world.splits == 0


def test_open_comms_takes_the_default_communicator_when_none_is_given(monkeypatch):
    job = _Job(1)
    world = ThreadComm(job, (0,), 0, "world")
    monkeypatch.setattr(comms, "_default_comm", lambda: world)
    opened = comms.open_comms(None, 1)
    assert opened.job is world and opened.pipeline is world and world.dups == 1


def test_mesh_with_replicas_takes_its_fields_from_the_split():
    devices = np.array(jax.devices()[:1]).reshape(1, 1)

    def build(c: ThreadComm) -> MpmdMesh:
        return MpmdMesh(Mesh(devices, ("stage", "data")), "stage", c, num_replicas=2,
                        replica_axis_name="replica")

    for w, mesh in enumerate(_run_ranks(4, build)):
        assert not isinstance(mesh, BaseException), mesh
        replica, mpmd_idx = divmod(w, 2)
        assert mesh.num_replicas == 2 and mesh.replica_idx == replica
        assert mesh.mpmd_dim == 2 and mesh.my_mpmd_axis_index == mpmd_idx
        assert mesh.comm.members == (2 * replica, 2 * replica + 1)
        assert mesh.replica_comm.members == (mpmd_idx, 2 + mpmd_idx)
        assert mesh.job_comm.members == (0, 1, 2, 3)
        assert f"replica {replica} of 2" in repr(mesh)
