"""Resharding between the whole-model (SPMD) layout and the per-group (MPMD) layout.

Planning (input checks on every rank, batches) is in `reshard/planning.py`; the moves
themselves in `reshard/moves.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding
from jaxpp_mpi._src.base.types import PyTree
from jaxpp_mpi._src.reshard.moves import Mover
from jaxpp_mpi._src.reshard.planning import (
    Leaf,
    ReshardStats,
    batches,
    mpmd_leaf,
    prepare,
    spmd_leaf,
    spmd_mesh,
)

__all__ = ["ReshardStats", "last_stats", "mpmd_to_spmd_reshard", "spmd_mesh",
           "spmd_to_mpmd_reshard"]

last_stats: ReshardStats | None = None
"""What the last reshard call did in this process."""


def _run_batches(mesh: MpmdMesh, xs: list[Any], tree: Any, leaves: list[Leaf],
                 threshold: int, move: Callable[[Mover, Leaf, Any], Any]) -> PyTree:
    """Moves `leaves` batch by batch (Note: Reshard batches, in planning.py)."""
    global last_stats
    stats = ReshardStats(threshold)
    last_stats = stats
    mover = Mover(mesh, stats)
    results = list(xs)
    last_use = {}
    for f in leaves:
        last_use[id(xs[f.index])] = f.index
    for batch in batches(leaves, threshold):
        stats.batches.append([f.index for f in batch])
        for f in batch:
            results[f.index] = move(mover, f, xs[f.index])
        for f in batch:
            jax.block_until_ready(results[f.index])
        if not mesh.is_local:
            jax.effects_barrier()  # every collective of the batch has completed
        for f in batch:
            x = xs[f.index]
            if last_use[id(x)] == f.index and hasattr(x, "delete") and not x.is_deleted():
                x.delete()
        mover.end_batch()
    return jax.tree.unflatten(tree, results)


def spmd_to_mpmd_reshard(
    mpmd_mesh: MpmdMesh, spmd_arrays: PyTree, mpmd_shardings: PyTree,
    threshold: int | None = None, *, process_local: bool = False,
) -> PyTree:
    """Reshards a pytree of SPMD arrays to `MpmdArray`s (see Note: SPMD layouts);
    collective: every rank of the mesh calls it alike.

    Args:
      mpmd_mesh: the mesh.
      spmd_arrays: a pytree of arrays, each the whole array (laid out over the MPMD
        axis or not), or, with `process_local`, this rank's block where its spec
        names the MPMD axis (Note: SPMD layouts). They are consumed: deleted once
        moved (numpy inputs excepted).
      mpmd_shardings: a pytree of `MpmdSharding`s (or None: that leaf is returned
        unchanged, not consumed) with the structure of `spmd_arrays`, e.g.
        `mpmd_jit_with_loop(...).compile(...).in_shardings`. One held by no group (an
        unused value) places its leaf on group 0, as JaxPP does.
      threshold: bound, in bytes, of the results one batch creates on a rank (Note:
        Reshard batches); None: a quarter of the free memory. The minimum over ranks
        is used.
      process_local: MPI mode: an array whose spec names the MPMD axis is this rank's
        block of a larger array, assembled from every rank's (Note: SPMD layouts).

    Returns:
      A pytree of `MpmdArray`s like `spmd_arrays`; their specs do not name the MPMD
      axis, their replicas lie on their groups' meshes with it (`sharding_for`).

    Raises:
      ValueError: on every rank, before any data moves, for mismatched structures,
        non-array leaves, layouts that do not fit the shapes, or ranks passing
        different logical shapes or dtypes.
    """
    xs, tree, leaves, threshold = prepare(
        mpmd_mesh, spmd_arrays, mpmd_shardings, threshold,
        functools.partial(spmd_leaf, process_local=process_local),
        lambda t: t is None or isinstance(t, MpmdSharding), ("spmd_arrays", "mpmd_shardings"))
    return _run_batches(mpmd_mesh, xs, tree, leaves, threshold, Mover.to_mpmd)


def mpmd_to_spmd_reshard(
    mpmd_mesh: MpmdMesh, mpmd_arrays: PyTree, spmd_shardings: PyTree,
    threshold: int | None = None, *, process_local: bool = False,
) -> PyTree:
    """Reshards a pytree of `MpmdArray`s to SPMD arrays (see Note: SPMD layouts);
    collective: every rank of the mesh calls it alike.

    Args:
      mpmd_mesh: the mesh.
      mpmd_arrays: a pytree of `MpmdArray`s on `mpmd_mesh`; consumed (deleted).
      spmd_shardings: a pytree like `mpmd_arrays` of targets: a `NamedSharding` on this
        process's devices, or a `PartitionSpec` over `spmd_mesh(mpmd_mesh)`'s axes (None
        means `PartitionSpec()`). Every rank gets the whole array.
      threshold: as for `spmd_to_mpmd_reshard`.
      process_local: MPI mode: a target naming the MPMD axis gives this rank's block
        of the array instead (Note: SPMD layouts).

    Returns:
      A pytree of `jax.Array`s like `mpmd_arrays`, laid out by `spmd_shardings`.

    Raises:
      ValueError: on every rank, before any data moves, for mismatched structures,
        leaves that are not `MpmdArray`s of this mesh, targets naming unknown axes or
        not fitting the shapes, or ranks disagreeing on shapes or placement.
    """
    xs, tree, leaves, threshold = prepare(
        mpmd_mesh, mpmd_arrays, spmd_shardings, threshold,
        functools.partial(mpmd_leaf, process_local=process_local),
        lambda t: t is None or isinstance(t, (PartitionSpec, NamedSharding)),
        ("mpmd_arrays", "spmd_shardings"))
    return _run_batches(mpmd_mesh, xs, tree, leaves, threshold, Mover.to_spmd)
