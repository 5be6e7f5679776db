"""The task model: task kinds, tasks, their labels and default latencies (no JAX, no MPI).

Note: task labels.
  Every task has one text form, its label: kind letter, microbatch, ``s``, stage, so
  ``F3s1`` is the forward of microbatch 3 at stage 1 and ``I0s2`` the input-gradient half
  of stage 2's backward of microbatch 0. A fused task joins its parts with ``+``
  (``F4s1+B1s1``). Code outside the microbatch loop runs as segments labelled
  ``pre<level>g<group>`` or ``post<level>g<group>`` (level may be empty: ``preg0``).
  Program `Run` instructions, watchdog reports, traces, Gantt charts and the simulator
  all write and read labels through `task_label` and `parse_label` here. CSV schedules
  (`schedules/custom.py`) write the same form and may leave out ``s<stage>`` when a row
  holds one stage, its own; they build their cells on `KIND_LETTERS` and `TaskType`.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DEFAULT_LATENCIES",
    "KIND_LETTERS",
    "KIND_NAMES",
    "ScheduleEntry",
    "ScheduleTasks",
    "Task",
    "TaskPart",
    "TaskType",
    "describe_label",
    "entry_tasks",
    "kind_latencies",
    "label_latency",
    "parse_label",
    "task_label",
]


class TaskType(enum.Enum):
    """Kind of a pipeline task; the value is its one-letter code in labels and CSV cells."""

    FWD = "F"
    BWD = "B"
    BWD_I = "I"  # gradient w.r.t. the stage input (activation gradient)
    BWD_W = "W"  # gradient w.r.t. the stage weights

    def __repr__(self) -> str:
        return f"TaskType.{self.name}"


# The kind letters, in TaskType order: "FBIW".
KIND_LETTERS = "".join(kind.value for kind in TaskType)

# Human words for each kind letter (watchdog reports, trace arguments).
KIND_NAMES: Mapping[str, str] = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input grads)",
    "W": "backward (weight grads)",
}

# Relative task costs used when nothing was measured (schedule analysis, program makespans).
DEFAULT_LATENCIES: Mapping[TaskType, float] = {
    TaskType.FWD: 1.0,
    TaskType.BWD: 2.0,
    TaskType.BWD_I: 1.0,
    TaskType.BWD_W: 1.0,
}


@dataclass(frozen=True)
class Task:
    """One unit of pipeline work: run ``type`` of stage ``stage_id`` on ``microbatch``.

    Attributes:
      stage_id: Pipeline stage, ``0 <= stage_id < num_stages``.
      microbatch: 0-based microbatch index.
      type: Forward, full backward, or one half of a split backward.
    """

    stage_id: int
    microbatch: int
    type: TaskType

    def __str__(self) -> str:
        return task_label(self)


# A schedule entry is one task or a fused task: a tuple of tasks run back to back.
ScheduleEntry = Task | tuple[Task, ...]
# One ordered entry list per MPMD index.
ScheduleTasks = list[list[ScheduleEntry]]


def entry_tasks(entry: ScheduleEntry) -> tuple[Task, ...]:
    """Returns the tasks of a schedule entry (one task, or the parts of a fused task)."""
    return entry if isinstance(entry, tuple) else (entry,)


def task_label(entry: ScheduleEntry) -> str:
    """Returns the label of a task or fused task (`Note: task labels`), e.g. ``F4s1+B1s1``."""
    return "+".join(
        f"{t.type.value}{t.microbatch}s{t.stage_id}" for t in entry_tasks(entry)
    )


@dataclass(frozen=True)
class TaskPart:
    """One part of a parsed label (`Note: task labels`).

    ``F3s1`` is ``TaskPart('F', 3, 1)``; ``preg0`` is ``TaskPart('pre', None, None)``
    (code outside the microbatch loop).

    Attributes:
      kind: Kind letter, ``'pre'``/``'post'`` for a segment, else the text's leading letters.
      microbatch: Microbatch index, or None outside the microbatch loop.
      stage: Stage index, or None outside the microbatch loop.
    """

    kind: str
    microbatch: int | None
    stage: int | None


_PART = re.compile(rf"([{KIND_LETTERS}])(\d+)s(\d+)")
_SEGMENT = re.compile(r"(pre|post)\d*g\d+")
_NOT_LETTER = re.compile(r"[^A-Za-z].*")


def parse_label(label: str) -> tuple[TaskPart, ...]:
    """Returns the parts of a label (`Note: task labels`), fused parts in order.

    A segment label (``preg0``, ``post1g0``) is kind ``pre`` or ``post``; any other text
    keeps its leading letters as its kind (``''`` -> ``'other'``).

    Args:
      label: A `Run` instruction's task label.

    Returns:
      One `TaskPart` per ``+``-separated part.
    """
    parts = []
    for text in label.split("+"):
        task = _PART.fullmatch(text)
        segment = _SEGMENT.fullmatch(text)
        if task:
            parts.append(TaskPart(task[1], int(task[2]), int(task[3])))
        elif segment:
            parts.append(TaskPart(segment[1], None, None))
        else:
            parts.append(TaskPart(_NOT_LETTER.sub("", text) or "other", None, None))
    return tuple(parts)


def describe_label(label: str) -> str:
    """Returns a label in words, for watchdog and error reports.

    Args:
      label: A task label, e.g. ``B3s1``; segments and other text are kept as they are.

    Returns:
      E.g. ``task B3s1 (backward, microbatch 3, stage 1)``; ``task preg0`` for a segment.
    """
    words = [
        f"{KIND_NAMES[p.kind]}, microbatch {p.microbatch}, stage {p.stage}"
        for p in parse_label(label)
        if p.microbatch is not None
    ]
    return f"task {label} ({'; '.join(words)})" if words else f"task {label}"


def kind_latencies(latencies: Mapping[TaskType, float] | None = None) -> dict[str, float]:
    """Returns task latencies keyed by kind letter: `DEFAULT_LATENCIES` updated by ``latencies``.

    Args:
      latencies: Latencies that replace the defaults of their kinds, or None.

    Returns:
      A dict from kind letter (``'F'``, ``'B'``, ``'I'``, ``'W'``) to latency.
    """
    merged = {**DEFAULT_LATENCIES, **(latencies or {})}
    return {kind.value: float(value) for kind, value in merged.items()}


def label_latency(label: str) -> float:
    """Returns the default latency of a labelled task: the sum over its parts, 0 for ``''``.

    Args:
      label: A task label (`Note: task labels`), fused or not, or ``''``.

    Returns:
      The sum of the parts' `DEFAULT_LATENCIES`.

    Raises:
      ValueError: if a part is not a pipeline task (a segment has no default latency).
    """
    if not label:
        return 0.0
    latency = kind_latencies()
    total = 0.0
    for part in parse_label(label):
        if part.kind not in latency or part.microbatch is None:
            raise ValueError(f"no default latency for task {label!r}")
        total += latency[part.kind]
    return total
