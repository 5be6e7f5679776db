"""Every schedule under plain `mpirun` against launch/jpprun, fresh launches taking turns.

Run (no MPI: this script starts the launches itself):
  .venv/bin/python bench/launchers.py --out bench/results/launchers.json

`import jaxpp_mpi` gives a rank started by a plain `mpirun -n 2 python train.py` the
settings jpprun exports (Note: Settings at import in jaxpp_mpi/_src/launch/auto.py); this
measures that the steps are as fast. Each round starts the two launches one after the
other (the order alternating round by round, so a noisy neighbour hurts both alike):
  - `jpprun`: `launch/jpprun -n 2 python bench/launchers.py --worker ...`;
  - `mpirun`: the venv's Open MPI `mpirun -n 2 python bench/launchers.py --worker ...`
    with only what Open MPI needs here (`--allow-run-as-root` as root, `--oversubscribe`
    with fewer cores than ranks: `plain_mpirun_argv` in launch/jpprun.py), in an
    environment stripped of jpprun's settings (`_common.without_rank_settings`): no
    `-m mpi4py`, no thread flags.
Every launch (a worker: bench/schedules.py's workload, compiled for each schedule) checks
its losses, times `--steps` plain steps of every schedule barrier to barrier (rotated
order) and reports each rank's XLA_FLAGS, OMP_NUM_THREADS, cores and their NUMA nodes;
with `--traces DIR` it also traces `--traced-steps` steps of each schedule (per-task
times, and the last one's Chrome trace in DIR/launchK_LAUNCHER/NAME.trace.json).
Per schedule and launcher: `step_ms`, the median of all its launches' steps,
`launch_medians_ms` (one per launch: a launch-to-launch spread shows here), and
`ratio` = mpirun step_ms / jpprun step_ms (1.0: the same speed). Each launch also keeps
`load_before`, the machine's 1-minute load average as it started (a busy machine's
figures say little). Only launches of one run compare: the machine changes between runs.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_common.py, schedules.py

from _common import (  # noqa: E402
    add_block_options,
    block_options,
    metadata,
    without_rank_settings,
    write_json,
)

from jaxpp_mpi._src.launch import jpprun as launcher  # noqa: E402 - stdlib only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHERS = ("jpprun", "mpirun")
RANKS = 2


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_block_options(
        p,
        schedules=("gpipe", "1f1b", "eager1f1b", "interleaved", "kimik2", "zerobubble",
                   "dualpipev"),
        width=1024,
        ffn=4096,
        repeats=4,
        repeats_help="rounds: each starts one launch per launcher",
        quick_help="d=256, ffn=1024, 3 rounds of 3 steps (a smoke run)",
    )
    p.add_argument("--steps", type=int, default=8,
                   help="timed steps of every schedule in each launch")
    p.add_argument("--launchers", default=",".join(LAUNCHERS),
                   help=f"comma-separated, from {', '.join(LAUNCHERS)}")
    p.add_argument("--traces", default=None,
                   help="folder for each launch's Chrome traces (and per-task times)")
    p.add_argument("--traced-steps", type=int, default=3,
                   help="with --traces: traced steps of every schedule in each launch")
    p.add_argument("--launch-timeout", type=float, default=900.0,
                   help="seconds one launch may take before it is killed")
    p.add_argument("--mpirun", default=None, help="Open MPI's mpirun (default: the venv's)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank's JSON
    p.add_argument("--out", default="bench/results/launchers.json")
    args = block_options(p, p.parse_args(argv))
    if args.quick:
        args.steps = 3
    args.launchers = [x for x in args.launchers.split(",") if x]
    unknown = [x for x in args.launchers if x not in LAUNCHERS]
    if unknown or not args.launchers:
        p.error(f"--launchers: unknown {unknown or 'none given'}; the names are "
                f"{', '.join(LAUNCHERS)}")
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1")
    return args


# ----------------------------------------------------------------------------- the launches


def jpprun_argv(num_ranks: int, command: Sequence[str], *, jpprun: str) -> list[str]:
    """The same program under launch/jpprun (which adds its settings itself)."""
    return [jpprun, "-n", str(num_ranks), *command]


def launch_argv(which: str, command: Sequence[str], mpirun: str) -> list[str]:
    """The argv of one launch of `command` under `which` ('jpprun' or 'mpirun')."""
    if which == "jpprun":
        return jpprun_argv(RANKS, command, jpprun=os.path.join(ROOT, "launch", "jpprun"))
    return launcher.plain_mpirun_argv(RANKS, command, mpirun=mpirun,
                                      is_root=os.geteuid() == 0,
                                      cores=launcher.usable_cores())


def launch_order(launchers: Sequence[str], round_idx: int) -> list[str]:
    """The launchers in round `round_idx`'s order: as given, reversed every other round."""
    return list(launchers) if round_idx % 2 == 0 else list(launchers)[::-1]


