"""Faults across hosts end the job within their bound, naming the host, and leave nothing.

Two hosts, one rank each (tests/hosts/netns.py; the fixture removes every namespace and
process, pass or fail). Each test starts a job, waits until it reaches the point of the
fault (programs/host_faults.py, programs/ring.py), injects it and times the job's end
from that moment (docs/reliability.md, "Lost hosts and links"):
- a link cut inside a step, or between steps: every rank names the peer it waits for and
  that peer's host; the job exits non-zero within the deadline + grace + 30 s;
- a host lost (every process on it killed): under jpprun the job exits non-zero within
  60 s naming it; under a plain mpirun, Open MPI's launcher exits 0 at once (asserted, so
  that a change is seen), and the check docs/reliability.md gives batch scripts fails
  naming the host;
- a link that drops for a few seconds: the steps end with jax.jit's results, no alarm;
- a link cut during a checkpoint save: the save before it stays whole, and
  `checkpoint.find` returns it.
Short settings keep the file quick: grace 1 s, JAXPP_MPI_ABORT_WAIT 2 s, an 8 s step
deadline (given, not learnt: on a loaded machine the learnt one grows with the steps,
and so would the test; tests/unit/runtime/test_rank_hosts.py checks the learnt one
reaches the call agreement).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import netns
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = Path(__file__).resolve().parent / "programs"
GRACE_S, ABORT_WAIT_S, STEP_DEADLINE_S = 1, 2, 8
SLACK_S = 30  # the bound past deadline + grace
START_LIMIT_S = 150  # the job's start and first steps, on a loaded 2-core machine
FLAP_S = 3.0


def _env(host_env: dict[str, str], **extra: str) -> dict[str, str]:
    return dict(host_env, JAXPP_MPI_WATCHDOG_GRACE=str(GRACE_S),
                JAXPP_MPI_ABORT_WAIT=str(ABORT_WAIT_S), **extra)


class Job:
    """A job across the hosts, its output in a file, and the moments of its fault."""

    def __init__(self, hosts: netns.Hosts, argv: list[str], env: dict[str, str],
                 workdir: Path):
        self.hosts, self.workdir = hosts, workdir
        self.log = workdir / "job.log"
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed in `end`
        self.proc = hosts.popen(argv, env=env, stdout=self._out, stderr=subprocess.STDOUT)
        self.fault_at: float | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def rank_err(self, rank: int, what: str, within_s: float) -> list[str]:
        """The lines of rank `rank`'s own copy of its stderr that hold `what`, waiting
        up to `within_s` after the fault for one (a rank behind a cut link outlives the
        job: it speaks at its own deadline)."""
        path = self.workdir / f"rank-{rank}.err"
        while True:
            text = path.read_text(errors="replace") if path.exists() else ""
            found = _lines(text, rank, what)
            if found or time.monotonic() > (self.fault_at or 0.0) + within_s:
                return found
            time.sleep(0.1)

    def wait_ready(self, point: str, ranks: tuple[int, ...]) -> None:
        """Waits until each of `ranks` has reached `point`."""
        give_up = time.monotonic() + START_LIMIT_S
        while not all((self.workdir / f"ready-{point}-{r}").exists() for r in ranks):
            if self.proc.poll() is not None:
                pytest.fail(f"the job ended before {point}:\n{self.output()}")
            if time.monotonic() > give_up:
                pytest.fail(f"the job did not reach {point} in {START_LIMIT_S} s:\n"
                            f"{self.output()}")
            time.sleep(0.05)

    def wait_output(self, texts: tuple[str, ...], within_s: float) -> str:
        """The job's output once it holds every one of `texts`, or as it is when the job
        ends or `within_s` pass: ranks' lines reach it through Open MPI's daemons, which
        may trail the ranks' own ready files under load."""
        give_up = time.monotonic() + within_s
        while True:
            out = self.output()
            if (all(t in out for t in texts) or self.proc.poll() is not None
                    or time.monotonic() > give_up):
                return out
            time.sleep(0.05)

    def go(self, point: str) -> None:
        (self.workdir / f"go-{point}").write_text("")

    def fault(self, inject) -> None:
        self.fault_at = time.monotonic()
        inject()

    def end(self, limit_s: float) -> tuple[int, float]:
        """(exit status, seconds from the fault to the job's end); fails past `limit_s`."""
        try:
            self.proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            self.hosts.kill_all()
            self.proc.wait()
            pytest.fail(f"the job outlived its fault by {limit_s} s:\n{self.output()}")
        finally:
            self._out.close()
        since_fault = time.monotonic() - (self.fault_at or 0.0)
        print(f"exit status {self.proc.returncode}, {since_fault:.1f} s after the fault")
        return self.proc.returncode, since_fault


