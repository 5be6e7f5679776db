"""JaxPP's views of an `MpmdMesh`: group meshes with the MPMD axis kept, device maps.

JaxPP's `MpmdMesh` hands out per-group meshes that keep every axis (the MPMD axis with
size 1: `unstack`, `my_mpmd_group_mesh`) and maps from devices to their coordinates. In
MPI mode a rank knows only its own group's devices (Note: Mesh modes in `mesh.py`), so
the views here are partial there: they hold what this process has and name the rank
that has the rest. Where only the shape matters (a submesh of other ranks' groups), the
view is a `jax.sharding.AbstractMesh` (`abstract_groups`): the same on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

__all__ = ["DeviceMap", "GroupMeshes", "GroupViews", "abstract_groups", "device_coords",
           "stack_group"]


def stack_group(group: Mesh, axis_name: str, axis_pos: int,
                axis_type: AxisType = AxisType.Auto) -> Mesh:
    """A group mesh with the MPMD axis (size 1) put back at position `axis_pos`.

    Args:
      group: a group mesh, without the MPMD axis.
      axis_name: the MPMD axis's name.
      axis_pos: its position among the axes of the result.
      axis_type: its type.

    Returns:
      A mesh of the same devices whose axes are the group's with `axis_name` inserted.
    """
    names = list(group.axis_names)
    types = list(group.axis_types)
    names.insert(axis_pos, axis_name)
    types.insert(axis_pos, axis_type)
    return Mesh(np.expand_dims(group.devices, axis_pos), tuple(names),
                axis_types=tuple(types))


def abstract_groups(group_shape: Mapping[str, int], group_types: Sequence[AxisType],
                    axis_name: str, axis_pos: int, axis_type: AxisType,
                    num_groups: int) -> AbstractMesh:
    """The device-free mesh of `num_groups` groups side by side along the MPMD axis.

    Args:
      group_shape: a group mesh's axis sizes by name, in axis order (no MPMD axis).
      group_types: their `AxisType`s.
      axis_name: the MPMD axis's name.
      axis_pos: its position among the axes of the result.
      axis_type: its type.
      num_groups: its size.

    Returns:
      An `AbstractMesh` with the group's axes and the MPMD axis of size `num_groups`:
      equal on every rank that builds it from the same arguments.
    """
    names = list(group_shape)
    sizes = [group_shape[n] for n in names]
    types = list(group_types)
    names.insert(axis_pos, axis_name)
    sizes.insert(axis_pos, num_groups)
    types.insert(axis_pos, axis_type)
    return AbstractMesh(tuple(sizes), tuple(names), axis_types=tuple(types))


def device_coords(groups: Mapping[int, Mesh], axis_pos: int) -> dict[Any, tuple[int, ...]]:
    """Every device's coordinates in the whole mesh, MPMD axis included.

    Args:
      groups: MPMD index -> that group's mesh (without the MPMD axis), for the groups
        whose devices are known here.
      axis_pos: the MPMD axis's position in the whole mesh.

    Returns:
      device -> coordinates, whose entry at `axis_pos` is the device's MPMD index.
    """
    coords = {}
    for mpmd_idx, group in groups.items():
        for coord, device in np.ndenumerate(group.devices):
            coords[device] = (*coord[:axis_pos], mpmd_idx, *coord[axis_pos:])
    return coords


class DeviceMap(Mapping):
    """A read-only map keyed by device whose misses say which devices it knows.

    Args:
      items: the map's contents.
      missing: the sentence a lookup of another device raises `KeyError` with.
    """

    def __init__(self, items: Mapping[Any, Any], missing: str):
        self._items = dict(items)
        self._missing = missing

    def __getitem__(self, device: Any) -> Any:
        try:
            return self._items[device]
        except KeyError:
            raise KeyError(f"{device}: {self._missing}") from None

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"DeviceMap({self._items!r})"


class GroupMeshes(Sequence):
    """Every group's mesh by MPMD index, of which this process knows some.

    Indexing works like a list's (negative indexes, slices, `IndexError` past the end);
    an index whose mesh is not known here raises what `missing` raises, so iterating
    over it stops with that error at the first such group.

    Args:
      known: MPMD index -> that group's mesh, for the groups known here.
      size: the number of groups.
      missing: called with an MPMD index not in `known`; raises the error to give.
    """

    def __init__(self, known: Mapping[int, Mesh], size: int,
                 missing: Callable[[int], Any]):
        self._known = dict(known)
        self._size = size
        self._missing = missing

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._size))]
        i = int(index)
        if i < 0:
            i += self._size
        if not 0 <= i < self._size:
            raise IndexError(f"group index {index} out of range for {self._size} groups")
        if i not in self._known:
            self._missing(i)
            raise AssertionError(f"missing({i}) returned instead of raising")
        return self._known[i]

    def __repr__(self) -> str:
        known = ", ".join(f"{i}: {m!r}" for i, m in sorted(self._known.items()))
        return f"GroupMeshes({self._size} groups, known here: {{{known}}})"


class GroupViews:
    """`MpmdMesh`'s JaxPP views: `unstack`, `mpmd_idx_for_mesh`, `device_coords`,
    `device_mpmd_idx`, `my_mpmd_group_mesh`.

    A mixin built on `MpmdMesh`'s public members (`is_local`, `mpmd_dim`, `mpmd_axis`,
    `mpmd_axis_name`, `my_mpmd_axis_index`, `local_groups`, `group_mesh`) and two
    hooks: `_mpmd_axis_type` (the MPMD axis's `AxisType`) and `_require_held()`
    (raises on a rank holding none of an MPI-mode submesh's groups).
    """

    def _stacked(self, group: Mesh) -> Mesh:
        return stack_group(group, self.mpmd_axis_name, self.mpmd_axis, self._mpmd_axis_type)

    def _known_groups(self) -> dict[int, Mesh]:
        """MPMD index -> group mesh (without the MPMD axis), for the groups held here."""
        return {i: self.group_mesh(i) for i in self.local_groups}

    @functools.cached_property
    def unstack(self) -> Sequence[Mesh]:
        """Every group's mesh in MPMD index order, keeping all axes (MPMD axis size 1).

        As JaxPP's `unstack`: `unstack[i]` spans group `i`'s devices with the whole
        mesh's axis names (`group_mesh(i)` is the same devices without the MPMD axis).

        Returns:
          A list in local mode. In MPI mode a sequence of `mpmd_dim` meshes of which
          only this rank's entry is known: `unstack[my_mpmd_axis_index]` is its group,
          and any other entry (iteration included) raises the `ValueError` that
          `group_mesh` raises for another rank's group.
        """
        known = {i: self._stacked(g) for i, g in self._known_groups().items()}
        if self.is_local:
            return [known[i] for i in range(self.mpmd_dim)]
        return GroupMeshes(known, self.mpmd_dim, self.group_mesh)

    @property
    def mpmd_idx_for_mesh(self) -> dict[Mesh, int]:
        """Group mesh -> MPMD index, for the groups held here (JaxPP's lookup).

        Keys are each held group's mesh in both forms: `unstack[i]` (as in JaxPP) and
        `group_mesh(i)` (the mesh of values this package puts on group `i`). In MPI mode
        only this rank's group; `.get(mesh)` is None for a mesh of no group held here.
        """
        known = self._known_groups()
        lookup = {self._stacked(g): i for i, g in known.items()}
        lookup.update((g, i) for i, g in known.items())
        return lookup

    @functools.cached_property
    def device_coords(self) -> Mapping[Any, tuple[int, ...]]:
        """Device -> its coordinates in the whole mesh, axes as in `unstack`'s meshes.

        The entry at `mpmd_axis` is the device's MPMD index, so coordinates are the same
        in every mode. In MPI mode only this rank's devices are known (other ranks'
        device objects do not exist here); looking up another device raises `KeyError`.
        """
        return DeviceMap(device_coords(self._known_groups(), self.mpmd_axis),
                         self._unknown_device())

    @functools.cached_property
    def device_mpmd_idx(self) -> Mapping[Any, int]:
        """Device -> the MPMD index of its group (same devices known as `device_coords`)."""
        idx = {d: i for i, g in self._known_groups().items() for d in g.devices.flat}
        return DeviceMap(idx, self._unknown_device())

    def _unknown_device(self) -> str:
        if self.is_local:
            return "not a device of this mesh"
        return ("not a device of this rank's group; in MPI mode a rank knows only its own "
                "group's devices")

    @property
    def my_mpmd_group_mesh(self) -> Mesh:
        """This rank's group mesh with every axis (MPMD axis of size 1), MPI mode only.

        Raises:
          ValueError: in local mode, where this process holds every group (JaxPP allows
            it only on multi-process meshes too), or on a rank holding none of an
            MPI-mode submesh's groups.
        """
        if self.is_local:
            raise ValueError(
                "my_mpmd_group_mesh needs an MPI-mode mesh: a local-mode mesh holds all "
                f"{self.mpmd_dim} groups in this process. Use unstack[i] (with the MPMD "
                "axis) or group_mesh(i) (without it)."
            )
        self._require_held()
        return self._stacked(self.group_mesh(self.my_mpmd_axis_index))
