"""CustomSchedule and CSV: round trips, cell syntax, and errors naming the cell."""

import pytest

from jaxpp_mpi._src.schedules.custom import MAX_CSV_CELLS, format_entry, parse_cell
from jaxpp_mpi.schedules import (
    CustomSchedule,
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    KimiK2,
    ScheduleError,
    Std1F1B,
    Task,
    TaskType,
    ZeroBubble,
    analyze_schedule,
    schedule_to_csv,
)

F, B, I, W = TaskType.FWD, TaskType.BWD, TaskType.BWD_I, TaskType.BWD_W  # noqa: E741

ROUND_TRIPS = [
    (GPipe(3), 4),
    (Std1F1B(4), 8),
    (Std1F1B(1), 1),
    (Eager1F1B(3), 2),
    (ZeroBubble(3), 5),
    (Interleaved1F1B(8, 4), 8),
    (Interleaved1F1B(4, 2, fuse_steady_state=True), 4),
    (KimiK2(6, 3), 6),
    (DualPipeV(4, 2), 4),
    (DualPipeV(2, 1), 3),
]


def write(tmp_path, text, name="s.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("schedule,n", ROUND_TRIPS, ids=repr)
def test_round_trip(tmp_path, schedule, n):
    path = tmp_path / "s.csv"
    schedule_to_csv(schedule, n, path)
    custom = CustomSchedule.from_csv(path)
    assert custom.tasks(n) == schedule.tasks(n)
    assert (custom.num_stages, custom.mpmd_dim, custom.num_microbatches) == (
        schedule.num_stages,
        schedule.mpmd_dim,
        n,
    )
    assert custom.is_partial_bwd == schedule.is_partial_bwd
    stages = range(schedule.num_stages)
    assert [custom.get_mpmd_idx(s) for s in stages] == [schedule.get_mpmd_idx(s) for s in stages]
    assert analyze_schedule(custom, n) == analyze_schedule(schedule, n)
    again = CustomSchedule.from_csv(path)
    assert again == custom and hash(again) == hash(custom) and repr(again) == repr(custom)


def test_cell_format():
    assert format_entry(Task(5, 3, F)) == "F3s5"
    assert format_entry(Task(5, 3, F), with_stage=False) == "F3"
    assert format_entry((Task(0, 4, F), Task(2, 1, B))) == "F4s0+B1s2"
    assert parse_cell("F3s5", row=1) == Task(5, 3, F)
    assert parse_cell(" I3 ", row=2) == Task(2, 3, I)
    assert parse_cell("F4+B1s2", row=0) == (Task(0, 4, F), Task(2, 1, B))
    assert parse_cell("W12", row=0) == Task(0, 12, W)


def test_written_text(tmp_path):
    path = tmp_path / "s.csv"
    schedule_to_csv(Std1F1B(2), 2, path)
    assert path.read_text().splitlines() == ["F0,F1,B0,B1", "F0,B0,F1,B1"]
    schedule_to_csv(Interleaved1F1B(4, 2), 2, path)
    assert path.read_text().splitlines()[0].startswith("F0s0,F1s0,F0s2")


def test_repr_is_deterministic_and_short():
    a = CustomSchedule.from_tasks(Std1F1B(2).tasks(2))
    assert repr(a).startswith("CustomSchedule(num_stages=2, mpmd_dim=2, num_microbatches=2, ")
    assert repr(a) == repr(CustomSchedule.from_tasks(Std1F1B(2).tasks(2)))
    assert repr(a) != repr(CustomSchedule.from_tasks(GPipe(2).tasks(2)))


def test_tasks_rejects_another_microbatch_count(tmp_path):
    path = tmp_path / "s.csv"
    schedule_to_csv(Std1F1B(2), 4, path)
    custom = CustomSchedule.from_csv(path)
    with pytest.raises(ValueError, match=r"written for 4 microbatches, got num_microbatches=8"):
        custom.tasks(8)


def test_hand_edited_csv_with_blanks_and_spaces(tmp_path):
    path = write(tmp_path, "F0, F1 ,,B0,B1,,\r\nF0,B0,F1,B1\r\n\r\n,,\r\n")
    custom = CustomSchedule.from_csv(path)
    assert custom.tasks(2) == Std1F1B(2).tasks(2)


def test_one_row_holding_several_stages(tmp_path):
    custom = CustomSchedule.from_csv(write(tmp_path, "F0s0,F0s1,B0s1,B0s0\n"))
    assert (custom.num_stages, custom.mpmd_dim) == (2, 1)
    assert custom.get_mpmd_idx(1) == 0


@pytest.mark.parametrize(
    "text,match",
    [
        ("F0,B0\nF0,B0x\n", r"row 2 \(group 1\), column 2 \('B0x'\): 'B0x' is not a task"),
        ("F0,B0\nF0,+B0\n", r"row 2 \(group 1\), column 2 \('\+B0'\): '' is not a task"),
        ("F0,B0\nF-1,B0\n", r"column 1 \('F-1'\)"),
        (
            "B0,F0\nF0,B0\n",
            r"s.csv: CustomSchedule: row 1 \(group 0\), column 1 \('B0'\): BWD\(stage=0, "
            r"microbatch=0\) runs before FWD\(stage=0, microbatch=0\)",
        ),
        (
            "F0s0,B0s0\nF0s1,B0s1,F0s0\n",
            r"row 2 \(group 1\), column 3 \('F0s0'\): FWD\(stage=0, microbatch=0\) is on group 1 "
            r"but stage 0 already runs on group 0 \(row 1 \(group 0\), column 1 \('F0s0'\)\)",
        ),
        (
            "F0,F0s2,B0s2,B0\nF0,B0\n",
            r"row 1 \(group 0\), column 1 \('F0'\): a cell without a stage suffix means stage 0",
        ),
        ("F0,B0,F1,B1\nF1,B1,F0,B0\n", r"wait for each other forever"),
        (
            "F0,B0\nF0,,B0,F0s0\n",
            r"row 2 \(group 1\), column 1 \('F0'\): a cell without a stage suffix means stage 1"
            r".*but column 4 \('F0s0'\) holds another stage",
        ),
        ("F0,F1,B1,B0\n\nF0,B0,F1,B1\n", r"row 2 \(group 1\) is empty"),
        ("F0,B0\nF0\n", r"BWD\(stage=1, microbatch=0\) is missing"),
        ("F0,B0,B0\nF0,B0\n", r"column 3 \('B0'\): BWD\(stage=0, microbatch=0\): appears twice"),
        ("F0,I0,W0\nF0,B0\n", r"row 2 \(group 1\), column 2 \('B0'\): .*BWD has no place"),
        ("F99999999,B0\n", r"column 1 \('F99999999'\): index too large"),
        ("F0s99,B0\n", r"index too large"),
        ("F1,B1\n", r"FWD\(stage=0, microbatch=0\) is missing"),
        ("", r"no groups"),
        ("F" + "0" * 200_000 + "\n", r"not a valid CSV file"),
    ],
)
def test_bad_csv_names_the_cell(tmp_path, text, match):
    with pytest.raises(ScheduleError, match=match):
        CustomSchedule.from_csv(write(tmp_path, text))


def test_absurd_sizes_are_rejected_before_allocating(tmp_path, monkeypatch):
    import jaxpp_mpi._src.schedules.custom as mod

    monkeypatch.setattr(mod, "MAX_CSV_CELLS", 3)
    with pytest.raises(ScheduleError, match="more than 3 tasks"):
        CustomSchedule.from_csv(write(tmp_path, "F0,F1,B0,B1\n"))
    monkeypatch.setattr(mod, "MAX_CSV_BYTES", 10)
    with pytest.raises(ScheduleError, match="too large for a schedule CSV"):
        CustomSchedule.from_csv(write(tmp_path, "F0,F1,B0,B1\nF0,B0,F1,B1\n"))
    assert MAX_CSV_CELLS == 1_000_000


def test_constructor_checks_too():
    with pytest.raises(ScheduleError, match="stage 1 appears in no group"):
        CustomSchedule(2, ((Task(0, 0, F), Task(0, 0, B)),), 1)
    with pytest.raises(ValueError, match="num_microbatches must be a positive integer"):
        CustomSchedule(1, ((Task(0, 0, F), Task(0, 0, B)),), 0)
    with pytest.raises(ScheduleError, match=r"group 0, position 1: 'B0' is not a Task"):
        CustomSchedule(1, ((Task(0, 0, F), "B0"),), 1)
