"""An object allgather made of point-to-point messages, whose waits another thread can read.

Note: watched allgather.
  A blocking `comm.allgather` cannot tell which rank has not arrived, so a deadline
  past it could only say where all ranks run. `allgather` gives the same list (element
  r is rank r's object) from non-blocking messages whose progress it keeps in a
  `Progress`, plain Python data that the deadline's thread reads without calling MPI:
  every rank but `ROOT` sends its pickled object to `ROOT` and waits for the gathered
  list (it waits for `ROOT`); `ROOT` receives every rank's object (matched probes, so
  no size is sent ahead; it waits for the ranks not heard from yet), then sends the
  pickled list to every rank (it waits for the ranks whose copy is not yet taken).
  Each wait tests its request at once for `SPIN_S` (200 us), then sleeps between
  tests a quarter of the time waited so far, from `FIRST_PAUSE_S` (50 us) up to
  `LAST_PAUSE_S` (1 ms): ranks that arrive together pay some microseconds more than a
  blocking allgather, and a rank that waits long does not take a core from its peers.
  The sleep grows with the wait, not by doubling: with doubling sleeps, ranks running
  agreements back to back fell into turns where each woke up to a whole sleep after
  the other's message and so made the other wait as long (measured: 1.7 ms a round
  instead of 15 us); a quarter of the wait shrinks such a lag each round.

  Every message goes on the communicator's highest tag (`MPI_TAG_UB`); the program's
  messages use small tags (one per shard: `Note: messages` in runtime/mpi_messages.py),
  so neither ever matches the other. Rounds cannot mix: a rank sends its next object
  only once it has this round's list, which `ROOT` sends only once it holds every
  rank's object, and MPI keeps the messages of one (source, tag) in order. Every rank
  of the communicator must call it at the same point, as for a collective; two calls
  from different places of the program (a rank compiling while another runs a step)
  still meet, each taking the other's object.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from mpi4py import MPI

__all__ = ["FIRST_PAUSE_S", "LAST_PAUSE_S", "PAUSE_SHARE", "ROOT", "SPIN_S", "Progress",
           "allgather"]

T = TypeVar("T")

ROOT = 0
"""The rank that gathers the objects and sends the list back."""

SPIN_S = 200e-6
"""How long a wait tests without sleeping first (`Note: watched allgather`)."""

FIRST_PAUSE_S = 50e-6
"""The first sleep between two tests of a wait (`Note: watched allgather`)."""

LAST_PAUSE_S = 1e-3
"""The longest sleep between two tests of a wait."""

PAUSE_SHARE = 0.25
"""A sleep's length as a share of the time waited so far (between the two above)."""


class Progress:
    """Which ranks an `allgather` in progress waits for; read from any thread.

    Attributes:
      waiting: the ranks of the communicator this rank waits for now, sorted (empty
        before the exchange and once it is done).
    """

    def __init__(self) -> None:
        self.waiting: tuple[int, ...] = ()


def _poll(test: Callable[[], T | None]) -> T:
    """`test()`'s first answer that is not None: tried at once for `SPIN_S`, then
    between sleeps of `PAUSE_SHARE` of the time waited so far, from `FIRST_PAUSE_S` up
    to `LAST_PAUSE_S` (`Note: watched allgather`)."""
    got = test()
    if got is not None:
        return got
    start = time.perf_counter()
    spin_until = start + SPIN_S
    while time.perf_counter() < spin_until:
        got = test()
        if got is not None:
            return got
    while True:
        waited = time.perf_counter() - start
        time.sleep(min(max(PAUSE_SHARE * waited, FIRST_PAUSE_S), LAST_PAUSE_S))
        got = test()
        if got is not None:
            return got


def _tag(comm: MPI.Comm) -> int:
    """The tag of every message here: the highest the communicator allows."""
    tag = comm.Get_attr(MPI.TAG_UB)
    return int(tag) if tag is not None else 32767  # the least MPI guarantees


def _receive(comm: MPI.Comm, source: int, tag: int) -> tuple[int, Any]:
    """(source, object) of the next message on `tag` from `source` (or any rank)."""
    status = MPI.Status()
    message = _poll(lambda: comm.improbe(source=source, tag=tag, status=status))
    buffer = bytearray(status.Get_count(MPI.BYTE))
    request = message.Irecv([buffer, MPI.BYTE])
    _poll(lambda: True if request.Test() else None)
    return status.Get_source(), MPI.pickle.loads(buffer)


def _wait_sends(sends: dict[int, MPI.Request], progress: Progress) -> None:
    """Waits until every send of `sends` (rank -> request) is done, noting the rest."""

    def test() -> bool | None:
        for rank in [r for r, request in sends.items() if request.Test()]:
            del sends[rank]
        progress.waiting = tuple(sorted(sends))
        return True if not sends else None

    _poll(test)


def allgather(obj: Any, comm: MPI.Comm, progress: Progress | None = None) -> list[Any]:
    """Every rank's `obj`, element `r` from rank `r`: `comm.allgather(obj)`'s result,
    from point-to-point messages (`Note: watched allgather`); collective.

    Args:
      obj: a small picklable value.
      comm: the communicator; every rank of it calls this alike.
      progress: where this rank notes the ranks it waits for (read by the deadline's
        report).

    Returns:
      The list of every rank's `obj`, in rank order.
    """
    progress = progress if progress is not None else Progress()
    size, rank = int(comm.Get_size()), int(comm.Get_rank())
    if size == 1:
        return [obj]
    tag = _tag(comm)
    if rank != ROOT:
        data = MPI.pickle.dumps(obj)
        sends = {ROOT: comm.Isend([data, MPI.BYTE], dest=ROOT, tag=tag)}
        progress.waiting = (ROOT,)
        _, gathered = _receive(comm, ROOT, tag)
        _wait_sends(sends, progress)
        return gathered
    gathered: list[Any] = [None] * size
    gathered[rank] = obj
    missing = set(range(size)) - {rank}
    while missing:
        progress.waiting = tuple(sorted(missing))
        source, value = _receive(comm, MPI.ANY_SOURCE, tag)
        gathered[source] = value
        missing.discard(source)
    data = MPI.pickle.dumps(gathered)
    sends = {r: comm.Isend([data, MPI.BYTE], dest=r, tag=tag)
             for r in range(size) if r != rank}
    _wait_sends(sends, progress)
    return gathered
