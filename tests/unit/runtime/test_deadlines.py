"""Deadlines of collectives outside the step and the step watchdog's timing
(runtime/failure.py: `Note: deadlines`, `Note: watchdog`), with stand-in communicators:
no MPI, no JAX."""

from __future__ import annotations

import threading
import time

import pytest

from jaxpp_mpi._src.base import config
from jaxpp_mpi._src.base.config import Options, parse_options
from jaxpp_mpi._src.runtime import agree, failure


class StallingComm:
    """A stand-in communicator whose collectives never complete on time (a peer never
    arrives) and whose `Abort` records the status instead of ending the process."""

    def __init__(self, rank: int = 1, stall_s: float = 1.0):
        self.rank, self.stall_s = rank, stall_s
        self.aborted = threading.Event()
        self.status = None

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return self.rank

    def Abort(self, status: int) -> None:  # noqa: N802 - mpi4py's name
        self.status = status
        self.aborted.set()

    def allgather(self, obj):
        self.aborted.wait(self.stall_s)
        return [obj, obj]

    def bcast(self, obj, root=0):
        self.aborted.wait(self.stall_s)
        return obj


@pytest.fixture
def quick(monkeypatch):
    """A 0.3 s deadline with no grace; the slowest-work records start empty."""
    options = Options(deadline_s=0.3, watchdog_grace_s=0.0)
    monkeypatch.setattr(config, "options", lambda: options)
    monkeypatch.setattr(failure, "_work", {})
    return options


def test_a_collective_past_its_deadline_names_its_label_and_aborts(quick, capfd):
    comm = StallingComm(rank=3)
    start = time.monotonic()
    agree.allgather("x", comm, "program agreement")
    assert comm.aborted.is_set() and comm.status == 1
    assert time.monotonic() - start < 0.3 + 2 * failure._POLL_S + 0.3
    err = capfd.readouterr().err
    assert ("[rank 3] jaxpp_mpi deadline: waiting in program agreement for " in err), err
    assert "past its deadline of 0.3 s (JAXPP_MPI_DEADLINE)" in err


@pytest.mark.parametrize("call", [
    lambda c: agree.bcast(1, c, label="L"),
    lambda c: agree.check_same("text", c, ValueError, "L"),
    lambda c: agree.raise_if_any(None, c, ValueError, label="L"),
    lambda c: agree.run(lambda: 1, c, ValueError, label="L"),
])
def test_every_agreement_path_waits_under_its_label(quick, capfd, call):
    comm = StallingComm()
    call(comm)
    assert comm.aborted.is_set()
    assert "waiting in L for" in capfd.readouterr().err


def test_a_collective_in_time_leaves_nothing_behind(quick):
    comm = StallingComm(stall_s=0.0)
    agree.allgather("x", comm, "L")
    time.sleep(0.3 + 2 * failure._POLL_S)
    assert not comm.aborted.is_set() and not failure._waits


def test_the_public_helper_watches_the_users_own_collective(quick, capfd):
    from jaxpp_mpi import launch

    comm = StallingComm(rank=0)
    with launch.deadline("loss broadcast", comm, seconds=0.2):
        comm.bcast(1.0, root=1)
    assert comm.aborted.is_set()
    err = capfd.readouterr().err
    assert "[rank 0] jaxpp_mpi deadline: waiting in loss broadcast for" in err
    assert "past its deadline of 0.2 s (given)" in err


def test_no_communicator_means_no_deadline(quick):
    with failure.deadline("alone"):  # no MPI in this process: nothing to wait for
        assert not failure._waits


def test_local_work_before_a_collective_lengthens_its_deadline(quick):
    assert failure.deadline_s("compile barrier") == 0.3
    agree.run(lambda: time.sleep(0.2), StallingComm(stall_s=0.0), ValueError,
              label="compile barrier")
    assert failure.deadline_s("compile barrier") >= 5 * 0.2  # work_factor x the work
    assert failure.deadline_s("another label") == 0.3


@pytest.mark.parametrize("env, enabled, seconds", [
    ({}, True, None),  # automatic: 300 s
    ({"JAXPP_MPI_STEP_TIMEOUT": "10"}, True, 10.0),  # follows the step timeout
    ({"JAXPP_MPI_STEP_TIMEOUT": "off"}, False, None),
    ({"JAXPP_MPI_STEP_TIMEOUT": "10", "JAXPP_MPI_DEADLINE": "7"}, True, 7.0),
    ({"JAXPP_MPI_DEADLINE": "off"}, False, None),
    ({"JAXPP_MPI_DEADLINE": "auto", "JAXPP_MPI_STEP_TIMEOUT": "10"}, True, None),
])
def test_deadline_settings(env, enabled, seconds):
    o = parse_options(env)
    assert (o.deadlines, o.deadline_s) == (enabled, seconds)
    assert failure.deadline_s("x", o) == (None if not enabled else seconds or 300.0)


def test_malformed_settings_name_the_variable():
    with pytest.raises(ValueError, match="JAXPP_MPI_DEADLINE='soon'"):
        parse_options({"JAXPP_MPI_DEADLINE": "soon"})
    with pytest.raises(ValueError, match="JAXPP_MPI_WATCHDOG_FLOOR='-1': use a number"):
        parse_options({"JAXPP_MPI_WATCHDOG_FLOOR": "-1"})


class Order:
    """A stand-in for a chain's `order` array."""

    def __init__(self, ready: bool = True):
        self.ready = ready

    def is_ready(self) -> bool:
        return self.ready


def _watchdog(**options) -> failure.Watchdog:
    o = Options(first_steps=3, first_steps_timeout_s=300.0, auto_floor_s=0.5, **options)
    return failure.Watchdog(0, o, str, 4, lambda status: None)


def test_back_to_back_steps_teach_the_automatic_deadline():
    """Each step starts as soon as the last one's results are ready,
    so a poll rarely lands between steps; the deadline must still learn."""
    wd = _watchdog()
    for _ in range(3):
        wd.step_started()
        time.sleep(0.01)
        wd.step_dispatched(Order())
    assert wd.deadline_s() == 300.0  # two steps known, three needed
    wd.step_started()  # records the third
    assert len(wd._durations) == 3
    assert wd.deadline_s() == max(0.5, 20 * max(wd._durations)) < 300.0


def test_a_step_still_running_when_the_next_starts_is_recorded_once_done():
    wd = _watchdog()
    first = Order(ready=False)
    wd.step_started()
    wd.step_dispatched(first)
    wd.step_started()  # the first is still in flight: not a duration yet
    assert wd._durations == []
    wd.step_dispatched(Order())
    first.ready = True
    wd.step_started()
    assert len(wd._durations) == 2


class SlowArrivals:
    """A stand-in communicator whose non-blocking barrier completes after `tests` tests."""

    def __init__(self, tests: int):
        self.left, self.sleeps = tests, []

    def Ibarrier(self):  # noqa: N802 - mpi4py's name
        return self

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        self.left -= 1
        return self.left <= 0

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        return 0

    def allgather(self, obj):
        return [obj, obj]


def test_waiting_for_peers_after_local_work_sleeps(quick, monkeypatch):
    """`Note: idle waits`: `run` waits for the others in a barrier it tests between
    sleeps, then takes the decision."""
    comm = SlowArrivals(tests=4)
    monkeypatch.setattr(agree.time, "sleep", lambda s: comm.sleeps.append(s))
    assert agree.run(lambda: 7, comm, ValueError, label="compile barrier") == 7
    assert comm.sleeps == [agree.IDLE_POLL_S] * 3
    agree.wait_idle(None)  # local mode: nothing to wait for
