"""The MPI side of an MpmdMesh: its communicators, where they come from, and the replica split.

Note: Pipeline replicas.
  In MPI mode a job may run `num_replicas` (R) copies of a P-group pipeline on R x P
  ranks: world rank = replica x P + mpmd_idx. The world communicator (`job_comm`) is
  split in two, on every rank alike at construction: `comm`, the P ranks of this
  rank's replica (its rank is the MPMD index, so every message path of one pipeline is
  unchanged), and `replica_comm`, the R ranks that run this rank's group in every
  replica (its rank is the replica index; gradients are combined over it, `Note:
  replicas` in compiler/replicas.py). Decisions that every rank must take alike
  (agreement, the per-call check, compile barriers, preemption, checkpoints) use
  `job_comm`. With one replica `job_comm is comm` and `replica_comm` is None. Local
  mode holds one replica.

Note: Default communicator.
  In MPI mode without an explicit `comm`, the mesh takes `collectives.world_dup()` (a
  duplicate of COMM_WORLD) once, at construction. `Dup` is collective: build an
  `MpmdMesh` at the same point of the program on every rank, and once per program
  (communicators are a finite resource in some MPI libraries). Every MPI-mode mesh hands
  its communicator to the MPI runtime (`runtime.mpi.adopt_comm`), which prepares the job
  for failures (Note: abort on exception in runtime/failure.py), and duplicates it once
  more, for the collective reads of values (Note: reading values, in fetch.py), so
  building an MPI-mode mesh is collective over its communicator, whoever made it.
  Nothing here imports mpi4py; the MPI world size is read from an already-imported
  `mpi4py.MPI` or from the launcher's environment (`launch.env.job_world_size`).
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Protocol

from jaxpp_mpi._src.launch.env import job_world_size

__all__ = ["Comm", "MeshComms", "open_comms"]


class Comm(Protocol):
    """What an `MpmdMesh` needs of a communicator (an `mpi4py.MPI.Comm` has it)."""

    def Get_rank(self) -> int: ...  # noqa: N802 - mpi4py's spelling

    def Get_size(self) -> int: ...  # noqa: N802 - mpi4py's spelling


def _mpi_world_size() -> int:
    """The MPI job's size, without importing mpi4py (see Note: Default communicator).

    Returns:
      `launch.env.job_world_size()`: 1 when neither an imported, initialised
      `mpi4py.MPI` nor the launcher's environment says otherwise.
    """
    return job_world_size()


def _default_comm() -> Comm:
    from jaxpp_mpi._src.mpi import collectives  # the MPI layer (imports mpi4py)

    return collectives.world_dup()


def _adopt(comm: Comm) -> None:
    """Hands an MPI-mode mesh's communicator to the MPI runtime (Note: Default communicator).

    Without an imported mpi4py no MPI job runs and `comm` is a stand-in (tests): the
    runtime, which imports mpi4py, is left unloaded.
    """
    if "mpi4py.MPI" not in sys.modules:
        return
    from jaxpp_mpi._src.runtime.mpi import adopt_comm

    adopt_comm(comm)


def _duplicate(comm: Comm) -> Comm:
    """A duplicate of `comm` for reading values (Note: Default communicator); `comm`
    itself for a stand-in without `Dup` (tests)."""
    dup = getattr(comm, "Dup", None)
    return comm if dup is None else dup()


def _split_replicas(job_comm: Comm, num_replicas: int) -> tuple[Comm, Comm | None, int]:
    """This rank's replica's pipeline communicator, its replica communicator and its
    replica index (Note: Pipeline replicas). Collective over `job_comm` when
    `num_replicas` > 1; `(job_comm, None, 0)` with one replica."""
    r = num_replicas
    if r == 1:
        return job_comm, None, 0
    size, rank = int(job_comm.Get_size()), int(job_comm.Get_rank())
    if size % r:
        raise ValueError(
            f"num_replicas={r} does not divide the job's {size} ranks: run R x P ranks "
            f"(mpirun -n {r}*P) for {r} replicas of a P-group pipeline")
    p = size // r
    replica_idx = rank // p
    pipeline = job_comm.Split(replica_idx, rank % p)
    replica_comm = job_comm.Split(rank % p, replica_idx)
    return pipeline, replica_comm, replica_idx


class MeshComms(NamedTuple):
    """The communicators of an MPI-mode mesh (Note: Pipeline replicas).

    Attributes:
      job: every rank of the job, as given or defaulted (`MpmdMesh.job_comm`).
      pipeline: the ranks of this rank's replica, rank = MPMD index (`MpmdMesh.comm`);
        `job` itself with one replica.
      replica: the ranks running this rank's group in every replica, rank = replica
        index; None with one replica.
      replica_idx: this rank's replica (0 with one replica).
      values: a duplicate of `pipeline`, for the collective reads of values (Note:
        Default communicator).
    """

    job: Comm
    pipeline: Comm
    replica: Comm | None
    replica_idx: int
    values: Comm


def open_comms(comm: Comm | None, num_replicas: int) -> MeshComms:
    """The communicators of a new MPI-mode mesh, made on every rank alike.

    Takes the default communicator when `comm` is None, hands it to the MPI runtime,
    splits it into replicas and duplicates the pipeline's for reading values, in that
    order (Notes: Default communicator, Pipeline replicas).

    Args:
      comm: the job's communicator, or None for `collectives.world_dup()`.
      num_replicas: copies of the pipeline in the job (already checked to be >= 1).

    Returns:
      The `MeshComms`.

    Raises:
      ValueError: `num_replicas` does not divide the communicator's size (on every rank
        alike, before any `Split`).
    """
    if comm is None:
        comm = _default_comm()
    _adopt(comm)
    pipeline, replica, replica_idx = _split_replicas(comm, num_replicas)
    return MeshComms(comm, pipeline, replica, replica_idx, _duplicate(pipeline))
