"""`make_mpmd_mesh`: an `MpmdMesh` from the global mesh shape, like `jax.make_mesh`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType

from jaxpp_mpi._src.arrays import comms as mesh_module  # its hooks, patched in tests
from jaxpp_mpi._src.arrays.comms import Comm
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
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
    """Builds an `MpmdMesh` from the *global* mesh shape, like `jax.make_mesh`.

    Local mode when no `comm` is given, the MPI job has one process, the MPMD axis is
    larger than 1 and this process has all `prod(axis_shapes)` devices (the first ones
    are used); mpi4py is not imported then. Otherwise MPI mode: rank `r` of `comm`
    (default `collectives.world_dup()`) gets group `r`, built from its local devices.

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
        (data parallelism across pipelines, Note: Pipeline replicas in comms.py): with
        it of size R, the job runs R x P ranks, world rank replica x P + mpmd_idx. The
        group mesh has neither it nor the MPMD axis's extent.

    Returns:
      The `MpmdMesh`.

    Raises:
      ValueError: malformed shape or names; the MPMD axis size (times the replica
        axis size) differs from the number of ranks; a rank's device count differs
        from one group's size; a rank has GPUs and `MPI4JAX_USE_CUDA_MPI=1` but its MPI
        cannot move GPU buffers (`Note: CUDA-aware MPI check`). All are raised on every rank
        alike: the first two depend only on arguments and the job size, and the device
        counts and CUDA answers are allgathered over `comm` (in MPI mode this function
        is collective, like the `Dup` of the default communicator).
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
    group_devices = total // num_groups

    world_size = mesh_module._mpi_world_size() if comm is None else int(comm.Get_size())
    if num_replicas > 1 and num_groups * num_replicas != world_size:
        raise ValueError(
            f"mesh wants {num_replicas} replicas (axis {replica_axis_name!r}) of "
            f"{num_groups} groups (axis {mpmd_axis_name!r}), {num_replicas * num_groups} "
            f"ranks, but the job has {world_size}: run with mpirun -n "
            f"{num_replicas * num_groups} (launch/jpprun -n {num_replicas * num_groups}).")
    if comm is None and world_size == 1 and num_groups > 1:
        available = list(jax.devices() if devices is None else devices)
        if len(available) >= total:
            mesh = jax.make_mesh(shape, names, axis_types, devices=available[:total])
            return MpmdMesh(mesh, mpmd_axis_name, replica_axis_name=replica_axis_name)
        raise ValueError(
            f"mesh wants {num_groups} groups but the job has 1 rank: run with "
            f"mpirun -n {num_groups} (launch/jpprun -n {num_groups}), or, in one process, "
            f"provide {total} devices (this process has {len(available)}; e.g. "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={total} on CPU)."
        )
    if num_groups * num_replicas != world_size:
        raise ValueError(
            f"mesh wants {num_groups} groups (axis {mpmd_axis_name!r}) but the job has "
            f"{world_size} ranks: run with mpirun -n {num_groups} "
            f"(launch/jpprun -n {num_groups})."
        )
    local = list(jax.local_devices() if devices is None else devices)
    if comm is None:
        comm = mesh_module._default_comm()
    # Every rank learns every rank's device count and whether its GPU buffers may go to
    # MPI, so a problem on one rank raises on all of them (a communicator without
    # allgather, e.g. a test double: this rank's own).
    mine = (len(local), cuda_mpi_problem(d.platform for d in local))
    gather = getattr(comm, "allgather", None)
    reports = list(gather(mine)) if gather is not None else [mine]
    counts = [c for c, _ in reports]
    wrong = [r for r, c in enumerate(counts) if c != group_devices]
    if wrong:
        group = ", ".join(f"{n!r}: {s}" for n, s in zip(names, shape) if n != mpmd_axis_name)
        which = "" if len(wrong) == len(counts) else (
            f" (rank(s) {wrong} have {[counts[r] for r in wrong]})")
        raise ValueError(
            f"each rank needs {group_devices} devices (group {{{group}}}), this rank has "
            f"{len(local)}{which}: set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{group_devices} on CPU, or CUDA_VISIBLE_DEVICES to {group_devices} GPUs per "
            "rank, or pass devices= explicitly."
        )
    problems = {r: p for r, (_, p) in enumerate(reports) if p}
    if problems:
        ranks = "" if len(problems) == len(reports) else f" (rank(s) {sorted(problems)})"
        raise ValueError(f"{next(iter(problems.values()))}{ranks}")
    group_shape = tuple(1 if i == pos else s for i, s in enumerate(shape))
    mesh = jax.make_mesh(group_shape, names, axis_types, devices=local)
    return MpmdMesh(mesh, mpmd_axis_name, comm, num_replicas=num_replicas,
                    replica_axis_name=replica_axis_name)
