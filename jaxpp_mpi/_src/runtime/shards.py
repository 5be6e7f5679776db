"""A value's distinct shards, and the compiled message chains that move them (`Note:
messages` in runtime/mpi_messages.py: shard j of a value travels with MPI tag j)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from jaxpp_mpi._src.ir.program import Aval
from jaxpp_mpi._src.mpi import chains

__all__ = ["Messenger", "ShardPlan"]


class ShardPlan:
    """The distinct shards of a value of `aval` under `sharding` (see `Note: messages`).

    Attributes:
      shape, dtype: the value's global shape and dtype.
      sharding: its sharding on the group mesh.
      pieces: per distinct shard, (first device holding it, its shape, the other
        devices holding the same index).
    """

    def __init__(self, aval: Aval, sharding: NamedSharding):
        self.shape = aval.shape
        self.dtype = np.dtype(aval.dtype)
        self.sharding = sharding
        by_index: dict[tuple, list] = {}
        indices = sharding.devices_indices_map(self.shape)
        for device in sharding.mesh.devices.flat:
            index = indices[device]
            key = tuple((s.start, s.stop, s.step) for s in index)
            by_index.setdefault(key, []).append((device, index))
        self.pieces = []
        for holders in by_index.values():
            device, index = holders[0]
            shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, self.shape))
            self.pieces.append((device, shape, [d for d, _ in holders[1:]]))
        self.single = sharding.mesh.devices.size == 1
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def shards_of(self, x: jax.Array) -> list[jax.Array]:
        """The distinct shards' data, in plan order."""
        if self.single:
            return [x]
        data = {s.device: s.data for s in x.addressable_shards}
        return [data[device] for device, _, _ in self.pieces]

    def assemble(self, pieces: list[jax.Array]) -> jax.Array:
        """The value from its distinct shards (each on the first device holding it)."""
        if self.single:
            return pieces[0]
        arrays = {}
        for (device, _, others), x in zip(self.pieces, pieces):
            arrays[device] = x
            for other in others:
                arrays[other] = jax.device_put(x, other)
        ordered = [arrays[d] for d in self.sharding.mesh.devices.flat]
        return jax.make_array_from_single_device_arrays(self.shape, self.sharding, ordered)


def _compiled(fn: Callable, args: list, in_sh, out_sh):
    """`jax.jit(fn)` with explicit shardings, compiled now (the first call then only hits
    JAX's compilation cache): no compiling while peers already send."""
    jitted = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh)
    jitted.lower(*args).compile()
    return jitted


class Messenger:
    """Pre-compiled message chains (`Note: message chains` in mpi/chains.py), one per
    distinct (kind, shapes, dtypes, device, peer, shard), each `fn(order, *x) -> (order,
    *received)` on one device."""

    def __init__(self, comm: Any, replica_comm: Any = None):
        self.comm = comm
        self.replica_comm = replica_comm

    def _in_sharding(self, plan: ShardPlan, device):
        return plan.sharding if plan.single else SingleDeviceSharding(device)

    @functools.cache  # noqa: B019 - lives as long as the executor
    def _fn(self, ops: tuple, device, send_shapes: tuple, send_shardings: tuple,
            recv_shardings: tuple):
        order_sh = SingleDeviceSharding(device)
        order = jax.ShapeDtypeStruct((), np.int32, sharding=order_sh)
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
                   for (shape, dtype), sh in zip(send_shapes, send_shardings)]
        return _compiled(chains.chain_fn(ops, self.comm), [order, *structs],
                         (order_sh, *send_shardings), (order_sh, *recv_shardings))

    def send(self, plan: ShardPlan, j: int, dst: int):
        device, shape, _ = plan.pieces[j]
        sh = self._in_sharding(plan, device)
        op = ("send", dst, j)
        return device, self._fn((op,), device, ((shape, plan.dtype),), (sh,), ())

    def recv(self, plan: ShardPlan, j: int, src: int):
        device, shape, _ = plan.pieces[j]
        sh = self._in_sharding(plan, device)
        op = ("recv", src, j, shape, plan.dtype.name)
        return device, self._fn((op,), device, (), (), (sh,))

    def sendrecv(self, s_plan: ShardPlan, r_plan: ShardPlan, j: int, peer: int):
        device, s_shape, _ = s_plan.pieces[j]
        _, r_shape, _ = r_plan.pieces[j]
        op = ("sendrecv", peer, j, j, r_shape,
              r_plan.dtype.name)
        return device, self._fn((op,), device, ((s_shape, s_plan.dtype),),
                                (self._in_sharding(s_plan, device),),
                                (self._in_sharding(r_plan, device),))

    def allreduce(self, op: str, pieces: tuple[tuple[ShardPlan, int], ...], device):
        """One bucket's chain on `device`: piece j of each (plan, j) combined by `op`
        over the replica communicator."""
        shardings = tuple(self._in_sharding(plan, device) for plan, _ in pieces)
        avals = tuple((plan.pieces[j][1], plan.dtype.name) for plan, j in pieces)
        return self._reducer(op, avals, device, shardings)

    @functools.cache  # noqa: B019 - lives as long as the executor
    def _reducer(self, op: str, avals: tuple, device, shardings: tuple):
        order_sh = SingleDeviceSharding(device)
        order = jax.ShapeDtypeStruct((), np.int32, sharding=order_sh)
        structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
                   for (shape, dtype), sh in zip(avals, shardings)]
        return _compiled(chains.allreduce_fn(op, avals, self.replica_comm), [order, *structs],
                         (order_sh, *shardings), (order_sh, *shardings))
