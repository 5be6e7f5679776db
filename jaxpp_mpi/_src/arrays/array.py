"""MpmdSharding and MpmdArray: where a value lives across MPMD groups, and the value.

Note: Array placement.
  An `MpmdArray` is one logical array held by the groups in its sharding's `mesh_ids`,
  replicated across them, each replica laid out by the same `spec` on its own group
  mesh. What this process holds of it (`partially_addressable_arrays`, in MPMD index
  order):
  - local mode: a replica for any subset of `mesh_ids`, each on its group's devices
    and sharded by `sharding_for(i)`: all of them (what `mpmd_array_from_local` and a
    compiled step give), some (partially addressable) or none (metadata only);
  - MPI mode: `[the replica of this rank's group]` when the rank is in `mesh_ids`,
    else `[]`. A holding rank must hold its replica: ranks move data without agreeing
    first, so a holder without data would fail mid-step on that rank alone.
  With no replica here the array's shape and dtype are given explicitly. `mesh_ids`
  may be empty (JaxPP's unused values): metadata only, everywhere. A replica placed
  here (`sharding_for`: reshards, `mpmd_init`, checkpoints) lies on its group's mesh
  with every axis, the MPMD axis of size 1 (`MpmdMesh.unstack[i]`), as JaxPP's; a
  step's results lie on the same devices without that axis (`group_mesh(i)`), an
  equivalent layout.

Note: implicit reads are local.
  What needs the value (`np.asarray`, `float`, `int`, `bool`, `complex`,
  `operator.index`, iteration) reads the lowest replica held here and sends no message,
  in either mode. Where this process holds no replica it raises `RuntimeError` at once
  (as `np.asarray` of a `jax.Array` spanning other processes' devices does), naming the
  array's shape, dtype and holding groups and the two ways to read it: the replica held
  on those groups' ranks (`x.to_mpmd_local_array`), or `jaxpp_mpi.process_allgather`,
  the explicit read that every rank makes (`Note: reading values` in driver/fetch.py).
  So a guard like `if x.is_partially_addressable: float(x)` never waits for a peer, and
  this module needs nothing from the layers above it. `format(x)` and `str(x)` (f-strings,
  print) never raise or communicate: the value where held, else the repr, a placeholder
  naming shape, dtype and groups.
"""

from __future__ import annotations

import collections
import math
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding, spec_text

__all__ = ["MpmdArray", "mpmd_array_from_local"]


