"""Moving a reshard's leaves: local copies, or MPI collectives on each group's first device."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.arrays.mesh import MpmdMesh
from jaxpp_mpi._src.reshard.planning import Leaf, ReshardStats
from jaxpp_mpi._src.runtime import agree
from jaxpp_mpi._src.runtime.failure import deadline

__all__ = ["Mover"]

# Note: Reshard messages (MPI mode).
#   spmd -> mpmd: a whole input stays where it is (owners keep a copy, no message); a
#   block (`process_local`, Note: SPMD layouts) is assembled with one allgather when
#   every group owns the result, else with one gather per owning group (cheaper:
#   non-owners receive nothing).
#   mpmd -> spmd: a result held by every group is sliced or copied locally (no message);
#   otherwise the first owning group broadcasts it (whole target) or scatters its blocks
#   (blocked target, `process_local`). Collectives run on the first device of each group (mpi4jax's
#   ordered effects need single-device computations), so a group of K > 1 devices stages
#   values through that device.


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


# -- moves --------------------------------------------------------------------------

# Jitted collectives, one per (kind, comm, parameters); each factory below takes the MPI
# layer's collectives module (`agree.collectives()`, imported on first use) and every
# value its function uses as arguments, so a retrace sees the same values.
_OPS: dict[tuple, Callable] = {}


def _collective(factory: Callable, comm: Any, *params: Any) -> Callable:
    """`factory(mpi, comm, *params)`, built once (the comm is keyed by id; the cached
    closure keeps it alive, so the id is not reused while cached)."""
    key = (factory.__name__, id(comm), *params)
    fn = _OPS.get(key)
    if fn is None:
        fn = _OPS[key] = factory(agree.collectives(), comm, *params)
    return fn


def _allgather_fn(mpi: ModuleType, comm, d: int, out):
    return jax.jit(lambda b: _merge(mpi.allgather(b, comm), d), out_shardings=out)


def _gather_fn(mpi: ModuleType, comm, d: int, root: int, out):
    if out is None:  # not the root: send only
        return jax.jit(lambda b: [mpi.gather(b, root, comm)][:0])
    return jax.jit(lambda b: _merge(mpi.gather(b, root, comm), d), out_shardings=out)


def _bcast_send_fn(mpi: ModuleType, comm, root: int):
    return jax.jit(lambda v: [mpi.bcast(v, root, comm)][:0])


def _bcast_recv_fn(mpi: ModuleType, comm, shape: tuple, dtype: str, root: int, out):
    return jax.jit(lambda: mpi.bcast(jnp.zeros(shape, dtype), root, comm),
                   out_shardings=out)


def _scatter_send_fn(mpi: ModuleType, comm, d: int, n: int, root: int, out):
    return jax.jit(lambda v: mpi.scatter(_split(v, d, n), root, comm),
                   out_shardings=out)


def _scatter_recv_fn(mpi: ModuleType, comm, shape: tuple, dtype: str, root: int, out):
    return jax.jit(lambda: mpi.scatter(jnp.zeros(shape, dtype), root, comm),
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


class Mover:
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

    def end_batch(self) -> None:
        """Starts counting the next batch's arrays (the last one's are released)."""
        self.meter.live = 0

    def _run(self, factory: Callable, params: tuple, *args):
        """One collective, waited for under a deadline (`Note: deadlines` in
        runtime/failure.py): a rank that never joins it ends the job."""
        kind = factory.__name__.strip("_").split("_")[0]
        self.stats.collectives.append(kind)
        with deadline(f"reshard {kind}", self.comm):
            out = _collective(factory, self.comm, *params)(*args)
            if jax.tree.leaves(out):
                jax.block_until_ready(out)
            else:  # a send-only collective: its ordered effect is what to wait for
                jax.effects_barrier()
        return out

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

    def to_mpmd(self, f: Leaf, x: Any) -> MpmdArray:
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

    def to_spmd(self, f: Leaf, x: MpmdArray) -> jax.Array:
        target = f.spmd
        if self.mesh.is_local:
            # Any held replica will do (replicas are equal); none held: a clear error.
            return self.meter.put(x._value_replica("mpmd_to_spmd_reshard"), target)
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
