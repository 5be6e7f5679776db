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
  `jaxpp_mpi.trace` turns these into Chrome-trace JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

__all__ = [
    "TaskTimes",
    "TraceEvent",
    "active_task_times",
    "collect_task_times_ms",
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
    """

    name: str
    cat: str
    group: int
    start_ns: int
    end_ns: int
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


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
