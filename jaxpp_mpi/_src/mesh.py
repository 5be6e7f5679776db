"""MpmdMesh: a JAX mesh split into MPMD groups, one per MPI rank or all in one process.

Note: Mesh modes.
  An `MpmdMesh` is in one of two modes, fixed at construction:
  - *Local mode* (`is_local`): `jax_mesh` has the MPMD axis with size > 1 and every
    device belongs to this process. All `mpmd_dim` groups live here; group `i` is the
    slice `jax_mesh.devices` at index `i` along the MPMD axis. There is no MPI
    communicator and no MPMD index of "this process" (`my_mpmd_axis_index is None`).
  - *MPI mode*: `jax_mesh` is this rank's own group mesh (the MPMD axis absent or of
    size 1). Rank `r` of `comm` is MPMD index `r`, `mpmd_dim == comm.size`, and only
    this rank's group's devices are known here: asking for another group's mesh or
    devices is an error.
  The mode depends only on the mesh, the communicator's size and the MPI world size,
  which every rank sees the same way, so mode errors are raised on every rank alike.

Note: Default communicator.
  In MPI mode without an explicit `comm`, the mesh takes `collectives.world_dup()` (a
  duplicate of COMM_WORLD) once, at construction. `Dup` is collective: build an
  `MpmdMesh` at the same point of the program on every rank, and once per program
  (communicators are a finite resource in some MPI libraries). Every MPI-mode mesh hands
  its communicator to the MPI runtime (`runtime.mpi.adopt_comm`), which prepares the job
  for failures (Note: abort on exception in runtime/failure.py). Nothing here imports
  mpi4py; the MPI world size is read from an already-imported `mpi4py.MPI` or from the
  launcher's environment (`launch.env.job_world_size`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpp_mpi._src.launch.env import job_world_size

__all__ = ["MpmdMesh", "make_mpmd_mesh"]

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


def _is_addressable(device: Any) -> bool:
    return device.process_index == jax.process_index()


def _describe(mesh: Mesh) -> str:
    return ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())


class MpmdMesh:
    """A JAX mesh partitioned into MPMD groups along `mpmd_axis_name`.

    See Note: Mesh modes. Two meshes are equal (and hash equal) when their device
    layout, MPMD axis, mode and own MPMD index are equal; the communicator object is
    not compared.

    Args:
      jax_mesh: in local mode the whole mesh (MPMD axis of size > 1, all devices in
        this process); in MPI mode this rank's group mesh (MPMD axis of size 1, or
        absent).
      mpmd_axis_name: the axis that separates the groups.
      comm: the communicator whose rank `r` is MPMD index `r` (MPI mode). Defaults to
        `collectives.world_dup()` in MPI mode and to none in local mode. A communicator
        of size 1 may be given with a local-mode mesh.

    Raises:
      ValueError: the mesh and the process setting disagree (an MPMD axis of size > 1
        under an MPI job of several ranks, devices this process cannot address, an
        MPMD axis missing from a one-process mesh).
    """

    def __init__(self, jax_mesh: Mesh, mpmd_axis_name: str, comm: Comm | None = None):
        if not isinstance(jax_mesh, Mesh):
            raise TypeError(f"jax_mesh must be a jax.sharding.Mesh, got {type(jax_mesh)}")
        if not isinstance(mpmd_axis_name, str):
            raise TypeError(f"mpmd_axis_name must be a str, got {mpmd_axis_name!r}")
        names = tuple(jax_mesh.axis_names)
        has_axis = mpmd_axis_name in names
        axis_size = jax_mesh.shape[mpmd_axis_name] if has_axis else 1
        foreign = [d for d in jax_mesh.devices.flat if not _is_addressable(d)]
        comm_size = None if comm is None else int(comm.Get_size())
        world_size = _mpi_world_size() if comm is None else comm_size

        self._jax_mesh = jax_mesh
        self._mpmd_axis_name = mpmd_axis_name
        self._axis_pos = names.index(mpmd_axis_name) if has_axis else None
        self._group_axis_names = tuple(n for n in names if n != mpmd_axis_name)
        types = tuple(jax_mesh.axis_types)
        self._group_axis_types = tuple(t for n, t in zip(names, types) if n != mpmd_axis_name)

        if axis_size > 1:
            self._init_local(axis_size, foreign, world_size, comm)
        else:
            if not has_axis and comm is None and world_size == 1:
                raise ValueError(
                    f"mpmd_axis_name {mpmd_axis_name!r} is not an axis of the mesh "
                    f"({_describe(jax_mesh)}). In one process, give a mesh whose "
                    f"{mpmd_axis_name!r} axis spans the groups, e.g. "
                    f"make_mpmd_mesh((4, 2), ('{mpmd_axis_name}', 'data'), "
                    f"'{mpmd_axis_name}'); for a single MPI group, add the axis with "
                    "size 1 or pass comm= explicitly."
                )
            self._init_mpi(foreign, comm)

    def _init_local(self, axis_size: int, foreign: list, world_size: int, comm) -> None:
        name = self._mpmd_axis_name
        if foreign:
            raise ValueError(
                f"the mesh's MPMD axis {name!r} has size {axis_size} but {len(foreign)} "
                f"of its devices belong to other processes (e.g. {foreign[0]}). jaxpp_mpi "
                "does not use multi-controller JAX: under MPI, give each rank its own "
                f"group mesh ({name!r} of size 1, built from jax.local_devices()), or use "
                "make_mpmd_mesh."
            )
        if world_size > 1:
            raise ValueError(
                f"the mesh puts all {axis_size} MPMD groups (axis {name!r}) in this "
                f"process, but the MPI job has {world_size} ranks. Under MPI, give each "
                f"rank its own group mesh ({name!r} of size 1) or build the mesh with "
                "make_mpmd_mesh(global_shape, ...); for local mode, run one process."
            )
        self._is_local = True
        self._comm = comm
        self._mpmd_dim = axis_size
        self._my_idx = None
        self._group_meshes = tuple(
            Mesh(
                np.take(self._jax_mesh.devices, i, axis=self._axis_pos),
                self._group_axis_names,
                axis_types=self._group_axis_types,
            )
            for i in range(axis_size)
        )

    def _init_mpi(self, foreign: list, comm) -> None:
        if foreign:
            raise ValueError(
                f"in MPI mode the mesh must be this rank's group mesh, but {len(foreign)} "
                f"of its devices belong to other processes (e.g. {foreign[0]}). Build it "
                "from jax.local_devices(), or use make_mpmd_mesh."
            )
        if comm is None:
            comm = _default_comm()
        _adopt(comm)
        self._is_local = False
        self._comm = comm
        self._mpmd_dim = int(comm.Get_size())
        self._my_idx = int(comm.Get_rank())
        devices = self._jax_mesh.devices
        if self._axis_pos is not None:
            devices = np.take(devices, 0, axis=self._axis_pos)
            own = Mesh(devices, self._group_axis_names, axis_types=self._group_axis_types)
        else:
            own = self._jax_mesh
        self._group_meshes = (own,)

    # -- identity -----------------------------------------------------------------

    def _key(self) -> tuple:
        return (self._is_local, self._mpmd_axis_name, self._jax_mesh, self._mpmd_dim,
                self._my_idx)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MpmdMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        mode = "local" if self._is_local else f"mpi, rank={self._my_idx}"
        group = ", ".join(f"{n!r}: {s}" for n, s in self.group_shape.items())
        return (f"MpmdMesh({mode}, {self._mpmd_axis_name!r}: {self._mpmd_dim}, "
                f"group={{{group}}})")

    # -- properties ---------------------------------------------------------------

    @property
    def jax_mesh(self) -> Mesh:
        """The mesh given: all groups in local mode, this rank's group in MPI mode."""
        return self._jax_mesh

    @property
    def mpmd_axis_name(self) -> str:
        """Name of the axis that separates the MPMD groups."""
        return self._mpmd_axis_name

    @property
    def comm(self) -> Comm | None:
        """The communicator (MPI mode); None in local mode unless one was given."""
        return self._comm

    @property
    def is_local(self) -> bool:
        """True when every group lives in this process (see Note: Mesh modes)."""
        return self._is_local

    @property
    def mpmd_dim(self) -> int:
        """Number of MPMD groups."""
        return self._mpmd_dim

    @property
    def my_mpmd_axis_index(self) -> int | None:
        """This rank's MPMD index in MPI mode; None in local mode (it holds all groups)."""
        return self._my_idx

    @property
    def local_groups(self) -> tuple[int, ...]:
        """MPMD indexes whose devices this process holds: all in local mode, else (rank,)."""
        if self._is_local:
            return tuple(range(self._mpmd_dim))
        return (self._my_idx,)

    @property
    def group_axis_names(self) -> tuple[str, ...]:
        """Axis names of a group mesh: the mesh's axes without the MPMD axis."""
        return self._group_axis_names

    @property
    def group_shape(self) -> dict[str, int]:
        """Axis sizes of a group mesh, in axis order."""
        return dict(self._group_meshes[0].shape)

    @property
    def group_size(self) -> int:
        """Number of devices in one group."""
        return self._group_meshes[0].devices.size

    @property
    def unstack(self) -> list[Mesh]:
        """Every group's mesh, in MPMD index order (local mode only).

        Raises:
          ValueError: in MPI mode, where other ranks' devices are unknown here.
        """
        if not self._is_local:
            raise ValueError(
                "MpmdMesh.unstack needs every group's devices, which only a local-mode "
                f"mesh has; in MPI mode use group_mesh({self._my_idx}) or lowering_mesh()."
            )
        return list(self._group_meshes)

    # -- groups -------------------------------------------------------------------

    def _check_idx(self, mpmd_idx: int) -> int:
        if not isinstance(mpmd_idx, (int, np.integer)) or isinstance(mpmd_idx, bool):
            raise TypeError(f"an MPMD index must be an int, got {mpmd_idx!r}")
        mpmd_idx = int(mpmd_idx)
        if not 0 <= mpmd_idx < self._mpmd_dim:
            raise ValueError(
                f"MPMD index {mpmd_idx} is out of range: the mesh has {self._mpmd_dim} "
                f"groups (0..{self._mpmd_dim - 1})"
            )
        if not self._is_local and mpmd_idx != self._my_idx:
            raise ValueError(
                f"group {mpmd_idx} lives on MPI rank {mpmd_idx}; this is rank "
                f"{self._my_idx}, which knows only its own group's devices. Ask for "
                f"group {self._my_idx} (my_mpmd_axis_index), or check is_partially_"
                "addressable before touching a value's devices."
            )
        return mpmd_idx

    def group_mesh(self, mpmd_idx: int) -> Mesh:
        """The mesh of group `mpmd_idx`, without the MPMD axis.

        Raises:
          ValueError: the index is out of range, or (MPI mode) is another rank's group.
        """
        idx = self._check_idx(mpmd_idx)
        return self._group_meshes[idx if self._is_local else 0]

    def devices_of(self, mpmd_idx: int) -> tuple[Any, ...]:
        """Group `mpmd_idx`'s devices, flat in mesh order (same errors as `group_mesh`)."""
        return tuple(self.group_mesh(mpmd_idx).devices.flat)

    def lowering_mesh(self) -> Mesh:
        """The mesh stage executables are compiled for.

        In MPI mode this rank's group mesh. In local mode group 0's mesh: every group
        has the same shape, so a stage compiled for it is re-targeted to another group
        by its shardings on that group's mesh.
        """
        return self._group_meshes[0]

    def mpmd_submesh(self, mpmd_idxs: Iterable[int]) -> Mesh:
        """A mesh spanning groups `mpmd_idxs`, keeping the MPMD axis (of size len(idxs)).

        Args:
          mpmd_idxs: distinct MPMD indexes, in the order wanted along the MPMD axis.

        Returns:
          In local mode the slice of `jax_mesh` at those indexes along the MPMD axis.
          In MPI mode only `(my_mpmd_axis_index,)` is allowed, and the result is this
          rank's group mesh with the MPMD axis (size 1) in its place.

        Raises:
          ValueError: empty or repeated indexes, or another rank's group in MPI mode.
        """
        idxs = [self._check_idx(i) if self._is_local else i for i in mpmd_idxs]
        if not idxs or len(set(idxs)) != len(idxs):
            raise ValueError(f"mpmd_submesh needs distinct MPMD indexes, got {idxs}")
        names = tuple(self._jax_mesh.axis_names)
        types = tuple(self._jax_mesh.axis_types)
        if self._is_local:
            devices = np.take(self._jax_mesh.devices, idxs, axis=self._axis_pos)
            return Mesh(devices, names, axis_types=types)
        if len(idxs) != 1:
            raise ValueError(
                f"mpmd_submesh({idxs}) spans several MPI ranks; in MPI mode a rank holds "
                f"only its own group: use mpmd_submesh(({self._my_idx},))."
            )
        self._check_idx(idxs[0])
        if self._axis_pos is not None:
            return self._jax_mesh
        own = self._group_meshes[0]
        return Mesh(
            own.devices[np.newaxis],
            (self._mpmd_axis_name, *own.axis_names),
            axis_types=(AxisType.Auto, *own.axis_types),
        )


