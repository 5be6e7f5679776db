"""Planning a reshard: checking the input on every rank, the leaves, their batches."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.arrays.sharding import MpmdSharding
from jaxpp_mpi._src.base.types import PyTree
from jaxpp_mpi._src.runtime import agree

__all__ = ["Leaf", "ReshardStats", "batches", "mpmd_leaf", "prepare", "spmd_leaf", "spmd_mesh"]

# Note: SPMD layouts.
#   An SPMD value is one logical array, whole on every process: its `.shape` is its
#   shape, as in JAX, whatever its layout. In local mode that is JAX's global view. In
#   MPI mode JAX sees only this rank's devices, laid out as `spmd_mesh(mpmd_mesh)` (the
#   rank's group mesh with the MPMD axis of size 1): an array laid out over the MPMD
#   axis there (`jax.jit(init, out_shardings=NamedSharding(mesh, P(("stage", "fsdp"))))`,
#   `jax.make_array_from_callback(shape, sharding, ...)`) is the whole array that this
#   rank computed, as JaxPP's programs make it (Note: MPMD axis in specs in sharding.py), and
#   every rank passes the same logical shape and dtype. A target naming the MPMD axis
#   (mpmd -> spmd) gives the whole array too.
#   `process_local=True` (MPI mode) reads an array whose spec names the MPMD axis on
#   dimension `d` (as the first, most major, name of that entry, or after axes of size
#   1 only, as in `P(None, ("model", "mpmd"))` with a 1-device "model") as *this rank's
#   block*, as its addressable data would be under multi-controller JAX: group `i`
#   holds block `i` of `shape[d]` rows along `d`, and the logical shape is `mpmd_dim`
#   times larger there (a value initialised block by block, each rank computing its
#   part only); a target naming the MPMD axis then gives this rank's block. In local
#   mode `process_local` changes nothing. With pipeline replicas (Note: Pipeline
#   replicas in comms.py) each replica reshards over its own pipeline, rank = MPMD index
#   as above, so a rank's block is that of its group in every replica; the input checks
#   are agreed over the whole job.
#
# Note: Reshard batches.
#   Leaves move in flat (pytree) order, in batches: a batch takes leaves while the
#   bytes their results occupy on the busiest rank stay within `threshold` (a leaf larger
#   than that moves alone). At the end of a batch this process waits for its results and
#   deletes the batch's inputs (consumed, as the API reference says; numpy inputs cannot
#   be deleted), so peak memory grows by at most one batch's results plus one leaf's
#   staging copies. Every rank computes the same threshold (the minimum over ranks) and
#   issues the same collectives in the same order. `last_stats` counts, per process, the
#   bytes of the arrays this module creates and still holds in the current batch (device
#   bytes: a replica on K devices counts K times), so tests can check that bound.


@dataclasses.dataclass
class ReshardStats:
    """What the last reshard call did in this process (see Note: Reshard batches).

    Attributes:
      threshold: the batch size bound used, in bytes (the same on every rank).
      batches: the flat leaf indexes of each batch, in order.
      peak_in_flight_bytes: the most bytes this module held at once in created arrays
        of one batch (staging copies and results).
      collectives: the MPI collectives issued, by kind, in order.
    """

    threshold: int
    batches: list[list[int]] = dataclasses.field(default_factory=list)
    peak_in_flight_bytes: int = 0
    collectives: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Leaf:
    """One leaf to move: where it is, where it goes, and what its results cost."""

    index: int
    path: str
    shape: tuple[int, ...]  # logical shape
    dtype: np.dtype
    mpmd: MpmdSharding
    spmd: Any  # the target NamedSharding (mpmd -> spmd), else None
    block_dim: int | None  # the SPMD side's blocked dimension, MPI mode only
    cost: int = 0


def spmd_mesh(mpmd_mesh: MpmdMesh) -> Mesh:
    """The mesh SPMD arrays live on (see Note: SPMD layouts): `jax_mesh` in local mode;
    in MPI mode this rank's group mesh with the MPMD axis (size 1) in its place."""
    if mpmd_mesh.is_local:
        return mpmd_mesh.jax_mesh
    return mpmd_mesh.mpmd_submesh((mpmd_mesh.my_mpmd_axis_index,)).jax_mesh


