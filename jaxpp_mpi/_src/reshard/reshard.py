"""Resharding between the whole-model (SPMD) layout and the per-group (MPMD) layout."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxpp_mpi._src.array import MpmdArray, MpmdSharding
from jaxpp_mpi._src.mesh import MpmdMesh

__all__ = ["ReshardStats", "last_stats", "mpmd_to_spmd_reshard", "spmd_mesh",
           "spmd_to_mpmd_reshard"]

# Note: SPMD layouts.
#   An SPMD value is one logical array in one of two layouts:
#   - whole: this process holds the whole array (any `jax.Array`, or a numpy array);
#   - blocked: its `NamedSharding` spec names the MPMD axis on dimension `d` (as the
#     first, most major, name of that entry); group `i` holds block `i` of
#     `shape[d] // mpmd_dim` rows along `d`.
#   Local mode: a `jax.Array` always is the whole logical array (JAX's global view); a
#   blocked one is merely laid out over the groups of `mpmd_mesh.jax_mesh`.
#   MPI mode: JAX sees only this rank's devices, laid out as `spmd_mesh(mpmd_mesh)`, the
#   rank's group mesh with the MPMD axis of size 1. An array whose `NamedSharding` names
#   the MPMD axis on dimension `d` is *this rank's block*, as its addressable data would
#   be under multi-controller JAX: the logical shape is `mpmd_dim` times larger along
#   `d`. (So `jax.jit(f, out_shardings=NamedSharding(mesh.jax_mesh, P(axis)))` computes a
#   whole array here, not a block: slice the rank's block out, or jit the block.) Every
#   other array is the whole array, and every rank passes the same logical shape and
#   dtype.
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
#
# Note: Reshard messages (MPI mode).
#   spmd -> mpmd: a whole input stays where it is (owners keep a copy, no message); a
#   blocked one is assembled with one allgather when every group owns the result, else
#   with one gather per owning group (cheaper: non-owners receive nothing).
#   mpmd -> spmd: a result held by every group is sliced or copied locally (no message);
#   otherwise the first owning group broadcasts it (whole target) or scatters its blocks
#   (blocked target). Collectives run on the first device of each group (mpi4jax's
#   ordered effects need single-device computations), so a group of K > 1 devices stages
#   values through that device.


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


last_stats: ReshardStats | None = None


@dataclasses.dataclass
class _Leaf:
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
    return mpmd_mesh.mpmd_submesh((mpmd_mesh.my_mpmd_axis_index,))


def _dev_bytes(x: jax.Array) -> int:
    sh = x.sharding
    return math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize * len(sh.device_set)


class _Meter:
    """Bytes of the arrays created in the current batch and still held."""

    def __init__(self, stats: ReshardStats):
        self.stats = stats
        self.live = 0

    def add(self, x: jax.Array) -> jax.Array:
        self.live += _dev_bytes(x)
        self.stats.peak_in_flight_bytes = max(self.stats.peak_in_flight_bytes, self.live)
        return x

    def drop(self, x: jax.Array) -> None:
        self.live -= _dev_bytes(x)
        x.delete()

    def put(self, x: Any, sharding: Any) -> jax.Array:
        """A copy of `x` laid out by `sharding`, sharing no buffer with `x`."""
        return self.add(_fresh(jax.device_put(x, sharding, may_alias=False), x))


def _fresh(out: jax.Array, src: Any) -> jax.Array:
    """`out`, with the shards that share a buffer with `src` replaced by copies.

    `device_put` reuses a source buffer for every device the source already covers,
    `may_alias=False` notwithstanding; the source is deleted afterwards, so the result
    must own all its buffers.
    """
    if not isinstance(src, jax.Array):
        return out
    taken = {s.data.unsafe_buffer_pointer() for s in src.addressable_shards}
    shards = [s.data for s in out.addressable_shards]
    if not any(a.unsafe_buffer_pointer() in taken for a in shards):
        return out
    owned = [jnp.copy(a) if a.unsafe_buffer_pointer() in taken else a for a in shards]
    return jax.make_array_from_single_device_arrays(out.shape, out.sharding, owned)


# -- validation ---------------------------------------------------------------------


def _block_dim(spec: PartitionSpec, axis: str, what: str) -> int | None:
    for d, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if axis in names:
            if names[0] != axis:
                raise ValueError(
                    f"{what}: spec {spec} names the MPMD axis {axis!r} after {names[0]!r} "
                    f"in dimension {d}; it must come first there (each group then holds "
                    "one contiguous block)")
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


def _spmd_leaf(mesh: MpmdMesh, k: int, path: str, x: Any, target: Any) -> _Leaf:
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
    shape = tuple(x.shape)
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
    block_dim = None
    sh = getattr(x, "sharding", None)
    axis = mesh.mpmd_axis_name
    if isinstance(sh, NamedSharding) and axis in sh.mesh.axis_names:
        block_dim = _block_dim(sh.spec, axis, what)
        if mesh.is_local:
            block_dim = None  # a global array: the whole logical array
        elif block_dim is not None:
            if set(sh.device_set) != set(mesh.devices_of(mesh.my_mpmd_axis_index)):
                raise ValueError(f"{what}: a block must lie on this rank's group devices, "
                                 f"not on {sorted(d.id for d in sh.device_set)}")
            shape = shape[:block_dim] + (shape[block_dim] * mesh.mpmd_dim,) \
                + shape[block_dim + 1:]
    replica = NamedSharding(mesh.lowering_mesh(), target.spec)
    _check_layout(replica, shape, f"{what} into {target!r}")
    copies = len(target.local_mesh_ids) if mesh.is_local else 1
    cost = _bytes_of(replica, shape, dtype) * copies
    return _Leaf(k, path, shape, dtype, target, None, block_dim, cost)


def _mpmd_leaf(mesh: MpmdMesh, k: int, path: str, x: Any, target: Any) -> _Leaf:
    what = f"mpmd_arrays{path if path != '<root>' else ''}"
    if not isinstance(x, MpmdArray):
        raise ValueError(f"{what}: expected an MpmdArray, got {type(x).__name__}")
    if x.mpmd_sharding.mpmd_mesh != mesh:
        raise ValueError(f"{what} lives on another mesh than {mesh!r}")
    if x.is_deleted():
        raise ValueError(f"{what} has been deleted (consumed by an earlier call?)")
    named = _named(target, mesh, f"spmd_shardings for {what}")
    shape = tuple(x.shape)
    local_shape, block_dim = shape, None
    axis = mesh.mpmd_axis_name
    if axis in named.mesh.axis_names:
        block_dim = _block_dim(named.spec, axis, f"spmd_shardings for {what}")
        if mesh.is_local:
            block_dim = None  # a global array: the whole logical array
        elif named.mesh.shape[axis] != 1:
            raise ValueError(f"spmd_shardings for {what}: in MPI mode the MPMD axis of "
                             "the target mesh must have size 1")
        elif block_dim is not None:
            if block_dim >= len(shape) or shape[block_dim] % mesh.mpmd_dim:
                raise ValueError(
                    f"spmd_shardings for {what}: {named.spec} splits dimension "
                    f"{block_dim} of shape {shape} into {mesh.mpmd_dim} blocks")
            local_shape = shape[:block_dim] + (shape[block_dim] // mesh.mpmd_dim,) \
                + shape[block_dim + 1:]
    _check_layout(named, local_shape, f"spmd_shardings for {what}")
    cost = _bytes_of(named, local_shape, x.dtype)
    return _Leaf(k, path, shape, np.dtype(x.dtype), x.mpmd_sharding, named, block_dim, cost)


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


def _agree(mesh: MpmdMesh, error: str | None, leaves: list[_Leaf], threshold: int) -> int:
    """Raises the same ValueError on every rank when any rank found bad input or the
    ranks disagree on the leaves; returns the common threshold (the minimum)."""
    if mesh.is_local:
        if error:
            raise ValueError(error)
        return threshold
    from jaxpp_mpi._src.mpi import collectives

    sig = None if error else [(f.path, f.shape, f.dtype.name, str(f.mpmd)) for f in leaves]
    reports = collectives.allgather_object((error, sig, threshold), mesh.comm)
    bad = [(r, e) for r, (e, _, _) in enumerate(reports) if e]
    if bad:
        ranks = [r for r, _ in bad]
        raise ValueError(f"bad input on rank(s) {ranks}: {bad[0][1]}")
    first = reports[0][1]
    for r, (_, other, _) in enumerate(reports):
        if other != first:
            diff = next((a, b) for a, b in zip(first + [None], other + [None]) if a != b)
            raise ValueError(
                f"ranks passed different arrays: rank 0 has {diff[0]}, rank {r} has "
                f"{diff[1]} (path, logical shape, dtype, placement)")
    return min(t for _, _, t in reports)


def _prepare(mesh: MpmdMesh, values, targets, threshold, make_leaf, is_target, names):
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
        error = str(e)
    if threshold is None:
        threshold = _default_threshold(mesh)
    common = _agree(mesh, error, leaves, int(threshold) if error is None else 1)
    return xs, tree, leaves, common


def _batches(leaves: list[_Leaf], threshold: int) -> list[list[_Leaf]]:
    out: list[list[_Leaf]] = []
    size = 0
    for f in leaves:
        if out and size + f.cost <= threshold:
            out[-1].append(f)
            size += f.cost
        else:
            out.append([f])
            size = f.cost
    return out


# -- moves --------------------------------------------------------------------------

# Jitted collectives, one per (kind, comm, parameters); each factory below takes every
# value its function uses as an argument, so a retrace sees the same values.
_OPS: dict[tuple, Callable] = {}


def _collective(factory: Callable, comm: Any, *params: Any) -> Callable:
    """`factory(comm, *params)`, built once (the comm is keyed by id; the cached
    closure keeps it alive, so the id is not reused while cached)."""
    key = (factory.__name__, id(comm), *params)
    fn = _OPS.get(key)
    if fn is None:
        fn = _OPS[key] = factory(comm, *params)
    return fn


def _allgather_fn(comm, d: int, out):
    from jaxpp_mpi._src.mpi import collectives

    return jax.jit(lambda b: _merge(collectives.allgather(b, comm), d), out_shardings=out)


def _gather_fn(comm, d: int, root: int, out):
    from jaxpp_mpi._src.mpi import collectives

    if out is None:  # not the root: send only
        return jax.jit(lambda b: [collectives.gather(b, root, comm)][:0])
    return jax.jit(lambda b: _merge(collectives.gather(b, root, comm), d), out_shardings=out)


def _bcast_send_fn(comm, root: int):
    from jaxpp_mpi._src.mpi import collectives

    return jax.jit(lambda v: [collectives.bcast(v, root, comm)][:0])


def _bcast_recv_fn(comm, shape: tuple, dtype: str, root: int, out):
    from jaxpp_mpi._src.mpi import collectives

    return jax.jit(lambda: collectives.bcast(jnp.zeros(shape, dtype), root, comm),
                   out_shardings=out)


def _scatter_send_fn(comm, d: int, n: int, root: int, out):
    from jaxpp_mpi._src.mpi import collectives

    return jax.jit(lambda v: collectives.scatter(_split(v, d, n), root, comm),
                   out_shardings=out)


def _scatter_recv_fn(comm, shape: tuple, dtype: str, root: int, out):
    from jaxpp_mpi._src.mpi import collectives

    return jax.jit(lambda: collectives.scatter(jnp.zeros(shape, dtype), root, comm),
                   out_shardings=out)


def _merge(stacked: jax.Array, d: int) -> jax.Array:
    """`(S, *block)` -> the blocks concatenated along `d`."""
    moved = jnp.moveaxis(stacked, 0, d)
    shape = moved.shape
    return moved.reshape(shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:])


def _split(x: jax.Array, d: int, n: int) -> jax.Array:
    """The inverse of `_merge`: `x` cut into `n` blocks along `d`, stacked first."""
    shape = x.shape
    parts = x.reshape(shape[:d] + (n, shape[d] // n) + shape[d + 1:])
    return jnp.moveaxis(parts, d, 0)


class _Mover:
    """One reshard call's moves on this process (see Note: Reshard messages)."""

    def __init__(self, mesh: MpmdMesh, stats: ReshardStats):
        self.mesh = mesh
        self.stats = stats
        self.meter = _Meter(stats)
        self.comm = mesh.comm
        if not mesh.is_local:
            self.me = mesh.my_mpmd_axis_index
            self.dev0 = mesh.devices_of(self.me)[0]
            self.single = SingleDeviceSharding(self.dev0)

    def _run(self, factory: Callable, params: tuple, *args):
        self.stats.collectives.append(factory.__name__.strip("_").split("_")[0])
        return _collective(factory, self.comm, *params)(*args)

    def _stage(self, x: jax.Array) -> jax.Array:
        """`x` on the group's first device, for a collective."""
        if x.sharding.device_set == {self.dev0}:
            return x
        return self.meter.put(x, self.single)

    def _unstage(self, staged: jax.Array, x: jax.Array) -> None:
        if staged is not x:
            self.meter.drop(staged)

    def _out(self, target: Any) -> Any:
        """Where a collective leaves its result: the target, if on the first device."""
        return target if target.device_set == {self.dev0} else self.single

    def _place(self, tmp: jax.Array, target: Any) -> jax.Array:
        if tmp.sharding.is_equivalent_to(target, tmp.ndim):
            return tmp
        out = self.meter.put(tmp, target)
        self.meter.drop(tmp)
        return out

    # spmd -> mpmd

    def to_mpmd(self, f: _Leaf, x: Any) -> MpmdArray:
        sh = f.mpmd
        if self.mesh.is_local:
            reps = [self.meter.put(x, sh.sharding_for(g)) for g in sh.local_mesh_ids]
            return MpmdArray(reps, sh, shape=f.shape, dtype=f.dtype)
        me, owners, d = self.me, sh.mesh_ids, f.block_dim
        target = sh.sharding_for(me) if me in owners else None
        if d is None:  # whole on every rank: owners copy, nothing moves
            reps = [self.meter.put(x, target)] if target is not None else []
            return MpmdArray(reps, sh, shape=f.shape, dtype=f.dtype)
        staged, full = self._stage(x), None
        if len(owners) == self.mesh.mpmd_dim:
            full = self._run(_allgather_fn, (d, self._out(target)), staged)
        else:  # one gather per owner: non-owners receive nothing
            for root in owners:
                out = self._out(target) if root == me else None
                got = self._run(_gather_fn, (d, root, out), staged)
                full = got if root == me else full
        self._unstage(staged, x)
        if full is None:
            return MpmdArray([], sh, shape=f.shape, dtype=f.dtype)
        placed = self._place(self.meter.add(full), target)
        return MpmdArray([placed], sh, shape=f.shape, dtype=f.dtype)

    # mpmd -> spmd

    def to_spmd(self, f: _Leaf, x: MpmdArray) -> jax.Array:
        target = f.spmd
        if self.mesh.is_local:
            return self.meter.put(x.first_mpmd_replica, target)
        me, owners, n, d = self.me, f.mpmd.mesh_ids, self.mesh.mpmd_dim, f.block_dim
        src = x.local_arrays.get(me)
        root, everywhere = owners[0], len(owners) == n
        if d is None:
            if src is not None:
                if not everywhere:  # take part in the broadcast, keep the own replica
                    staged = self._stage(src)
                    self._run(_bcast_send_fn, (root,), staged)
                    self._unstage(staged, src)
                return self.meter.put(src, target)
            params = (f.shape, f.dtype.name, root, self._out(target))
            return self._place(self.meter.add(self._run(_bcast_recv_fn, params)), target)
        b = f.shape[d] // n
        if everywhere:  # every group holds it: slice this rank's block, nothing moves
            block = self.meter.add(jax.lax.slice_in_dim(src, me * b, (me + 1) * b, axis=d))
            return self._place(block, target)
        out = self._out(target)
        if me == root:
            staged = self._stage(src)
            block = self._run(_scatter_send_fn, (d, n, root, out), staged)
            self._unstage(staged, src)
        else:
            shape = f.shape[:d] + (b,) + f.shape[d + 1:]
            block = self._run(_scatter_recv_fn, (shape, f.dtype.name, root, out))
        return self._place(self.meter.add(block), target)


