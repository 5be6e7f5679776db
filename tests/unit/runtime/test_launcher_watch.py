"""jpprun's watch over the launcher (`Note: Watching the launcher` in
launch/launcher_watch.py): its reading of the launcher's output, and a stand-in
launcher that outstays an abort, loses a host, or ends well."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from jaxpp_mpi._src.launch.launcher_watch import LauncherWatch, abort_wait_s, wait_watched

LOST_DAEMON = b"""--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-n1-1918870@0,0] on node n1
  Remote daemon: [prterun-n1-1918870@0,1] on node n7

This is usually due to either a failure of the TCP network
"""
NOT_REPORTED = b"""A daemon failed to report back after being spawned. This could
be due to several factors, including inability to find the

  Local host:    h1
  Remote host:   h2
  Daemon exit status: 0
"""


def feed(watch: LauncherWatch, text: bytes, now: float = 0.0) -> None:
    for line in text.splitlines():
        watch.feed(line, now)


def test_a_lost_daemon_fails_a_launcher_that_exits_0():
    for text, host in ((LOST_DAEMON, "n7"), (NOT_REPORTED, "h2")):
        watch = LauncherWatch(10.0)
        feed(watch, b"rank 0 step 3 done\n" + text)
        assert watch.lost_hosts == [host]
        status, word = watch.status(0, ended_by_us=False)
        assert status == 1 and f"the job lost host {host}" in word
        assert watch.status(3, ended_by_us=False) == (3, None)  # its own failure stands


def test_hosts_are_read_only_in_a_lost_daemon_report():
    watch = LauncherWatch(10.0)
    feed(watch, b"WARNING: Open MPI failed to TCP connect\n  Remote host: h9\n")
    assert watch.lost_hosts == [] and watch.status(0, ended_by_us=False) == (0, None)


def test_an_abort_gives_the_launcher_the_wait_after_the_announced_grace():
    watch = LauncherWatch(10.0)
    watch.feed(b"[rank 1] aborting the MPI job in 5 s", 100.0)
    assert not watch.overdue(114.9) and watch.overdue(115.1)
    watch.feed(b"MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD", 106.0)
    watch.feed(b"  Errorcode: 3", 106.0)
    assert watch.overdue(115.1)  # the earliest end stands
    status, word = watch.status(-9, ended_by_us=True)
    assert status == 3 and "had not ended 10 s later" in word


def test_the_wait_comes_from_the_environment():
    assert abort_wait_s({}) == 10.0
    assert abort_wait_s({"JAXPP_MPI_ABORT_WAIT": "2.5"}) == 2.5
    assert abort_wait_s({"JAXPP_MPI_ABORT_WAIT": "soon"}) == 10.0  # the ranks report it


def _launcher(script: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_a_launcher_outstaying_an_abort_is_ended():
    proc = _launcher("import sys, time\n"
                     "print('[rank 0] aborting the MPI job in 0 s', file=sys.stderr, "
                     "flush=True)\n"
                     "time.sleep(60)\n")
    out, err = io.BytesIO(), io.BytesIO()
    start = time.monotonic()
    status, word = wait_watched(proc, out, err, LauncherWatch(0.5))
    assert time.monotonic() - start < 10
    assert status == 1 and "ended it" in word
    assert b"aborting the MPI job in 0 s" in err.getvalue()


def test_a_launcher_reporting_a_lost_host_and_exiting_0_fails():
    proc = _launcher(f"import sys\nsys.stdout.write({LOST_DAEMON.decode()!r})\n")
    out, err = io.BytesIO(), io.BytesIO()
    status, word = wait_watched(proc, out, err, LauncherWatch(10.0))
    assert status == 1 and "lost host n7" in word
    assert out.getvalue() == LOST_DAEMON  # copied as it came


def test_a_launcher_ending_well_is_left_alone():
    proc = _launcher("import sys\nprint('done')\nprint('note', file=sys.stderr)\n"
                     "sys.exit(0)\n")
    out, err = io.BytesIO(), io.BytesIO()
    assert wait_watched(proc, out, err, LauncherWatch(10.0)) == (0, None)
    assert out.getvalue() == b"done\n" and err.getvalue() == b"note\n"


class _Closed(io.BytesIO):
    def write(self, data):
        raise BrokenPipeError("the reader has gone")


def test_a_launcher_whose_reader_has_gone_is_still_drained():
    """`jpprun ... | head`: the copy stops, the launcher is never blocked on its pipe."""
    proc = _launcher("import sys\nfor i in range(20000): print('x' * 50)\n")
    status, word = wait_watched(proc, _Closed(), io.BytesIO(), LauncherWatch(10.0))
    assert (status, word) == (0, None)
