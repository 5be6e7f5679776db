"""Per-task wall times: `collect_task_times_ms`, as in JaxPP.

Note: task timing.
  While a `collect_task_times_ms()` block is active, the executors time every Run whose
  task label is not empty: they wait for its inputs, dispatch it, wait for its outputs
  (`block_until_ready`) and append the elapsed wall time in milliseconds to the list of
  its label ('F3s1', 'B0s2', fused labels such as 'F3s1+B1s1' as one entry). This
  serialises the step, so timed steps run slower than untimed ones. Outside such a block
  nothing blocks: an executor looks at `active_task_times()` once per step.

Note: trace events.
  Inside a `record_trace_events()` block the executors run their timed steps (as for task
  timing, and the task times are collected too) and also append one `TraceEvent` per
  timed Run and per message instruction (Send, Recv, SendRecv, local transfers, and
  the AllReduce across pipeline replicas) to the block's list: its wall-clock start and
  end (`time.time_ns()`, comparable between processes of one host and, up to clock
  sync, between hosts) and what it was. A message event spans the whole blocking call,
  waiting for the peer included: that is where a pipeline's bubbles show.
  Staged messages (`Note: staged messages` in mpi/staged.py) also leave the work of
  their threads, each on its thread's own `track` ('sender', 'receiver'): per message
  'copy to host' (from the Send until the host copy is taken), 'MPI send' (posted until
  seen complete), 'MPI recv' (posted until complete, the wait for the sender included)
  and 'copy to device' (until the array is on its devices); the dispatching thread's
  own 'send' only queues the message, its 'recv' waits for the receiver. A recorded
  step returns once its sends have completed, so its events are all in the list.
  `message_overlap` sums a step's message work and the share of it hidden behind
  tasks. `jaxpp_mpi.trace` turns these into Chrome-trace JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = [
    "TaskTimes",
    "TraceEvent",
    "active_task_times",
    "collect_task_times_ms",
    "message_overlap",
    "record_trace_events",
]


class TaskTimes(dict[str, list[float]]):
    """Task label -> wall times in ms; `events` is the trace-event list of an enclosing
    `record_trace_events` block, or None (see `Note: trace events`)."""

    events: list[TraceEvent] | None = None


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One timed instruction of one step (see `Note: trace events`).

    Attributes:
      name: the task label ('F3s1', 'B0s2', fused 'F3s1+B1s1') or the message kind
        ('send', 'recv', 'sendrecv', 'transfer', 'allreduce').
      cat: 'task' or 'message'.
      group: the MPMD index that ran it.
      start_ns, end_ns: wall clock (`time.time_ns()`) around the blocking call.
      args: what it was: for messages the peer(s), tag(s), buffer id(s) and bytes; for
        an all-reduce its buffers, op, bytes and replicas.
      track: '' for the group's dispatching thread; the thread that did the work
        otherwise ('sender', 'receiver': staged messages, with names such as 'copy to
        host' and 'MPI send').
    """

    name: str
    cat: str
    group: int
    start_ns: int
    end_ns: int
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    track: str = ""


def _union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint spans covering the same time as `spans`."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def _overlap_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """The time two sorted, disjoint span lists share."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def message_overlap(events: Iterable[TraceEvent]) -> dict[int, dict[str, float]]:
    """Per group, its message time and the share of it hidden behind computation.

    Message time is the time during which some 'message' event of the group runs, on
    any of its tracks (overlapping messages count once); the hidden part is the part
    during which one of the group's 'task' events runs too. Pass the events of one
    step (`record_trace_events` around one step) to get that step's summary.

    Args:
      events: trace events (see `Note: trace events`).

    Returns:
      {group: {"message_ms": ..., "hidden_ms": ..., "hidden_share": hidden / message
      (0 without messages)}} for each group with events.
    """
    spans: dict[int, dict[str, list[tuple[int, int]]]] = {}
    for e in events:
        kinds = spans.setdefault(e.group, {"task": [], "message": []})
        if e.cat in kinds:
            kinds[e.cat].append((e.start_ns, e.end_ns))
    out = {}
    for group, kinds in sorted(spans.items()):
        message = _union(kinds["message"])
        total = sum(end - start for start, end in message)
        hidden = _overlap_ns(message, _union(kinds["task"]))
        out[group] = {"message_ms": total / 1e6, "hidden_ms": hidden / 1e6,
                      "hidden_share": hidden / total if total else 0.0}
    return out


_active: list[TaskTimes] = []  # innermost enabled block last


def active_task_times() -> TaskTimes | None:
    """The dict of the innermost enabled `collect_task_times_ms` block, or None."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def collect_task_times_ms(enabled: bool = True) -> Iterator[TaskTimes | None]:
    """Context manager collecting per-task execution times in milliseconds.

    See `Note: task timing`. Blocks nest; times go to the innermost enabled one.

    Example:
      with collect_task_times_ms() as stats:
          step(state, batch)
      for task, times in stats.items():
          print(task, times)

    Args:
      enabled: when False, nothing is collected and the block yields None.

    Yields:
      A dict from task label to the list of its wall times in ms (filled as steps run),
      or None when `enabled` is False.
    """
    if not enabled:
        yield None
        return
    times = TaskTimes()
    _active.append(times)
    try:
        yield times
    finally:
        del _active[next(i for i, t in enumerate(_active) if t is times)]


@contextlib.contextmanager
def record_trace_events() -> Iterator[list[TraceEvent]]:
    """Context manager recording a `TraceEvent` per timed instruction on this process.

    See `Note: trace events`. Task times are collected too (into a block of their own,
    which `collect_task_times_ms` blocks outside this one do not see).

    Yields:
      The list the executors append events to, in the order they happen.
    """
    events: list[TraceEvent] = []
    times = TaskTimes()
    times.events = events
    _active.append(times)
    try:
        yield events
    finally:
        del _active[next(i for i, t in enumerate(_active) if t is times)]
