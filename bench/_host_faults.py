"""bench/faults.py's faults across hosts: two hosts made on this machine (network
namespaces, tests/hosts/netns.py; needs root), one rank each, one fault per job.

Each job runs a program of tests/hosts/programs/ under `launch/jpprun` (or a plain
mpirun), which says when it reaches the fault's point and waits there; the fault is
injected then and the job timed from that moment to its end:
- `link-mid-step`: rank 1's link cut while it is inside step 4 (host_faults.py);
- `link-between`: the link cut between steps 3 and 4;
- `link-flap`: the link cut for 3 s inside step 4, then restored (the job must end 0,
  its steps matching jax.jit);
- `host-lost`, `host-lost-mpirun`: every process on rank 1's host killed (ring.py),
  under jpprun and under a plain mpirun (which exits 0: docs/reliability.md, "Lost
  hosts and links").
Settings: a 10 s step deadline (JAXPP_MPI_STEP_TIMEOUT; the call agreement follows it),
a 2 s grace and JAXPP_MPI_ABORT_WAIT=5.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = ROOT / "tests" / "hosts" / "programs"
HOST_FAULTS = ["link-mid-step", "link-between", "link-flap", "host-lost", "host-lost-mpirun"]
HANG_LIMIT_S = 300
FLAP_S = 3.0
NAMED = r"on host h2|rank 1 on h2|lost host h2|Remote host: +h2"  # the lost host, named


def _netns():
    sys.path.insert(0, str(ROOT / "tests" / "hosts"))
    import netns  # noqa: PLC0415 - tests/hosts/netns.py, only when these rows run

    return netns


def _wait_for(paths: list[Path], proc: subprocess.Popen) -> bool:
    give_up = time.monotonic() + HANG_LIMIT_S
    while not all(p.exists() for p in paths):
        if proc.poll() is not None or time.monotonic() > give_up:
            return False
        time.sleep(0.05)
    return True


def run_across_hosts(fault: str) -> dict:
    """One job across two hosts with `fault`; its exit status and time from the fault."""
    netns = _netns()
    env = dict(os.environ, JAXPP_MPI_PYTHON=sys.executable, JAXPP_MPI_STEP_TIMEOUT="10",
               JAXPP_MPI_WATCHDOG_GRACE="2", JAXPP_MPI_ABORT_WAIT="5")
    env.pop("XLA_FLAGS", None)
    with tempfile.TemporaryDirectory() as tmp, netns.make_hosts(2, tmp) as hosts:
        work = Path(tmp)
        if fault.startswith("host-lost"):
            command = ["python", str(PROGRAMS / "ring.py"), tmp]
            argv = (hosts.mpirun_argv([1, 1], [sys.executable, *command[1:]])
                    if fault.endswith("mpirun") else hosts.jpprun_argv([1, 1], command))
            point, ranks = "ring", (0, 1)
        else:
            mode = {"link-mid-step": "mid-step", "link-between": "between",
                    "link-flap": "flap-save"}[fault]
            argv = hosts.jpprun_argv([1, 1], ["python", str(PROGRAMS / "host_faults.py"),
                                              mode, tmp])
            point, ranks = ("between", (0, 1)) if mode == "between" else ("mid-step", (1,))
        log = work / "job.log"
        with open(log, "wb") as out:
            proc = hosts.popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
            if not _wait_for([work / f"ready-{point}-{r}" for r in ranks], proc):
                hosts.kill_all()
                return {"fault": fault, "survived": False, "hung": False, "started": False}
            fault_at = time.monotonic()
            if fault.startswith("host-lost"):
                hosts.kill_host("h2")
            else:
                hosts.link_down("h2")
                (work / f"go-{point}").write_text("")
            if fault == "link-flap":
                time.sleep(FLAP_S)
                hosts.link_up("h2")
                if _wait_for([work / f"ready-save-{r}" for r in (0, 1)], proc):
                    (work / "go-save").write_text("")
            try:
                proc.wait(timeout=HANG_LIMIT_S)
                hung = False
            except subprocess.TimeoutExpired:
                hung = True
            seconds = time.monotonic() - fault_at
            hosts.link_up("h2")
            hosts.kill_all()
        text = log.read_text(errors="replace")
    ok = proc.returncode == 0 if fault == "link-flap" else proc.returncode != 0
    return {"fault": fault, "survived": ok and not hung, "hung": hung,
            "exit_status": proc.returncode, "seconds_to_exit": seconds,
            "names_host": (bool(re.search(NAMED, text)) if fault != "link-flap" else None),
            "matches_jax_jit": ("rank 1 matches jax.jit" in text
                                if fault == "link-flap" else None)}
