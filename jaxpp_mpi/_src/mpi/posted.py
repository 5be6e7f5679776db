"""Posted sends: a CPU group's sends as non-blocking MPI sends from host memory.

Note: posted sends.
  A blocking MPI_Send returns only once the receiving process has taken part: for a
  small message it waits until the receiver's MPI library hands the fragment back, for
  a large one until the receiver has posted the matching receive. Inside a message
  chain that holds the sender's next task back until its peer next enters MPI, which on
  a busy peer is the end of the peer's current task: every message couples the two
  ranks' timelines and passes each rank's jitter on to its neighbours (measured: the
  step sat 3-5% above the prediction of the program's own order).

  On a CPU group a Send (and the send half of a SendRecv) is posted instead with
  MPI_Isend from the array's own host memory, and the rank goes on at once. Open MPI's
  shared-memory transport lets the receiver fetch a large message without the sender's
  help (single copy), so the data moves while the sender computes (measured with the
  default settings: a receiver that posts its receive while the sender computes gets
  even a 1 MiB message at once). The request, the array and its host view stay here
  until the request completes; completed requests are reaped at the next post and when
  a step starts, and every live `PostedSends` is waited for by `chains.quiesce` and at
  exit, before MPI is finalized (`chains.wait_for_chains`).

  Order. MPI matches the messages of one (source, communicator, tag) in the order they
  were posted; every send of a CPU group is posted here, in program order, from the
  dispatching thread, so the pairing `Note: messages` (runtime/mpi_messages.py) relies on holds.
  A posted send never blocks, so it cannot add a deadlock to a program the verifier
  proved deadlock-free with blocking sends (`simulate(..., sends="posted")` times it).

  Memory. The message is read from a host view of the array's own buffer, so posting
  waits for the task that computes it (Python blocks there, where a chain would be
  queued behind the task and Python would dispatch on). While the view lives, JAX does
  not donate the buffer (a Run that donates it gets a fresh output buffer instead), so a
  message in flight is never overwritten. The view is taken with DLPack, which the
  array does not cache, so once the send completes and is reaped, later donations of
  the buffer work again; dtypes DLPack lacks in NumPy (bfloat16, float16, float8: `Note:
  Wire dtypes`) use the array's own cached NumPy view, which keeps JAX from donating
  that buffer at all.

  Other platforms keep the chains: there the host view would be a device-to-host copy
  and a wait that stalls the dispatch of the next tasks. JAXPP_MPI_POSTED_SENDS=0 keeps
  them on CPU too (`bench/schedules.py --chained` runs both in the same rounds; on its
  2-rank workload, a core per rank, the step times differ by less than that machine's
  noise, measured when this path was chosen).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import jax
import numpy as np

# Why an mpi4jax internal: the MPI datatype its receives use for each dtype, so that
# both ends of a message name the same datatype.
from mpi4jax._src.utils import MPI_TYPE_MAP
from mpi4py import MPI

from jaxpp_mpi._src.ir.simulate import runtime_sends
from jaxpp_mpi._src.mpi.wire import wire_dtype

__all__ = ["PostedSends", "posts_sends", "wait_for_posted"]

_live: weakref.WeakSet[PostedSends] = weakref.WeakSet()


def posts_sends(device: jax.Device, posted_sends: bool = True) -> bool:
    """Whether sends from `device` are posted (`Note: posted sends`) or chained;
    `posted_sends` is the option JAXPP_MPI_POSTED_SENDS (`simulate.runtime_sends`)."""
    return runtime_sends(device.platform, posted_sends) == "posted"


class PostedSends:
    """This rank's sends in flight (see `Note: posted sends`).

    Args:
      comm: the communicator the sends go over.
    """

    def __init__(self, comm: Any):
        self.comm = comm
        self._pending: collections.deque = collections.deque()
        _live.add(self)

    def post(self, x: jax.Array, dst: int, tag: int) -> None:
        """Sends single-device array `x` to `dst` with `tag`, without waiting for it.

        Args:
          x: the value (waited for: the message is read from its buffer).
          dst: the destination rank in `comm`.
          tag: the MPI tag.
        """
        wire = wire_dtype(x.dtype)
        if wire == x.dtype:
            host = np.from_dlpack(x.block_until_ready())
        else:
            host = np.asarray(x).view(wire)
        datatype = getattr(MPI, MPI_TYPE_MAP[wire.name])
        request = self.comm.Isend([host, datatype], dst, tag)
        self._pending.append((request, host, x))
        self.reap()

    def post_shards(self, shards: list[jax.Array], dst: int) -> None:
        """Posts a value's distinct shards to `dst`, shard j with tag j (`Note:
        messages` in runtime/mpi_messages.py)."""
        for j, shard in enumerate(shards):
            self.post(shard, dst, j)

    def reap(self) -> None:
        """Drops the oldest sends that have completed."""
        pending = self._pending
        while pending and pending[0][0].Test():
            pending.popleft()

    def wait(self) -> None:
        """Blocks until every send posted so far has completed."""
        pending = self._pending
        MPI.Request.Waitall([p[0] for p in pending])
        pending.clear()


def wait_for_posted() -> None:
    """Blocks until every send of every live `PostedSends` has completed (also at exit:
    `chains.wait_for_chains`)."""
    for p in list(_live):
        p.wait()
