"""MpmdSharding and MpmdArray: where a value lives across MPMD groups, and the value.

Note: Array placement.
  An `MpmdArray` is one logical array held by the groups in its sharding's `mesh_ids`,
  replicated across them, each replica laid out by the same `spec` on its own group
  mesh. What this process holds of it (`partially_addressable_arrays`):
  - local mode: one `jax.Array` per group of `mesh_ids`, in `mesh_ids` order, the one
    of group `i` sharded by `sharding_for(i)`;
  - MPI mode: `[the replica of this rank's group]` when the rank is in `mesh_ids`,
    else `[]` (the array's shape and dtype are then given explicitly).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_mpi._src.mesh import MpmdMesh

__all__ = ["MpmdArray", "MpmdSharding", "mpmd_array_from_local"]


def _format_spec(spec: PartitionSpec) -> str:
    return "P(" + ", ".join(repr(entry) for entry in spec) + ")"


def _spec_axis_names(spec: PartitionSpec) -> list[str]:
    names = []
    for entry in spec:
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            continue
        names.extend(entry if isinstance(entry, tuple) else (entry,))
    return names


@dataclasses.dataclass(frozen=True)
class MpmdSharding:
    """The MPMD groups holding a value and its layout inside each group.

    Args:
      mpmd_mesh: the mesh.
      mesh_ids: the groups holding the value (any iterable of MPMD indexes, or one
        index); stored as a sorted tuple.
      spec: a `PartitionSpec` over the group axes (`mpmd_mesh.group_axis_names`);
        it must not name the MPMD axis. None means `PartitionSpec()`.

    Raises:
      ValueError: no groups, an index out of range, or a spec naming the MPMD axis, an
        unknown axis or an axis twice.
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
        if not ids:
            raise ValueError("MpmdSharding needs at least one MPMD group in mesh_ids")
        if ids[0] < 0 or ids[-1] >= dim:
            raise ValueError(
                f"mesh_ids {ids} out of range: the mesh has {dim} groups (0..{dim - 1})"
            )
        spec = PartitionSpec() if self.spec is None else self.spec
        if not isinstance(spec, PartitionSpec):
            raise TypeError(f"spec must be a jax.sharding.PartitionSpec, got {spec!r}")
        names = _spec_axis_names(spec)
        mpmd_axis = self.mpmd_mesh.mpmd_axis_name
        group_axes = self.mpmd_mesh.group_axis_names
        if mpmd_axis in names:
            raise ValueError(
                f"spec {_format_spec(spec)} names the MPMD axis {mpmd_axis!r}; an "
                "MpmdSharding's spec is the layout inside each group, over the group axes "
                f"{group_axes}. The groups holding the value are given by mesh_ids."
            )
        unknown = [n for n in names if n not in group_axes]
        if unknown:
            raise ValueError(
                f"spec {_format_spec(spec)} names axes {unknown} that the group mesh lacks "
                f"(group axes: {group_axes})"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"spec {_format_spec(spec)} names an axis more than once")
        object.__setattr__(self, "mesh_ids", ids)
        object.__setattr__(self, "spec", spec)

    def __repr__(self) -> str:
        return f"MpmdSharding(groups={self.mesh_ids}, spec={_format_spec(self.spec)})"

    def sharding_for(self, mpmd_idx: int) -> NamedSharding:
        """The layout of the replica on group `mpmd_idx`, on that group's mesh.

        Raises:
          ValueError: the group does not hold the value, or (MPI mode) is another
            rank's group.
        """
        if mpmd_idx not in self.mesh_ids:
            raise ValueError(f"group {mpmd_idx} does not hold this value ({self!r})")
        return NamedSharding(self.mpmd_mesh.group_mesh(mpmd_idx), self.spec)

    @property
    def sharding(self) -> NamedSharding:
        """A `NamedSharding` spanning the devices of every group in `mesh_ids`.

        In local mode its mesh is `mpmd_mesh.mpmd_submesh(mesh_ids)` and the spec does
        not name the MPMD axis, so the value is replicated across the groups. In MPI
        mode a rank knows only its own group: the result is `sharding_for(rank)`.

        Raises:
          ValueError: in MPI mode, on a rank whose group does not hold the value.
        """
        mesh = self.mpmd_mesh
        if mesh.is_local:
            return NamedSharding(mesh.mpmd_submesh(self.mesh_ids), self.spec)
        if mesh.my_mpmd_axis_index not in self.mesh_ids:
            raise ValueError(
                f"rank {mesh.my_mpmd_axis_index} does not hold this value ({self!r}); "
                "in MPI mode its sharding is known only on the owning ranks"
            )
        return self.sharding_for(mesh.my_mpmd_axis_index)

    @property
    def local_mesh_ids(self) -> tuple[int, ...]:
        """The groups of `mesh_ids` whose devices this process holds."""
        return tuple(i for i in self.mesh_ids if i in self.mpmd_mesh.local_groups)


