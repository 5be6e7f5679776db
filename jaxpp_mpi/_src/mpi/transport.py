"""MPI transport: the only module that imports mpi4py and mpi4jax.

Note: Wire dtypes.
  MPI has no bfloat16, float16 or float8 datatypes (mpi4jax rejects them), so such
  values travel bitcast to the unsigned integer of the same width and are bitcast back
  on arrival: the bytes on the wire are exactly the array's bytes, NaN payloads and
  signed zeros included. Every function here takes and returns the user's dtype.

Note: Ordering.
  mpi4jax >= 0.8 takes no tokens; each op carries a JAX ordered effect, so on one rank
  MPI operations happen in dispatch order. Ordered effects are only allowed in
  single-device computations: the callers transfer multi-device values shard by shard.
  The executor's messages use `chain` instead (Note: message chains): the same MPI
  calls, ordered by data, without the effect's dispatch cost.

Note: message chains.
  mpi4jax's send/recv carry a JAX *ordered effect*. JAX then threads a runtime token
  through every such computation, which takes its Python dispatch path on each call
  (measured: ~0.3-0.4 ms per call on this machine, against ~9 us for a jitted call
  without effects). A pipeline step makes several such calls per task, so that cost
  dominated small models.

  `mpi_chain_p` runs the same MPI calls (mpi4jax's own XLA FFI handlers
  `mpi_send_ffi`, `mpi_recv_ffi`, `mpi_sendrecv_ffi`) with no JAX effect: inside one
  computation the calls are chained by an XLA token created in that computation, and
  between computations they are ordered by *data*: every chain takes an `order` array
  and returns the next one. PJRT starts an execution only when all its argument
  buffers are ready and makes its results ready only when it has finished, so a chain
  passed the previous chain's `order` starts after that chain's MPI calls completed:
  this rank's MPI calls happen in program order, as with the effect, and a jitted
  chain keeps JAX's fast C++ dispatch path.

  The calls are marked `has_side_effect`, so XLA neither removes nor merges them; the
  `order` result keeps the primitive alive in JAX's own dead-code elimination. A
  dispatcher keeps its latest `order` in a `Chain`; every live Chain is waited for at
  exit, before MPI is finalized (JAX's own exit hook waits only for effect tokens).

  Relies on mpi4jax internals (the FFI target names and attributes, the communicator
  and datatype handles) as of mpi4jax 0.9; the MPI tests exercise every path.
"""

from __future__ import annotations

import atexit
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
from jax.extend.core import Primitive
from jax.extend.mlir.dialects import stablehlo as hlo
from jax.interpreters import mlir

# Why mpi4jax internals: the handles its own lowerings pass to its FFI handlers; there
# is no public API for lowering its calls without its ordered effect (message chains).
from mpi4jax._src.decorators import translation_rule_cpu, translation_rule_cuda
from mpi4jax._src.jax_compat import abstract_token
from mpi4jax._src.utils import to_dtype_handle, to_mpi_handle
from mpi4jax._src.xla_bridge import MPI_STATUS_IGNORE_ADDR
from mpi4py import MPI

_MPI_NATIVE = frozenset(
    ["float32", "float64", "complex64", "complex128", "int8", "int16", "int32", "int64",
     "uint8", "uint16", "uint32", "uint64", "bool"]
)
_UINT_OF_SIZE = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def wire_dtype(dtype) -> np.dtype:
    """The dtype a value of `dtype` travels as (see Note: Wire dtypes)."""
    dtype = np.dtype(dtype)
    if dtype.name in _MPI_NATIVE:
        return dtype
    if dtype.itemsize not in _UINT_OF_SIZE:
        raise TypeError(f"jaxpp_mpi cannot send arrays of dtype {dtype.name} over MPI")
    return np.dtype(_UINT_OF_SIZE[dtype.itemsize])


def _to_wire(x: jax.Array) -> jax.Array:
    wire = wire_dtype(x.dtype)
    return x if wire == x.dtype else jax.lax.bitcast_convert_type(x, wire)


def _from_wire(x: jax.Array, dtype) -> jax.Array:
    return x if x.dtype == np.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def _wire_like(shape, dtype) -> jax.Array:
    return jnp.zeros(shape, wire_dtype(dtype))


def world_dup() -> MPI.Comm:
    """A duplicate of COMM_WORLD, so user MPI traffic never mixes with the runtime's."""
    return MPI.COMM_WORLD.Dup()


def send(x: jax.Array, dst: int, tag: int, comm: MPI.Comm) -> None:
    """Blocking send of `x` to rank `dst` (traceable; use inside jit)."""
    mpi4jax.send(_to_wire(x), dest=dst, tag=tag, comm=comm)


def recv(shape, dtype, src: int, tag: int, comm: MPI.Comm) -> jax.Array:
    """Blocking receive of an array of `shape`/`dtype` from rank `src` (traceable)."""
    out = mpi4jax.recv(_wire_like(shape, dtype), source=src, tag=tag, comm=comm)
    return _from_wire(out, dtype)