# -- validation ---------------------------------------------------------------------


def _block_dim(spec: PartitionSpec, axis: str, what: str,
               sizes: dict[str, int]) -> int | None:
    """The dimension `spec` blocks over the MPMD axis (MPI mode; Note: SPMD layouts).

    Raises:
      ValueError: an axis of more than one device comes before the MPMD axis in its
        entry: each rank's part would not be one contiguous block.
    """
    for d, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis in names:
            before = [n for n in names[:names.index(axis)] if sizes.get(n, 1) > 1]
            if before:
                moved = (axis, *(n for n in names if n != axis))
                raise ValueError(
                    f"{what}: spec {spec} names the MPMD axis {axis!r} after {before} in "
                    f"dimension {d}, so each rank's part of that dimension is not one "
                    "contiguous block; under MPI put the MPMD axis first in that entry "
                    f"({moved!r}), or reshard in one process, where any position works")
            return d
    return None


def _check_layout(sharding: NamedSharding, shape: tuple[int, ...], what: str) -> None:
    if len(sharding.spec) > len(shape):
        raise ValueError(f"{what}: {sharding.spec} cannot lay out shape {shape}: the spec "
                         f"has {len(sharding.spec)} entries, the array {len(shape)} dims")
    try:
        sharding.shard_shape(shape)
    except Exception as e:  # noqa: BLE001 - JAX raises several types; all mean "bad spec"
        raise ValueError(f"{what}: {sharding.spec} cannot lay out shape {shape}: {e}") from e


def _named(spec_or_sharding: Any, mesh: MpmdMesh, what: str) -> NamedSharding:
    """A target SPMD sharding from a `NamedSharding`, a `PartitionSpec` or None."""
    target = PartitionSpec() if spec_or_sharding is None else spec_or_sharding
    if isinstance(target, PartitionSpec):
        try:
            return NamedSharding(spmd_mesh(mesh), target)
        except Exception as e:  # noqa: BLE001
            axes = tuple(spmd_mesh(mesh).axis_names)
            raise ValueError(f"{what}: spec {target} does not fit the SPMD mesh (axes "
                             f"{axes}): {e}") from e
    if not isinstance(target, NamedSharding):
        raise ValueError(f"{what}: expected a NamedSharding, PartitionSpec or None, got "
                         f"{type(target).__name__}")
    if any(d.process_index != jax.process_index() for d in target.device_set):
        raise ValueError(f"{what}: {target} has devices of other processes")
    return target


def _flatten_pair(values: Any, targets: Any, is_target: Callable, names: tuple[str, str]):
    flat, tree = jax.tree_util.tree_flatten_with_path(values)
    target_leaves, target_tree = jax.tree.flatten(targets, is_leaf=is_target)
    if target_tree != tree:
        raise ValueError(f"{names[0]} and {names[1]} differ in structure:\n  {names[0]}: "
                         f"{tree}\n  {names[1]}: {target_tree}")
    paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in flat]
    return [x for _, x in flat], target_leaves, paths, tree


