"""`make_mpmd_mesh`: an `MpmdMesh` from the global mesh shape, like `jax.make_mesh`."""

from __future__ import annotations

import contextlib
import math
import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
from jax.sharding import AxisType

from jaxpp_mpi._src.arrays import comms  # the mesh's MPI hooks, patched in tests
from jaxpp_mpi._src.arrays.comms import Comm
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.mesh_agreement import (
    MeshReport,
    differing_arguments_error,
    spell_arguments,
)
from jaxpp_mpi._src.launch.abort import raised_on_every_rank
from jaxpp_mpi._src.mpi.cuda_mpi import cuda_mpi_problem

__all__ = ["make_mpmd_mesh"]


def make_mpmd_mesh(
    axis_shapes: Sequence[int],
    axis_names: Sequence[str],
    mpmd_axis_name: str,
    comm: Comm | None = None,
    devices: Sequence[Any] | None = None,
    *,
    axis_types: tuple[AxisType, ...] | None = None,
    replica_axis_name: str | None = None,
) -> MpmdMesh:
    """Builds an `MpmdMesh` from the *global* mesh shape, like `jax.make_mesh`;
    collective in MPI mode: every rank of the job calls it alike.

    Local mode when no `comm` is given, the MPI job has one process, the MPMD axis is
    larger than 1 and this process has all `prod(axis_shapes)` devices (the first ones
    are used); mpi4py is not imported then. Otherwise MPI mode: rank `r` of `comm`
    (default `collectives.world_dup()`) gets group `r`, built from its local devices.
    In a job of several ranks (or with a `comm`) the ranks first compare their
    arguments (`Note: mesh agreement` in mesh_agreement.py).

    Unlike `jax.make_mesh`, axes default to `AxisType.Auto`: stage executables are
    partitioned by XLA's automatic sharding propagation.

    Args:
      axis_shapes: global axis sizes, MPMD axis included.
      axis_names: axis names, one per size.
      mpmd_axis_name: the axis that separates the groups.
      comm: communicator for MPI mode (see Note: Default communicator).
      devices: devices to use (local mode: at least the global count; MPI mode: this
        rank's, exactly one group's worth). Defaults to `jax.devices()` /
        `jax.local_devices()`.
      axis_types: per-axis types; default all `AxisType.Auto`.
      replica_axis_name: an axis of `axis_shapes` that counts copies of the pipeline
        (data parallelism across pipelines, Note: Pipeline replicas): with it of size
        R, the job runs R x P ranks, world rank replica x P + mpmd_idx. The group mesh
        has neither it nor the MPMD axis's extent.

    Returns:
      The `MpmdMesh`.

    Raises:
      ValueError: the ranks were given different arguments (naming each, with every
        rank's value); malformed shape or names; the MPMD axis size (times the replica
        axis size) differs from the number of ranks; a rank's device count differs
        from one group's size; a rank has GPUs and `MPI4JAX_USE_CUDA_MPI=1` but its MPI
        cannot move GPU buffers (`Note: CUDA-aware MPI check`). In MPI mode all are
        raised on every rank alike, before any communicator is made: the ranks'
        arguments, device counts and CUDA answers are allgathered over `comm` (or
        `MPI_COMM_WORLD`) first, under a deadline (this function is collective, like
        the `Dup` of the default communicator).
    """
    args = (axis_shapes, axis_names, mpmd_axis_name, axis_types, replica_axis_name)
    world_size = comms._mpi_world_size() if comm is None else int(comm.Get_size())
    agree_over = None  # where the ranks compare their arguments; None: one process
    if comm is None and world_size == 1:
        plan = _plan(*args)
        if plan.num_replicas == 1 and plan.num_groups > 1:
            return _local_mesh(plan, mpmd_axis_name, replica_axis_name, devices)
        _check_job_size(plan, world_size, mpmd_axis_name, replica_axis_name)
    local = list(jax.local_devices() if devices is None else devices)
    # Every rank learns every rank's arguments, device count and whether its GPU buffers
    # may go to MPI, so a problem on one rank raises on all of them.
    mine = MeshReport(spell_arguments(axis_shapes, axis_names, mpmd_axis_name,
                                      replica_axis_name, axis_types),
                      _mesh_words(*args), len(local),
                      cuda_mpi_problem(d.platform for d in local), axis_types is not None,
                      socket.gethostname())
    reports = [mine]
    if comm is not None or world_size > 1:
        agree_over = comm if comm is not None else _world_comm()
        reports = _agree(mine, agree_over)
        try:
            error = differing_arguments_error(reports)
            if error is not None:
                raise error
            plan = _plan(*args)
            _check_job_size(plan, world_size, mpmd_axis_name, replica_axis_name)
            _check_devices(plan, reports, len(local))
        except (TypeError, ValueError) as e:
            raised_on_every_rank(e)  # the peers raise it too (Note: abort before the mesh)
            raise
    else:
        _check_devices(plan, reports, len(local))
    group_shape = tuple(1 if i == plan.pos else s for i, s in enumerate(plan.shape))
    mesh = jax.make_mesh(group_shape, plan.names, plan.axis_types, devices=local)
    with _communicators(agree_over):
        if comm is None:
            comm = comms._default_comm()
        return MpmdMesh(mesh, mpmd_axis_name, comm, num_replicas=plan.num_replicas,
                        replica_axis_name=replica_axis_name)


