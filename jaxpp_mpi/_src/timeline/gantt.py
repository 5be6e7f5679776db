"""Gantt charts of a pipeline step (groups x time), planned or measured, drawn as PNG.

Note: gantt charts.
  A `Chart` is plain data: one row per group (or trace track) and one `Cell` per task,
  so tests check the drawing's content without looking at pixels. `schedule_chart`
  builds it from a schedule's simulated timeline (`analyze_schedule`), `trace_chart`
  from a Chrome trace written by `jaxpp_mpi.trace.export`, so the two pictures of one
  step compare by eye. A fused task (one schedule entry, one executable) becomes one
  cell per part, its time split in proportion to the parts' default latencies. Cells
  are coloured by kind (F, B, I, W; other code grey), hold their microbatch number,
  and are hatched for a group's second and later stages (interleaved, DualPipeV).
  Message waits of a measured trace are thin grey bars under the task cells.
  `draw_png` needs matplotlib (the `plot` extra); it uses the Agg canvas directly, so
  it never changes the backend of the caller's pyplot.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpp_mpi._src.schedules.check import ScheduleAnalysis
from jaxpp_mpi._src.schedules.tasks import (
    KIND_LETTERS,
    TaskType,
    entry_tasks,
    kind_latencies,
    parse_label,
    task_label,
)

__all__ = ["COLORS", "Cell", "Chart", "draw_png", "schedule_chart", "trace_chart"]

COLORS = {"F": "#5b9bd5", "B": "#ed7d31", "I": "#70ad47", "W": "#9e6ebd",
          "other": "#bfbfbf", "message": "#d9d9d9"}
_TASK_KINDS = frozenset(KIND_LETTERS)
_MISSING = ("drawing PNG charts needs matplotlib, an optional extra of jaxpp_mpi: "
            "pip install 'jaxpp_mpi[plot]' (or pip install matplotlib)")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One bar of the chart.

    Attributes:
      row: index into `Chart.rows`.
      start, end: time, in the chart's unit.
      kind: 'F', 'B', 'I', 'W', 'other' (code outside the loop) or 'message'.
      text: what is written in it: the microbatch number, '' for messages.
      stage: the pipeline stage, or None.
      chunk: the stage's rank among its row's stages (0 = the row's first stage).
      label: the task label or message kind it came from.
    """

    row: int
    start: float
    end: float
    kind: str
    text: str
    stage: int | None = None
    chunk: int = 0
    label: str = ""


@dataclasses.dataclass(frozen=True)
class Chart:
    """Rows (top to bottom), cells, the time axis' unit and a title."""

    rows: tuple[str, ...]
    cells: tuple[Cell, ...]
    unit: str
    title: str

    def tasks(self) -> list[Cell]:
        """The cells of pipeline tasks (F, B, I, W)."""
        return [c for c in self.cells if c.kind in _TASK_KINDS]


def _split(start: float, end: float, kinds: Sequence[str],
           latency: Mapping[str, float]) -> list[tuple[float, float]]:
    """[start, end] cut into one interval per part, in proportion to their latencies."""
    weights = [latency.get(k, 1.0) for k in kinds]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(kinds), float(len(kinds))
    out, t = [], start
    for w in weights:
        step = (end - start) * w / total
        out.append((t, t + step))
        t += step
    return out


def _with_chunks(cells: list[Cell]) -> tuple[Cell, ...]:
    stages: dict[int, list[int]] = {}
    for c in cells:
        if c.stage is not None and c.stage not in stages.setdefault(c.row, []):
            stages[c.row].append(c.stage)
    order = {row: {s: i for i, s in enumerate(sorted(ss))} for row, ss in stages.items()}
    return tuple(c if c.stage is None else dataclasses.replace(c, chunk=order[c.row][c.stage])
                 for c in cells)


def schedule_chart(
    analysis: ScheduleAnalysis,
    latencies: Mapping[TaskType, float] | None = None,
    title: str = "",
) -> Chart:
    """Returns the chart of a schedule's simulated timeline.

    Args:
      analysis: from `analyze_schedule(schedule, n, latencies)`.
      latencies: the task latencies it used (to split fused tasks); defaults if None.
      title: the chart's title.

    Returns:
      One row per group, times in task latency units.
    """
    lat = kind_latencies(latencies)
    cells = []
    for g, row in enumerate(analysis.timeline):
        for e in row:
            tasks = entry_tasks(e.entry)
            spans = _split(e.start, e.end, [t.type.value for t in tasks], lat)
            for t, (a, b) in zip(tasks, spans):
                cells.append(Cell(g, a, b, t.type.value, str(t.microbatch), t.stage_id,
                                  label=task_label(t)))
    rows = tuple(f"group {g}" for g in range(len(analysis.timeline)))
    return Chart(rows, _with_chunks(cells), "time (task latency units)", title)


def _bad(what: str) -> ValueError:
    return ValueError(f"not a trace written by jaxpp_mpi.trace.export: {what}")