class MpmdArray:
    """An array held by one or more MPMD groups (see Note: Array placement).

    Args:
      partially_addressable_arrays: this process's replicas, each a `jax.Array` on the
        devices of one group of `mesh_ids` (any order; each group at most once). Local
        mode: any subset of the groups, none for a metadata-only array. MPI mode: the
        replica of this rank's group when it is in `mesh_ids`, else none.
      mpmd_sharding: the groups holding the array and its per-group spec.
      shape: the array's shape; required when this process holds no replica.
      dtype: the array's dtype; required when this process holds no replica.

    Raises:
      ValueError: a replica is not on one group of `mesh_ids` (or, MPI mode, the
        count is not this rank's), two are on one group, or a replica's layout, shape
        or dtype disagrees with `mpmd_sharding`, `shape`, `dtype` or the others.
      TypeError: a replica is not a `jax.Array`, or `mpmd_sharding` not an
        `MpmdSharding`.
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
        mesh = mpmd_sharding.mpmd_mesh
        local_ids = mpmd_sharding.local_mesh_ids
        if not mesh.is_local and len(arrays) != len(local_ids):
            raise ValueError(
                f"{mpmd_sharding!r} on rank {mesh.my_mpmd_axis_index} needs "
                f"{len(local_ids)} local array(s) (one per group {local_ids}), got "
                f"{len(arrays)}: a rank holds its group's replica exactly when its group "
                "is in mesh_ids"
            )
        if not arrays and (shape is None or dtype is None):
            raise ValueError(
                "this process holds no replica of the array, so shape and dtype must be "
                "given explicitly"
            )
        want_shape = tuple(arrays[0].shape) if shape is None else tuple(int(d) for d in shape)
        want_dtype = np.dtype(arrays[0].dtype if dtype is None else dtype)
        by_group: dict[int, tuple[int, jax.Array]] = {}
        for j, arr in enumerate(arrays):
            idx = _group_of(arr, j, mpmd_sharding)
            if idx in by_group:
                raise ValueError(f"local arrays {by_group[idx][0]} and {j} are both on "
                                 f"group {idx}'s devices; give each group's replica once")
            _check_replica(arr, idx, mpmd_sharding, want_shape, want_dtype)
            by_group[idx] = (j, arr)
        ids = tuple(sorted(by_group))
        self._arrays = [by_group[i][1] for i in ids]
        self._ids = None if ids == local_ids else ids
        self._mpmd_sharding = mpmd_sharding
        self._shape = want_shape
        self._dtype = want_dtype
        self._weak_type = False
        self._deleted = False

    @classmethod
    def _trusted(cls, arrays: list[jax.Array], mpmd_sharding: MpmdSharding,
                 shape: tuple[int, ...], dtype: np.dtype, weak_type: bool = False
                 ) -> MpmdArray:
        """An MpmdArray from replicas known to match (a compiled step's outputs, built
        with exactly these shardings, one per group of `local_mesh_ids`): skips the
        per-replica checks of `__init__`. `weak_type` as `jax.jit`'s result has it."""
        self = cls.__new__(cls)
        self._arrays = arrays
        self._ids = None
        self._mpmd_sharding = mpmd_sharding
        self._shape = shape
        self._dtype = dtype
        self._weak_type = weak_type
        self._deleted = False
        return self

    @property
    def _held_ids(self) -> tuple[int, ...]:
        """The groups whose replicas this process holds, in MPMD index order."""
        ids = self._ids
        return self._mpmd_sharding.local_mesh_ids if ids is None else ids

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
        """This process's replicas, in MPMD index order (see Note: Array placement)."""
        return list(self._arrays)

    @property
    def local_arrays(self) -> dict[int, jax.Array]:
        """This process's replicas by MPMD index."""
        return dict(zip(self._held_ids, self._arrays))

    @property
    def is_partially_addressable(self) -> bool:
        """True when this process holds a replica of the array (of some group)."""
        return bool(self._arrays)

    @property
    def is_mpmd_replicated(self) -> bool:
        """True when more than one group holds the array."""
        return len(self._mpmd_sharding.mesh_ids) > 1

    @property
    def to_mpmd_local_array(self) -> jax.Array | list[jax.Array] | None:
        """This process's replica, or None when it holds none.

        In local mode the single array when this process holds one replica, and the
        list of replicas (in MPMD index order) when it holds several.
        """
        if not self._arrays:
            return None
        if self._mpmd_sharding.mpmd_mesh.is_local and len(self._arrays) > 1:
            return list(self._arrays)
        return self._arrays[0]

    @property
    def _partially_addressable_arrays(self) -> collections.OrderedDict[int, jax.Array]:
        """JaxPP's private view of this process's replicas: MPMD index -> replica, in
        index order (`local_arrays`, ordered; JaxPP's tutorial reads it)."""
        return collections.OrderedDict(zip(self._held_ids, self._arrays))

    @property
    def _mpmd_local_sharding(self) -> NamedSharding:
        """JaxPP's private per-group layout: `spec` on `lowering_mesh()` (the MPMD axis
        of size 1), known on every rank that holds a group (JaxPP's tests read it)."""
        return NamedSharding(self._mpmd_sharding.mpmd_mesh.lowering_mesh(),
                             self._mpmd_sharding.spec)

    @property
    def first_mpmd_replica(self) -> jax.Array | None:
        """The replica of the lowest group in `mpmd_idxs`, when held here; else None."""
        first = self._mpmd_sharding.mesh_ids[0]
        return self.local_arrays.get(first)

    @property
    def sharding(self) -> NamedSharding:
        """`mpmd_sharding.sharding`, on every rank: note it differs from a replica's
        sharding when the array is replicated on several groups."""
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
    def weak_type(self) -> bool:
        """Whether the value is weakly typed (a step's result as `jax.jit` types it)."""
        return self._weak_type

    @property
    def aval(self) -> jax.core.ShapedArray:
        """Shape, dtype and weak type as a `ShapedArray`."""
        return jax.core.ShapedArray(self._shape, self._dtype, weak_type=self._weak_type)

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

    # -- conversion (Note: implicit reads are local) ---------------------------------

    def _value_replica(self, op: str) -> jax.Array:
        """The lowest replica held here, read without any message (see Note: implicit
        reads are local).

        Raises:
          RuntimeError: this process holds no replica; the message names the array's
            shape, dtype and holders, and how to read it.
        """
        if self._arrays:
            return self._arrays[0]
        ids = self._mpmd_sharding.mesh_ids
        mesh = self._mpmd_sharding.mpmd_mesh
        what = (f"{op} of an MpmdArray of shape {self._shape} and dtype {self._dtype.name} "
                f"held by groups {ids}")
        if mesh.is_local:
            raise RuntimeError(
                f"{what}: this process holds no replica of it (metadata only: built "
                f"without the arrays of groups {ids}); build it with its data, e.g. "
                "mpmd_array_from_local(mesh, value, mpmd_sharding)")
        if not ids:
            raise RuntimeError(f"{what}: no group holds its value (an unused value's "
                               "metadata), so no rank can read it")
        raise RuntimeError(
            f"{what}, not by this rank's group ({mesh.my_mpmd_axis_index}): an implicit "
            "read never sends a message. Read it where it is held, on a rank of groups "
            f"{ids} (x.to_mpmd_local_array; e.g. `if x.is_partially_addressable: "
            "float(x)`), or on every rank at once, explicitly: "
            "jaxpp_mpi.process_allgather(x) (collective: every rank of the pipeline calls "
            "it)")

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """The value as a numpy array, read where held; raises elsewhere (see Note:
        implicit reads are local)."""
        kwargs = {} if copy is None else {"copy": copy}
        return np.asarray(self._value_replica("np.asarray"), dtype=dtype, **kwargs)

    def __format__(self, format_spec: str) -> str:
        """The value formatted where held, else the repr; never raises for lack of a
        replica, never communicates (Note: implicit reads are local)."""
        if not self._arrays:  # as a jax.Array spanning other processes' devices does
            return repr(self)
        return format(self._arrays[0], format_spec)

    def __str__(self) -> str:
        """The value where held (as `str` of a `jax.Array`), else the repr; no message."""
        return str(self._arrays[0]) if self._arrays else repr(self)

    def __bool__(self) -> bool:
        return bool(self._value_replica("bool()"))

    def __int__(self) -> int:
        return int(self._value_replica("int()"))

    def __float__(self) -> float:
        return float(self._value_replica("float()"))

    def __complex__(self) -> complex:
        return complex(self._value_replica("complex()"))

    def __index__(self) -> int:
        return operator.index(self._value_replica("operator.index()"))

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of unsized object")  # as numpy and jax.Array say
        return self._shape[0]

    def __iter__(self) -> Iterator[jax.Array]:
        """Iterates the first axis of the value held here, as `jax.Array`s (raises where
        none is held, as `np.asarray` does)."""
        if not self._shape:
            raise TypeError("iteration over a 0-d array")  # as numpy and jax.Array say
        return iter(self._value_replica("iteration"))

    def __repr__(self) -> str:
        state = ", deleted" if self._deleted else ""
        return (f"MpmdArray(shape={self._shape}, dtype={self._dtype.name}, "
                f"groups={self._mpmd_sharding.mesh_ids}, "
                f"spec={spec_text(self._mpmd_sharding.spec)}{state})")


