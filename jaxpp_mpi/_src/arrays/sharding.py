"""MpmdSharding: which MPMD groups hold a value, and its layout inside each group.

The spec's MPMD axis is read as JaxPP reads it (`Note: MPMD axis in specs`); the value
itself is an `MpmdArray` (array.py, `Note: Array placement`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_mpi._src.arrays.mesh import MpmdMesh

__all__ = ["MpmdSharding", "spec_text", "spec_axis_names", "without_axis"]


def spec_text(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(entry) for entry in spec) + ")"


def spec_axis_names(spec: PartitionSpec) -> list[str]:
    names = []
    for entry in spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        names.extend(entry if isinstance(entry, tuple) else (entry,))
    return names


def without_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """`spec` with the mesh axis `axis` removed from every entry (`Note: MPMD axis in
    specs`): `P("mpmd", "data")` -> `P(None, "data")`, `P(("model", "mpmd"))` ->
    `P("model")`; `spec` itself when it does not name `axis`."""
    if axis not in spec_axis_names(spec):
        return spec
    entries = []
    for entry in spec:
        if isinstance(entry, tuple):
            kept = tuple(name for name in entry if name != axis)
            entry = kept[0] if len(kept) == 1 else (kept or None)
        elif entry == axis:
            entry = None
        entries.append(entry)
    return PartitionSpec(*entries)


# Note: MPMD axis in specs.
#   A spec naming the MPMD axis (in `in_shardings`, `out_shardings`, an `MpmdSharding`)
#   means what it means in JaxPP: JaxPP lays every value out on its "lowering mesh", the
#   group mesh with the MPMD axis kept at size 1 (`MpmdMesh.lowering_mesh`), and its
#   `MpmdSharding.__post_init__` filters the axis out of the spec (`filter_axes`) for
#   that reason: splitting a dimension one way leaves it whole. So the axis is dropped
#   with its meaning intact (`without_axis`), inside a tuple entry too. The MPMD axis
#   never says which groups hold a value (that is `mesh_ids`, or the step's placement),
#   and a value is never split across groups. Nor is a `jax.Array` laid out over the
#   MPMD axis: under MPI this rank's meshes have the axis at size 1, so such an array is
#   the whole array, as `jax.jit` made it on this rank (JaxPP's "initialise with SPMD,
#   then run the pipeline"); a step and `spmd_to_mpmd_reshard` take it as such (Note:
#   SPMD layouts in reshard/planning.py; `process_local=True` reads it as this rank's
#   block instead).


@dataclasses.dataclass(frozen=True)
class MpmdSharding:
    """The MPMD groups holding a value and its layout inside each group.

    Args:
      mpmd_mesh: the mesh.
      mesh_ids: the groups holding the value (any iterable of MPMD indexes, or one
        index); stored as a sorted tuple. Empty for a value no group holds (JaxPP's
        unused values: metadata only; `spmd_to_mpmd_reshard` places one on group 0,
        as JaxPP does).
      spec: a `PartitionSpec` over the group axes (`mpmd_mesh.group_axis_names`).
        The MPMD axis, if named, is dropped (`Note: MPMD axis in specs`), as JaxPP
        does. None means `PartitionSpec()`.

    Raises:
      ValueError: an index out of range, or a spec naming an unknown axis or an axis
        twice.
    """

    mpmd_mesh: MpmdMesh
    mesh_ids: tuple[int, ...]
    spec: PartitionSpec

    def __post_init__(self):
        if not isinstance(self.mpmd_mesh, MpmdMesh):
            raise TypeError(f"mpmd_mesh must be an MpmdMesh, got {type(self.mpmd_mesh)}")
        ids = self.mesh_ids
        ids = (ids,) if isinstance(ids, (int, np.integer)) else tuple(ids)
        if any(not isinstance(i, (int, np.integer)) or isinstance(i, bool) for i in ids):
            raise TypeError(f"mesh_ids must be MPMD indexes (ints), got {self.mesh_ids!r}")
        ids = tuple(sorted({int(i) for i in ids}))
        dim = self.mpmd_mesh.mpmd_dim
        if ids and (ids[0] < 0 or ids[-1] >= dim):
            raise ValueError(
                f"mesh_ids {ids} out of range: the mesh has {dim} groups (0..{dim - 1})"
            )
        spec = PartitionSpec() if self.spec is None else self.spec
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"spec must be a jax.sharding.PartitionSpec, got {spec!r}")
        spec = without_axis(spec, self.mpmd_mesh.mpmd_axis_name)
        names = spec_axis_names(spec)
        group_axes = self.mpmd_mesh.group_axis_names
        unknown = [n for n in names if n not in group_axes]
        if unknown:
            raise ValueError(
                f"spec {spec_text(spec)} names axes {unknown} that the group mesh lacks "
                f"(group axes: {group_axes})"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"spec {spec_text(spec)} names an axis more than once")
        object.__setattr__(self, "mesh_ids", ids)
        object.__setattr__(self, "spec", spec)

    def __repr__(self) -> str:
        return f"MpmdSharding(groups={self.mesh_ids}, spec={spec_text(self.spec)})"

    def sharding_for(self, mpmd_idx: int) -> NamedSharding:
        """The layout of the replica on group `mpmd_idx`: on that group's mesh with
        every axis, the MPMD axis of size 1 (`mpmd_mesh.unstack[mpmd_idx]`), as JaxPP
        lays values out (`Note: Array placement`).

        Raises:
          ValueError: the group does not hold the value, or (MPI mode) is another
            rank's group.
        """
        if mpmd_idx not in self.mesh_ids:
            raise ValueError(f"group {mpmd_idx} does not hold this value ({self!r})")
        return NamedSharding(self.mpmd_mesh.unstack[mpmd_idx], self.spec)

    @property
    def sharding(self) -> NamedSharding:
        """The value's layout over every group in `mesh_ids`, as JaxPP's: a
        `NamedSharding` on `mpmd_mesh.mpmd_submesh(mesh_ids).jax_mesh` (the MPMD axis of
        size `len(mesh_ids)`; the spec does not name it, so the value is replicated
        across the groups).

        In MPI mode, known on every rank: on the holder of a one-group value it is the
        replica's layout (`sharding_for`); elsewhere its mesh is an `AbstractMesh`
        (Note: Mesh modes in mesh.py), equal on every rank.

        Raises:
          ValueError: no group holds the value (empty `mesh_ids`).
        """
        if not self.mesh_ids:
            raise ValueError(f"{self!r} is held by no group (an unused value): it has no "
                             "sharding")
        return NamedSharding(self.mpmd_mesh.mpmd_submesh(self.mesh_ids).jax_mesh, self.spec)

    @property
    def local_mesh_ids(self) -> tuple[int, ...]:
        """The groups of `mesh_ids` whose devices this process holds."""
        return tuple(i for i in self.mesh_ids if i in self.mpmd_mesh.local_groups)