def summarize(launches: Sequence[Mapping[str, Any]], launchers: Sequence[str]
              ) -> dict[str, dict[str, Any]]:
    """Per schedule: each launcher's median step over all its launches' steps, the
    per-launch medians, and mpirun's median over jpprun's (`ratio`) where both ran."""
    from statistics import median

    out: dict[str, dict[str, Any]] = {}
    for name in launches[0]["steps_ms"]:
        row: dict[str, Any] = {}
        for which in launchers:
            mine = [x for x in launches if x["launcher"] == which]
            steps = [t for x in mine for t in x["steps_ms"][name]]
            row[which] = {
                "step_ms": median(steps),
                "launch_medians_ms": [median(x["steps_ms"][name]) for x in mine],
            }
        if "jpprun" in row and "mpirun" in row:
            row["ratio"] = row["mpirun"]["step_ms"] / row["jpprun"]["step_ms"]
        out[name] = row
    return out


def run_launch(which: str, args: argparse.Namespace, round_idx: int, workdir: str
               ) -> dict[str, Any]:
    """Starts one launch and waits for it; its rank-0 report, with its wall time."""
    report = os.path.join(workdir, f"launch{round_idx}_{which}.json")
    command = [sys.executable, os.path.abspath(__file__), "--worker", report,
               *worker_options(args)]
    if args.traces:
        command += ["--traces", os.path.join(args.traces, f"launch{round_idx}_{which}")]
    argv = launch_argv(which, command, args.mpirun or launcher.find_mpirun())
    env = dict(os.environ, JAXPP_MPI_PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    if which == "mpirun":
        env = without_rank_settings(env)
    print(f"round {round_idx} {which}: {shlex.join(argv)}", flush=True)
    load = os.getloadavg()[0]  # the machine's 1-minute load just before: how quiet it was
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        log = proc.communicate(timeout=args.launch_timeout)[0]
    except subprocess.TimeoutExpired:
        proc.terminate()  # mpirun, and jpprun through it, end the ranks on SIGTERM
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise SystemExit(f"{which} launch {round_idx} took over {args.launch_timeout} s: "
                         "stopped (raise --launch-timeout, or look for a hung rank)") from None
    if proc.returncode != 0 or not os.path.exists(report):
        raise SystemExit(f"{which} launch {round_idx} failed (exit {proc.returncode}):\n"
                         f"{log[-6000:]}")
    with open(report) as f:
        result = json.load(f)
    result.update(launcher=which, round=round_idx, argv=argv, load_before=load,
                  wall_s=time.perf_counter() - start)
    return result


def worker_options(args: argparse.Namespace) -> list[str]:
    """The workload's options, passed on to each launch's ranks."""
    return ["--schedules", ",".join(args.schedules), "--width", str(args.width),
            "--ffn", str(args.ffn), "--blocks", str(args.blocks), "--rows", str(args.rows),
            "--microbatches", str(args.num_microbatches), "--steps", str(args.steps),
            "--traced-steps", str(args.traced_steps)]


def launch_line(launch: Mapping[str, Any]) -> str:
    """One launch in a few words: wall time, median steps, each rank's cores and NUMA
    nodes and, when traced, the sum of its median task times per schedule."""
    from statistics import median

    steps = "  ".join(f"{n} {median(t):.1f}" for n, t in launch["steps_ms"].items())
    ranks = []
    for f in launch["ranks"]:
        tasks = " ".join(f"{n} {sum(median(v) for v in t.values()):.1f}"
                         for n, t in f["task_ms"].items())
        ranks.append(f"rank {f['rank']} cores {f['cores']} numa {f['numa_nodes']}"
                     + (f" tasks ms {tasks}" if tasks else ""))
    return (f"  {launch['wall_s']:.0f} s, load {launch['load_before']:.1f} before; median "
            f"step ms: {steps}\n  " + "; ".join(ranks))


def drive(args: argparse.Namespace) -> None:
    """The rounds of launches, the summary, the JSON."""
    launches = []
    with tempfile.TemporaryDirectory(prefix="jaxpp_launchers_") as workdir:
        for r in range(args.repeats):
            for which in launch_order(args.launchers, r):
                launches.append(run_launch(which, args, r, workdir))
                print(launch_line(launches[-1]), flush=True)
    losses = {n: {x["loss"][n] for x in launches} for n in args.schedules}
    for name, seen in losses.items():
        if max(seen) - min(seen) > 1e-5 * max(abs(v) for v in seen):
            raise SystemExit(f"{name}: the launches computed different losses {sorted(seen)}")
    summary = summarize(launches, args.launchers)
    write_json(args.out, {
        "benchmark": "launchers", **metadata(), "ranks": RANKS, "quick": args.quick,
        "width": args.width, "ffn": args.ffn, "blocks": args.blocks, "rows": args.rows,
        "num_microbatches": args.num_microbatches, "rounds": args.repeats,
        "steps_per_launch": args.steps, "launchers": args.launchers,
        "schedules": summary, "launches": launches,
    })
    print(f"{'schedule':<12}" + "".join(f"{w + ' ms':>12}" for w in args.launchers)
          + ("    ratio" if "ratio" in next(iter(summary.values())) else ""))
    for name, row in summary.items():
        ratio = f"  {row['ratio']:7.3f}" if "ratio" in row else ""
        print(f"{name:<12}" + "".join(f"{row[w]['step_ms']:>12.1f}" for w in args.launchers)
              + ratio)
    print(f"wrote {args.out}", flush=True)


# ----------------------------------------------------------------------------- a launch's ranks


def numa_node(core: int, sysfs: str = "/sys/devices/system/cpu") -> int | None:
    """The NUMA node of CPU `core` (from sysfs), None where sysfs does not say."""
    for path in glob.glob(os.path.join(sysfs, f"cpu{core}", "node*")):
        m = re.fullmatch(r"node(\d+)", os.path.basename(path))
        if m:
            return int(m.group(1))
    return None


def rank_facts() -> dict[str, Any]:
    """This rank's settings as the step runs: flags, threads, cores and their NUMA nodes."""
    cores = sorted(os.sched_getaffinity(0))
    return {
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cores": cores,
        "numa_nodes": sorted({n for c in cores if (n := numa_node(c)) is not None}),
        "host": os.uname().nodename,
    }


def work(args: argparse.Namespace) -> None:
    """One launch's ranks: compile, check, time every schedule; rank 0 writes the report."""
    # jaxpp_mpi was imported above (its launch modules), before JAX: its settings hold.
    import jax
    import numpy as np
    import schedules as bench  # the workload and its timing: bench/schedules.py

    import jaxpp_mpi
    from jaxpp_mpi.schedules import schedule_by_name

    mesh = jaxpp_mpi.make_mpmd_mesh((RANKS, 1), ("stage", "data"), "stage")
    comm = mesh.comm
    np_params, np_batch = bench.make_data(args)
    params = jax.tree.map(jax.numpy.asarray, np_params)
    batch = jax.tree.map(jax.numpy.asarray, np_batch)
    n = args.num_microbatches
    compiled, losses = {}, {}
    for name in args.schedules:
        compiled[name] = bench.compile_schedule(schedule_by_name(name, RANKS), mesh, params,
                                                batch, n)
        bench.run_step(compiled[name], params, batch)
        out = bench.run_step(compiled[name], params, batch)
        value = (float(np.asarray(out.first_mpmd_replica).sum())
                 if out.is_partially_addressable else None)
        losses[name] = comm.bcast(value, root=min(out.mpmd_idxs))
    steps: dict[str, list[float]] = {name: [] for name in args.schedules}
    for r in range(args.steps):
        k = r % len(args.schedules)
        for name in args.schedules[k:] + args.schedules[:k]:
            wall, _ = bench.barrier_timed(
                comm, lambda name=name: bench.run_step(compiled[name], params, batch))
            steps[name].append(wall)
    tasks: dict[str, dict[str, list[float]]] = {}
    traced: dict[str, list[float]] = {}
    if args.traces:
        for name in args.schedules:
            tasks[name], traced[name] = {}, []
            for _ in range(args.traced_steps):
                with jaxpp_mpi.trace.record() as events:
                    wall, _ = bench.barrier_timed(
                        comm, lambda name=name: bench.run_step(compiled[name], params, batch))
                traced[name].append(wall)
                for e in events:
                    if e.cat == "task":
                        tasks[name].setdefault(e.name, []).append((e.end_ns - e.start_ns) * 1e-6)
            jaxpp_mpi.trace.export(os.path.join(args.traces, f"{name}.trace.json"), events,
                                   mesh, other_data={"schedule": name})
    facts = dict(rank_facts(), rank=comm.rank, task_ms=tasks)
    per_rank = comm.gather(facts, root=0)
    if comm.rank == 0:
        write_json(args.worker, {"steps_ms": steps, "traced_steps_ms": traced,
                                 "loss": losses, "ranks": per_rank})


def main() -> None:
    args = parse_args()
    if args.worker:
        work(args)
    else:
        drive(args)


if __name__ == "__main__":
    main()
