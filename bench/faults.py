"""Fault injection: does every injected fault end the job, and how fast?

Run (no mpirun: it starts 2-rank jobs itself):
    .venv/bin/python bench/faults.py --repeats 3 --out bench/results/faults.json

Each repeat starts tests/jobs/harness/faults.py under `launch/jpprun -n 2` without
`python -m mpi4py` (so jaxpp_mpi's own hooks act) with one fault on rank 1:
- `stage-exception`: a host callback in stage 1 raises;
- `trace-exception`: rank 1 raises while tracing the step (rank 0 waits in the
  program-hash allgather);
- `stall`: stage 1 sleeps 600 s (watchdog deadline JAXPP_MPI_STEP_TIMEOUT=5, grace 2 s);
- `sigkill`: rank 1 SIGKILLs itself inside stage 1;
- `stall-step6`: stage 1 stalls in step 6 of 8 back-to-back steps, under the automatic
  watchdog deadline (floor JAXPP_MPI_WATCHDOG_FLOOR=5 instead of 60 s);
- `stall-trace`, `stall-should-stop`, `stall-save`, `stall-reshard`, `stall-user`: rank 1
  stalls while tracing, or before `PreemptionGuard.should_stop`, `checkpoint.save`,
  `spmd_to_mpmd_reshard`, the user's own bcast under `jaxpp_mpi.launch.deadline`; rank 0
  waits in that collective (deadline JAXPP_MPI_DEADLINE=5, grace 2 s).
A fault is *survived* when the job exits non-zero before the hang limit. The harness
prints `fault at <unix time>` on rank 1 just before injecting, so time-to-exit is
measured from the fault, not from the job's start (JAX start-up and compilation).

`--across-hosts` (root: hosts as network namespaces) runs the faults across two hosts
instead (bench/_host_faults.py: a link cut inside a step or between steps, a link
dropping for 3 s, a host lost under jpprun and under a plain mpirun), written to
bench/results/faults_hosts.json:
    .venv/bin/python bench/faults.py --across-hosts --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ["stage-exception", "trace-exception", "stall", "sigkill", "stall-step6",
          "stall-trace", "stall-should-stop", "stall-save", "stall-reshard", "stall-user"]
HANG_LIMIT_S = 300


def run_once(fault: str) -> dict:
    env = dict(os.environ, JAXPP_MPI_PYTHON=sys.executable, JAXPP_MPI_WATCHDOG_GRACE="2",
               JAXPP_MPI_FAULT_STAMP="1")
    if fault == "stall-step6":  # the automatic deadline, with a lower floor
        env["JAXPP_MPI_WATCHDOG_FLOOR"] = "5"
    else:
        env.update(JAXPP_MPI_STEP_TIMEOUT="5", JAXPP_MPI_DEADLINE="5")
    env.pop("XLA_FLAGS", None)
    cmd = [str(ROOT / "launch" / "jpprun"), "-n", "2", "env", sys.executable,
           "tests/jobs/harness/faults.py", fault]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                              timeout=HANG_LIMIT_S)
    except subprocess.TimeoutExpired:
        return {"fault": fault, "survived": False, "hung": True}
    end = time.time()
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    stamps = [float(line.split()[-1]) for line in out.splitlines()
              if line.startswith("fault at ")]
    fault_time = stamps[0] if stamps else start
    return {"fault": fault, "survived": proc.returncode != 0, "hung": False,
            "exit_status": proc.returncode, "seconds_to_exit": end - fault_time,
            "stamped": bool(stamps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--across-hosts", action="store_true",
                        help="the faults across two hosts (root; bench/_host_faults.py)")
    args = parser.parse_args()
    faults, run = FAULTS, run_once
    if args.across_hosts:
        from _host_faults import HOST_FAULTS, run_across_hosts

        faults, run = HOST_FAULTS, run_across_hosts
    args.out = args.out or ("bench/results/faults_hosts.json" if args.across_hosts
                            else "bench/results/faults.json")
    runs = [run(f) for _ in range(args.repeats) for f in faults]
    summary = {}
    for fault in faults:
        mine = [r for r in runs if r["fault"] == fault]
        times = [r["seconds_to_exit"] for r in mine if r["survived"]]
        summary[fault] = {
            "injected": len(mine),
            "survived_without_hang": sum(r["survived"] for r in mine),
            "median_s_to_exit": statistics.median(times) if times else None,
            "max_s_to_exit": max(times) if times else None,
        }
    all_times = [r["seconds_to_exit"] for r in runs if r["survived"]]
    result = {"benchmark": "faults", "runs": runs, "summary": summary,
              "total": {"injected": len(runs),
                        "survived_without_hang": sum(r["survived"] for r in runs),
                        "median_s_to_exit": statistics.median(all_times),
                        "max_s_to_exit": max(all_times)}}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'fault':<18} {'injected':>8} {'survived':>8} {'median s':>9} {'max s':>7}")
    for fault, s in summary.items():
        print(f"{fault:<18} {s['injected']:>8} {s['survived_without_hang']:>8} "
              f"{s['median_s_to_exit'] or float('nan'):>9.1f} "
              f"{s['max_s_to_exit'] or float('nan'):>7.1f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
