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
  `mpmd_submesh(idxs)` keeps the mode. In local mode it is the slice of `jax_mesh`
  (local even with one group). In MPI mode it is built on every rank alike from groups
  on ranks `idxs`: a member rank knows its own group, a non-member none
  (`local_groups == ()`), and unless `idxs` is every rank in order its MPMD indexes
  are not communicator ranks, so it has no `comm`: it describes groups, it runs
  nothing. Its `jax_mesh` is JaxPP's (every axis, the MPMD axis of size `len(idxs)`)
  as far as this process can hold it: on the rank of a one-group submesh that group's
  devices (`my_mpmd_group_mesh`), everywhere else the `AbstractMesh` of that shape
  (metadata, the same on every rank), so a value's `sharding` and a submesh compare
  alike on every rank. JaxPP's device-level views (`unstack`, `device_coords`, ...)
  are in `mesh_views.py`.
  The mode depends only on the mesh, the communicator's size and the MPI world size,
  which every rank sees the same way, so mode errors are raised on every rank alike.
  An MPI-mode mesh's communicators (where they come from, how replicas split the job's)
  are made by `comms.py` (Notes: Pipeline replicas, Default communicator).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxpp_mpi._src.arrays import comms  # its hooks, patched in tests
from jaxpp_mpi._src.arrays.comms import Comm
from jaxpp_mpi._src.arrays.mesh_views import GroupViews, abstract_groups

__all__ = ["MpmdMesh"]

def _is_addressable(device: Any) -> bool:
    return device.process_index == jax.process_index()


def _describe(mesh: Mesh) -> str:
    return ", ".join(f"{name!r}: {size}" for name, size in mesh.shape.items())