def _run_batches(mesh, xs, tree, leaves, threshold, move) -> Any:
    global last_stats
    stats = ReshardStats(threshold)
    last_stats = stats
    mover = _Mover(mesh, stats)
    results = list(xs)
    last_use = {}
    for f in leaves:
        last_use[id(xs[f.index])] = f.index
    for batch in _batches(leaves, threshold):
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
        mover.meter.live = 0
    return jax.tree.unflatten(tree, results)


def spmd_to_mpmd_reshard(
    mpmd_mesh: MpmdMesh, spmd_arrays: Any, mpmd_shardings: Any, threshold: int | None = None
) -> Any:
    """Reshards a pytree of SPMD arrays to `MpmdArray`s (see Note: SPMD layouts).

    Args:
      mpmd_mesh: the mesh.
      spmd_arrays: a pytree of arrays, each whole or this rank's block (Note: SPMD
        layouts). They are consumed: deleted once moved (numpy inputs excepted).
      mpmd_shardings: a pytree of `MpmdSharding`s (or None: that leaf is returned
        unchanged, not consumed) with the structure of `spmd_arrays`, e.g.
        `mpmd_jit_with_loop(...).compile(...).in_shardings`.
      threshold: bound, in bytes, of the results one batch creates on a rank (Note:
        Reshard batches); None: a quarter of the free memory. The minimum over ranks
        is used.

    Returns:
      A pytree of `MpmdArray`s like `spmd_arrays`; their specs do not name the MPMD axis.

    Raises:
      ValueError: on every rank, before any data moves, for mismatched structures,
        non-array leaves, layouts that do not fit the shapes, or ranks passing
        different logical shapes or dtypes.
    """
    xs, tree, leaves, threshold = _prepare(
        mpmd_mesh, spmd_arrays, mpmd_shardings, threshold, _spmd_leaf,
        lambda t: t is None or isinstance(t, MpmdSharding), ("spmd_arrays", "mpmd_shardings"))
    return _run_batches(mpmd_mesh, xs, tree, leaves, threshold, _Mover.to_mpmd)