class MpmdArray:
    """An array held by one or more MPMD groups (see Note: Array placement).

    Args:
      partially_addressable_arrays: this process's replicas, in `mesh_ids` order.
      mpmd_sharding: the groups holding the array and its per-group spec.
      shape: the array's shape; required when this process holds no replica.
      dtype: the array's dtype; required when this process holds no replica.

    Raises:
      ValueError: the replicas do not match `mpmd_sharding` (count, devices, layout)
        or disagree with `shape` / `dtype` or each other.
    """

    def __init__(
        self,
        partially_addressable_arrays: Sequence[jax.Array],
        mpmd_sharding: MpmdSharding,
        shape: tuple[int, ...] | None = None,
        dtype: Any = None,
    ):
        if not isinstance(mpmd_sharding, MpmdSharding):
            raise TypeError(f"mpmd_sharding must be an MpmdSharding, got {mpmd_sharding!r}")
        arrays = list(partially_addressable_arrays)
        local_ids = mpmd_sharding.local_mesh_ids
        if len(arrays) != len(local_ids):
            where = "in local mode" if mpmd_sharding.mpmd_mesh.is_local else (
                f"on rank {mpmd_sharding.mpmd_mesh.my_mpmd_axis_index}")
            raise ValueError(
                f"{mpmd_sharding!r} {where} needs {len(local_ids)} local array(s) (one per "
                f"group {local_ids}), got {len(arrays)}"
            )
        if not arrays and (shape is None or dtype is None):
            raise ValueError(
                "this process holds no replica of the array, so shape and dtype must be "
                "given explicitly"
            )
        want_shape = tuple(arrays[0].shape) if shape is None else tuple(int(d) for d in shape)
        want_dtype = np.dtype(arrays[0].dtype if dtype is None else dtype)
        for idx, arr in zip(local_ids, arrays):
            _check_replica(arr, idx, mpmd_sharding, want_shape, want_dtype)
        self._arrays = arrays
        self._mpmd_sharding = mpmd_sharding
        self._shape = want_shape
        self._dtype = want_dtype
        self._deleted = False

    @classmethod
    def _trusted(cls, arrays: list[jax.Array], mpmd_sharding: MpmdSharding,
                 shape: tuple[int, ...], dtype: np.dtype) -> MpmdArray:
        """An MpmdArray from replicas known to match (a compiled step's outputs, built
        with exactly these shardings): skips the per-replica checks of `__init__`."""
        self = cls.__new__(cls)
        self._arrays = arrays
        self._mpmd_sharding = mpmd_sharding
        self._shape = shape
        self._dtype = dtype
        self._deleted = False
        return self

    # -- placement ----------------------------------------------------------------

    @property
    def mpmd_sharding(self) -> MpmdSharding:
        """The groups holding the array and its per-group spec."""
        return self._mpmd_sharding

    @property
    def mpmd_idxs(self) -> frozenset[int]:
        """The MPMD groups holding the array."""
        return frozenset(self._mpmd_sharding.mesh_ids)

    @property
    def partially_addressable_arrays(self) -> list[jax.Array]:
        """This process's replicas, in `mesh_ids` order (see Note: Array placement)."""
        return list(self._arrays)

    @property
    def local_arrays(self) -> dict[int, jax.Array]:
        """This process's replicas by MPMD index."""
        return dict(zip(self._mpmd_sharding.local_mesh_ids, self._arrays))

    @property
    def is_partially_addressable(self) -> bool:
        """True when this process holds a replica (always, in local mode)."""
        return bool(self._arrays)

    @property
    def is_mpmd_replicated(self) -> bool:
        """True when more than one group holds the array."""
        return len(self._mpmd_sharding.mesh_ids) > 1

    @property
    def to_mpmd_local_array(self) -> jax.Array | list[jax.Array] | None:
        """This process's replica, or None when it holds none.

        In local mode the single array when one group holds it, and the list of
        replicas (in `mesh_ids` order) when several do.
        """
        if not self._arrays:
            return None
        if self._mpmd_sharding.mpmd_mesh.is_local and len(self._arrays) > 1:
            return list(self._arrays)
        return self._arrays[0]

    @property
    def first_mpmd_replica(self) -> jax.Array | None:
        """The replica of the lowest group in `mpmd_idxs`, when held here; else None."""
        first = self._mpmd_sharding.mesh_ids[0]
        return self.local_arrays.get(first)

    @property
    def sharding(self) -> NamedSharding:
        """`mpmd_sharding.sharding`: note it differs from a replica's sharding when the
        array is replicated on several groups."""
        return self._mpmd_sharding.sharding

    @property
    def spec(self) -> PartitionSpec:
        """The layout of each replica on its group mesh."""
        return self._mpmd_sharding.spec

    # -- abstract value -----------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def aval(self) -> jax.core.ShapedArray:
        """Shape and dtype as a `ShapedArray`."""
        return jax.core.ShapedArray(self._shape, self._dtype)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        """Bytes of one logical copy (not counting replicas or shards)."""
        return self.size * self._dtype.itemsize

    # -- lifetime -----------------------------------------------------------------

    def block_until_ready(self) -> MpmdArray:
        """Waits until this process's replicas are computed; returns self."""
        for arr in self._arrays:
            arr.block_until_ready()
        return self

    def delete(self) -> None:
        """Frees this process's replicas; the array is unusable afterwards."""
        for arr in self._arrays:
            if not arr.is_deleted():
                arr.delete()
        self._deleted = True

    def is_deleted(self) -> bool:
        """True after `delete()`, or when a replica was deleted (e.g. donated)."""
        return self._deleted or any(arr.is_deleted() for arr in self._arrays)

    # -- conversion ---------------------------------------------------------------

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        first = self.first_mpmd_replica
        if first is None and self._arrays:
            first = self._arrays[0]
        if first is None:
            mesh = self._mpmd_sharding.mpmd_mesh
            raise TypeError(
                f"{self!r} lives on groups {self._mpmd_sharding.mesh_ids}, not on this rank "
                f"({mesh.my_mpmd_axis_index}); bring it here first, e.g. with "
                "mpmd_to_spmd_reshard, or convert it on an owning rank"
            )
        out = np.asarray(first)
        if dtype is not None:
            out = out.astype(dtype, copy=False)
        return np.array(out, copy=True) if copy else out

    def __repr__(self) -> str:
        state = ", deleted" if self._deleted else ""
        return (f"MpmdArray(shape={self._shape}, dtype={self._dtype.name}, "
                f"groups={self._mpmd_sharding.mesh_ids}, "
                f"spec={_format_spec(self._mpmd_sharding.spec)}{state})")


