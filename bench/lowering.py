"""Program order against the schedule: the lowered program's makespan vs the schedule's own.

Run (no MPI, no XLA compile; JAX only traces):

    .venv/bin/python bench/lowering.py --out bench/results/lowering.json

For every schedule, 2 and 4 groups, 4, 8 and 16 microbatches, the step of
`bench/schedules.py` (its residual-MLP workload) is traced and lowered by the compiler
(`build_step` on abstract arguments), and makespans are computed with the same task
times and message cost:
- `lowered`: `simulate` of the compiled program (rendezvous play, blocking sends);
- `rounds_lowered`: the same for the round order alone (`Note: global order` in
  compiler/walks.py, the only order before `Note: timed order`), lowered again from the
  program's task graph (`graph_of`);
- `schedule`: the schedule's own dataflow timeline (`schedules.schedule_makespan`: a
  task starts when its group is free and its inputs exist).
`ratio` = lowered / schedule (and `rounds_ratio`): above 1, the program waits where the
schedule does not. Deterministic: the same figures on every run.

Task times: `default` (F=1, B=2, I=W=1), `split` (F=1, I=1, W=2, B=3: the weight half the
heavier one), both with free messages; `measured`: the per-task medians of
`bench/results/schedules.json` for that schedule (labels the measured run did not have,
other stage or microbatch counts, take the median of their kind and stage, else of their
kind), messages at its fitted `MessageCost`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable, Mapping

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/schedules.py

import schedules as workload  # noqa: E402 - bench/schedules.py, no JAX import
from _common import write_json  # noqa: E402

from jaxpp_mpi._src.compiler import lower, walks  # noqa: E402
from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode  # noqa: E402
from jaxpp_mpi._src.ir import passes  # noqa: E402
from jaxpp_mpi._src.ir.program import Aval, Program, Run  # noqa: E402
from jaxpp_mpi._src.ir.simulate import MessageCost, simulate  # noqa: E402
from jaxpp_mpi._src.schedules.tasks import label_latency, parse_label  # noqa: E402
from jaxpp_mpi.schedules import schedule_by_name  # noqa: E402

TIMES = ("default", "split", "measured")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default=",".join(workload.DEFAULT_SCHEDULES))
    p.add_argument("--groups", default="2,4")
    p.add_argument("--microbatches", default="4,8,16")
    p.add_argument("--times", default=",".join(TIMES), help=f"from {', '.join(TIMES)}")
    p.add_argument("--measured", default="bench/results/schedules.json")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.groups = [int(g) for g in args.groups.split(",") if g]
    args.microbatches = [int(m) for m in args.microbatches.split(",") if m]
    args.times = [t for t in args.times.split(",") if t]
    return args


def workload_program(
    name: str,
    groups: int,
    num_microbatches: int,
    width: int = 1024,
    ffn: int = 4096,
    blocks: int = 8,
    rows: int = 16,
) -> Program:
    """The compiled program of bench/schedules.py's step (abstract arguments, no compile)."""
    import jax

    from jaxpp_mpi._src.compiler.build import build_step

    sched = schedule_by_name(name, groups)
    blocks = blocks if blocks % sched.num_stages == 0 else sched.num_stages
    d, f = width, ffn
    params = [
        {
            "w1": jax.ShapeDtypeStruct((d, f), "float32"),
            "w2": jax.ShapeDtypeStruct((f, d), "float32"),
        }
        for _ in range(blocks)
    ]
    mb = jax.ShapeDtypeStruct((num_microbatches, rows, d), "float32")
    step = workload.pipelined_step(sched, num_microbatches)
    return build_step(step, (params, (mb, mb)), groups).program


def graph_of(program: Program) -> TaskGraph:
    """The task graph a lowered program was built from (values named `g:buffer`).

    A received buffer is the value of the buffer its matching send sends.
    """
    matching = passes.match_messages(program)

    def value(g: int, b: int) -> str:
        for i, instr in enumerate(program.groups[g].instrs):
            r = passes.recv_half(instr)
            if r is not None and r[0] == b:
                h, j = matching.send_of[g][i]
                return value(h, passes.send_half(program.groups[h].instrs[j])[0])
        return f"{g}:{b}"

    tasks, avals = [], {}
    for gp in program.groups:
        g = gp.mpmd_idx
        names = {b: value(g, b) for b, _ in gp.avals}
        avals.update({names[b]: a for b, a in gp.avals})
        tasks.append(
            tuple(
                TaskNode(
                    r.task,
                    g,
                    r.exe,
                    tuple(names[b] for b in r.ins),
                    tuple(names[b] for b in r.outs),
                    tuple(names[b] for b in r.donate),
                )
                for r in gp.instrs
                if isinstance(r, Run)
            )
        )
    inputs = [(f"{gp.mpmd_idx}:{b}", gp.mpmd_idx, k) for gp in program.groups for b, k in gp.inputs]
    outputs = [(f"{gp.mpmd_idx}:{b}", k) for gp in program.groups for b, k in gp.outputs]
    return TaskGraph(program.num_groups, tasks, inputs, outputs, avals)


