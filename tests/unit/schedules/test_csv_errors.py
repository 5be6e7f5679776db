"""Unreadable or hostile schedule CSVs: each is a ScheduleError naming the file and the line
or cell (never a bare UnicodeDecodeError or OSError), sizes are bounded before anything is
built, and the viewer reports each on one line with status 2."""

import os

import pytest

import jaxpp_mpi._src.schedules.custom as custom
from jaxpp_mpi.schedules import CustomSchedule, ScheduleError, Task, TaskType
from jaxpp_mpi.schedules.__main__ import main

F, B = TaskType.FWD, TaskType.BWD
# The CSV "F0,B0\nF0,B0\n" by hand: two stages on two groups, one microbatch.
TWO_STAGES = [[Task(0, 0, F), Task(0, 0, B)], [Task(1, 0, F), Task(1, 0, B)]]


def write(tmp_path, data: bytes, name="s.csv"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    "data, match",
    [
        (b"F0,B0\nF0,\xe9B0\n", r"s.csv: line 2: byte 0xe9 is not UTF-8 text"),  # Latin-1
        ("F0,B0\n".encode("utf-16"), r"s.csv: line 1: byte 0xff is not UTF-8 text"),
        (b"F0,B0\r\n\r\nF0,B0\xc3\n", r"s.csv: line 3: byte 0xc3 is not UTF-8 text"),
    ],
)
def test_text_that_is_not_utf8_names_file_and_line(tmp_path, data, match):
    # Before: UnicodeDecodeError naming no file.
    with pytest.raises(ScheduleError, match=match):
        CustomSchedule.from_csv(write(tmp_path, data))


def test_utf8_byte_order_mark_and_trailing_blank_rows_are_accepted(tmp_path):
    path = write(tmp_path, b"\xef\xbb\xbfF0,B0\r\nF0,B0\r\n\r\n,,\n")
    assert CustomSchedule.from_csv(path).tasks(1) == TWO_STAGES


def test_unreadable_paths_name_the_file(tmp_path, monkeypatch):
    missing = tmp_path / "missing.csv"
    with pytest.raises(ScheduleError, match=rf"{missing}: cannot read the schedule CSV: No such"):
        CustomSchedule.from_csv(missing)
    with pytest.raises(ScheduleError, match=rf"{tmp_path}: cannot read .*: Is a directory"):
        CustomSchedule.from_csv(tmp_path)
    # A device reports size 0 but never ends: the read is bounded all the same.
    monkeypatch.setattr(custom, "MAX_CSV_BYTES", 1000)
    with pytest.raises(ScheduleError, match="/dev/zero: larger than 1000 bytes, too large"):
        CustomSchedule.from_csv("/dev/zero")


def test_fields_are_counted_before_the_csv_module_builds_a_row(tmp_path, monkeypatch):
    monkeypatch.setattr(custom, "MAX_CSV_FIELDS", 6)
    assert CustomSchedule.from_csv(write(tmp_path, b"F0,,B0\nF0,B0\n")).tasks(1) == TWO_STAGES
    with pytest.raises(ScheduleError, match=r"s.csv: 7 commas and line breaks .* \(limit 6\)"):
        CustomSchedule.from_csv(write(tmp_path, b"F0,,,,,,B0\n"))
    with pytest.raises(ScheduleError, match=r"s.csv: 7 commas and line breaks"):
        CustomSchedule.from_csv(write(tmp_path, b"F0,B0\n" + b"\n" * 5))


def test_task_limit_names_the_cell(tmp_path, monkeypatch):
    monkeypatch.setattr(custom, "MAX_CSV_CELLS", 3)
    with pytest.raises(
        ScheduleError, match=r"s.csv: row 2 \(group 1\), column 2 \('F1\+B1'\): more than 3 tasks"
    ):
        CustomSchedule.from_csv(write(tmp_path, b"F0,B0\nF0,F1+B1,B0\n"))


def test_empty_row_before_tasks_is_refused_at_once(tmp_path):
    with pytest.raises(
        ScheduleError, match=r"s.csv: row 2 \(group 1\) is empty but row 5 holds tasks"
    ):
        CustomSchedule.from_csv(write(tmp_path, b"F0,B0\n\n,\n\nF0,B0\n"))


def test_non_ascii_digits_are_not_indexes(tmp_path):
    # \d would take Arabic-Indic or full-width digits for microbatch numbers.
    with pytest.raises(ScheduleError, match=r"row 1 \(group 0\), column 1 .* is not a task"):
        CustomSchedule.from_csv(write(tmp_path, "F\u0663,B0\n".encode()))


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_viewer_reports_bad_files_on_one_line(tmp_path, capsys):
    latin = write(tmp_path, b"F0,B0\nF0,\xe9B0\n")
    utf16_trace = write(tmp_path, '{"traceEvents": []}'.encode("utf-16"), "t.json")
    cases = [
        (["--from-csv", str(latin)], f"{latin}: line 2: byte 0xe9 is not UTF-8 text"),
        (["--from-csv", str(tmp_path)], f"{tmp_path}: cannot read the schedule CSV"),
        (
            ["--from-trace", str(utf16_trace), "--png", str(tmp_path / "x.png")],
            f"--from-trace: {utf16_trace} is not UTF-8 text (byte 0xff at offset 0)",
        ),
        (
            ["--from-trace", "/dev/zero", "--png", str(tmp_path / "x.png")],
            "--from-trace: /dev/zero is not a regular file",
        ),
        (
            ["--from-trace", str(tmp_path / "no.json"), "--png", str(tmp_path / "x.png")],
            "does not exist",
        ),
    ]
    for argv, needle in cases:
        status, out, err = run(capsys, *argv)
        assert (status, out) == (2, ""), argv
        assert err.count("\n") == 1 and err.startswith("python -m jaxpp_mpi.schedules: error: ")
        assert needle in err, (argv, err)
    assert not os.path.exists(tmp_path / "x.png")