def make_mpmd_mesh(
    axis_shapes: Sequence[int],
    axis_names: Sequence[str],
    mpmd_axis_name: str,
    comm: Comm | None = None,
    devices: Sequence[Any] | None = None,
    *,
    axis_types: tuple[AxisType, ...] | None = None,
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

    Returns:
      The `MpmdMesh`.

    Raises:
      ValueError: malformed shape or names; the MPMD axis size differs from the number
        of ranks; a rank's device count differs from one group's size. All are raised
        on every rank alike: the first two depend only on arguments and the job size,
        and the device counts are allgathered over `comm` (in MPI mode this function
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
    pos = names.index(mpmd_axis_name)
    num_groups = shape[pos]
    total = math.prod(shape)
    group_devices = total // num_groups

    world_size = _mpi_world_size() if comm is None else int(comm.Get_size())
    if comm is None and world_size == 1 and num_groups > 1:
        available = list(jax.devices() if devices is None else devices)
        if len(available) >= total:
            mesh = jax.make_mesh(shape, names, axis_types, devices=available[:total])
            return MpmdMesh(mesh, mpmd_axis_name)
        raise ValueError(
            f"mesh wants {num_groups} groups but the job has 1 rank: run with "
            f"mpirun -n {num_groups} (launch/jpprun -n {num_groups}), or, in one process, "
            f"provide {total} devices (this process has {len(available)}; e.g. "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={total} on CPU)."
        )
    if num_groups != world_size:
        raise ValueError(
            f"mesh wants {num_groups} groups (axis {mpmd_axis_name!r}) but the job has "
            f"{world_size} ranks: run with mpirun -n {num_groups} "
            f"(launch/jpprun -n {num_groups})."
        )
    local = list(jax.local_devices() if devices is None else devices)
    if comm is None:
        comm = _default_comm()
    # Every rank learns every rank's device count, so a wrong count on one rank raises
    # on all of them (a communicator without allgather, e.g. a test double: this rank).
    gather = getattr(comm, "allgather", None)
    counts = list(gather(len(local))) if gather is not None else [len(local)]
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
    group_shape = tuple(1 if i == pos else s for i, s in enumerate(shape))
    mesh = jax.make_mesh(group_shape, names, axis_types, devices=local)
    return MpmdMesh(mesh, mpmd_axis_name, comm)
