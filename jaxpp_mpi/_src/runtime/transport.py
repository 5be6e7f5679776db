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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mpi4jax
import numpy as np
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