def spmd_leaf(mesh: MpmdMesh, k: int, path: str, x: Any, target: Any,
              process_local: bool = False) -> Leaf:
    """One spmd -> mpmd leaf (Note: SPMD layouts); an unused target (no group) is
    placed on group 0, as JaxPP does.

    Raises:
      ValueError: `x` is not an array or is deleted, `target` is not an
        `MpmdSharding` of `mesh`, or the layouts do not fit the shape.
    """
    what = f"spmd_arrays{path if path != '<root>' else ''}"
    if isinstance(x, MpmdArray):
        raise ValueError(f"{what} is already an MpmdArray; spmd_to_mpmd_reshard takes "
                         "ordinary arrays")
    if not isinstance(x, (jax.Array, np.ndarray)):
        raise ValueError(f"{what}: expected a jax.Array or numpy array, got "
                         f"{type(x).__name__}")
    if isinstance(x, jax.Array) and x.is_deleted():
        raise ValueError(f"{what} has been deleted (consumed by an earlier call?)")
    if not isinstance(target, MpmdSharding):
        raise ValueError(f"mpmd_shardings for {what}: expected an MpmdSharding or None, "
                         f"got {type(target).__name__}")
    if target.mpmd_mesh != mesh:
        raise ValueError(f"mpmd_shardings for {what}: {target!r} belongs to another mesh")
    if not target.mesh_ids:  # JaxPP's unused values: group 0 holds them
        target = MpmdSharding(mesh, (0,), target.spec)
    shape = tuple(x.shape)
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
    block_dim = None
    sh = getattr(x, "sharding", None)
    axis = mesh.mpmd_axis_name
    if process_local and not mesh.is_local and isinstance(sh, NamedSharding) \
            and axis in sh.mesh.axis_names:
        block_dim = _block_dim(sh.spec, axis, what, dict(sh.mesh.shape))
        if block_dim is not None:
            if set(sh.device_set) != set(mesh.devices_of(mesh.my_mpmd_axis_index)):
                raise ValueError(f"{what}: a block must lie on this rank's group devices, "
                                 f"not on {sorted(d.id for d in sh.device_set)}")
            shape = shape[:block_dim] + (shape[block_dim] * mesh.mpmd_dim,) \
                + shape[block_dim + 1:]
    replica = NamedSharding(mesh.lowering_mesh(), target.spec)
    _check_layout(replica, shape, f"{what} into {target!r}")
    copies = len(target.local_mesh_ids) if mesh.is_local else 1
    cost = _bytes_of(replica, shape, dtype) * copies
    return Leaf(k, path, shape, dtype, target, None, block_dim, cost)


