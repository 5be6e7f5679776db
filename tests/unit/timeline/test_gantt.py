"""Gantt charts of schedules and measured traces: the chart's data, the PNG, the CLI."""

from __future__ import annotations

import sys
from collections import Counter

import pytest

from jaxpp_mpi._src.schedules.library import entry_tasks
from jaxpp_mpi._src.timeline.gantt import draw_png, schedule_chart, trace_chart
from jaxpp_mpi.schedules import (
    DualPipeV,
    Interleaved1F1B,
    Std1F1B,
    ZeroBubble,
    analyze_schedule,
)
from jaxpp_mpi.schedules.__main__ import main
from jaxpp_mpi.trace import TraceEvent, chrome_trace

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data.startswith(PNG_MAGIC)


@pytest.mark.parametrize("schedule,n", [
    (Std1F1B(4), 8),
    (ZeroBubble(3), 4),
    (Interleaved1F1B(4, 2, fuse_steady_state=True), 4),
    (DualPipeV(4, 2), 4),
])
def test_schedule_chart_has_a_cell_per_task(schedule, n):
    analysis = analyze_schedule(schedule, n)
    chart = schedule_chart(analysis)
    tasks = schedule.tasks(n)
    assert chart.rows == tuple(f"group {g}" for g in range(len(tasks)))
    want = Counter((g, str(t)) for g, row in enumerate(tasks) for e in row
                   for t in entry_tasks(e))
    assert Counter((c.row, c.label) for c in chart.cells) == want
    assert len(chart.tasks()) == len(chart.cells) == sum(want.values())
    for c in chart.cells:
        assert c.text == str(int(c.label[1:].split("s")[0]))  # the microbatch number
        assert c.kind == c.label[0] and 0 <= c.start < c.end <= analysis.makespan
        assert c.chunk == sorted({x.stage for x in chart.cells if x.row == c.row}).index(
            c.stage)


def test_fused_entries_split_in_proportion_to_latency():
    schedule = Interleaved1F1B(4, 2, fuse_steady_state=True)
    chart = schedule_chart(analyze_schedule(schedule, 4))
    by_start = sorted(chart.cells, key=lambda c: (c.row, c.start))
    fused = [(a, b) for a, b in zip(by_start, by_start[1:])
             if a.row == b.row and a.kind == "F" and b.kind == "B" and a.end == b.start]
    assert fused and all(b.end - b.start == pytest.approx(2 * (a.end - a.start))
                         for a, b in fused)


def _trace():
    ms = 1_000_000
    events = [TraceEvent("preg0", "task", 0, 0, ms),
              TraceEvent("F0s0", "task", 0, ms, 2 * ms),
              TraceEvent("send", "message", 0, 2 * ms, 3 * ms, {"dst": 1, "tag": 0}),
              TraceEvent("F1s0+B0s0", "task", 0, 3 * ms, 6 * ms)]
    other = [TraceEvent("recv", "message", 1, 2 * ms, 3 * ms, {"src": 0, "tag": 0}),
             TraceEvent("F0s1", "task", 1, 3 * ms, 4 * ms),
             TraceEvent("B0s1", "task", 1, 4 * ms, 6 * ms)]
    return chrome_trace([events, other])


def test_trace_chart_has_a_cell_per_task_part():
    chart = trace_chart(_trace())
    assert chart.rows == ("rank 0: group 0", "rank 1: group 1") and chart.unit == "time (ms)"
    tasks = sorted((c.row, c.kind, c.text, c.start, c.end) for c in chart.tasks())
    assert tasks == [(0, "B", "0", 4.0, 6.0), (0, "F", "0", 1.0, 2.0), (0, "F", "1", 3.0, 4.0),
                     (1, "B", "0", 4.0, 6.0), (1, "F", "0", 3.0, 4.0)]
    kinds = Counter(c.kind for c in chart.cells)
    assert kinds == {"F": 3, "B": 2, "message": 2, "other": 1}
    with pytest.raises(ValueError, match="lacks a name, ts"):
        trace_chart({"traceEvents": [{"ph": "X", "name": "F0s0"}]})


def test_png_from_schedule_and_from_trace(tmp_path):
    analysis = analyze_schedule(DualPipeV(4, 2), 4)
    draw_png(schedule_chart(analysis, title="planned"), str(tmp_path / "planned.png"))
    draw_png(trace_chart(_trace(), title="measured"), str(tmp_path / "measured.png"))
    assert _is_png(tmp_path / "planned.png") and _is_png(tmp_path / "measured.png")


def test_cli_png_and_from_trace(tmp_path, capsys):
    out = tmp_path / "s.png"
    assert main(["Std1F1B", "--stages", "2", "--microbatches", "3", "--png", str(out)]) == 0
    assert f"wrote {out} (12 tasks on 2 rows)" in capsys.readouterr().out and _is_png(out)
    trace_file = tmp_path / "t.json"
    trace_file.write_text(__import__("json").dumps(_trace()))
    measured = tmp_path / "m.png"
    assert main(["--from-trace", str(trace_file), "--png", str(measured)]) == 0
    text = capsys.readouterr().out
    assert "5 tasks on 2 tracks, 6.000 ms" in text and _is_png(measured)
    assert main(["--from-trace", str(trace_file)]) == 2
    assert "give --png OUT" in capsys.readouterr().err
    assert main(["Std1F1B", "--from-trace", str(trace_file), "--png", str(measured)]) == 2
    trace_file.write_text("{}")
    assert main(["--from-trace", str(trace_file), "--png", str(measured)]) == 2
    assert "no 'traceEvents' list" in capsys.readouterr().err


def test_missing_matplotlib_is_a_clear_error(tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "matplotlib"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    out = tmp_path / "s.png"
    assert main(["GPipe", "--stages", "2", "--microbatches", "2", "--png", str(out)]) == 2
    err = capsys.readouterr().err
    assert "needs matplotlib" in err and "pip install 'jaxpp_mpi[plot]'" in err
    assert not out.exists()