def _check_replica(
    arr: Any, idx: int, mpmd_sharding: MpmdSharding, shape: tuple[int, ...],
    dtype: np.dtype,
) -> None:
    if not isinstance(arr, jax.Array):
        raise TypeError(f"replica for group {idx} must be a jax.Array, got {type(arr)}")
    if tuple(arr.shape) != shape or np.dtype(arr.dtype) != dtype:
        raise ValueError(
            f"replica for group {idx} is {np.dtype(arr.dtype).name}{list(arr.shape)}, "
            f"expected {dtype.name}{list(shape)}"
        )
    want = mpmd_sharding.sharding_for(idx)
    if arr.sharding.device_set != set(want.device_set):
        raise ValueError(
            f"replica for group {idx} is on devices {sorted(d.id for d in arr.sharding.device_set)}"
            f", but group {idx} has devices {sorted(d.id for d in want.device_set)}"
        )
    if not arr.sharding.is_equivalent_to(want, len(shape)):
        raise ValueError(
            f"replica for group {idx} is laid out as {arr.sharding}, not as "
            f"{_format_spec(mpmd_sharding.spec)} on the group mesh; device_put it with "
            f"mpmd_sharding.sharding_for({idx})"
        )


def mpmd_array_from_local(
    mpmd_mesh: MpmdMesh, value: Any, mpmd_sharding: MpmdSharding
) -> MpmdArray:
    """Places an ordinary array on every group of `mpmd_sharding` that this process holds.

    Every rank passes the same value; a rank whose group does not hold it keeps only its
    shape and dtype.

    Args:
      mpmd_mesh: the mesh (must equal `mpmd_sharding.mpmd_mesh`).
      value: a `jax.Array`, numpy array or scalar.
      mpmd_sharding: where the result lives.

    Returns:
      An `MpmdArray` holding `value`.
    """
    if mpmd_sharding.mpmd_mesh != mpmd_mesh:
        raise ValueError(f"{mpmd_sharding!r} belongs to another mesh than {mpmd_mesh!r}")
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        value = np.asarray(value)
    shape = tuple(value.shape)
    dtype = jax.dtypes.canonicalize_dtype(value.dtype)
    arrays = [jax.device_put(value, mpmd_sharding.sharding_for(i))
              for i in mpmd_sharding.local_mesh_ids]
    return MpmdArray(arrays, mpmd_sharding, shape=shape, dtype=dtype)

