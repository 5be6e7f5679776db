"""MPI collectives and point-to-point calls of arrays and host values (mpi4py, mpi4jax).

Note: Ordering.
  mpi4jax >= 0.8 takes no tokens; each op carries a JAX ordered effect, so on one rank
  MPI operations happen in dispatch order. Ordered effects are only allowed in
  single-device computations: the callers transfer multi-device values shard by shard.
  The executor's messages use `chain` instead (Note: message chains): the same MPI
  calls, ordered by data, without the effect's dispatch cost.
"""

from __future__ import annotations

import time

import jax
import mpi4jax
import numpy as np
from mpi4py import MPI

from jaxpp_mpi._src.mpi.wire import from_wire, to_wire, wire_like

__all__ = [
    "allgather",
    "allgather_bytes",
    "allgather_object",
    "allreduce_max_int",
    "bcast",
    "bcast_bytes",
    "clock_offsets_ns",
    "gather",
    "gather_bytes",
    "library_version",
    "recv",
    "scatter",
    "send",
    "sendrecv",
    "world",
    "world_dup",
]


def world_dup() -> MPI.Comm:
    """A duplicate of COMM_WORLD, so user MPI traffic never mixes with the runtime's."""
    return MPI.COMM_WORLD.Dup()


def world() -> MPI.Comm:
    """COMM_WORLD itself, for a collective that must come before any communicator is
    made (`make_mpmd_mesh`'s argument agreement)."""
    return MPI.COMM_WORLD


def send(x: jax.Array, dst: int, tag: int, comm: MPI.Comm) -> None:
    """Blocking send of `x` to rank `dst` (traceable; use inside jit)."""
    mpi4jax.send(to_wire(x), dest=dst, tag=tag, comm=comm)


def recv(shape, dtype, src: int, tag: int, comm: MPI.Comm) -> jax.Array:
    """Blocking receive of an array of `shape`/`dtype` from rank `src` (traceable)."""
    out = mpi4jax.recv(wire_like(shape, dtype), source=src, tag=tag, comm=comm)
    return from_wire(out, dtype)


def sendrecv(
    x: jax.Array, dst: int, send_tag: int, shape, dtype, src: int, recv_tag: int,
    comm: MPI.Comm,
) -> jax.Array:
    """Sends `x` to `dst` and receives a `shape`/`dtype` array from `src`, together.

    MPI_Sendrecv: it cannot deadlock against the peer's matching exchange (traceable).
    """
    out = mpi4jax.sendrecv(
        to_wire(x), wire_like(shape, dtype), source=src, dest=dst,
        sendtag=send_tag, recvtag=recv_tag, comm=comm,
    )
    return from_wire(out, dtype)


def bcast(x: jax.Array, root: int, comm: MPI.Comm) -> jax.Array:
    """Broadcast from `root`; on other ranks `x` gives only shape and dtype."""
    return from_wire(mpi4jax.bcast(to_wire(x), root=root, comm=comm), x.dtype)


def allgather(x: jax.Array, comm: MPI.Comm) -> jax.Array:
    """Stacks every rank's `x` (same shape/dtype everywhere) along a new leading axis."""
    return from_wire(mpi4jax.allgather(to_wire(x), comm=comm), x.dtype)


def library_version() -> str:
    """The MPI library's name and version, one line."""
    return MPI.Get_library_version().splitlines()[0].strip().strip("\x00").strip()


# ------------------------------------------------------------------ host-side helpers
# Pickle-free: only bytes and int64 buffers cross the wire, so nothing received is ever
# unpickled (DESIGN.md §7); used between steps, e.g. by jaxpp_mpi.trace.export.


def gather_bytes(data: bytes, comm: MPI.Comm, root: int = 0) -> list[bytes] | None:
    """Every rank's `data`, in rank order, at `root` (collective, pickle-free).

    Args:
      data: this rank's bytes (any length; lengths may differ between ranks).
      comm: the communicator.
      root: the rank that receives.

    Returns:
      At `root`, one `bytes` per rank in rank order; None on the other ranks.
    """
    sizes = np.zeros(comm.Get_size(), np.int64) if comm.Get_rank() == root else None
    comm.Gather(np.array([len(data)], np.int64), sizes, root=root)
    mine = np.frombuffer(data, np.uint8)
    if sizes is None:
        comm.Gatherv([mine, MPI.BYTE], None, root=root)
        return None
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = np.empty(int(sizes.sum()), np.uint8)
    comm.Gatherv([mine, MPI.BYTE], [out, sizes.tolist(), displs.tolist(), MPI.BYTE], root=root)
    return [out[d : d + n].tobytes() for d, n in zip(displs, sizes)]


_MAX_ROUND_BYTES = 2**31 - 1  # MPI's int counts and displacements


