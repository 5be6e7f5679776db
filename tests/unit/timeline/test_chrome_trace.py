"""Chrome traces from trace events: labels, tracks, times, args, the file (no JAX, no MPI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trace_schema import SCHEMA, check_chrome_trace, schema_errors, task_counts

from jaxpp_mpi.trace import TaskPart, TraceEvent, chrome_trace, export, load, parse_label

MS = 1_000_000  # ns


def _rank_events(rank: int, t0: int) -> list[TraceEvent]:
    """A 2-microbatch step's events on one rank: tasks, a send and a fused task."""
    return [
        TraceEvent(f"preg{rank}", "task", rank, t0, t0 + MS),
        TraceEvent(f"F0s{rank}", "task", rank, t0 + MS, t0 + 3 * MS),
        TraceEvent("send", "message", rank, t0 + 3 * MS, t0 + 4 * MS,
                   {"dst": 1 - rank, "tag": 7, "buf": 12, "bytes": 256}),
        TraceEvent(f"F1s{rank}+B0s{rank}", "task", rank, t0 + 4 * MS, t0 + 7 * MS),
    ]


def test_parse_label():
    assert parse_label("F3s1") == (TaskPart("F", 3, 1),)
    assert parse_label("F3s1+B1s1") == (TaskPart("F", 3, 1), TaskPart("B", 1, 1))
    assert parse_label("I0s2+W5s2")[1] == TaskPart("W", 5, 2)
    assert parse_label("preg0") == (TaskPart("pre", None, None),)
    assert parse_label("post1g3") == (TaskPart("post", None, None),)
    assert parse_label("") == (TaskPart("other", None, None),)


def test_mpi_trace_has_one_track_per_rank_and_every_event():
    t0 = 1_700_000_000 * 10**9
    per_rank = [_rank_events(0, t0), _rank_events(1, t0 + 2 * MS)]
    trace = chrome_trace(per_rank, offsets_ns=[0, -MS], other_data={"schedule": "1f1b"})
    names = check_chrome_trace(trace)
    assert names == {(0, 0): "group 0", (1, 1): "group 1"}
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    assert sum(task_counts(trace).values()) == 6 and max(task_counts(trace).values()) == 1
    slices = {(e["pid"], e["name"]): e for e in trace["traceEvents"] if e["ph"] == "X"}
    # Rank 1 started 2 ms later on a clock 1 ms ahead: 1 ms after rank 0 on rank 0's.
    assert slices[0, "preg0"]["ts"] == 0 and slices[1, "preg1"]["ts"] == 1000
    assert slices[0, "F0s0"]["dur"] == 2000
    assert slices[0, "F0s0"]["args"] == {"group": 0, "kind": "F", "microbatch": 0, "stage": 0}
    fused = slices[1, "F1s1+B0s1"]["args"]
    assert fused == {"group": 1, "kind": "F+B", "microbatch": [1, 0], "stage": [1, 1]}
    send = slices[0, "send"]
    assert send["cat"] == "message"
    assert send["args"] == {"group": 0, "dst": 1, "tag": 7, "buf": 12, "bytes": 256}
    assert slices[0, "preg0"]["args"]["kind"] == "pre"
    assert trace["otherData"]["start_unix_ns"] == t0
    assert trace["otherData"]["schedule"] == "1f1b"
    assert trace["displayTimeUnit"] == "ms"


def test_local_trace_is_one_process_with_a_track_per_group():
    events = _rank_events(0, 0) + _rank_events(1, MS)
    trace = chrome_trace([events], local=True)
    assert check_chrome_trace(trace) == {(0, 0): "group 0", (0, 1): "group 1"}
    assert [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"] \
        == ["local"]
    assert trace["otherData"]["mode"] == "local"


def test_slices_are_sorted_by_time_and_offsets_are_checked():
    trace = chrome_trace([_rank_events(0, 5 * MS), _rank_events(1, 0)])
    ts = [e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert ts == sorted(ts) and ts[0] == 0
    with pytest.raises(ValueError, match="2 clock offsets for 1 processes"):
        chrome_trace([_rank_events(0, 0)], offsets_ns=[0, 0])


def test_schema_rejects_broken_traces():
    good = chrome_trace([_rank_events(0, 0)])
    assert schema_errors(good, SCHEMA) == []
    bad = json.loads(json.dumps(good))
    bad["traceEvents"][-1]["dur"] = -1.0
    del bad["traceEvents"][-2]["ts"]
    bad["traceEvents"][0]["ph"] = "B"
    errors = "\n".join(schema_errors(bad, SCHEMA))
    assert "matches 0 of the oneOf" in errors and errors.count("\n") == 2
    assert schema_errors({"displayTimeUnit": "ms"}, SCHEMA) == ["$: missing 'traceEvents'"]


class _LocalMesh:
    is_local = True


def test_export_and_load_local(tmp_path):
    path = tmp_path / "sub" / "trace.json"
    trace = export(path, _rank_events(0, 0), _LocalMesh(), other_data={"step": 1})
    assert load(path) == trace
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]  # no temporary left
    check_chrome_trace(load(path))
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="no 'traceEvents' list"):
        load(tmp_path / "bad.json")
    (tmp_path / "worse.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        load(tmp_path / "worse.json")


def test_trace_module_imports_neither_jax_nor_mpi():
    code = ("import sys, jaxpp_mpi.trace; "
            "sys.exit(1 if {'jax', 'mpi4py'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