def _group_of(arr: Any, j: int, mpmd_sharding: MpmdSharding) -> int:
    """The group of `mesh_ids` whose devices local array `j` is on.

    Raises:
      TypeError: `arr` is not a `jax.Array`.
      ValueError: its devices are not those of one group of `mesh_ids` held here.
    """
    if not isinstance(arr, jax.Array):
        raise TypeError(f"local array {j} must be a jax.Array, got {type(arr)}")
    mesh = mpmd_sharding.mpmd_mesh
    devices = arr.sharding.device_set
    found = [g for g in mesh.local_groups if devices == set(mesh.devices_of(g))]
    if not found:
        groups = ", ".join(f"group {g}: {sorted(d.id for d in mesh.devices_of(g))}"
                           for g in mpmd_sharding.local_mesh_ids)
        where = "" if mesh.is_local else f" on rank {mesh.my_mpmd_axis_index}"
        raise ValueError(
            f"local array {j} is on devices {sorted(d.id for d in devices)}, not on the "
            f"devices of one group of {mpmd_sharding!r}{where} ({groups}); device_put "
            "it with mpmd_sharding.sharding_for(group)"
        )
    if found[0] not in mpmd_sharding.mesh_ids:
        raise ValueError(
            f"local array {j} is on group {found[0]}'s devices, but {mpmd_sharding!r} "
            f"places the array on groups {mpmd_sharding.mesh_ids}"
        )
    return found[0]


def _check_replica(
    arr: jax.Array, idx: int, mpmd_sharding: MpmdSharding, shape: tuple[int, ...],
    dtype: np.dtype,
) -> None:
    if tuple(arr.shape) != shape or np.dtype(arr.dtype) != dtype:
        raise ValueError(
            f"replica for group {idx} is {np.dtype(arr.dtype).name}{list(arr.shape)}, "
            f"expected {dtype.name}{list(shape)}"
        )
    want = mpmd_sharding.sharding_for(idx)
    if not arr.sharding.is_equivalent_to(want, len(shape)):
        raise ValueError(
            f"replica for group {idx} is laid out as {arr.sharding}, not as "
            f"{spec_text(mpmd_sharding.spec)} on the group mesh; device_put it with "
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

