"""Placement plans: where each leaf of a tree lives (`compile(...).in_shardings`), as JSON.

A plan file is {"format": "jaxpp_mpi.plan", "version": 1, "mpmd_axis_name": "stage",
"mpmd_dim": 4, "group_shape": [["data", 1]], "entries": [{"path": [[kind, key], ...],
"mesh_ids": [...], "spec": [...], "shape": [...] | null, "dtype": str | null}, ...]},
paths and specs encoded as in a checkpoint manifest (see Note: Checkpoint format).
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding
from jaxpp_mpi._src.base.types import PyTree, Spec
from jaxpp_mpi._src.checkpoint import format as fmt

__all__ = ["Plan", "PlanEntry", "plan_from_shardings"]

FORMAT = "jaxpp_mpi.plan"
VERSION = 1


@dataclasses.dataclass(frozen=True)
class PlanEntry:
    """Where one leaf lives; `shape` / `dtype` are None when the plan was saved without
    them."""

    path: fmt.KeyPath
    mesh_ids: tuple[int, ...]
    spec: tuple[fmt.SpecEntry, ...]
    shape: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def placement(self) -> fmt.Placement:
        return fmt.Placement(self.mesh_ids, self.spec)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A placement plan: per leaf key path, its groups and spec, for an MPMD mesh of
    `mpmd_dim` groups whose group mesh has axes `group_shape`."""

    mpmd_axis_name: str
    mpmd_dim: int
    group_shape: tuple[tuple[str, int], ...]
    entries: tuple[PlanEntry, ...]

    def by_path(self) -> dict[fmt.KeyPath, PlanEntry]:
        return {e.path: e for e in self.entries}

    def to_json(self) -> str:
        entries = [{"path": [list(p) for p in e.path], "mesh_ids": list(e.mesh_ids),
                    "spec": fmt.spec_json(e.spec),
                    "shape": None if e.shape is None else list(e.shape), "dtype": e.dtype}
                   for e in self.entries]
        head = json.dumps({"format": FORMAT, "version": VERSION,
                           "mpmd_axis_name": self.mpmd_axis_name, "mpmd_dim": self.mpmd_dim,
                           "group_shape": [list(a) for a in self.group_shape]})
        return fmt.dump_with_list(head, "entries", entries)

    @classmethod
    def from_json(cls, text: str, where: str = "plan") -> Plan:
        """Parses and checks a plan file's text.

        Raises:
          CheckpointError: malformed JSON or any field out of shape.
        """
        raw = fmt._load_json(text, where)
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise fmt.CheckpointError(f"{where}: not a {FORMAT} version {VERSION} file")
        axis, dim, group = raw.get("mpmd_axis_name"), raw.get("mpmd_dim"), raw.get("group_shape")
        if not isinstance(axis, str) or not (fmt._is_int(dim) and dim >= 1):
            raise fmt.CheckpointError(f"{where}: bad mpmd_axis_name or mpmd_dim")
        if not (isinstance(group, list) and all(
                isinstance(a, list) and len(a) == 2 and isinstance(a[0], str)
                and fmt._is_int(a[1]) and a[1] >= 1 for a in group)):
            raise fmt.CheckpointError(f"{where}: group_shape must be [[axis, size], ...]")
        entries, seen = [], set()
        raw_entries = raw.get("entries")
        if not isinstance(raw_entries, list):
            raise fmt.CheckpointError(f"{where}: entries must be a list")
        for i, item in enumerate(raw_entries):
            at = f"{where}: entry {i}"
            if not isinstance(item, dict):
                raise fmt.CheckpointError(f"{at} is not an object")
            path = fmt._decode_key_path(item.get("path"), at)
            if path in seen:
                raise fmt.CheckpointError(f"{at}: path {fmt.format_key_path(path)} repeats")
            seen.add(path)
            shape, dtype = item.get("shape"), item.get("dtype")
            shape = None if shape is None else fmt.decode_shape(shape, at)
            if dtype is not None:
                fmt.decode_dtype(dtype, at)
            entries.append(PlanEntry(path, fmt.decode_mesh_ids(item.get("mesh_ids"), at, dim),
                                     fmt._decode_spec(item.get("spec"), at), shape, dtype))
        return cls(axis, dim, tuple((a, s) for a, s in group), tuple(entries))

    def problems_with(self, manifest: fmt.Manifest) -> list[str]:
        """Every way this plan does not fit `manifest`'s leaves (empty when it fits):
        missing or extra key paths, shapes and dtypes, specs the group mesh cannot
        split the leaf by."""
        mine = self.by_path()
        theirs = {leaf.path: leaf for leaf in manifest.leaves}
        out = [f"the checkpoint has {fmt.format_key_path(p)}, the plan does not place it"
               for p in theirs if p not in mine]
        out += [f"the plan places {fmt.format_key_path(p)}, the checkpoint has no such leaf"
                for p in mine if p not in theirs]
        sizes = dict(self.group_shape)
        for path, leaf in theirs.items():
            entry = mine.get(path)
            if entry is None:
                continue
            name = fmt.format_key_path(path)
            if entry.shape is not None and entry.shape != leaf.shape:
                out.append(f"{name}: the plan has shape {list(entry.shape)}, the checkpoint "
                           f"{list(leaf.shape)}")
            if entry.dtype is not None and entry.dtype != leaf.dtype:
                out.append(f"{name}: the plan has dtype {entry.dtype}, the checkpoint "
                           f"{leaf.dtype}")
            out += [f"{name}: {p}" for p in _spec_problems(entry.spec, leaf.shape, sizes)]
        return out

    def shardings_like(self, like: PyTree, mpmd_mesh: MpmdMesh) -> PyTree:
        """A pytree like `like` holding, per leaf, the plan's `MpmdSharding` on
        `mpmd_mesh` (None for leaves the plan does not place).

        Raises:
          CheckpointError: the mesh's group count or group axes differ from the plan's.
        """
        group = tuple(mpmd_mesh.group_shape.items())
        if mpmd_mesh.mpmd_dim != self.mpmd_dim or group != self.group_shape:
            raise fmt.CheckpointError(
                f"the plan is for {self.mpmd_dim} groups of {dict(self.group_shape)}, the mesh "
                f"has {mpmd_mesh.mpmd_dim} groups of {dict(group)}"
            )
        paths, _, treedef = fmt.flatten_with_paths(like)
        mine = self.by_path()
        out = [None if p not in mine else
               MpmdSharding(mpmd_mesh, mine[p].mesh_ids, PartitionSpec(*mine[p].spec))
               for p in paths]
        return jax.tree.unflatten(treedef, out)


