"""`launch/jpprun` passes a SIGTERM to itself on as SIGUSR1 (Open MPI's mpirun forwards
SIGUSR1 to every rank but kills them on SIGTERM); a second SIGTERM goes on as SIGTERM
(`Note: Signals to the launcher` in launch/jpprun.py). The launcher here is a stand-in
child process that reports the signals it gets."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from jaxpp_mpi._src.launch.jpprun import run_forwarding_signals

CHILD = """
import signal, sys, time
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append("USR1"))
open(sys.argv[1], "w").close()  # ready
while not got:
    time.sleep(0.01)
print(" ".join(got), flush=True)
time.sleep(float(sys.argv[2]))  # SIGTERM here keeps its default action
sys.exit(7)
"""


def _signal_self_when_ready(ready: str, times: int) -> threading.Thread:
    def run() -> None:
        while not os.path.exists(ready):
            time.sleep(0.01)
        for _ in range(times):
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_first_sigterm_reaches_the_ranks_as_sigusr1(tmp_path, capfd):
    ready = str(tmp_path / "ready")
    thread = _signal_self_when_ready(ready, 1)
    status = run_forwarding_signals([sys.executable, "-c", CHILD, ready, "0"], os.environ)
    thread.join()
    assert status == 7  # the child's own exit: it stopped as it chose
    out, err = capfd.readouterr()
    assert out.strip() == "USR1"
    assert "jpprun: SIGTERM: asking the ranks to stop" in err
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored


def test_second_sigterm_kills_the_job(tmp_path):
    ready = str(tmp_path / "ready")
    thread = _signal_self_when_ready(ready, 2)
    status = run_forwarding_signals([sys.executable, "-c", CHILD, ready, "30"], os.environ)
    thread.join()
    assert status == 128 + signal.SIGTERM
