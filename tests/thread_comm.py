"""A stand-in communicator whose ranks are threads of one process: for tests of
collective decisions (agreement, shared compiles) without MPI."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class ThreadComm:
    """One rank's end of an in-process communicator whose ranks are threads (mpi4py's
    object collectives that jaxpp_mpi uses, nothing else)."""

    def __init__(self, rank: int, shared: dict):
        self.rank, self.shared = rank, shared

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return len(self.shared["slots"])

    def allgather(self, obj):
        s = self.shared
        s["slots"][self.rank] = obj
        s["barrier"].wait()
        out = list(s["slots"])
        s["barrier"].wait()
        return out

    def alltoall(self, objs):
        everyone = self.allgather(objs)
        return [everyone[r][self.rank] for r in range(len(everyone))]


def on_thread_ranks(n: int, fn: Callable[[int, ThreadComm], Any]) -> list[tuple[Any, Any]]:
    """Runs `fn(rank, comm)` on `n` thread ranks; per rank (result, error)."""
    shared = {"slots": [None] * n, "barrier": threading.Barrier(n, timeout=60)}
    out: list[tuple[Any, Any]] = [(None, None)] * n

    def rank(r: int) -> None:
        try:
            out[r] = (fn(r, ThreadComm(r, shared)), None)
        except BaseException as e:  # noqa: BLE001 - the caller looks at it
            out[r] = (None, e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class AbortRecordingComm:
    """A stand-in communicator of `size` ranks with no collectives (whatever waits on it
    waits until its deadline) whose `Abort` records that it was called."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.aborted = threading.Event()

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Abort(self, status: int) -> None:  # noqa: N802
        self.aborted.set()