def _spec_problems(spec: Spec, shape: tuple[int, ...], sizes: dict[str, int]) -> list[str]:
    if len(spec) > len(shape):
        return [f"spec has {len(spec)} entries for {len(shape)} dimensions"]
    out, used = [], []
    for dim, entry in enumerate(spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        unknown = [a for a in axes if a not in sizes]
        if unknown:
            out.append(f"spec names axes {unknown} the group mesh lacks ({list(sizes)})")
            continue
        used += axes
        parts = math.prod(sizes[a] for a in axes)
        if shape[dim] % parts:
            out.append(f"dimension {dim} of size {shape[dim]} does not split into {parts}")
    if len(set(used)) != len(used):
        out.append("spec names an axis twice")
    return out


def plan_from_shardings(shardings: PyTree, like: PyTree = None) -> Plan:
    """The plan of a pytree of `MpmdSharding`s (None leaves are skipped).

    Args:
      shardings: e.g. `compile(...).in_shardings`, or a sub-tree of it matching a
        checkpoint's tree.
      like: optional pytree of arrays (or anything with shape and dtype) with the same
        key paths, whose shapes and dtypes the plan then records.

    Raises:
      CheckpointError: no shardings, or shardings on different meshes.
    """
    paths, leaves, _ = fmt.flatten_with_paths(shardings)
    bad = [fmt.format_key_path(p) for p, s in zip(paths, leaves)
           if not isinstance(s, MpmdSharding)]
    if bad:
        raise fmt.CheckpointError(f"leaves {bad[:5]} are not MpmdShardings")
    if not leaves:
        raise fmt.CheckpointError("the shardings tree has no MpmdSharding leaf")
    meshes = {s.mpmd_mesh for s in leaves}
    if len(meshes) != 1:
        raise fmt.CheckpointError("the shardings live on different MPMD meshes")
    mesh = leaves[0].mpmd_mesh
    avals = {}
    if like is not None:
        like_paths, like_leaves, _ = fmt.flatten_with_paths(like)
        for p, x in zip(like_paths, like_leaves):
            if isinstance(x, MpmdArray) or hasattr(x, "shape"):
                avals[p] = (tuple(int(d) for d in x.shape), fmt.dtype_name(x.dtype))
            else:
                v = np.asarray(x)
                avals[p] = (v.shape, fmt.dtype_name(v.dtype))
    entries = tuple(PlanEntry(p, s.mesh_ids, fmt.encode_spec(s.spec), *avals.get(p, (None, None)))
                    for p, s in zip(paths, leaves))
    return Plan(mesh.mpmd_axis_name, mesh.mpmd_dim, tuple(mesh.group_shape.items()), entries)