class MpmdMesh(GroupViews):
    """A JAX mesh partitioned into MPMD groups along `mpmd_axis_name`; building one in
    MPI mode is collective: every rank of its communicator builds it alike.

    See Note: Mesh modes. Two meshes are equal (and hash equal) when their device
    layout, MPMD axis, mode, own MPMD index and (MPI mode) ranks are equal; the
    communicator object is not compared.

    `with mpmd_mesh:` makes it the innermost entry of `MpmdMesh.mesh_stack`, as in
    JaxPP; it sets no JAX mesh (no `jax.set_mesh`): each group's executables are
    compiled on that group's mesh, and inside a step a bare `PartitionSpec` needs no
    mesh context (Note: sharding constraints in `retarget.py`).

    Args:
      jax_mesh: in local mode the whole mesh (MPMD axis of size > 1, all devices in
        this process); in MPI mode this rank's group mesh (MPMD axis of size 1, or
        absent).
      mpmd_axis_name: the axis that separates the groups.
      comm: the communicator whose rank `r` is MPMD index `r` (MPI mode), or, with
        `num_replicas` > 1, whose rank `replica x mpmd_dim + mpmd_idx` runs group
        `mpmd_idx` of pipeline replica `replica` (Note: Pipeline replicas in
        comms.py). Defaults to `collectives.world_dup()` in MPI mode and to none in
        local mode. A communicator of size 1 may be given with a local-mode mesh.
      num_replicas: copies of the pipeline in the MPI job (MPI mode only).
      replica_axis_name: the name of the replica axis in `make_mpmd_mesh`'s global
        shape, if it had one (for messages and specs; the group mesh lacks it).

    Raises:
      ValueError: the mesh and the process setting disagree (an MPMD axis of size > 1
        under an MPI job of several ranks, devices this process cannot address, an
        MPMD axis missing from a one-process mesh).
    """

    mesh_stack: ClassVar[list[MpmdMesh]] = []

    def __init__(self, jax_mesh: Mesh, mpmd_axis_name: str, comm: Comm | None = None, *,
                 num_replicas: int = 1, replica_axis_name: str | None = None):
        if not isinstance(jax_mesh, Mesh):
            raise TypeError(f"jax_mesh must be a jax.sharding.Mesh, got {type(jax_mesh)}")
        if not isinstance(mpmd_axis_name, str):
            raise TypeError(f"mpmd_axis_name must be a str, got {mpmd_axis_name!r}")
        has_axis = mpmd_axis_name in tuple(jax_mesh.axis_names)
        axis_size = jax_mesh.shape[mpmd_axis_name] if has_axis else 1
        foreign = [d for d in jax_mesh.devices.flat if not _is_addressable(d)]
        comm_size = None if comm is None else int(comm.Get_size())
        world_size = comms._mpi_world_size() if comm is None else comm_size
        self._setup(jax_mesh, mpmd_axis_name)
        if (not isinstance(num_replicas, (int, np.integer)) or isinstance(num_replicas, bool)
                or num_replicas < 1):
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        self._num_replicas = int(num_replicas)
        self._replica_axis_name = replica_axis_name
        self._replica_idx = 0
        self._replica_comm = None

        if axis_size > 1:
            if num_replicas > 1:
                raise ValueError(
                    f"pipeline replicas (num_replicas={num_replicas}) need MPI mode: one "
                    "rank per (replica, group), e.g. make_mpmd_mesh((R, P, ...), "
                    "('replica', 'stage', ...), 'stage', replica_axis_name='replica') "
                    "under mpirun -n R*P; this mesh puts every group in one process.")
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

    def _setup(self, jax_mesh: Mesh, mpmd_axis_name: str) -> None:
        """Sets the fields that depend only on the mesh and the axis name."""
        names = tuple(jax_mesh.axis_names)
        types = tuple(jax_mesh.axis_types)
        self._jax_mesh = jax_mesh
        self._mpmd_axis_name = mpmd_axis_name
        self._axis_pos = names.index(mpmd_axis_name) if mpmd_axis_name in names else None
        # Without the axis (MPI mode), meshes built here put it first (`mpmd_axis`).
        self._mpmd_axis = 0 if self._axis_pos is None else self._axis_pos
        self._mpmd_axis_type = AxisType.Auto if self._axis_pos is None else types[
            self._axis_pos]
        self._group_axis_names = tuple(n for n in names if n != mpmd_axis_name)
        self._group_axis_types = tuple(t for n, t in zip(names, types) if n != mpmd_axis_name)
        self._group_shape = {n: s for n, s in jax_mesh.shape.items() if n != mpmd_axis_name}

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
        self._read_comm = None
        self._mpmd_dim = axis_size
        self._my_idx = None
        self._my_rank = None
        self._ranks = None
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
        opened = comms.open_comms(comm, self._num_replicas)
        self._is_local = False
        self._job_comm = opened.job
        self._replica_comm, self._replica_idx = opened.replica, opened.replica_idx
        self._comm = opened.pipeline
        self._mpmd_dim = int(opened.pipeline.Get_size())
        self._my_rank = self._my_idx = int(opened.pipeline.Get_rank())
        self._ranks = tuple(range(self._mpmd_dim))
        self._root_comm = opened.pipeline
        self._read_comm = opened.values
        devices = self._jax_mesh.devices
        if self._axis_pos is not None:
            devices = np.take(devices, 0, axis=self._axis_pos)
            own = Mesh(devices, self._group_axis_names, axis_types=self._group_axis_types)
        else:
            own = self._jax_mesh
        self._group_meshes = (own,)

    # -- replicas -----------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        """Copies of the pipeline in the job (Note: Pipeline replicas in comms.py); 1 in
        local mode."""
        return self._num_replicas

    @property
    def replica_idx(self) -> int:
        """This rank's pipeline replica (0 with one replica, and in local mode)."""
        return self._replica_idx

    @property
    def replica_axis_name(self) -> str | None:
        """The replica axis's name in the global mesh shape, if it was given one."""
        return self._replica_axis_name

    @property
    def replica_comm(self) -> Comm | None:
        """The ranks running this rank's group in every replica (rank = replica index);
        None with one replica."""
        return self._replica_comm

    @property
    def job_comm(self) -> Comm | None:
        """Every rank of the job (every replica's pipeline); `comm` with one replica.

        Raises:
          ValueError: as `comm`, for an MPI-mode submesh without a communicator.
        """
        if self._num_replicas == 1:
            return self.comm
        return self._job_comm

    # -- identity -----------------------------------------------------------------

    def _key(self) -> tuple:
        return (self._is_local, self._mpmd_axis_name, self._jax_mesh, self._mpmd_dim,
                self._my_idx, self._my_rank, self._ranks, self._num_replicas,
                self._replica_idx)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MpmdMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        if self._is_local:
            mode = "local"
        else:
            mode = f"mpi, rank={self._my_rank}"
            if self._ranks != tuple(range(self._mpmd_dim)):
                mode += f", groups on ranks {list(self._ranks)}"
            if self._num_replicas > 1:
                mode += f", replica {self._replica_idx} of {self._num_replicas}"
        group = ", ".join(f"{n!r}: {s}" for n, s in self.group_shape.items())
        return (f"MpmdMesh({mode}, {self._mpmd_axis_name!r}: {self._mpmd_dim}, "
                f"group={{{group}}})")

    def __enter__(self) -> MpmdMesh:
        """Pushes this mesh on `MpmdMesh.mesh_stack` (see the class docstring)."""
        MpmdMesh.mesh_stack.append(self)
        return self

    def __exit__(self, *exc_info) -> None:
        if not MpmdMesh.mesh_stack or MpmdMesh.mesh_stack[-1] is not self:
            raise RuntimeError(
                f"leaving `with {self!r}:` but it is not the innermost mesh entered "
                "(MpmdMesh.mesh_stack was changed inside the block); nest `with` "
                "blocks instead of calling __enter__/__exit__ by hand."
            )
        MpmdMesh.mesh_stack.pop()

    # -- properties ---------------------------------------------------------------

    def _require_held(self) -> None:
        if not self._is_local and self._my_idx is None:
            raise ValueError(
                f"{self!r} holds no devices on this rank ({self._my_rank}): its groups "
                f"live on MPI ranks {list(self._ranks)}. Check local_groups (empty here) "
                "before asking for its devices."
            )

    @property
    def jax_mesh(self) -> Mesh | AbstractMesh:
        """The mesh given: all groups in local mode, this rank's group in MPI mode.

        For an MPI-mode `mpmd_submesh` (Note: Mesh modes): the group mesh with the MPMD
        axis (size 1) on the rank of a one-group submesh, else the `AbstractMesh` of the
        submesh's groups (the MPMD axis of size `mpmd_dim`), on every rank alike.
        """
        return self._jax_mesh

    @property
    def _values_comm(self) -> Comm | None:
        """The communicator of collective reads (Note: reading values, in fetch.py):
        a duplicate of `comm`; None in local mode and for a submesh without `comm`."""
        return self._read_comm

    @property
    def mpmd_axis_name(self) -> str:
        """Name of the axis that separates the MPMD groups."""
        return self._mpmd_axis_name

    @property
    def mpmd_axis(self) -> int:
        """Position of the MPMD axis among the whole mesh's axes (JaxPP's `mpmd_axis`).

        The axis along which the devices split into groups: `device_coords[d][mpmd_axis]`
        is device `d`'s MPMD index. In MPI mode with a group mesh that lacks the MPMD
        axis, 0: the meshes built here (`unstack`, `my_mpmd_group_mesh`,
        `mpmd_submesh`) put it first.
        """
        return self._mpmd_axis

    @property
    def comm(self) -> Comm | None:
        """The communicator (MPI mode); None in local mode unless one was given.

        Raises:
          ValueError: an MPI-mode `mpmd_submesh` of other groups than all ranks in
            order: its MPMD indexes are not a communicator's ranks, so it has none.
        """
        if self._comm is None and not self._is_local:
            raise ValueError(
                f"{self!r} is a submesh of MPI ranks {list(self._ranks)}: its MPMD "
                "indexes are not its ranks, so it has no communicator. Pipelines, "
                "reshards, checkpoints and traces run on the full mesh (every rank, "
                "MPMD index = rank): pass the mesh the submesh was taken from."
            )
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
        """This rank's MPMD index in MPI mode; None in local mode (it holds all groups).

        Also None on a rank that holds none of an MPI-mode `mpmd_submesh`'s groups.
        """
        return self._my_idx

    @property
    def local_groups(self) -> tuple[int, ...]:
        """MPMD indexes whose devices this process holds: all in local mode, else (rank,).

        Empty on a rank that holds none of an MPI-mode `mpmd_submesh`'s groups.
        """
        if self._is_local:
            return tuple(range(self._mpmd_dim))
        return () if self._my_idx is None else (self._my_idx,)

    @property
    def group_axis_names(self) -> tuple[str, ...]:
        """Axis names of a group mesh: the mesh's axes without the MPMD axis."""
        return self._group_axis_names

    @property
    def group_shape(self) -> dict[str, int]:
        """Axis sizes of a group mesh, in axis order."""
        return dict(self._group_shape)

    @property
    def group_size(self) -> int:
        """Number of devices in one group."""
        return math.prod(self._group_shape.values())

    # -- groups -------------------------------------------------------------------

    def _check_range(self, mpmd_idx: int) -> int:
        if not isinstance(mpmd_idx, (int, np.integer)) or isinstance(mpmd_idx, bool):
            raise TypeError(f"an MPMD index must be an int, got {mpmd_idx!r}")
        mpmd_idx = int(mpmd_idx)
        if not 0 <= mpmd_idx < self._mpmd_dim:
            raise ValueError(
                f"MPMD index {mpmd_idx} is out of range: the mesh has {self._mpmd_dim} "
                f"groups (0..{self._mpmd_dim - 1})"
            )
        return mpmd_idx

    def _check_idx(self, mpmd_idx: int) -> int:
        mpmd_idx = self._check_range(mpmd_idx)
        if not self._is_local and mpmd_idx != self._my_idx:
            where = (f"group {mpmd_idx} lives on MPI rank {self._ranks[mpmd_idx]}; this is "
                     f"rank {self._my_rank}")
            if self._my_idx is None:
                raise ValueError(f"{where}, which holds none of the groups of {self!r}. "
                                 "Check local_groups before touching devices.")
            raise ValueError(
                f"{where}, which knows only its own group's devices. Ask for group "
                f"{self._my_idx} (my_mpmd_axis_index), or check is_partially_addressable "
                "before touching a value's devices."
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
        """The mesh a stage's values are laid out on, as JaxPP's: a group mesh with every
        axis, the MPMD axis of size 1, so a spec naming it splits nothing.

        In MPI mode this rank's group (`my_mpmd_group_mesh`). In local mode group 0's
        (`unstack[0]`): every group has the same shape, so a stage laid out for it is
        re-targeted to another group by its shardings on that group's mesh.
        `group_mesh(i)` is the same devices without the MPMD axis.

        Raises:
          ValueError: a rank holding none of an MPI-mode submesh's groups.
        """
        self._require_held()
        return self._stacked(self._group_meshes[0])

    def mpmd_submesh(self, mpmd_idxs: Iterable[int]) -> MpmdMesh:
        """The `MpmdMesh` of groups `mpmd_idxs`, group `mpmd_idxs[k]` becoming group `k`.

        Args:
          mpmd_idxs: distinct MPMD indexes, in the order wanted along the MPMD axis.

        Returns:
          In local mode the `MpmdMesh` of the slice of `jax_mesh` at those indexes along the
          MPMD axis, local even for one group. In MPI mode an MPI-mode mesh of the
          groups on those ranks, on every rank alike: a member rank knows its own group
          (`my_mpmd_axis_index` is then its position in `mpmd_idxs`), a rank holding
          none of them gets `local_groups == ()`; its `jax_mesh` is this rank's group
          with the MPMD axis (size 1) for a one-group submesh of this rank, else the
          `AbstractMesh` of the groups (Note: Mesh modes). Unless `mpmd_idxs` is every
          group in order, it has no communicator (`comm` raises): it describes groups,
          and cannot run a pipeline.

        Raises:
          ValueError: empty, repeated or out-of-range indexes.
          TypeError: an index that is not an int.
        """
        idxs = tuple(self._check_range(i) for i in mpmd_idxs)
        if not idxs or len(set(idxs)) != len(idxs):
            raise ValueError(f"mpmd_submesh needs distinct MPMD indexes, got {list(idxs)}")
        sub = object.__new__(MpmdMesh)
        if self._is_local:
            names = tuple(self._jax_mesh.axis_names)
            devices = np.take(self._jax_mesh.devices, idxs, axis=self._axis_pos)
            sub._setup(Mesh(devices, names, axis_types=tuple(self._jax_mesh.axis_types)),
                       self._mpmd_axis_name)
            sub._num_replicas, sub._replica_idx, sub._replica_comm = 1, 0, None
            sub._replica_axis_name = self._replica_axis_name
            sub._init_local(len(idxs), [], 1, self._comm)
            return sub
        mine = self._my_idx in idxs
        for field in ("_mpmd_axis_name", "_mpmd_axis", "_mpmd_axis_type",
                      "_group_axis_names", "_group_axis_types", "_group_shape",
                      "_num_replicas", "_replica_axis_name", "_replica_idx",
                      "_replica_comm", "_job_comm"):
            setattr(sub, field, getattr(self, field))
        sub._jax_mesh = (self.my_mpmd_group_mesh if mine and len(idxs) == 1 else
                         abstract_groups(self._group_shape, self._group_axis_types,
                                         self._mpmd_axis_name, self._mpmd_axis,
                                         self._mpmd_axis_type, len(idxs)))
        sub._axis_pos = self._mpmd_axis
        sub._is_local = False
        sub._mpmd_dim = len(idxs)
        sub._my_rank = self._my_rank
        sub._my_idx = idxs.index(self._my_idx) if mine else None
        sub._ranks = tuple(self._ranks[i] for i in idxs)
        sub._root_comm = self._root_comm
        every_rank = tuple(range(int(self._root_comm.Get_size())))
        sub._comm = self._root_comm if sub._ranks == every_rank else None
        sub._read_comm = self._values_comm if sub._comm is not None else None
        sub._group_meshes = self._group_meshes if mine else ()
        return sub