def sendrecv(
    x: jax.Array, dst: int, send_tag: int, shape, dtype, src: int, recv_tag: int,
    comm: MPI.Comm,
) -> jax.Array:
    """Sends `x` to `dst` and receives a `shape`/`dtype` array from `src`, together
    (MPI_Sendrecv: cannot deadlock against the peer's matching exchange)."""
    out = mpi4jax.sendrecv(
        _to_wire(x), _wire_like(shape, dtype), source=src, dest=dst,
        sendtag=send_tag, recvtag=recv_tag, comm=comm,
    )
    return _from_wire(out, dtype)


def bcast(x: jax.Array, root: int, comm: MPI.Comm) -> jax.Array:
    """Broadcast from `root`; on other ranks `x` gives only shape and dtype."""
    return _from_wire(mpi4jax.bcast(_to_wire(x), root=root, comm=comm), x.dtype)


def allgather(x: jax.Array, comm: MPI.Comm) -> jax.Array:
    """Stacks every rank's `x` (same shape/dtype everywhere) along a new leading axis."""
    return _from_wire(mpi4jax.allgather(_to_wire(x), comm=comm), x.dtype)


def library_version() -> str:
    """The MPI library's name and version, one line."""
    return MPI.Get_library_version().splitlines()[0].strip().strip("\x00").strip()


# ------------------------------------------------------------------ host-side helpers
# Pickle-free: only bytes and int64 buffers cross the wire, so nothing received is ever
# unpickled (DESIGN.md §7); used between steps, e.g. by jaxpp_mpi.trace.export.


def gather_bytes(data: bytes, comm: MPI.Comm, root: int = 0) -> list[bytes] | None:
    """Every rank's `data`, in rank order, at `root` (None on the other ranks)."""
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


def bcast_bytes(data: bytes | None, comm: MPI.Comm, root: int = 0) -> bytes:
    """`data` of `root` on every rank (other ranks pass None)."""
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
    most half that round trip). Collective over `comm`; None on the other ranks.
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


# ----------------------------------------------------------------- message chains

# ("send", peer, tag) | ("recv", peer, tag, shape, dtype)
# | ("sendrecv", peer, send_tag, recv_tag, shape, dtype); dtypes are MPI-native names.
Op = tuple

mpi_chain_p = Primitive("jaxpp_mpi_chain")
mpi_chain_p.multiple_results = True


def chain(order: jax.Array, sends: Sequence[jax.Array], ops: tuple[Op, ...],
          comm: Any) -> tuple[jax.Array, list[jax.Array]]:
    """Runs `ops` in order (traceable; use inside jit). See `Note: message chains`.

    Args:
      order: the previous chain's order array (an int32 scalar).
      sends: one array per "send"/"sendrecv" op, in op order, of MPI-native dtypes.
      ops: the calls.
      comm: the communicator.

    Returns:
      The next order array, and one array per "recv"/"sendrecv" op, in op order.
    """
    out = mpi_chain_p.bind(order, *sends, ops=ops, comm=int(to_mpi_handle(comm)))
    return out[0], list(out[1:])


def _received(ops):
    return [jax.core.ShapedArray(op[-2], np.dtype(op[-1])) for op in ops
            if op[0] in ("recv", "sendrecv")]


@mpi_chain_p.def_abstract_eval
def _mpi_chain_abstract_eval(order, *sends, ops, comm):
    return [jax.core.ShapedArray(order.shape, order.dtype), *_received(ops)]


def _ffi(ctx, target, operands, avals_in, avals_out, **attrs):
    sub = ctx.replace(avals_in=avals_in, avals_out=avals_out)
    return jax.ffi.ffi_lowering(target, has_side_effect=True)(sub, *operands, **attrs)


def _mpi_chain_lowering(ctx, order, *sends, ops, comm):
    token = hlo.create_token()
    send_avals = iter(zip(sends, ctx.avals_in[1:]))
    recv_avals = iter(ctx.avals_out[1:])
    received = []
    comm = np.int64(comm)
    for op in ops:
        kind, peer = op[0], np.int64(op[1])
        if kind == "send":
            x, aval = next(send_avals)
            (token,) = _ffi(
                ctx, "mpi_send_ffi", (x, token), (aval, abstract_token), (abstract_token,),
                nitems=np.int64(np.prod(aval.shape, dtype=np.int64)), dest=peer,
                tag=np.int64(op[2]), comm=comm, dtype=np.int64(to_dtype_handle(aval.dtype)))
        elif kind == "recv":
            aval = next(recv_avals)
            y, token = _ffi(
                ctx, "mpi_recv_ffi", (token,), (abstract_token,), (aval, abstract_token),
                nitems=np.int64(np.prod(aval.shape, dtype=np.int64)), source=peer,
                tag=np.int64(op[2]), comm=comm, dtype=np.int64(to_dtype_handle(aval.dtype)),
                status=np.int64(MPI_STATUS_IGNORE_ADDR))
            received.append(y)
        elif kind == "sendrecv":
            x, s_aval = next(send_avals)
            r_aval = next(recv_avals)
            y, token = _ffi(
                ctx, "mpi_sendrecv_ffi", (x, token), (s_aval, abstract_token),
                (r_aval, abstract_token),
                sendcount=np.int64(np.prod(s_aval.shape, dtype=np.int64)), dest=peer,
                sendtag=np.int64(op[2]), sendtype=np.int64(to_dtype_handle(s_aval.dtype)),
                recvcount=np.int64(np.prod(r_aval.shape, dtype=np.int64)), source=peer,
                recvtag=np.int64(op[3]), recvtype=np.int64(to_dtype_handle(r_aval.dtype)),
                comm=comm, status=np.int64(MPI_STATUS_IGNORE_ADDR))
            received.append(y)
        else:
            raise ValueError(f"unknown MPI chain op {op!r}")
    one = mlir.ir_constant(np.array(1, dtype=ctx.avals_in[0].dtype))
    return [hlo.add(order, one), *received]


