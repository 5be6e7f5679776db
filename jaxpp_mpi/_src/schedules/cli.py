"""The schedule viewer, ``python -m jaxpp_mpi.schedules``: timeline, task order, figures."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

from jaxpp_mpi._src.schedules.check import ScheduleAnalysis, analyze_schedule
from jaxpp_mpi._src.schedules.custom import (
    CustomSchedule,
    format_entry,
    groups_needing_stage,
    schedule_to_csv,
)
from jaxpp_mpi._src.schedules.library import (
    SCHEDULES,
    BaseSchedule,
    DualPipeV,
    Interleaved1F1B,
    KimiK2,
)
from jaxpp_mpi._src.schedules.tasks import DEFAULT_LATENCIES, TaskType, entry_tasks
from jaxpp_mpi._src.timeline import gantt
from jaxpp_mpi._src.timeline.chrome import load as load_trace

__all__ = ["main", "render"]

PROG = "python -m jaxpp_mpi.schedules"
# The viewer names schedules by class (any case), from the registry (`Note: schedule registry`).
_BY_CLASS_NAME = {cls.__name__.lower(): cls for cls in SCHEDULES.values()}
_CLASS_NAMES = ", ".join(cls.__name__ for cls in SCHEDULES.values())
_INTERLEAVED = (Interleaved1F1B, KimiK2)
MAX_TASKS_SHOWN = 100_000


class UsageError(Exception):
    """Bad command-line input; reported on one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description="Show how a pipeline schedule runs: per-group timeline (idle time as dots), "
        "task order, makespan, bubble fraction and peak in-flight activations.",
        epilog=f"schedules: {_CLASS_NAMES}. Example: {PROG} Std1F1B --stages 4 "
        "--microbatches 8 --png schedule.png; measured: "
        f"{PROG} --from-trace trace.json --png measured.png; every schedule ranked for a "
        f"step: {PROG} plan FILE.py:FUNCTION (see {PROG} plan --help)",
    )
    p.add_argument("schedule", nargs="?",
                   help="schedule name (omit with --from-csv or --from-trace)")
    p.add_argument("--stages", type=int, help="number of pipeline stages")
    p.add_argument("--microbatches", type=int, help="number of microbatches")
    # Deprecated spelling of --microbatches, kept working but hidden from --help.
    p.add_argument("--mubatches", dest="microbatches", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mpmd-dim", type=int, help="number of MPMD groups (interleaved, DualPipeV)")
    p.add_argument(
        "--fuse-steady-state",
        action="store_true",
        help="fuse steady-state forward/backward pairs (Interleaved1F1B, KimiK2)",
    )
    p.add_argument("--csv", metavar="OUT", help="also write the schedule as CSV to OUT")
    p.add_argument("--from-csv", metavar="IN", help="read a custom schedule from a CSV file")
    p.add_argument("--png", metavar="OUT",
                   help="also draw the timeline as a Gantt chart to OUT (needs matplotlib)")
    p.add_argument("--from-trace", metavar="TRACE",
                   help="draw a measured step instead: a Chrome trace written by "
                   "jaxpp_mpi.trace.export (examples/train.py --trace); needs --png")
    p.add_argument(
        "--latency",
        default="",
        metavar="F=1,B=2,I=1,W=1",
        help="task durations by kind (defaults F=1,B=2,I=1,W=1)",
    )
    p.add_argument(
        "--comm-latency",
        type=float,
        default=0.0,
        help="delay for a result to reach another group (default 0)",
    )
    return p


def _parse_latencies(text: str) -> dict[TaskType, float]:
    """Parses ``--latency`` (``F=1,B=2``; kinds by letter or TaskType name, any case)."""
    kinds = {k.value: k for k in TaskType} | {k.name: k for k in TaskType}
    out: dict[TaskType, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        kind = kinds.get(key.strip().upper())
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or kind is None or not (0 <= number < math.inf):
            raise UsageError(
                f"--latency: bad item {item!r}; write KIND=DURATION with KIND one of F, B, I, W "
                "and DURATION >= 0, e.g. F=1,B=2,I=1,W=1"
            )
        out[kind] = number
    return out


def _build(args: argparse.Namespace) -> tuple[BaseSchedule, int]:
    """Returns the schedule the arguments name and its number of microbatches."""
    if args.from_csv:
        if args.schedule not in (None, "CustomSchedule"):
            raise UsageError("give either a schedule name or --from-csv, not both")
        schedule = CustomSchedule.from_csv(args.from_csv)
        return schedule, args.microbatches or schedule.num_microbatches
    if args.schedule is None:
        raise UsageError(f"name a schedule ({_CLASS_NAMES}) or give --from-csv")
    cls = _BY_CLASS_NAME.get(args.schedule.lower())
    if cls is None:
        raise UsageError(f"unknown schedule {args.schedule!r}; choose one of {_CLASS_NAMES}")
    if args.stages is None or args.microbatches is None:
        raise UsageError(f"{cls.__name__} needs --stages and --microbatches")
    if args.fuse_steady_state and cls not in _INTERLEAVED:
        raise UsageError(
            f"--fuse-steady-state only applies to Interleaved1F1B and KimiK2, not {cls.__name__}"
        )
    if cls in _INTERLEAVED:
        if args.mpmd_dim is None:
            raise UsageError(f"{cls.__name__} needs --mpmd-dim (the number of MPMD groups)")
        schedule = cls(args.stages, args.mpmd_dim, args.fuse_steady_state)
    elif cls is DualPipeV:
        mpmd_dim = args.mpmd_dim if args.mpmd_dim is not None else args.stages // 2
        schedule = DualPipeV(args.stages, mpmd_dim)
    else:
        if args.mpmd_dim not in (None, args.stages):
            raise UsageError(
                f"{cls.__name__} runs one stage per group: --mpmd-dim must equal "
                f"--stages ({args.stages}) or be omitted"
            )
        schedule = cls(args.stages)
    return schedule, args.microbatches


def render(
    schedule: BaseSchedule,
    n: int,
    a: ScheduleAnalysis,
    latencies: dict[TaskType, float],
    comm_latency: float,
) -> str:
    """Returns the viewer's text report: timeline, task order and figures.

    Args:
      schedule: The schedule shown.
      n: Number of microbatches.
      a: Its analysis (`analyze_schedule`) with these latencies.
      latencies: Task durations given on the command line (over the defaults).
      comm_latency: Delay for a result to reach another group.

    Returns:
      The report, lines joined with newlines.
    """
    lat = {**DEFAULT_LATENCIES, **latencies}
    with_stage = any(groups_needing_stage([[e.entry for e in row] for row in a.timeline]))
    rows = [[format_entry(e.entry, with_stage) for e in row] for row in a.timeline]
    single = [
        format_entry(t, with_stage) for row in a.timeline for e in row for t in entry_tasks(e.entry)
    ]
    width = 1 + max((len(s) for s in single), default=1)  # characters per time quantum
    durations = [v for v in (*lat.values(), comm_latency) if v > 0]
    quantum = min(durations, default=1.0)

    def col(t: float) -> int:
        return round(t / quantum * width)

    total = col(a.makespan)
    prefix = [f"group {g}" for g in range(len(a.timeline))]
    pw = max(len(p) for p in prefix) + 1
    unit = f"{quantum:g} time unit" + ("" if quantum == 1 else "s")
    stage_note = ", s<stage>" if with_stage else ""
    lines = [
        f"{schedule!r} with {n} microbatches",
        "latencies "
        + " ".join(f"{k.value}={lat[k]:g}" for k in TaskType)
        + f", comm latency {comm_latency:g}",
        "",
        f"Timeline: {width} characters = {unit}, '.' = idle; cell = F/B/I/W<microbatch>"
        f"{stage_note}; '+' joins a fused task",
    ]
    tick = max(1, math.ceil((len(f"{a.makespan:g}") + 1) / width)) * 5
    ruler = [" "] * (total + 8)
    marks = [" "] * (total + 8)
    t = 0
    while col(t * quantum) <= total:
        c = col(t * quantum)
        label = f"{t * quantum:g}"
        ruler[c : c + len(label)] = label
        marks[c] = "|"
        t += tick
    lines += ["time".ljust(pw) + "".join(ruler).rstrip(), " " * pw + "".join(marks).rstrip()]
    for g, row in enumerate(a.timeline):
        chars = ["."] * total
        for e, text in zip(row, rows[g], strict=True):
            c0, c1 = col(e.start), col(e.end)
            if c1 <= c0:
                continue
            label = text if len(text) < c1 - c0 else text[: max(1, c1 - c0 - 1)]
            chars[c0:c1] = label.ljust(c1 - c0)
        lines.append(prefix[g].ljust(pw) + "".join(chars).rstrip())
    lines += ["", "Task order"]
    lines += [prefix[g].ljust(pw) + " ".join(cells) for g, cells in enumerate(rows)]
    mean_bubble = sum(a.bubble_fraction) / max(1, len(a.bubble_fraction))
    lines += [
        "",
        f"makespan {a.makespan:g}, mean bubble {100 * mean_bubble:.1f}%, "
        f"peak activations {max(a.peak_activations, default=0)} (worst group)",
    ]
    stages = [
        ",".join(str(s) for s in range(schedule.num_stages) if schedule.get_mpmd_idx(s) == g)
        for g in range(len(a.timeline))
    ]
    sw = max(6, *(len(s) for s in stages))
    lines.append(f"group  {'stages':<{sw}}  {'busy':>6}  bubble  peak activations")
    for g in range(len(a.timeline)):
        lines.append(
            f"{g:>5}  {stages[g]:<{sw}}  {a.busy[g]:>6g}  {100 * a.bubble_fraction[g]:>5.1f}%"
            f"  {a.peak_activations[g]:>16}"
        )
    return "\n".join(lines)


def _draw(chart: gantt.Chart, path: str) -> None:
    gantt.draw_png(chart, path)
    print(f"\nwrote {path} ({len(chart.tasks())} tasks on {len(chart.rows)} rows)")


def _from_trace(args: argparse.Namespace) -> None:
    """Draws a measured step: `--from-trace TRACE --png OUT`."""
    if args.schedule or args.from_csv:
        raise UsageError("give either a schedule or --from-trace, not both")
    if not args.png:
        raise UsageError("--from-trace draws a chart: give --png OUT")
    if not os.path.isfile(args.from_trace):  # a directory or a device (/dev/zero): no trace
        what = "is not a regular file" if os.path.exists(args.from_trace) else "does not exist"
        raise UsageError(f"--from-trace: {args.from_trace} {what}")
    try:
        trace = load_trace(args.from_trace)
    except UnicodeDecodeError as e:
        raise UsageError(
            f"--from-trace: {args.from_trace} is not UTF-8 text (byte 0x{e.object[e.start]:02x} "
            f"at offset {e.start}); give the JSON trace written by jaxpp_mpi.trace.export"
        ) from None
    chart = gantt.trace_chart(trace, title=f"measured: {os.path.basename(args.from_trace)}")
    span = max((c.end for c in chart.cells), default=0.0)
    print(f"{args.from_trace}: {len(chart.tasks())} tasks on {len(chart.rows)} tracks, "
          f"{span:.3f} ms")
    _draw(chart, args.png)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the schedule viewer.

    Args:
      argv: The arguments, without the program name; ``sys.argv[1:]`` if None.

    Returns:
      The exit status: 0, or 2 on bad input (reported on one line on stderr).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plan"]:  # the planner (imports JAX): jaxpp_mpi/_src/planner/cli.py
        from jaxpp_mpi._src.planner.cli import main as plan_main

        return plan_main(argv[1:])
    try:
        args = _parser().parse_args(argv)
        if args.from_trace:
            _from_trace(args)
            return 0
        latencies = _parse_latencies(args.latency)
        if not args.comm_latency >= 0:
            raise UsageError(f"--comm-latency must be >= 0, got {args.comm_latency}")
        schedule, n = _build(args)
        if schedule.num_stages * n > MAX_TASKS_SHOWN:
            raise UsageError(
                f"{schedule.num_stages} stages x {n} microbatches is too large to "
                f"display (limit {MAX_TASKS_SHOWN} stage-microbatch pairs)"
            )
        analysis = analyze_schedule(schedule, n, latencies, comm_latency=args.comm_latency)
        print(render(schedule, n, analysis, latencies, args.comm_latency))
        if args.csv:
            schedule_to_csv(schedule, n, args.csv)
            print(f"\nwrote {args.csv}")
        if args.png:
            title = f"{schedule!r}, {n} microbatches (simulated)"
            _draw(gantt.schedule_chart(analysis, latencies, title), args.png)
    except (UsageError, ValueError, OSError, ImportError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0
