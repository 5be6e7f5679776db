"""What a save writes: the tree's manifest, agreed by every rank, and the leaves each rank
writes (`Note: Checkpoints with replicas` in checkpoint/store.py says who writes what)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.comms import _mpi_world_size
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding
from jaxpp_mpi._src.base.types import PyTree
from jaxpp_mpi._src.checkpoint import format as fmt
from jaxpp_mpi._src.checkpoint.commit import Producer, Ranks
from jaxpp_mpi._src.checkpoint.format import CheckpointError, Manifest

__all__ = ["Described", "abstract", "describe_save", "mesh_of", "ranks_of", "writers_of"]


def ranks_of(mesh: MpmdMesh | None, label: str = "checkpoint collective") -> Ranks:
    """Every rank of `mesh`'s job, every replica's (this process alone in local mode);
    their collectives wait under the deadline `label` (`Note: deadlines` in
    runtime/failure.py, `Note: Checkpoints with replicas`).

    In MPI mode waits for this rank's pending computations and message chains first
    (`chains.quiesce`), so no MPI message of a running step is in flight meanwhile.

    Raises:
      CheckpointError: no mesh is known in a job of several MPI ranks.
    """
    if mesh is None:
        if _mpi_world_size() > 1:
            raise CheckpointError(
                "this MPI job has several ranks but the tree holds no MpmdArray: pass "
                "mesh= so that the ranks can agree on who writes what"
            )
        return Ranks(None)
    if mesh.is_local:
        return Ranks(None)
    from jaxpp_mpi._src.mpi import chains

    chains.quiesce()
    return Ranks(mesh.job_comm, label)


def writers_of(mesh: MpmdMesh | None, ranks: Ranks) -> Ranks | None:
    """The ranks that write a save (`Note: Checkpoints with replicas`): `ranks` itself
    with one replica; with several, replica 0's pipeline (None on another replica)."""
    if mesh is None or mesh.is_local or mesh.num_replicas == 1:
        return ranks
    return Ranks(mesh.comm, ranks.label) if mesh.replica_idx == 0 else None


def mesh_of(items: Sequence[Any], mesh: MpmdMesh | None) -> MpmdMesh | None:
    """The one mesh of `items`' MpmdArrays and MpmdShardings (and `mesh`), or None.

    Raises:
      CheckpointError: they live on different meshes.
    """
    meshes = {x.mpmd_mesh for x in items if isinstance(x, MpmdSharding)}
    meshes |= {x.mpmd_sharding.mpmd_mesh for x in items if isinstance(x, MpmdArray)}
    if mesh is not None:
        meshes.add(mesh)
    if len(meshes) > 1:
        raise CheckpointError("the tree's MpmdArrays / shardings live on different meshes")
    return next(iter(meshes), None)


def abstract(x: Any) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a leaf (Python scalars as numpy makes them)."""
    if isinstance(x, MpmdArray) or (hasattr(x, "shape") and hasattr(x, "dtype")):
        return tuple(int(d) for d in x.shape), np.dtype(x.dtype)
    v = np.asarray(x)
    return v.shape, v.dtype


@dataclasses.dataclass
class Described:
    """A save as every rank agreed on it (`describe_save`).

    Attributes:
      manifest: the checkpoint's manifest, the same on every rank.
      mine: (leaf index, function returning the leaf's value: a `jax.Array`, numpy
        array or scalar) for the leaves this rank writes; across the writing ranks every
        leaf is written exactly once.
      ranks: every rank of the job (the save's collectives).
      writers: the ranks that write (None on a replica that does not).
      mesh: the tree's mesh, or None.
    """

    manifest: Manifest
    mine: list[tuple[int, Producer]]
    ranks: Ranks
    writers: Ranks | None
    mesh: MpmdMesh | None


def describe_save(path: str, tree: PyTree, step: int | None,
                  mesh: MpmdMesh | None) -> Described:
    """The manifest of `tree` and the leaves this rank writes; collective in MPI mode
    (every rank of the job calls it with the same tree).

    An MpmdArray is written by the process holding its first group (`mesh_ids[0]`),
    with its placement; a plain leaf by rank 0 with no placement.

    Raises:
      CheckpointError: on every rank: an unsupported leaf or dtype, a deleted (donated)
        MpmdArray, or ranks passing different trees.
    """
    paths, leaves, _ = fmt.flatten_with_paths(tree)
    mesh = mesh_of(leaves, mesh)
    ranks = ranks_of(mesh, f"checkpoint save of {path}")
    writers = writers_of(mesh, ranks)
    plain_writer = writers is not None and writers.rank == 0

    def describe() -> tuple[Manifest, list[tuple[int, Producer]]]:
        entries, mine = [], []
        for i, (p, x) in enumerate(zip(paths, leaves)):
            shape, dtype = abstract(x)
            placement = None
            if isinstance(x, MpmdArray):
                sharding = x.mpmd_sharding
                if x.is_deleted():
                    raise CheckpointError(f"{fmt.format_key_path(p)} was deleted (donated?)")
                placement = fmt.Placement(sharding.mesh_ids, fmt.encode_spec(sharding.spec))
                if writers is not None and sharding.mesh_ids[0] in mesh.local_groups:
                    mine.append((i, lambda x=x, p=p: x._value_replica(
                        f"saving {fmt.format_key_path(p)}")))
            elif plain_writer:
                mine.append((i, lambda x=x: x))
            entries.append(fmt.LeafEntry(p, shape, fmt.dtype_name(dtype), fmt.leaf_file(i),
                                         placement))
        return Manifest(tuple(entries), step, None if mesh is None else mesh.mpmd_dim), mine

    manifest, mine = ranks.run(describe)
    ranks.check_same(manifest.to_json(), "tree (key paths, shapes, dtypes, placement)")
    return Described(manifest, mine, ranks, writers, mesh)
