"""Task labels, kinds and default latencies: the one home of the label format."""

import pytest

from jaxpp_mpi._src.runtime.failure import describe_task
from jaxpp_mpi._src.schedules.custom import format_entry, parse_cell
from jaxpp_mpi._src.schedules.tasks import (
    KIND_LETTERS,
    KIND_NAMES,
    Task,
    TaskPart,
    TaskType,
    describe_label,
    kind_latencies,
    label_latency,
    parse_label,
    task_label,
)

F, B, I, W = TaskType.FWD, TaskType.BWD, TaskType.BWD_I, TaskType.BWD_W  # noqa: E741


def test_kinds_are_defined_once():
    assert KIND_LETTERS == "FBIW" and set(KIND_NAMES) == set(KIND_LETTERS)
    assert kind_latencies() == {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    assert kind_latencies({B: 3}) == {"F": 1.0, "B": 3.0, "I": 1.0, "W": 1.0}


@pytest.mark.parametrize(
    "entry,label",
    [
        (Task(1, 3, F), "F3s1"),
        (Task(2, 0, I), "I0s2"),
        ((Task(1, 4, F), Task(1, 1, B)), "F4s1+B1s1"),
    ],
)
def test_label_round_trip(entry, label):
    assert task_label(entry) == str(entry if isinstance(entry, Task) else label) == label
    tasks = entry if isinstance(entry, tuple) else (entry,)
    assert parse_label(label) == tuple(
        TaskPart(t.type.value, t.microbatch, t.stage_id) for t in tasks
    )
    assert format_entry(entry) == label and parse_cell(label, row=0) == entry


def test_describe_and_latency():
    assert describe_label("B3s1") == "task B3s1 (backward, microbatch 3, stage 1)"
    assert describe_label("I0s2+W0s2") == (
        "task I0s2+W0s2 (backward (input grads), microbatch 0, stage 2; "
        "backward (weight grads), microbatch 0, stage 2)"
    )
    assert describe_label("preg0") == "task preg0"
    assert describe_task is describe_label
    assert label_latency("") == 0 and label_latency("F4s1+B1s1") == 3
    for bad in ("preg0", "Q1s1", "F1"):
        with pytest.raises(ValueError, match="no default latency"):
            label_latency(bad)