def _jpprun(hosts: netns.Hosts, program: str, *args: str) -> list[str]:
    return hosts.jpprun_argv([1, 1], ["python", str(PROGRAMS / program), *args])


def _deadline_of(line: str) -> float:
    return float(re.search(r"past its deadline of ([0-9.]+) s", line)[1])


def _lines(text: str, rank: int, what: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith(f"[rank {rank}] ") and what in ln]


def _ranks_on(hosts: netns.Hosts, host: str, program: str) -> list[int]:
    """The processes on `host` that run `program` (the job's ranks)."""
    found = []
    for pid in hosts.pids(host):
        try:
            if program in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                found.append(pid)
        except OSError:  # gone meanwhile
            pass
    return found


def _nothing_left(hosts: netns.Hosts, job: Job, program: str = "host_faults.py") -> None:
    """No rank of the job runs on either host once it ended: a rank behind a cut link
    ended itself (`Note: bounded abort`); then nothing at all (the fixture removes the
    hosts: a launcher daemon behind a cut link lives until the link is back)."""
    if job.proc.poll() is not None:
        give_up = time.monotonic() + 10
        while any(_ranks_on(hosts, h, program) for h in hosts.names):
            assert time.monotonic() < give_up, {h: _ranks_on(hosts, h, program)
                                                for h in hosts.names}
            time.sleep(0.1)
    hosts.kill_all()
    assert job.proc.poll() is not None
    assert all(not hosts.pids(h) for h in hosts.names), {h: hosts.pids(h) for h in hosts.names}


def test_a_link_cut_inside_a_step_names_the_peer_host_and_ends_the_job(
        make_hosts, host_env, tmp_path):
    hosts = make_hosts(2)
    job = Job(hosts, _jpprun(hosts, "host_faults.py", "mid-step", str(tmp_path)),
              _env(host_env, JAXPP_MPI_STEP_TIMEOUT=str(STEP_DEADLINE_S)), tmp_path)
    try:
        job.wait_ready("mid-step", (1,))
        job.fault(lambda: hosts.link_down("h2"))
        job.go("mid-step")
        status, since_fault = job.end(120)
        out = job.output()
        assert status != 0, out
        rank0 = _lines(out, 0, "jaxpp_mpi watchdog: step 4 ")
        assert rank0 and "from rank 1 on host h2" in rank0[0], out
        deadline = _deadline_of(rank0[0])
        assert deadline == STEP_DEADLINE_S, rank0
        assert since_fault < deadline + GRACE_S + SLACK_S, f"{since_fault:.1f} s\n{out}"
        rank1 = job.rank_err(1, "jaxpp_mpi watchdog: step 4 ", deadline + SLACK_S)
        assert rank1 and "rank 0 on host h1" in rank1[0], rank1
    finally:
        hosts.link_up("h2")
        _nothing_left(hosts, job)


def test_a_link_cut_between_steps_ends_the_job_at_the_step_deadline(
        make_hosts, host_env, tmp_path):
    """The ranks meet in the next step's call agreement, which waits under the step's
    deadline, while the other collectives keep their automatic 300 s; each names the
    peer it waits for and its host (`Note: watched allgather` in mpi/gather.py)."""
    hosts = make_hosts(2)
    job = Job(hosts, _jpprun(hosts, "host_faults.py", "between", str(tmp_path)),
              _env(host_env, JAXPP_MPI_STEP_TIMEOUT=str(STEP_DEADLINE_S),
                   JAXPP_MPI_DEADLINE="auto"), tmp_path)
    try:
        job.wait_ready("between", (0, 1))
        job.fault(lambda: hosts.link_down("h2"))
        job.go("between")
        status, since_fault = job.end(120)
        out = job.output()
        assert status != 0, out
        what = "jaxpp_mpi deadline: waiting in step call agreement"
        rank0 = _lines(out, 0, what)
        assert rank0, out
        deadline = _deadline_of(rank0[0])
        assert deadline == STEP_DEADLINE_S, out  # the step's, not the 300 s of others
        assert since_fault < deadline + GRACE_S + SLACK_S, f"{since_fault:.1f} s\n{out}"
        rank1 = job.rank_err(1, what, deadline + SLACK_S)
        for waits, peer in ((rank0, "rank 1 on host h2"), (rank1, "rank 0 on host h1")):
            assert waits and "(the step's deadline" in waits[0], waits
            assert f"; it waits for {peer} (stalled, or lost" in waits[0], waits[0]
            assert "where the ranks run: rank 0 on h1, rank 1 on h2" in waits[0], waits[0]
    finally:
        hosts.link_up("h2")
        _nothing_left(hosts, job)


