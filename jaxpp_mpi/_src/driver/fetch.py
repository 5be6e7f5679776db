"""Reading an `MpmdArray`'s value on every rank: a broadcast from its lowest holder.

Note: reading values.
  `np.asarray(x)`, `float(x)`, `int(x)`, `bool(x)`, `complex(x)`, `operator.index(x)`
  and iterating `x` need `x`'s value. In local mode, and in MPI mode where every group
  holds a replica, each process reads its own (the lowest group's it holds): no message.
  In MPI mode, where some group does not hold `x`, the read is *collective* over the
  mesh's communicator (each pipeline replica's own): every rank reads at the same point
  of the program, as JaxPP's programs do when they print or check a result on every
  process, and every rank gets the value:
  1. one allgather of what each rank reads (shape, dtype, groups, spec), whether it
     holds it, and a holder's error if it cannot read its replica (deleted, donated): a
     holder's error raises on every rank;
  2. when every rank holds what it reads (each rank reading its own group's array at
     once), each returns its own replica; else, when every rank reads the same array,
     its lowest holder broadcasts the value's bytes (pickle-free) and every rank
     returns them as a numpy array; else (different arrays, some not held) every rank
     raises the same `ValueError`.
  Both steps run on a communicator of their own (`MpmdMesh._values_comm`, a duplicate
  of the mesh's made when the mesh was built), so a read never meets another
  collective, and under the deadline of `Note: deadlines` (runtime/failure.py),
  labelled with the array: a rank that reads alone (e.g. `if x.is_partially_addressable:
  float(x)` where the other ranks do not read) waits until the deadline, then the job
  ends with every waiting rank naming where it waits. To read on the holders only, read
  the replica held here, `x.to_mpmd_local_array` (a `jax.Array`, no message).
  `format(x)` (f-strings, log lines) is never collective: the value where held, else
  the repr. Ranks reading different arrays of the same shape, dtype and placement get
  the holder's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxpp_mpi._src.runtime import agree
from jaxpp_mpi._src.runtime.failure import deadline

if TYPE_CHECKING:
    from jaxpp_mpi._src.arrays.array import MpmdArray

__all__ = ["is_collective_read", "read_value"]


def is_collective_read(x: MpmdArray) -> bool:
    """Whether reading `x`'s value is collective here (see Note: reading values): MPI
    mode and some group of the pipeline does not hold it."""
    sharding = x.mpmd_sharding
    mesh = sharding.mpmd_mesh
    return not mesh.is_local and len(sharding.mesh_ids) < mesh.mpmd_dim


def _header(x: MpmdArray) -> tuple:
    """What a rank reads, as ranks compare it."""
    return (tuple(x.shape), np.dtype(x.dtype).name, tuple(x.mpmd_sharding.mesh_ids),
            str(x.spec))


def _broadcast_bytes(data: bytes | None, comm: Any, root: int) -> bytes:
    """`root`'s bytes on every rank of `comm` (the MPI layer's pickle-free broadcast)."""
    return agree.collectives().bcast_bytes(data, comm, root)


def _read_failed(what: str, failed: list[int], messages: list[str | None]) -> Exception:
    """The error every rank raises when the holder could not read its replica."""
    message = messages[failed[0]]
    kind = TypeError if message.startswith("TypeError") else RuntimeError
    return kind(f"{what}: rank {failed[0]}, which holds it, cannot read its replica: "
                f"{message}")


def read_value(x: MpmdArray, op: str) -> np.ndarray:
    """`x`'s value on every rank, from its lowest holder (Note: reading values);
    collective over the mesh's ranks.

    Args:
      x: an array of an MPI-mode mesh that some group does not hold.
      op: the conversion that reads it (`"np.asarray"`, `"float()"`, ...), for messages.

    Returns:
      The value as a numpy array, on every rank.

    Raises:
      TypeError: no group holds `x` (an unused value), its mesh is a submesh without
        a communicator, its dtype is a PRNG key's (as `jax.Array` refuses), or the
        holder's replica cannot be converted; the first three on this rank alone
        (each depends only on metadata every rank has), the last on every rank.
      ValueError: on every rank, when the ranks read different arrays, not every one
        held where it is read.
      RuntimeError: on every rank, when the holder's replica was deleted.
    """
    sharding = x.mpmd_sharding
    mesh = sharding.mpmd_mesh
    what = f"{op} of {x!r}"
    if not sharding.mesh_ids:
        raise TypeError(f"{what}: no group holds the value (an unused value's metadata)")
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        raise TypeError(f"{what}: an array of PRNG keys has no numpy value; read "
                        "jax.random.key_data of it inside the step, or on its holder")
    comm = mesh._values_comm
    if comm is None:
        raise TypeError(
            f"{what}: its mesh is a submesh without a communicator, so the ranks cannot "
            "fetch it from its holder; read it on the full mesh's arrays, or on its "
            "holder (x.to_mpmd_local_array)")
    root = sharding.mesh_ids[0]
    replica = x.local_arrays.get(mesh.my_mpmd_axis_index)
    value, error = None, None
    if replica is not None:
        try:
            value = np.asarray(replica)
        except Exception as e:  # noqa: BLE001 - raised on every rank just below
            error = e
    label = (f"a read of {x!r} (collective: every rank must read it; to read it on its "
             "holders alone, read x.to_mpmd_local_array)")
    reports = agree.allgather_or_raise(
        (_header(x), replica is not None), error, comm,
        lambda failed, messages: _read_failed(what, failed, messages), own="never",
        label=label)
    if all(held for _, held in reports):  # each rank reads a replica of its own
        return value
    headers = [h for h, _ in reports]
    differ = agree.differing_ranks(headers)
    if differ:
        r = differ[0]
        raise ValueError(
            f"{op}: the ranks read different arrays: rank 0 reads {headers[0]}, rank "
            f"{r} reads {headers[r]} (shape, dtype, groups, spec), not all held where "
            "read. Reading an MpmdArray that some group does not hold is collective: "
            "every rank reads the same arrays in the same order, or reads its own "
            "replica (x.to_mpmd_local_array)")
    mine = mesh.my_mpmd_axis_index == root
    data = np.ascontiguousarray(value).tobytes() if mine else None
    with deadline(label, comm):
        got = _broadcast_bytes(data, comm, root)
    if value is not None:
        return value
    return np.frombuffer(got, dtype=np.dtype(x.dtype)).reshape(x.shape).copy()