def mpmd_to_spmd_reshard(
    mpmd_mesh: MpmdMesh, mpmd_arrays: Any, spmd_shardings: Any, threshold: int | None = None
) -> Any:
    """Reshards a pytree of `MpmdArray`s to SPMD arrays (see Note: SPMD layouts).

    Args:
      mpmd_mesh: the mesh.
      mpmd_arrays: a pytree of `MpmdArray`s on `mpmd_mesh`; consumed (deleted).
      spmd_shardings: a pytree like `mpmd_arrays` of targets: a `NamedSharding` on this
        process's devices, or a `PartitionSpec` over `spmd_mesh(mpmd_mesh)`'s axes (None
        means `PartitionSpec()`). A target naming the MPMD axis gives, in MPI mode, this
        rank's block; otherwise every rank gets the whole array.
      threshold: as for `spmd_to_mpmd_reshard`.

    Returns:
      A pytree of `jax.Array`s like `mpmd_arrays`, laid out by `spmd_shardings`.

    Raises:
      ValueError: on every rank, before any data moves, for mismatched structures,
        leaves that are not `MpmdArray`s of this mesh, targets naming unknown axes or
        not fitting the shapes, or ranks disagreeing on shapes or placement.
    """
    xs, tree, leaves, threshold = _prepare(
        mpmd_mesh, mpmd_arrays, spmd_shardings, threshold, _mpmd_leaf,
        lambda t: t is None or isinstance(t, (PartitionSpec, NamedSharding)),
        ("mpmd_arrays", "spmd_shardings"))
    return _run_batches(mpmd_mesh, xs, tree, leaves, threshold, _Mover.to_spmd)
