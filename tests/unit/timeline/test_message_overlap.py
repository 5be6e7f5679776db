"""`message_overlap` and the thread tracks of Chrome traces, on hand-made events (no
JAX, no MPI): message time counts once however many tracks work at once, and the
hidden share is the part of it during which a task of the same group runs."""

from __future__ import annotations

import pytest

from jaxpp_mpi._src.timeline.chrome import chrome_trace, decode_events, encode_events
from jaxpp_mpi._src.timeline.timing import TraceEvent, message_overlap

MS = 1_000_000  # ns


def task(group: int, start: float, end: float, name: str = "F0s0") -> TraceEvent:
    return TraceEvent(name, "task", group, int(start * MS), int(end * MS))


def message(group: int, start: float, end: float, name: str = "MPI send",
            track: str = "sender") -> TraceEvent:
    return TraceEvent(name, "message", group, int(start * MS), int(end * MS), {}, track)


def test_no_messages():
    assert message_overlap([task(0, 0, 2)]) == {
        0: {"message_ms": 0.0, "hidden_ms": 0.0, "hidden_share": 0.0}}
    assert message_overlap([]) == {}


def test_a_message_between_tasks_is_not_hidden():
    # blocking messages on the dispatching thread: between the tasks
    out = message_overlap([task(0, 0, 2), message(0, 2, 3, "recv", ""), task(0, 3, 5)])
    assert out[0] == pytest.approx({"message_ms": 1.0, "hidden_ms": 0.0, "hidden_share": 0.0})


def test_staged_work_behind_a_task_is_hidden():
    events = [
        task(0, 0, 4),
        message(0, 1, 2, "copy to host"),  # wholly behind the task
        message(0, 1.5, 5, "MPI send"),  # overlaps the copy (counted once): 2.5 hidden
        message(0, 3, 6, "MPI recv", "receiver"),  # 1 of it behind the task
        message(0, 7, 8, "copy to device", "receiver"),  # after every task
        task(0, 7.5, 9),  # 0.5 of the copy to device behind it
    ]
    out = message_overlap(events)[0]
    # message time: [1, 6] and [7, 8] = 6 ms; hidden: [1, 4] and [7.5, 8] = 3.5 ms
    assert out == pytest.approx({"message_ms": 6.0, "hidden_ms": 3.5,
                                 "hidden_share": 3.5 / 6.0})


def test_groups_are_summed_apart():
    events = [task(0, 0, 10), message(1, 2, 4), task(1, 5, 6), message(0, 2, 4)]
    out = message_overlap(events)
    assert out[0]["hidden_share"] == 1.0 and out[1]["hidden_share"] == 0.0
    assert out[0]["message_ms"] == out[1]["message_ms"] == pytest.approx(2.0)


def test_thread_tracks_in_a_chrome_trace():
    events = [task(1, 0, 4, "F0s1"), message(1, 1, 2, "copy to host"),
              message(1, 2, 3, "MPI recv", "receiver"), message(1, 4, 5, "send", "")]
    trace = chrome_trace([[], events])
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "thread_name"}
    # tracks sorted by name: receiver first, then sender
    assert names == {(1, 1): "group 1", (1, 1 + 65536): "group 1 receiver thread",
                     (1, 1 + 2 * 65536): "group 1 sender thread"}
    slices = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert slices["copy to host"]["tid"] == 1 + 2 * 65536
    assert slices["copy to host"]["args"] == {"group": 1}
    assert slices["MPI recv"]["tid"] == 1 + 65536 and slices["send"]["tid"] == 1
    assert trace["otherData"]["message_overlap"] == [
        {"pid": 1, "group": 1, "message_ms": 3.0, "hidden_ms": 2.0,
         "hidden_share": pytest.approx(2 / 3)}]


def test_tracks_survive_the_gather_encoding():
    events = [task(0, 0, 1), message(0, 0, 1, "MPI send"), message(0, 1, 2, "send", "")]
    assert decode_events(encode_events(events)) == events
