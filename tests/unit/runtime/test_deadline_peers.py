"""A deadline's report names the peers its collective waits for, and their hosts
(`waiting_on` of `deadline` in runtime/failure.py, `describe_peers` in runtime/hosts.py):
stand-in communicators, no MPI, no JAX."""

from __future__ import annotations

import pytest
from thread_comm import AbortRecordingComm

from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.base.config import Options
from jaxpp_mpi._src.runtime import failure, hosts


@pytest.fixture
def known(monkeypatch):
    """Four ranks noted on hosts n1, n1, n2, n3 (the registry restored afterwards);
    deadlines of 0.2 s, no grace."""
    monkeypatch.setattr(hosts, "_by_world", {})
    hosts.note_hosts(AbortRecordingComm(0, 4), ["n1", "n1", "n2", "n3"])
    monkeypatch.setattr(config, "options", lambda: Options(deadline_s=0.2,
                                                           watchdog_grace_s=0.0))


def test_peers_are_named_with_their_hosts():
    where = ("n1", "n1", "n2", None)
    assert hosts.describe_peers([2], where) == "rank 2 on host n2"
    assert hosts.describe_peers([1, 0, 2], where) == "ranks 0-1 on host n1, rank 2 on host n2"
    assert hosts.describe_peers([3], where) == "rank 3"  # host unknown
    assert hosts.describe_peers([5], where) == "rank 5"


def _report(comm: AbortRecordingComm, waiting_on) -> bool:
    with failure.deadline("step call agreement", comm, waiting_on=waiting_on):
        assert comm.aborted.wait(5.0)
    return comm.aborted.is_set()


@pytest.mark.parametrize("rank, waiting, named", [
    (0, (2, 3), "it waits for rank 2 on host n2, rank 3 on host n3 (stalled, or lost; "),
    (3, (0,), "it waits for rank 0 on host n1 (stalled, or lost; "),
])
def test_a_deadline_names_the_peers_it_waits_for(known, capfd, rank, waiting, named):
    progress = [waiting]
    assert _report(AbortRecordingComm(rank, 4), lambda: progress[0])
    err = capfd.readouterr().err
    assert f"[rank {rank}] jaxpp_mpi deadline: waiting in step call agreement" in err, err
    assert named in err, err
    assert "where the ranks run: ranks 0-1 on n1, rank 2 on n2, rank 3 on n3)" in err, err


@pytest.mark.parametrize("waiting_on", [None, lambda: (), lambda: 1 / 0])
def test_without_peers_the_report_says_a_peer_has_not_arrived(known, capfd, waiting_on):
    assert _report(AbortRecordingComm(1, 4), waiting_on)
    err = capfd.readouterr().err
    assert "; a peer rank has not reached it (stalled, or lost; where the ranks run" in err, err