def round_order(graph: TaskGraph) -> Program:
    """`graph` lowered in the round order alone (the lowering before the timed order)."""
    program, _ = lower._finish(walks.RoundWalk(graph))
    return program


def kind_stage_times(task_ms: Mapping[str, float]) -> dict[tuple[str, int], float]:
    """Median time per (kind letter, stage) of measured single-task labels."""
    by: dict[tuple[str, int], list[float]] = {}
    for label, t in task_ms.items():
        parts = parse_label(label) if label[:1] in "FBIW" else []
        if len(parts) == 1:
            by.setdefault((parts[0].kind, parts[0].stage), []).append(t)
    return {key: statistics.median(ts) for key, ts in by.items()}


def label_times(program: Program, per: Callable[[str, str, int], float]) -> dict[str, float]:
    """Every pipeline task label of `program`'s Runs (fused ones split) -> its time.

    `per(label, kind letter, stage)` gives one task's time.
    """
    out: dict[str, float] = {}
    for g in program.groups:
        for instr in g.instrs:
            if isinstance(instr, Run) and instr.task[:1] in "FBIW":
                for label in instr.task.split("+"):
                    part = parse_label(label)[0]
                    out[label] = per(label, part.kind, part.stage)
    return out


def makespans(
    program: Program,
    sched,
    num_microbatches: int,
    task_ms: Mapping[str, float],
    cost: MessageCost | None,
    act: Aval,
) -> dict[str, float]:
    """The lowered program's simulated makespan and the schedule's own, same times."""

    def latency(run: Run) -> float:
        return sum(task_ms.get(label, 0.0) for label in run.task.split("+"))

    lowered = simulate(program, latency=latency, transfer=cost, check_leaks=False).makespan
    own = workload.schedule_makespan(sched, num_microbatches, task_ms, cost(act) if cost else 0.0)
    return {"lowered": lowered, "schedule": own, "ratio": lowered / own}


def compare(
    program: Program,
    sched,
    num_microbatches: int,
    task_ms: Mapping[str, float],
    cost: MessageCost | None,
    act: Aval,
) -> dict[str, float]:
    """`makespans` of the compiled program, plus the round order's (`rounds_*`)."""
    out = makespans(program, sched, num_microbatches, task_ms, cost, act)
    rounds = makespans(round_order(graph_of(program)), sched, num_microbatches, task_ms, cost, act)
    out["rounds_lowered"], out["rounds_ratio"] = rounds["lowered"], rounds["ratio"]
    return out


def times_for(kind: str, name: str, measured: Mapping | None):
    """(per (kind, stage) time function, message cost) for one task-time source."""
    if kind == "default":
        return (lambda label, k, s: label_latency(label)), None
    if kind == "split":
        return (lambda label, k, s: {"F": 1.0, "B": 3.0, "I": 1.0, "W": 2.0}[k]), None
    if measured is None or name not in measured["schedules"]:
        raise SystemExit(f"no measured times for {name} (see --measured)")
    task_ms = measured["schedules"][name]["task_ms"]
    table = kind_stage_times(task_ms)
    by_kind: dict[str, list[float]] = {}
    for (k, _), t in table.items():
        by_kind.setdefault(k, []).append(t)
    fallback = {k: statistics.median(ts) for k, ts in by_kind.items()}
    mc = measured["message_cost"]
    cost = MessageCost(mc["latency_ms"], mc["bytes_per_ms"])

    def per(label: str, k: str, s: int) -> float:
        if label in task_ms:
            return task_ms[label]
        return table.get((k, s), fallback.get(k, 0.0))

    return per, cost


def main(argv=None) -> None:
    args = parse_args(argv)
    measured = None
    if "measured" in args.times:
        with open(args.measured) as f:
            measured = json.load(f)
    width = measured["width"] if measured else 1024
    act = Aval((16, width), "float32")
    rows = []
    print("lowered / schedule's own makespan: round order -> this lowering")
    print(f"{'schedule':<12} {'g':>2} {'m':>3} " + " ".join(f"{t:>16}" for t in args.times))
    for name in args.schedules:
        for groups in args.groups:
            for m in args.microbatches:
                sched = schedule_by_name(name, groups)
                try:
                    program = workload_program(name, groups, m, width=width)
                except Exception as e:  # a schedule that rejects this microbatch count
                    print(f"{name:<12} {groups:>2} {m:>3}  skipped: {str(e).splitlines()[0]}")
                    continue
                row = {"schedule": name, "groups": groups, "num_microbatches": m}
                cells = []
                for kind in args.times:
                    per, cost = times_for(kind, name, measured)
                    r = compare(program, sched, m, label_times(program, per), cost, act)
                    row[kind] = r
                    cells.append(f"{r['rounds_ratio']:>7.3f} -> {r['ratio']:.3f}")
                rows.append(row)
                print(f"{name:<12} {groups:>2} {m:>3} " + " ".join(cells), flush=True)
    if args.out:
        write_json(
            args.out, {"benchmark": "lowering", "measured_from": args.measured, "rows": rows}
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
