"""The watched allgather (`Note: watched allgather` in mpi/gather.py): `comm.allgather`'s
result from point-to-point messages, round after round, beside messages on other tags,
and the peers each rank waits for while a rank is late."""

from __future__ import annotations

import threading
import time

import pytest
from mpi4py import MPI

from jaxpp_mpi._src.mpi import collectives, gather
from jaxpp_mpi._src.runtime import agree

COMM = collectives.world_dup()
RANK, SIZE = COMM.rank, COMM.size

VALUES = {
    "none": lambda r: None,
    "int": lambda r: r,
    "report": lambda r: (None if r % 2 else f"ValueError: rank {r}", ("step", r * 7)),
    "sizes": lambda r: "x" * (10 ** r),  # different sizes per rank
    "large": lambda r: bytes([r]) * (4 << 20),  # past any eager limit
}


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", sorted(VALUES))
def test_gives_comm_allgathers_result(kind):
    obj = VALUES[kind](RANK)
    assert gather.allgather(obj, COMM) == COMM.allgather(obj)


@pytest.mark.mpi(min_size=2)
def test_rounds_in_a_row_and_between_collectives_keep_their_order():
    progress = gather.Progress()
    for k in range(50):
        got = gather.allgather((k, RANK), COMM, progress)
        assert got == [(k, r) for r in range(SIZE)]
        assert progress.waiting == ()
        if k % 10 == 0:
            assert COMM.allgather(k) == [k] * SIZE


@pytest.mark.mpi(min_size=2)
def test_messages_on_other_tags_are_left_alone():
    """A message of the program's (tag 0, to the next rank) posted before the allgather
    is received after it, unchanged."""
    peer_to, peer_from = (RANK + 1) % SIZE, (RANK - 1) % SIZE
    data = MPI.pickle.dumps(("program", RANK))
    send = COMM.Isend([data, MPI.BYTE], dest=peer_to, tag=0)
    assert gather.allgather(RANK, COMM) == list(range(SIZE))
    assert COMM.recv(source=peer_from, tag=0) == ("program", peer_from)
    send.Wait()


@pytest.mark.mpi(min_size=2)
def test_agree_allgather_takes_it_on_an_mpi_communicator(monkeypatch):
    calls = []
    real = gather.allgather
    monkeypatch.setattr(gather, "allgather",
                        lambda obj, comm, progress=None: calls.append(obj) or
                        real(obj, comm, progress))
    assert agree.allgather(RANK, COMM, "test agreement") == list(range(SIZE))
    assert calls == [RANK]


@pytest.mark.mpi(min_size=2)
def test_a_late_rank_is_named_by_rank_0_and_rank_0_by_the_others():
    late = SIZE - 1
    progress = gather.Progress()
    seen: list[tuple[int, ...]] = []
    look = threading.Timer(0.3, lambda: seen.append(progress.waiting))
    look.start()
    if RANK == late:
        time.sleep(1.0)
    assert gather.allgather(RANK, COMM, progress) == list(range(SIZE))
    look.join()
    if RANK == 0:
        assert seen == [(late,)]
    elif RANK != late:
        assert seen == [(gather.ROOT,)]
    assert progress.waiting == ()
    COMM.Barrier()