def _local_mesh(plan: _Plan, mpmd_axis_name: str, replica_axis_name: str | None,
                devices: Sequence[Any] | None) -> MpmdMesh:
    """Local mode: every group in this process (Note: Mesh modes)."""
    available = list(jax.devices() if devices is None else devices)
    if len(available) >= plan.total:
        mesh = jax.make_mesh(plan.shape, plan.names, plan.axis_types,
                             devices=available[:plan.total])
        return MpmdMesh(mesh, mpmd_axis_name, replica_axis_name=replica_axis_name)
    raise ValueError(
        f"mesh wants {plan.num_groups} groups but the job has 1 rank: run with "
        f"mpirun -n {plan.num_groups} (launch/jpprun -n {plan.num_groups}), or, in one "
        f"process, provide {plan.total} devices (this process has {len(available)}; e.g. "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={plan.total} on CPU)."
    )


def _check_job_size(plan: _Plan, world_size: int, mpmd_axis_name: str,
                    replica_axis_name: str | None) -> None:
    """Raises unless the job has one rank per group of every replica."""
    ranks = plan.num_replicas * plan.num_groups
    if plan.num_replicas > 1 and ranks != world_size:
        raise ValueError(
            f"mesh wants {plan.num_replicas} replicas (axis {replica_axis_name!r}) of "
            f"{plan.num_groups} groups (axis {mpmd_axis_name!r}), {ranks} "
            f"ranks, but the job has {world_size}: run with mpirun -n "
            f"{ranks} (launch/jpprun -n {ranks}).")
    if ranks != world_size:
        raise ValueError(
            f"mesh wants {plan.num_groups} groups (axis {mpmd_axis_name!r}) but the job has "
            f"{world_size} ranks: run with mpirun -n {plan.num_groups} "
            f"(launch/jpprun -n {plan.num_groups})."
        )


def _check_devices(plan: _Plan, reports: Sequence[MeshReport], own: int) -> None:
    """Raises unless every rank has one group's devices and may hand its buffers to MPI."""
    counts = [r.devices for r in reports]
    wrong = [r for r, c in enumerate(counts) if c != plan.group_devices]
    if wrong:
        group = ", ".join(f"{n!r}: {s}" for i, (n, s) in enumerate(zip(plan.names, plan.shape))
                          if i != plan.pos)
        which = "" if len(wrong) == len(counts) else (
            f" (rank(s) {wrong} have {[counts[r] for r in wrong]})")
        raise ValueError(
            f"each rank needs {plan.group_devices} devices (group {{{group}}}), this rank "
            f"has {own}{which}: set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{plan.group_devices} on CPU, or CUDA_VISIBLE_DEVICES to {plan.group_devices} "
            "GPUs per rank, or pass devices= explicitly."
        )
    problems = {r: rep.cuda_problem for r, rep in enumerate(reports) if rep.cuda_problem}
    if problems:
        ranks = "" if len(problems) == len(reports) else f" (rank(s) {sorted(problems)})"
        raise ValueError(f"{next(iter(problems.values()))}{ranks}")


