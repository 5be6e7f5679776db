"""`process_allgather`: the explicit, collective read of MpmdArrays on every rank.

Note: reading values.
  There are two ways to read an `MpmdArray`'s value, and only the explicit one talks to
  other ranks:
  - implicitly (`np.asarray(x)`, `float(x)`, `int(x)`, `bool(x)`, iteration...): the
    replica this process holds, never a message; where none is held it raises at once
    (`Note: implicit reads are local` in arrays/array.py). `x.to_mpmd_local_array` is
    the same replica as a `jax.Array` (None elsewhere).
  - explicitly, `process_allgather(tree)`, named after JAX's
    `jax.experimental.multihost_utils.process_allgather` (what it gives for a global
    `jax.Array`: its whole value as numpy on every process): every rank of the
    pipeline (each pipeline replica's ranks, on their own) calls it at the same point
    with the same tree, and every rank gets every array's value as numpy. For the
    whole tree it costs
    1. one allgather of metadata: per leaf its shape, dtype, holding groups and spec,
       and each rank's error if it cannot read its part (a deleted or donated replica,
       PRNG keys, an unused value): ranks passing different trees, or any rank's error,
       raise on every rank alike, before any value moves;
    2. at most one `Allgatherv` of bytes (pickle-free; more rounds only past MPI's
       2 GiB count limit): every leaf some group does not hold travels once, packed
       with the others, from its lowest holder; a leaf every group holds is read where
       it is, no byte sent. A tree whose leaves are all held everywhere sends no bytes.
  Both run on the mesh's communicator for reads (`MpmdMesh._values_comm`, a duplicate
  of the pipeline's, so a read never meets another collective), under the deadline of
  `Note: deadlines` (runtime/failure.py), labelled `jaxpp_mpi.process_allgather`: a
  rank that calls it alone waits until the deadline, then every waiting rank names it.
  In local mode (one process holds every group) it reads each leaf where it is: no
  message. Leaves must be `MpmdArray`s of one mesh: JAX's function stacks a process's
  own arrays, which have no counterpart here, so other leaves are refused rather than
  given another meaning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxpp_mpi._src.arrays.array import MpmdArray
from jaxpp_mpi._src.runtime import agree
from jaxpp_mpi._src.runtime.failure import deadline

__all__ = ["process_allgather"]

_NAME = "jaxpp_mpi.process_allgather"


def _allgather_bytes(data: bytes, sizes: list[int], comm: Any) -> list[np.ndarray]:
    """Every rank's bytes on every rank (the MPI layer's pickle-free Allgatherv)."""
    return agree.collectives().allgather_bytes(data, sizes, comm)


def _header(x: MpmdArray) -> tuple:
    """What a rank reads at one leaf, as the ranks compare it."""
    return (tuple(x.shape), str(x.dtype), tuple(x.mpmd_sharding.mesh_ids),
            str(x.spec))


def _check_leaves(leaves: Sequence[Any]) -> Any:
    """The read communicator shared by every leaf (None: local mode).

    Raises:
      TypeError: a leaf is not an `MpmdArray`, or the leaves lie on different meshes.
    """
    meshes = []
    for k, x in enumerate(leaves):
        if not isinstance(x, MpmdArray):
            raise TypeError(
                f"{_NAME} reads MpmdArrays (a pipelined step's results); leaf {k} is a "
                f"{type(x).__name__}, which each process already holds: read it "
                "directly")
        meshes.append(x.mpmd_sharding.mpmd_mesh)
    local = {m.is_local for m in meshes}
    comms = {id(m._values_comm) for m in meshes}
    if len(local) > 1 or (local == {False} and len(comms) > 1):
        raise TypeError(f"{_NAME}: the leaves lie on different meshes; read each mesh's "
                        "arrays in a call of their own")
    return None if local == {True} else meshes[0]._values_comm


def _own_part(x: MpmdArray, k: int, me: int) -> tuple[np.ndarray | None, bool]:
    """(this rank's numpy value of leaf `k`, or None where not held; whether some group
    lacks it so its lowest holder sends it).

    Raises:
      TypeError: the leaf has no numpy value to send (PRNG keys, unused, a submesh).
      RuntimeError: the replica held here was deleted or donated.
    """
    sharding = x.mpmd_sharding
    what = f"{_NAME}: leaf {k}, {x!r}"
    if not sharding.mesh_ids:
        raise TypeError(f"{what}: no group holds the value (an unused value's metadata)")
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        raise TypeError(f"{what}: an array of PRNG keys has no numpy value; return "
                        "jax.random.key_data of it from the step")
    mesh = sharding.mpmd_mesh
    sent = len(sharding.mesh_ids) < mesh.mpmd_dim
    replica = x.local_arrays.get(me)
    if replica is None:
        return None, sent
    if replica.is_deleted():
        raise RuntimeError(f"{what}: the replica held on rank {me} was deleted (donated "
                           "to a later step?); read results before passing them on")
    return np.asarray(replica), sent


def _failure(failed: list[int], messages: Sequence[str | None]) -> Exception:
    """The error every rank raises when some rank cannot read its part."""
    message = messages[failed[0]]
    kind = next((e for e in (TypeError, RuntimeError, ValueError)
                 if message.startswith(e.__name__ + ":")), RuntimeError)
    others = f" (and ranks {failed[1:]})" if len(failed) > 1 else ""
    return kind(f"rank {failed[0]}{others}: {message.split(': ', 1)[1]}")


def process_allgather(tree: Any) -> Any:
    """Collective: every rank reads every `MpmdArray` of `tree` as numpy (Note: reading values).

    Every rank of the pipeline (of each pipeline replica) calls it at the same point
    with the same tree, as with `jax.experimental.multihost_utils.process_allgather`
    of global arrays. One metadata allgather and at most one Allgatherv of bytes for
    the whole tree, under the deadline `jaxpp_mpi.process_allgather`. To read a value
    on its holders alone, with no message, use `x.to_mpmd_local_array` (or `float(x)`
    where `x.is_partially_addressable`).

    Example:
      o, p, loss = step(o, p, batch)
      print(f"loss {float(jaxpp_mpi.process_allgather(loss)):.4f}")  # on every rank

    Args:
      tree: a pytree of `MpmdArray`s of one mesh (a step's results, or part of them).

    Returns:
      The same tree with each leaf's value as a `numpy.ndarray`, on every rank.

    Raises:
      TypeError: a leaf is not an `MpmdArray` or the leaves lie on different meshes
        (on this rank, before any message); or, on every rank, some leaf has no numpy
        value (PRNG keys, an unused value) or lies on a submesh without a communicator.
      RuntimeError: on every rank, when a holder's replica was deleted (donated).
      ValueError: on every rank, when the ranks passed different trees.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    comm = _check_leaves(leaves)
    if comm is None:
        if not leaves[0].mpmd_sharding.mpmd_mesh.is_local:
            raise TypeError(f"{_NAME}: the arrays lie on a submesh without a "
                            "communicator; read them on the full mesh's arrays, or "
                            "where held (x.to_mpmd_local_array)")
        values = [np.asarray(x._value_replica(_NAME)) for x in leaves]
        return jax.tree.unflatten(treedef, values)
    me = leaves[0].mpmd_sharding.mpmd_mesh.my_mpmd_axis_index
    label = (f"{_NAME} of {len(leaves)} array(s) (collective: every rank of the "
             "pipeline calls it; to read a value on its holders alone, read "
             "x.to_mpmd_local_array)")
    parts, error = [], None
    try:
        parts = [_own_part(x, k, me) for k, x in enumerate(leaves)]
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        error = e
    headers = [_header(x) for x in leaves]
    reports = agree.allgather_or_raise(headers, error, comm, _failure, own="never",
                                       label=label)
    differ = agree.differing_ranks(reports)
    if differ:
        r = differ[0]
        k = next((k for k, (a, b) in enumerate(zip(reports[0], reports[r])) if a != b),
                 min(len(reports[0]), len(reports[r])))
        raise ValueError(
            f"{_NAME}: the ranks passed different trees: rank 0 has {len(reports[0])} "
            f"leaves, rank {r} {len(reports[r])}; at leaf {k} rank 0 has "
            f"{reports[0][k] if k < len(reports[0]) else None} and rank {r} "
            f"{reports[r][k] if k < len(reports[r]) else None} (shape, dtype, groups, "
            "spec). Every rank passes the same arrays in the same order")
    return jax.tree.unflatten(treedef, _exchange(leaves, parts, comm, me, label))


def _exchange(leaves: Sequence[MpmdArray], parts: list[tuple[np.ndarray | None, bool]],
              comm: Any, me: int, label: str) -> list[np.ndarray]:
    """The leaves' values: each sent leaf from its lowest holder, packed in one
    Allgatherv; the others read where they are."""
    size = int(comm.Get_size())
    roots = [x.mpmd_sharding.mesh_ids[0] if sent else None
             for x, (_, sent) in zip(leaves, parts)]
    sizes = [0] * size
    for x, root in zip(leaves, roots):
        if root is not None:
            sizes[root] += x.nbytes
    values = [value for value, _ in parts]
    if not any(sizes):
        return values
    mine = b"".join(np.ascontiguousarray(value).tobytes()
                    for (value, _), root in zip(parts, roots) if root == me)
    with deadline(label, comm):
        received = _allgather_bytes(mine, sizes, comm)
    offsets = [0] * size
    for k, (x, root) in enumerate(zip(leaves, roots)):
        if root is None:
            continue
        start = offsets[root]
        offsets[root] += x.nbytes
        if values[k] is None:
            data = received[root][start:start + x.nbytes]
            values[k] = np.frombuffer(data, np.dtype(x.dtype)).reshape(x.shape).copy()
    return values
