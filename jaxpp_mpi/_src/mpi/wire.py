"""Wire dtypes: how values of dtypes MPI lacks travel (JAX only, no MPI).

Note: Wire dtypes.
  MPI has no bfloat16, float16 or float8 datatypes (mpi4jax rejects them), so such
  values travel bitcast to the unsigned integer of the same width and are bitcast back
  on arrival: the bytes on the wire are exactly the array's bytes, NaN payloads and
  signed zeros included. Every function here takes and returns the user's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["from_wire", "to_wire", "wire_dtype", "wire_like"]

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


def to_wire(x: jax.Array) -> jax.Array:
    """`x` as it travels: bitcast to its wire dtype when MPI lacks its own."""
    wire = wire_dtype(x.dtype)
    return x if wire == x.dtype else jax.lax.bitcast_convert_type(x, wire)


def from_wire(x: jax.Array, dtype) -> jax.Array:
    """A received wire array back in the user's `dtype`."""
    return x if x.dtype == np.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def wire_like(shape, dtype) -> jax.Array:
    """A receive buffer template for a `shape`/`dtype` value."""
    return jnp.zeros(shape, wire_dtype(dtype))