class _Plan(NamedTuple):
    """The mesh the arguments ask for, checked (the replica axis taken out)."""

    shape: tuple[int, ...]  # without the replica axis
    names: tuple[str, ...]
    axis_types: tuple[AxisType, ...]
    num_replicas: int
    pos: int  # of the MPMD axis in `shape`
    num_groups: int
    total: int  # devices of one replica
    group_devices: int
    words: str  # the global mesh, for messages


def _plan(axis_shapes, axis_names, mpmd_axis_name, axis_types, replica_axis_name) -> _Plan:
    """Checks the arguments alone (the same on every rank given the same arguments).

    Raises:
      ValueError: malformed shape, names or axis choice.
    """
    shape = tuple(int(s) for s in axis_shapes)
    names = tuple(axis_names)
    if len(shape) != len(names):
        raise ValueError(f"axis_shapes {shape} and axis_names {names} differ in length")
    if any(s < 1 for s in shape):
        raise ValueError(f"axis sizes must be positive, got {shape}")
    if len(set(names)) != len(names):
        raise ValueError(f"axis names must be distinct, got {names}")
    if mpmd_axis_name not in names:
        raise ValueError(
            f"mpmd_axis_name {mpmd_axis_name!r} is not one of the axis names {names}"
        )
    if axis_types is None:
        axis_types = (AxisType.Auto,) * len(names)
    axis_types = tuple(axis_types)
    words = "{" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, shape)) + "}"
    num_replicas = 1
    if replica_axis_name is not None:
        if replica_axis_name not in names or replica_axis_name == mpmd_axis_name:
            raise ValueError(
                f"replica_axis_name {replica_axis_name!r} must be one of the axis names "
                f"{names} other than the MPMD axis {mpmd_axis_name!r}")
        r_pos = names.index(replica_axis_name)
        num_replicas = shape[r_pos]
        keep = [i for i in range(len(names)) if i != r_pos]
        shape = tuple(shape[i] for i in keep)
        names = tuple(names[i] for i in keep)
        axis_types = tuple(axis_types[i] for i in keep)
    pos = names.index(mpmd_axis_name)
    num_groups = shape[pos]
    total = math.prod(shape)
    words += (f", MPMD axis {mpmd_axis_name!r}: {num_replicas} replica(s) of "
              f"{num_groups} group(s) of {total // num_groups} device(s)")
    return _Plan(shape, names, axis_types, num_replicas, pos, num_groups, total,
                 total // num_groups, words)


def _mesh_words(*args) -> str:
    """The global mesh the arguments give, in words, or why they give none."""
    try:
        return _plan(*args).words
    except (TypeError, ValueError) as e:
        return f"none ({type(e).__name__}: {e})"


def _world_comm() -> Comm:
    """MPI_COMM_WORLD, where the ranks compare their arguments when no `comm` is given
    (imports the MPI layer; patched in tests)."""
    from jaxpp_mpi._src.mpi import collectives  # the MPI layer (imports mpi4py)

    return collectives.world()


def _agree(mine: MeshReport, comm: Comm) -> list[MeshReport]:
    """Every rank's report, in one allgather under a deadline (`Note: mesh agreement`);
    `[mine]` for a communicator without allgather (a test's stand-in)."""
    if getattr(comm, "allgather", None) is None:
        return [mine]
    from jaxpp_mpi._src.runtime import agree, hosts  # up a layer, lazily (DESIGN.md section 3)

    reports = [MeshReport(*r) for r in agree.allgather(mine, comm, _AGREEMENT)]
    hosts.note_hosts(comm, [r.host for r in reports])  # Note: rank hosts
    return reports


def _communicators(comm: Comm | None):
    """The deadline the mesh's communicators are made under (`Note: mesh agreement`)."""
    if comm is None or getattr(comm, "Abort", None) is None:
        return contextlib.nullcontext()
    from jaxpp_mpi._src.runtime import failure  # up a layer, lazily (DESIGN.md section 3)

    return failure.deadline(_COMMUNICATORS, comm)


_AGREEMENT = "make_mpmd_mesh argument agreement"
_COMMUNICATORS = "make_mpmd_mesh communicators"