def allgather_bytes(data: bytes, sizes: list[int], comm: MPI.Comm) -> list[np.ndarray]:
    """Every rank's `data` on every rank (collective, pickle-free): one Allgatherv,
    more only when the ranks' bytes together pass MPI's 2 GiB count limit.

    Args:
      data: this rank's bytes, `sizes[rank]` of them (may be empty).
      sizes: every rank's byte count, known on every rank alike.
      comm: the communicator.

    Returns:
      One uint8 array per rank, in rank order.
    """
    n, me = comm.Get_size(), comm.Get_rank()
    mine = np.frombuffer(data, np.uint8)
    chunk = max(1, _MAX_ROUND_BYTES // n)
    rounds = max(1, -(-max(sizes) // chunk))
    out = [np.empty(s, np.uint8) for s in sizes] if rounds > 1 else None
    for k in range(rounds):
        lo = k * chunk
        counts = [max(0, min(s - lo, chunk)) for s in sizes]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        recv = np.empty(int(sum(counts)), np.uint8)
        comm.Allgatherv([mine[lo:lo + counts[me]], MPI.BYTE],
                        [recv, counts, displs.tolist(), MPI.BYTE])
        if out is None:
            return [recv[d:d + c] for d, c in zip(displs, counts)]
        for r, (d, c) in enumerate(zip(displs, counts)):
            out[r][lo:lo + c] = recv[d:d + c]
    return out


def bcast_bytes(data: bytes | None, comm: MPI.Comm, root: int = 0) -> bytes:
    """`root`'s `data` on every rank (collective, pickle-free).

    Args:
      data: the bytes at `root`; other ranks pass None.
      comm: the communicator.
      root: the rank that sends.

    Returns:
      `root`'s bytes, on every rank.
    """
    size = np.array([len(data) if comm.Get_rank() == root else 0], np.int64)
    comm.Bcast(size, root=root)
    buf = np.frombuffer(data, np.uint8).copy() if comm.Get_rank() == root else None
    if buf is None:
        buf = np.empty(int(size[0]), np.uint8)
    comm.Bcast([buf, MPI.BYTE], root=root)
    return buf.tobytes()


def clock_offsets_ns(
    comm: MPI.Comm, root: int = 0, rounds: int = 8, always: bool = False
) -> list[int] | None:
    """At `root`, per rank, the ns to add to its `time.time_ns()` to read root's clock.

    Ranks on root's host share its clock (offset 0). For the others (every rank but root
    with `always`) the offset comes from `rounds` ping-pongs with root: the rank's reply
    time against the midpoint of the shortest round trip (Cristian's algorithm; error at
    most half that round trip).

    Args:
      comm: the communicator (collective over it).
      root: the rank whose clock is the reference.
      rounds: ping-pongs per remote rank.
      always: measure every rank but root, even those on root's host (tests).

    Returns:
      At `root`, the offset of each rank in ns; None on the other ranks.
    """
    rank = comm.Get_rank()
    if always:  # the same on every rank, so every rank skips the bcast alike
        remote = rank != root
    else:
        host = MPI.Get_processor_name().encode()
        remote = bcast_bytes(host, comm, root) != host
    flags = np.zeros(comm.Get_size(), np.int64) if rank == root else None
    comm.Gather(np.array([int(remote)], np.int64), flags, root=root)
    ping, pong = np.zeros(1, np.int64), np.zeros(1, np.int64)
    if rank != root:
        for k in range(rounds if remote else 0):
            comm.Recv(ping, source=root, tag=k)
            pong[0] = time.time_ns()
            comm.Send(pong, dest=root, tag=k)
        return None
    offsets = [0] * comm.Get_size()
    for r in np.flatnonzero(flags).tolist():
        best = None
        for k in range(rounds):
            t0 = time.time_ns()
            comm.Send(ping, dest=r, tag=k)
            comm.Recv(pong, source=r, tag=k)
            t1 = time.time_ns()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, (t0 + t1) // 2 - int(pong[0]))
        offsets[r] = best[1]
    return offsets


def gather(x: jax.Array, root: int, comm: MPI.Comm) -> jax.Array:
    """Gathers every rank's `x` (same shape/dtype everywhere) on `root` (traceable).

    Returns:
      On `root`, the values stacked along a new leading axis, `(comm.size, *x.shape)`;
      on the other ranks `x` unchanged (callers usually drop it).
    """
    return from_wire(mpi4jax.gather(to_wire(x), root=root, comm=comm), x.dtype)


def scatter(x: jax.Array, root: int, comm: MPI.Comm) -> jax.Array:
    """Sends slice `i` of `root`'s `x` (shape `(comm.size, *shape)`) to rank `i`.

    Traceable; on the other ranks `x` (shape `shape`) gives only shape and dtype.

    Returns:
      This rank's slice, of shape `shape`.
    """
    return from_wire(mpi4jax.scatter(to_wire(x), root=root, comm=comm), x.dtype)


def allgather_object(obj, comm: MPI.Comm) -> list:
    """Host-side allgather of a small picklable Python value (metadata, never arrays).

    Blocking, not traceable: element `r` of the result is rank `r`'s `obj`.
    """
    return comm.allgather(obj)


def allreduce_max_int(value: int, comm: MPI.Comm) -> int:
    """The largest `value` over the ranks of `comm` (host-side, pickle-free)."""
    out = np.zeros(1, np.int64)
    comm.Allreduce(np.array([value], np.int64), out, op=MPI.MAX)
    return int(out[0])