def test_a_brief_link_drop_is_survived_and_a_cut_during_a_save_keeps_the_last_one(
        make_hosts, host_env, tmp_path):
    """One job, two faults in turn: a 3 s drop inside step 4 (TCP retransmits; the steps
    match jax.jit, no watchdog or deadline speaks), then a cut before the save of step 6
    over the checkpoint of step 2 (the job ends; step 2's checkpoint is found whole)."""
    from jaxpp_mpi import checkpoint

    hosts = make_hosts(2)
    deadline = STEP_DEADLINE_S
    job = Job(hosts, _jpprun(hosts, "host_faults.py", "flap-save", str(tmp_path)),
              _env(host_env, JAXPP_MPI_DEADLINE=str(deadline)), tmp_path)
    try:
        job.wait_ready("mid-step", (1,))
        hosts.link_down("h2")
        job.go("mid-step")
        time.sleep(FLAP_S)
        hosts.link_up("h2")
        job.wait_ready("save", (0, 1))
        matched = ("rank 0 matches jax.jit", "rank 1 matches jax.jit")
        out = job.wait_output(matched, START_LIMIT_S)
        assert all(m in out for m in matched), out
        assert "jaxpp_mpi watchdog" not in out and "jaxpp_mpi deadline" not in out, out
        job.fault(lambda: hosts.link_down("h2"))
        job.go("save")
        status, since_fault = job.end(120)
        out = job.output()
        assert status != 0, out
        waits = _lines(out, 0, "jaxpp_mpi deadline: waiting in checkpoint")
        assert waits and "rank 1 on h2" in waits[0], out
        assert since_fault < deadline + GRACE_S + SLACK_S, f"{since_fault:.1f} s\n{out}"
    finally:
        hosts.link_up("h2")
        _nothing_left(hosts, job)
    ckpt = str(tmp_path / "ckpt")
    found = checkpoint.find(ckpt)
    assert found is not None and found.step == 2
    whole = checkpoint.load_whole(ckpt)
    saved = {}
    for rank in (0, 1):
        with np.load(tmp_path / f"saved-rank{rank}.npz") as held:
            saved.update({int(k): held[k] for k in held.files})
    assert sorted(saved) == [0, 1]
    for i, value in saved.items():
        np.testing.assert_array_equal(whole[i], value)


def _lost_host_check() -> str:
    """The batch-script check of docs/reliability.md's "Lost hosts and links"."""
    text = (ROOT / "docs" / "reliability.md").read_text()
    section = text.split("## Lost hosts and links", 1)[1]
    return re.search(r"```bash\n(.*?)```", section, re.S)[1]


def test_a_host_lost_under_jpprun_fails_the_job_naming_it(make_hosts, host_env, tmp_path):
    hosts = make_hosts(2)
    job = Job(hosts, _jpprun(hosts, "ring.py", str(tmp_path)), _env(host_env), tmp_path)
    try:
        job.wait_ready("ring", (0, 1))
        job.fault(lambda: hosts.kill_host("h2"))
        status, since_fault = job.end(60)
        out = job.output()
        assert status != 0, out
        assert "jpprun: the job lost host h2" in out, out
        assert since_fault < 60, f"{since_fault:.1f} s\n{out}"
    finally:
        _nothing_left(hosts, job, "ring.py")


def test_a_host_lost_under_plain_mpirun_exits_0_and_the_documented_check_fails(
        make_hosts, host_env, tmp_path):
    """Open MPI's launcher ends the job at once but exits 0, before any rank could act
    (the ranks on other hosts are killed by it within milliseconds): the check that
    docs/reliability.md gives batch scripts turns that into a failure naming the host."""
    hosts = make_hosts(2)
    argv = hosts.mpirun_argv([1, 1], [sys.executable, str(PROGRAMS / "ring.py"),
                                      str(tmp_path)])
    job = Job(hosts, argv, _env(host_env), tmp_path)
    try:
        job.wait_ready("ring", (0, 1))
        job.fault(lambda: hosts.kill_host("h2"))
        status, since_fault = job.end(60)
        out = job.output()
        assert status == 0, out  # Open MPI's behaviour: if it changes, so must the docs
        assert since_fault < 60 and "ring finished" not in out, out
    finally:
        _nothing_left(hosts, job, "ring.py")
    check = subprocess.run(["bash", "-c", _lost_host_check(), "check", str(job.log),
                            str(status), "ring finished"],
                           capture_output=True, text=True, timeout=30)
    assert check.returncode != 0, check
    assert "h2" in check.stderr, check