def mpmd_leaf(mesh: MpmdMesh, k: int, path: str, x: Any, target: Any,
              process_local: bool = False) -> Leaf:
    """One mpmd -> spmd leaf (Note: SPMD layouts).

    Raises:
      ValueError: `x` is not an `MpmdArray` of `mesh`, is held by no group or deleted,
        or the target does not fit it.
    """
    what = f"mpmd_arrays{path if path != '<root>' else ''}"
    if not isinstance(x, MpmdArray):
        raise ValueError(f"{what}: expected an MpmdArray, got {type(x).__name__}")
    if x.mpmd_sharding.mpmd_mesh != mesh:
        raise ValueError(f"{what} lives on another mesh than {mesh!r}")
    if not x.mpmd_sharding.mesh_ids:
        raise ValueError(f"{what} is held by no group (an unused value): it has no data")
    if x.is_deleted():
        raise ValueError(f"{what} has been deleted (consumed by an earlier call?)")
    named = _named(target, mesh, f"spmd_shardings for {what}")
    shape = tuple(x.shape)
    local_shape, block_dim = shape, None
    axis = mesh.mpmd_axis_name
    if process_local and axis in named.mesh.axis_names and not mesh.is_local:
        if named.mesh.shape[axis] != 1:
            raise ValueError(f"spmd_shardings for {what}: in MPI mode the MPMD axis of "
                             "the target mesh must have size 1")
        block_dim = _block_dim(named.spec, axis, f"spmd_shardings for {what}",
                               dict(named.mesh.shape))
        if block_dim is not None:
            if block_dim >= len(shape) or shape[block_dim] % mesh.mpmd_dim:
                raise ValueError(
                    f"spmd_shardings for {what}: {named.spec} splits dimension "
                    f"{block_dim} of shape {shape} into {mesh.mpmd_dim} blocks")
            local_shape = shape[:block_dim] + (shape[block_dim] // mesh.mpmd_dim,) \
                + shape[block_dim + 1:]
    _check_layout(named, local_shape, f"spmd_shardings for {what}")
    cost = _bytes_of(named, local_shape, x.dtype)
    return Leaf(k, path, shape, np.dtype(x.dtype), x.mpmd_sharding, named, block_dim, cost)


def _bytes_of(sharding: NamedSharding, shape: tuple[int, ...], dtype: np.dtype) -> int:
    return (math.prod(sharding.shard_shape(shape)) * np.dtype(dtype).itemsize
            * len(sharding.device_set))


def _default_threshold(mesh: MpmdMesh) -> int:
    """A quarter of the smallest free memory of this process's devices (of the host,
    when the backend reports none)."""
    free = []
    for g in mesh.local_groups:
        for d in mesh.devices_of(g):
            stats = d.memory_stats() or {}
            if "bytes_limit" in stats:
                free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    if not free:
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            free.append(int(info["MemAvailable"].split()[0]) * 1024)
        except (OSError, KeyError, ValueError):
            free.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return max(1, min(free) // 4)


def _bad_input(failed: list[int], messages: Sequence[str | None]) -> ValueError:
    return ValueError(f"bad input on rank(s) {failed}: {messages[failed[0]]}")


def _text(error: BaseException | None) -> str | None:
    return None if error is None else str(error)


def _agree(mesh: MpmdMesh, error: ValueError | None, leaves: list[Leaf],
           threshold: int) -> int:
    """Raises the same ValueError on every rank when any rank found bad input or the
    ranks disagree on the leaves (Note: raise on every rank, in agree.py); returns the
    common threshold (the minimum).

    With pipeline replicas every replica reshards over its own pipeline communicator,
    but this decision is the job's (`mesh.job_comm`): every replica passes the same
    leaves, and a bad input on one replica stops them all.
    """
    comm = None if mesh.is_local else mesh.job_comm
    sig = None if error else [(f.path, f.shape, f.dtype.name, str(f.mpmd)) for f in leaves]
    reports = agree.allgather_or_raise((sig, threshold), error, comm, _bad_input,
                                       own="never", message=_text, label="reshard agreement")
    sigs = [s for s, _ in reports]
    differ = agree.differing_ranks(sigs)
    if differ:
        r = differ[0]
        diff = next((a, b) for a, b in zip(sigs[0] + [None], sigs[r] + [None]) if a != b)
        raise ValueError(
            f"ranks passed different arrays: rank 0 has {diff[0]}, rank {r} has "
            f"{diff[1]} (path, logical shape, dtype, placement)")
    return min(t for _, t in reports)


def prepare(mesh: MpmdMesh, values: PyTree, targets: PyTree, threshold: int | None,
            make_leaf: Callable[..., Leaf], is_target: Callable[[Any], bool],
            names: tuple[str, str]) -> tuple[list[Any], Any, list[Leaf], int]:
    """Checks one reshard call's input on every rank alike, before any data moves.

    Args:
      mesh: the mesh.
      values: the pytree to move.
      targets: the pytree of targets, like `values`.
      threshold: the batch bound asked for, or None (see `_default_threshold`).
      make_leaf: `spmd_leaf` or `mpmd_leaf`.
      is_target: tells a target leaf (None included) from a subtree of `targets`.
      names: the user's names of `values` and `targets`, for messages.

    Returns:
      (flat values, their treedef, the leaves to move, the common threshold).

    Raises:
      ValueError: on every rank, when any rank found bad input or the ranks disagree.
    """
    if not isinstance(mesh, MpmdMesh):
        raise ValueError(f"mpmd_mesh must be an MpmdMesh, got {type(mesh).__name__}")
    error, leaves, xs, tree = None, [], [], None
    try:
        if threshold is not None and (not isinstance(threshold, (int, np.integer))
                                      or isinstance(threshold, bool) or threshold <= 0):
            raise ValueError(f"threshold must be a positive number of bytes, got {threshold!r}")
        xs, ts, paths, tree = _flatten_pair(values, targets, is_target, names)
        for k, (x, t, p) in enumerate(zip(xs, ts, paths)):
            if t is None and names[0] == "spmd_arrays":
                continue  # not placed: passed through unchanged
            leaves.append(make_leaf(mesh, k, p, x, t))
    except ValueError as e:
        error = e
    if threshold is None:
        threshold = _default_threshold(mesh)
    common = _agree(mesh, error, leaves, int(threshold) if error is None else 1)
    return xs, tree, leaves, common


def batches(leaves: list[Leaf], threshold: int) -> list[list[Leaf]]:
    """`leaves` in flat order, cut into batches of at most `threshold` bytes of results
    (a larger leaf alone; see Note: Reshard batches)."""
    out: list[list[Leaf]] = []
    size = 0
    for f in leaves:
        if out and size + f.cost <= threshold:
            out[-1].append(f)
            size += f.cost
        else:
            out.append([f])
            size = f.cost
    return out