# mpi4jax's own per-platform wrappers run its set-up first (on CUDA: load its CUDA
# extension and apply MPI4JAX_USE_CUDA_MPI), as for its own primitives.
mlir.register_lowering(mpi_chain_p, translation_rule_cpu(_mpi_chain_lowering),
                       platform="cpu")
mlir.register_lowering(mpi_chain_p, translation_rule_cuda(_mpi_chain_lowering),
                       platform="cuda")

_chains: weakref.WeakSet[Chain] = weakref.WeakSet()


class Chain:
    """The current `order` array of one dispatcher of chains (see `Note: message chains`).

    Args:
      device: where the first order array lives.
    """

    def __init__(self, device: jax.Device):
        self.device = device
        self.order: jax.Array = jax.device_put(np.zeros((), np.int32), device)
        _chains.add(self)

    def on(self, device: jax.Device) -> jax.Array:
        """The order array, moved to `device` first if it lives elsewhere (the copy
        waits for it, so the order carries over)."""
        if device != self.device:
            self.order = jax.device_put(self.order, device)
            self.device = device
        return self.order

    def wait(self) -> None:
        """Blocks until every chain dispatched so far has finished."""
        self.order.block_until_ready()


def chain_fn(ops: tuple[Op, ...], comm: Any) -> Any:
    """A traceable `fn(order, *sends) -> (order, *received)` running `ops` (user dtypes
    in and out: bfloat16 and friends travel bitcast, see `Note: Wire dtypes`)."""
    wire_ops = tuple(op[:-1] + (wire_dtype(op[-1]).name,) if op[0] != "send" else op
                     for op in ops)
    recv_dtypes = [op[-1] for op in ops if op[0] != "send"]

    def fn(order, *sends):
        order, got = chain(order, [_to_wire(x) for x in sends], wire_ops, comm)
        return (order, *[_from_wire(y, d) for y, d in zip(got, recv_dtypes)])

    return fn


def quiesce() -> None:
    """Waits until this process's dispatched MPI work is done: effectful computations
    (`jax.effects_barrier`) and every live message `Chain`."""
    jax.effects_barrier()
    for c in list(_chains):
        c.wait()


@atexit.register
def wait_for_chains() -> None:
    """Waits for every live `Chain` (runs at exit, before mpi4py finalizes MPI)."""
    for c in list(_chains):
        try:
            c.wait()
        except Exception:  # noqa: BLE001 - a failed step already reported its error
            pass


def gather(x: jax.Array, root: int, comm: MPI.Comm) -> jax.Array:
    """Gathers every rank's `x` (same shape/dtype everywhere) on `root` (traceable).

    Returns:
      On `root`, the values stacked along a new leading axis, `(comm.size, *x.shape)`;
      on the other ranks `x` unchanged (callers usually drop it).
    """
    return _from_wire(mpi4jax.gather(_to_wire(x), root=root, comm=comm), x.dtype)


def scatter(x: jax.Array, root: int, comm: MPI.Comm) -> jax.Array:
    """Sends slice `i` of `root`'s `x` (shape `(comm.size, *shape)`) to rank `i`
    (traceable); on the other ranks `x` (shape `shape`) gives only shape and dtype.

    Returns:
      This rank's slice, of shape `shape`.
    """
    return _from_wire(mpi4jax.scatter(_to_wire(x), root=root, comm=comm), x.dtype)


def allgather_object(obj, comm: MPI.Comm) -> list:
    """Host-side allgather of a small picklable Python value (metadata, never array
    data): element `r` of the result is rank `r`'s `obj`. Blocking, not traceable."""
    return comm.allgather(obj)


def allreduce_max_int(value: int, comm: MPI.Comm) -> int:
    """The largest `value` over the ranks of `comm` (host-side, pickle-free)."""
    out = np.zeros(1, np.int64)
    comm.Allreduce(np.array([value], np.int64), out, op=MPI.MAX)
    return int(out[0])
