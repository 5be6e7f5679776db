"""Timelines of pipeline steps as Chrome-trace JSON (Perfetto, chrome://tracing).

Note: trace format.
  `export` writes the JSON Object Format of the Trace Event Format:
  `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`. Each process
  track is an MPI rank of the job (`pid` = rank; local mode: one process, `pid` 0) and
  each thread track an MPMD group (`tid` = group), named by `process_name` /
  `thread_name` metadata events (`"ph": "M"`). With pipeline replicas (Note: Pipeline
  replicas in comms.py) every rank of every replica has its track: `pid` is the job
  rank, replica x P + group, the process is named "rank N (replica r)", each slice's
  args carry `replica`, and `otherData.replicas` says R. Every `TraceEvent` (see
  `Note: trace events`) becomes one complete event (`"ph": "X"`): a timed Run has
  `cat` 'task', its task label as `name` and, from `schedules.tasks.parse_label` (see
  `Note: task labels`), args `kind` ('F', 'B', 'I', 'W'; fused tasks join kinds with
  '+', as 'F+B'; code outside the microbatch loop is 'pre' or 'post'), `microbatch` and
  `stage` (lists for a fused task, absent outside the loop); a message instruction has
  `cat` 'message', its kind ('send', 'recv', 'sendrecv', 'transfer', 'allreduce') as
  `name`, and its peer(s), tag(s), buffer(s) and bytes as args (an all-reduce across
  replicas: its buffers, op, bytes and replicas). `ts` and `dur` are microseconds from
  the earliest event; `otherData.start_unix_ns` is that event's wall-clock time.
  An event of another thread than the group's dispatching one (its `track`: the
  threads of staged messages) sits on a track of its own, `tid` = group + 65536 x
  (1 + the track's index among the trace's track names, sorted), named "group G
  <track> thread" and sorted after the groups; its args still say the `group`.
  `otherData.message_overlap` lists, per process and group, the recorded message
  time and the share of it hidden behind tasks (`timing.message_overlap`; record one
  step to read it per step): `{"pid", "group", "message_ms", "hidden_ms",
  "hidden_share"}`.

Note: trace clocks.
  Events carry `time.time_ns()` readings. Ranks on one host read the same clock, so
  their times are compared as they are. The clock of a rank on another host than rank 0
  is put on rank 0's by ping-pong with rank 0 (`collectives.clock_offsets_ns`: the shortest
  of 8 round trips, error at most half of it, microseconds on a cluster network), not
  left to NTP, which can be milliseconds off: a pipeline's tasks are often shorter.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from jaxpp_mpi._src.schedules.tasks import parse_label
from jaxpp_mpi._src.timeline.timing import TraceEvent, message_overlap, record_trace_events

__all__ = ["chrome_trace", "decode_events", "encode_events", "load", "record", "write_trace"]


def record() -> contextlib.AbstractContextManager[list[TraceEvent]]:
    """Context manager: records this process's `TraceEvent`s of the steps run inside.

    The same as `jaxpp_mpi._src.timeline.timing.record_trace_events` (see `Note: trace events`):
    steps inside run timed, one instruction at a time, so record one step after a
    warm-up one, then `export` the list.

    Example:
      with jaxpp_mpi.trace.record() as events:
          state = step(*state, batch)
      jaxpp_mpi.trace.export("step.json", events, mesh)

    Returns:
      A context manager yielding the list the executors append events to.
    """
    return record_trace_events()


def _task_args(label: str) -> dict[str, Any]:
    parts = parse_label(label)
    args: dict[str, Any] = {"kind": "+".join(p.kind for p in parts)}
    if all(p.microbatch is not None for p in parts):
        one = len(parts) == 1
        args["microbatch"] = parts[0].microbatch if one else [p.microbatch for p in parts]
        args["stage"] = parts[0].stage if one else [p.stage for p in parts]
    return args


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__index__"):
        return int(value)
    return str(value)


_TRACK_STRIDE = 1 << 16  # tids of a thread's track: group + stride x (1 + track index)


def _events_of(per_process: Sequence[Sequence[TraceEvent]]) -> Iterator[tuple[int, TraceEvent]]:
    for pid, events in enumerate(per_process):
        for e in events:
            yield pid, e


def chrome_trace(
    per_process: Sequence[Sequence[TraceEvent]],
    *,
    offsets_ns: Sequence[int] | None = None,
    local: bool = False,
    other_data: Mapping[str, Any] | None = None,
    replicas: int = 1,
) -> dict[str, Any]:
    """Builds a Chrome trace (see `Note: trace format`) from each process's events.

    Args:
      per_process: the events of rank 0, 1, ... of the job (local mode: one list, all
        groups).
      offsets_ns: per process, ns added to its times to put them on one clock
        (see `Note: trace clocks`); zeros if None.
      local: name the one process 'local' instead of 'rank 0'.
      other_data: extra entries for the trace's `otherData` (e.g. the schedule).
      replicas: pipeline replicas in the job: rank N is replica N // P, P =
        len(per_process) // replicas.

    Returns:
      The trace as a JSON-ready dict.

    Raises:
      ValueError: if `offsets_ns` does not have one entry per process, or `replicas`
        does not divide the processes.
    """
    offsets = list(offsets_ns) if offsets_ns is not None else [0] * len(per_process)
    if len(offsets) != len(per_process):
        raise ValueError(f"{len(offsets)} clock offsets for {len(per_process)} processes")
    if replicas < 1 or len(per_process) % replicas or (local and replicas > 1):
        raise ValueError(f"{replicas} replicas do not divide {len(per_process)} "
                         f"{'local ' if local else ''}processes")
    per_replica = max(1, len(per_process) // replicas)
    timed = [(pid, e, e.start_ns + offsets[pid]) for pid, e in _events_of(per_process)]
    tracks = sorted({e.track for _, e in _events_of(per_process) if e.track})

    def tid_of(e: TraceEvent) -> int:
        return e.group + (_TRACK_STRIDE * (1 + tracks.index(e.track)) if e.track else 0)
    origin = min((start for _, _, start in timed), default=0)
    meta: list[dict[str, Any]] = []
    for pid, events in enumerate(per_process):
        pname = "local" if local else f"rank {pid}"
        if replicas > 1:
            pname += f" (replica {pid // per_replica})"
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"name": pname}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"sort_index": pid}})
        for group in sorted({e.group for e in events}):
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": group,
                         "args": {"name": f"group {group}"}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": group,
                         "args": {"sort_index": group}})
        for group, track in sorted({(e.group, e.track) for e in events if e.track}):
            tid = tid_of(TraceEvent("", "", group, 0, 0, track=track))
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"name": f"group {group} {track} thread"}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"sort_index": tid}})
    slices = []
    for pid, e, start in sorted(timed, key=lambda t: (t[2], t[0], t[1].group)):
        args = {"group": e.group, **{k: _jsonable(v) for k, v in e.args.items()}}
        if replicas > 1:
            args["replica"] = pid // per_replica
        if e.cat == "task":
            args.update(_task_args(e.name))
        slices.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": pid, "tid": tid_of(e),
                       "ts": (start - origin) / 1e3, "dur": (e.end_ns - e.start_ns) / 1e3,
                       "args": args})
    data = {"start_unix_ns": origin, "clock_offsets_ns": offsets,
            "processes": len(per_process), "mode": "local" if local else "mpi",
            "replicas": replicas,
            "message_overlap": [{"pid": pid, "group": group, **summary}
                                for pid, events in enumerate(per_process)
                                for group, summary in message_overlap(events).items()]}
    data.update(other_data or {})
    return {"traceEvents": meta + slices, "displayTimeUnit": "ms", "otherData": data}


def write_trace(path: str | os.PathLike, trace: Mapping[str, Any]) -> None:
    """Writes `trace` to `path` atomically (a temporary file, then a rename)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(trace, f, separators=(",", ":"))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def encode_events(events: Sequence[TraceEvent]) -> bytes:
    """`events` as JSON bytes (no pickle), for gathering across ranks."""
    rows = [[e.name, e.cat, e.group, e.start_ns, e.end_ns,
             {k: _jsonable(v) for k, v in e.args.items()}] + ([e.track] if e.track else [])
            for e in events]
    return json.dumps(rows).encode()


def decode_events(data: bytes) -> list[TraceEvent]:
    """The events `encode_events` wrote (JSON data only)."""
    return [TraceEvent(str(n), str(c), int(g), int(s), int(t), dict(a),
                       str(track[0]) if track else "")
            for n, c, g, s, t, a, *track in json.loads(data)]


def load(path: str | os.PathLike) -> dict[str, Any]:
    """Reads a Chrome trace written by `export` (parsed as JSON data only).

    Raises:
      ValueError: if the file is not a JSON object with a `traceEvents` list.
    """
    with open(path) as f:
        try:
            trace = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON: {e}") from e
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path} is not a Chrome trace: no 'traceEvents' list at the top")
    return trace
