"""jpprun's watch over the MPI launcher: a job that aborted or lost a host ends promptly,
and never with status 0 (stdlib only, like launch/jpprun.py).

Note: Watching the launcher.
  Open MPI's launcher (prterun, 5.0) ends a job that loses a host late, or as a success:
  - a link down: once a rank aborts (its watchdog or a deadline, `Note: watchdog`),
    prterun waits for the unreachable host's daemon to confirm that its ranks are dead,
    until TCP gives up on the connection (seen: still waiting 150 s after the abort),
    though every rank it can reach has ended;
  - a host lost (its processes killed): prterun notices its daemon gone, reports it
    (`PRTE has lost communication with a remote daemon`, or `A daemon failed to report
    back` for a daemon it started itself) and ends the job at once, but exits 0.
  So jpprun runs the launcher with its output piped through itself (stdout and stderr
  each copied to jpprun's own as it comes, byte for byte: prterun prints its reports on
  stdout, the ranks' words come on either) and reads it by lines (`LauncherWatch`):
  - a rank's announcement that it ends the job (Open MPI's `MPI_ABORT was invoked`,
    jaxpp_mpi's `aborting the MPI job [in N s]`) starts a clock: if the launcher still
    runs JAXPP_MPI_ABORT_WAIT seconds (10) after it (plus the N announced), jpprun says
    so, sends it SIGTERM and, 3 s later, SIGKILL, and exits with the abort's error
    code (`Errorcode: E`, else 1);
  - Open MPI's report of a lost daemon names its host (`on node H`, `Remote host: H`);
    when the launcher then exits 0, jpprun prints `jpprun: the job lost host H ...` and
    exits 1.
  The ranks bound their own abort too (`Note: bounded abort` in launch/abort.py). Under
  a plain `mpirun` nobody watches: docs/reliability.md ("Lost hosts and links") says
  what a batch script checks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping
from typing import BinaryIO

from jaxpp_mpi._src.base.variables import VariableError, variable

__all__ = ["LauncherWatch", "abort_wait_s", "wait_watched"]

_ABORT = re.compile(rb"MPI_ABORT was invoked|aborting the MPI job(?: in ([0-9.]+) s)?")
_ERRORCODE = re.compile(rb"Errorcode: (-?\d+)")
_LOST = re.compile(rb"lost communication with a remote daemon|"
                   rb"daemon failed to report back")
_LOST_HOST = re.compile(rb"Remote daemon:.* on node (\S+)|Remote host:\s+(\S+)")
_LOST_LINES = 16  # lines after a lost daemon's report that may name its host
KILL_AFTER_S = 3.0  # between SIGTERM and SIGKILL to a launcher that outstays an abort


def abort_wait_s(env: Mapping[str, str]) -> float:
    """JAXPP_MPI_ABORT_WAIT from `env` (its default when malformed: the ranks report
    that)."""
    var = variable("JAXPP_MPI_ABORT_WAIT")
    try:
        return float(var.parse(env))
    except VariableError:
        return float(var.unset)


class LauncherWatch:
    """What the launcher's output has said of the job's end (`Note: Watching the
    launcher`); fed line by line, asked for the time to end the launcher and for the
    job's status.

    Args:
      abort_wait_s: how long the launcher may run on after a rank's abort.
    """

    def __init__(self, abort_wait_s: float):
        self.abort_wait_s = abort_wait_s
        self.end_by: float | None = None  # when the launcher must have ended
        self.errorcode: int | None = None
        self.lost_hosts: list[str] = []
        self.lost = False
        self._lost_lines = 0

    def feed(self, line: bytes, now: float) -> None:
        """Reads one line of the launcher's output, seen at `now` (monotonic seconds)."""
        aborting = _ABORT.search(line)
        if aborting is not None:
            delay = float(aborting.group(1)) if aborting.group(1) else 0.0
            end_by = now + delay + self.abort_wait_s
            self.end_by = end_by if self.end_by is None else min(self.end_by, end_by)
        code = _ERRORCODE.search(line)
        if code is not None and self.errorcode is None:
            self.errorcode = int(code.group(1))
        if _LOST.search(line):
            self.lost, self._lost_lines = True, _LOST_LINES
            return
        if self._lost_lines > 0:
            self._lost_lines -= 1
            named = _LOST_HOST.search(line)
            if named is not None:
                host = (named.group(1) or named.group(2)).decode(errors="replace")
                if host not in self.lost_hosts:
                    self.lost_hosts.append(host)

    def overdue(self, now: float) -> bool:
        """Whether a rank aborted the job and the launcher has outstayed the wait."""
        return self.end_by is not None and now > self.end_by

    def status(self, launcher_status: int, ended_by_us: bool) -> tuple[int, str | None]:
        """The job's exit status and jpprun's word on it, if any.

        Args:
          launcher_status: the launcher's exit status (negative: the signal that ended it).
          ended_by_us: whether jpprun ended the launcher after an abort.
        """
        hosts = ", ".join(self.lost_hosts) or "(not named)"
        if ended_by_us:
            code = self.errorcode if self.errorcode else 1
            lost = f" ({hosts} lost)" if self.lost else ""
            return code, (f"jpprun: a rank aborted the job and mpirun had not ended "
                          f"{self.abort_wait_s:g} s later (it waits for a host it cannot "
                          f"reach{lost}); ended it, exit status {code}")
        if self.lost and launcher_status == 0:
            return 1, (f"jpprun: the job lost host {hosts} (Open MPI's launcher reported "
                       f"its daemon lost and exited 0); exit status 1")
        return launcher_status, None