def trace_chart(trace: Mapping[str, Any], title: str = "") -> Chart:
    """Returns the chart of a Chrome trace from `jaxpp_mpi.trace.export`.

    Args:
      trace: the trace (see `Note: trace format`), e.g. from `jaxpp_mpi.trace.load`.
      title: the chart's title.

    Returns:
      One row per (process, thread) track; times in ms from the first slice.

    Raises:
      ValueError: if the trace's events do not have the fields `export` writes.
    """
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        raise _bad("no 'traceEvents' list")
    names: dict[tuple[str, Any], str] = {}
    slices = []
    for ev in events:
        if not isinstance(ev, dict):
            raise _bad(f"event {ev!r} is not an object")
        if ev.get("ph") == "M" and ev.get("name") in ("process_name", "thread_name"):
            key = ("p", ev.get("pid")) if ev["name"] == "process_name" else (
                "t", (ev.get("pid"), ev.get("tid")))
            names[key] = str(ev.get("args", {}).get("name", ""))
        elif ev.get("ph") == "X":
            fields = (ev.get("ts"), ev.get("dur"), ev.get("pid"), ev.get("tid"))
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                       for v in fields) or not isinstance(ev.get("name"), str):
                raise _bad(f"slice {ev!r} lacks a name, ts, dur, pid or tid")
            slices.append(ev)
    tracks = sorted({(ev["pid"], ev["tid"]) for ev in slices})
    row_of = {t: i for i, t in enumerate(tracks)}
    several = len({p for p, _ in tracks}) > 1

    def row_name(pid: Any, tid: Any) -> str:
        thread = names.get(("t", (pid, tid)), f"thread {tid}")
        process = names.get(("p", pid), f"process {pid}")
        return f"{process}: {thread}" if several else thread

    origin = min((ev["ts"] for ev in slices), default=0.0)
    unit = kind_latencies()
    cells = []
    for ev in slices:
        row = row_of[ev["pid"], ev["tid"]]
        a, b = (ev["ts"] - origin) / 1e3, (ev["ts"] + ev["dur"] - origin) / 1e3
        if ev.get("cat") != "task":
            cells.append(Cell(row, a, b, "message", "", label=ev["name"]))
            continue
        parts = parse_label(ev["name"])
        for p, (s, e) in zip(parts, _split(a, b, [p.kind for p in parts], unit)):
            kind = p.kind if p.kind in unit else "other"
            text = str(p.microbatch) if p.microbatch is not None else p.kind
            cells.append(Cell(row, s, e, kind, text, p.stage, label=ev["name"]))
    rows = tuple(row_name(*t) for t in tracks)
    return Chart(rows, _with_chunks(cells), "time (ms)", title)


def _matplotlib() -> tuple[Any, Any, Any]:
    """matplotlib's Figure, Agg canvas and Patch, or a clear ImportError."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError(_MISSING) from e
    return Figure, FigureCanvasAgg, Patch


def draw_png(chart: Chart, path: str | os.PathLike) -> None:
    """Draws `chart` (see `Note: gantt charts`) to the PNG file `path`.

    Args:
      chart: what to draw.
      path: the PNG file to write.

    Raises:
      ImportError: if matplotlib is not installed, saying how to install it.
    """
    figure_cls, canvas_cls, patch_cls = _matplotlib()
    per_row = max((sum(1 for c in chart.tasks() if c.row == r) for r in range(len(chart.rows))),
                  default=1)
    width = min(40.0, max(8.0, 2.0 + 0.3 * per_row))
    fig = figure_cls(figsize=(width, 1.2 + 0.45 * max(1, len(chart.rows))), dpi=100)
    canvas_cls(fig)
    ax = fig.add_subplot()
    span = max((c.end for c in chart.cells), default=1.0) or 1.0
    inches_per_unit = (width - 2.0) / span
    for c in chart.cells:
        top = len(chart.rows) - 1 - c.row  # the first row at the top
        if c.kind == "message":
            ax.broken_barh([(c.start, c.end - c.start)], (top - 0.42, 0.12),
                           facecolors=COLORS["message"])
            continue
        ax.broken_barh([(c.start, c.end - c.start)], (top - 0.28, 0.7),
                       facecolors=COLORS[c.kind], edgecolors="white", linewidth=0.5,
                       hatch="//" if c.chunk else None)
        if (c.end - c.start) * inches_per_unit >= 0.08 * len(c.text) + 0.05:
            ax.text((c.start + c.end) / 2, top + 0.07, c.text, ha="center", va="center",
                    fontsize=7)
    ax.set_yticks(range(len(chart.rows)), list(reversed(chart.rows)))
    ax.set_ylim(-0.6, len(chart.rows) - 0.4)
    ax.set_xlim(0, span)
    ax.set_xlabel(chart.unit)
    if chart.title:
        ax.set_title(chart.title, fontsize=10)
    kinds = [k for k in ("F", "B", "I", "W", "other", "message")
             if any(c.kind == k for c in chart.cells)]
    handles = [patch_cls(color=COLORS[k], label=k) for k in kinds]
    if any(c.chunk for c in chart.cells):
        handles.append(patch_cls(facecolor="white", edgecolor="black", hatch="//",
                                 label="later stage"))
    ax.legend(handles=handles,
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, format="png")
