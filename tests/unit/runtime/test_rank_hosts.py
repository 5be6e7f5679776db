"""Where each rank runs, in the reports of faults (`Note: rank hosts` in
runtime/hosts.py), and the step call agreement's deadline (`Note: deadlines` in
runtime/failure.py): stand-in communicators, no MPI, no JAX."""

from __future__ import annotations

import pytest
from thread_comm import AbortRecordingComm

from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.base.config import Options
from jaxpp_mpi._src.runtime import agree, failure, hosts


class StallingComm(AbortRecordingComm):
    """A stand-in communicator whose allgather completes only after the deadline (it
    waits for the abort, or 2 s)."""

    def allgather(self, obj):
        self.aborted.wait(2.0)
        return [obj] * self.size


@pytest.fixture
def known(monkeypatch):
    """Four ranks noted on hosts n1, n1, n2, n3 (the registry restored afterwards)."""
    monkeypatch.setattr(hosts, "_by_world", {})
    hosts.note_hosts(StallingComm(0, 4), ["n1", "n1", "n2", "n3"])


def test_hosts_are_noted_once_and_read_per_communicator(known):
    assert hosts.hosts_of(StallingComm(2, 4)) == ("n1", "n1", "n2", "n3")
    assert hosts.hosts_of(StallingComm(0, 6))[4:] == (None, None)  # not noted: unknown
    assert hosts.hosts_of(None) == ()
    assert hosts.host_of(("n1", "n2"), 1) == " on host n2"
    assert hosts.host_of(("n1", None), 1) == "" and hosts.host_of((), 0) == ""


def test_where_ranks_run_is_said_only_across_hosts():
    assert hosts.describe_hosts(["n1", "n1", "n2", None]) == (
        "ranks 0-1 on n1, rank 2 on n2, rank 3 on an unknown host")
    assert hosts.describe_hosts(["n1", "n1"]) == ""  # one host: nothing to act on
    assert hosts.describe_hosts([None, None]) == ""


def test_a_deadline_report_says_where_the_ranks_run(known, monkeypatch, capfd):
    monkeypatch.setattr(config, "options", lambda: Options(deadline_s=0.2,
                                                           watchdog_grace_s=0.0))
    comm = StallingComm(1, 4)
    agree.allgather("x", comm, "step call agreement")
    assert comm.aborted.is_set()
    err = capfd.readouterr().err
    assert ("a peer rank has not reached it (stalled, or lost; where the ranks run: "
            "ranks 0-1 on n1, rank 2 on n2, rank 3 on n3)") in err, err


def test_a_deadline_given_with_its_origin_says_so(monkeypatch, capfd):
    monkeypatch.setattr(config, "options", lambda: Options(watchdog_grace_s=0.0))
    comm = StallingComm(0, 2)
    agree.allgather("x", comm, "step call agreement", seconds=0.2,
                    how="the step's deadline, the watchdog's")
    assert comm.aborted.is_set()
    err = capfd.readouterr().err
    assert "past its deadline of 0.2 s (the step's deadline, the watchdog's)" in err, err


@pytest.mark.parametrize("options, step_deadline, gap, expected", [
    (Options(), 60.0, 0.5, 60.0),  # automatic: the step's learnt deadline, not 300 s
    (Options(), 300.0, 0.5, 300.0),  # while the watchdog learns: its first-steps one
    (Options(), 60.0, 30.0, 150.0),  # a loop that works between calls: 5 x that work
    (Options(deadline_s=20.0), 60.0, 0.5, None),  # a number given: the usual deadline
    (Options(deadlines=False), 60.0, 0.5, None),  # deadlines off
    (Options(), None, 0.5, None),  # no watchdog
])
def test_the_step_call_agreement_waits_under_the_step_deadline(options, step_deadline, gap,
                                                               expected):
    assert failure.step_call_deadline_s(options, step_deadline, gap) == expected


def test_the_learnt_step_deadline_reaches_the_call_agreement():
    """Once 3 steps ran, the watchdog's deadline is max(floor, 20 x the slowest), and the
    call agreement takes it (instead of the 300 s automatic deadline of collectives)."""
    options = Options(auto_floor_s=3.0)
    wd = failure.Watchdog(0, options, str, 4, lambda status: None)
    assert failure.step_call_deadline_s(options, wd.deadline_s(), 0.0) == 300.0
    wd._durations = [0.05, 0.5, 0.1]
    assert failure.step_call_deadline_s(options, wd.deadline_s(), 0.01) == 10.0