def _copy_and_feed(stream: BinaryIO, out: BinaryIO, watch: LauncherWatch,
                   lock: threading.Lock) -> None:
    """Copies `stream` to `out` as it comes and feeds `watch` its lines (on reading to
    its end even when `out` is closed: a launcher blocked on a full pipe would hang)."""
    pending = b""
    fd = stream.fileno()
    copying = True
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        if copying:
            try:
                out.write(chunk)
                out.flush()
            except (OSError, ValueError):  # e.g. `jpprun ... | head` has gone
                copying = False
        *lines, pending = (pending + chunk).split(b"\n")
        with lock:
            for line in lines:
                watch.feed(line, time.monotonic())
    if pending:
        with lock:
            watch.feed(pending, time.monotonic())


def wait_watched(proc: subprocess.Popen, stdout: BinaryIO, stderr: BinaryIO,
                 watch: LauncherWatch, poll_s: float = 0.1) -> tuple[int, str | None]:
    """Waits for the launcher `proc` (started with `stdout=PIPE, stderr=PIPE`), copying
    its output to `stdout` and `stderr`, and ends it when it outstays a rank's abort
    (`Note: Watching the launcher`). Signals to this process are handled between polls.

    Returns:
      The job's exit status (never negative: 128 + N for a launcher ended by signal N)
      and jpprun's word on it, if any.
    """
    lock = threading.Lock()
    readers = [threading.Thread(target=_copy_and_feed, args=(stream, out, watch, lock),
                                daemon=True, name=f"jpprun-{name}")
               for name, stream, out in (("stdout", proc.stdout, stdout),
                                         ("stderr", proc.stderr, stderr))]
    for reader in readers:
        reader.start()
    ended_by_us = False
    while proc.poll() is None:
        time.sleep(poll_s)
        with lock:
            overdue = watch.overdue(time.monotonic())
        if overdue and not ended_by_us:
            ended_by_us = True
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                proc.kill()
    for reader in readers:  # what the launcher said last; a child holding its pipe open
        reader.join(timeout=1.0 if ended_by_us else 5.0)  # must not hold jpprun
    with lock:
        status, word = watch.status(proc.returncode, ended_by_us)
    return (128 - status if status < 0 else status), word
