"""The schedule viewer: ``python -m jaxpp_mpi.schedules``."""

import os
import subprocess
import sys

import pytest

from jaxpp_mpi.schedules import CustomSchedule, Std1F1B
from jaxpp_mpi.schedules.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def run(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_std_1f1b_view(capsys):
    status, out, err = run(capsys, "Std1F1B", "--stages", "4", "--microbatches", "8")
    assert status == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "Std1F1B(num_stages=4) with 8 microbatches"
    assert "group 0 F0 F1 F2 F3 ..................B0    F4 B1" in out
    assert "group 3 .........F0 B0    F1 B1" in out
    assert "group 0 F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7" in lines  # task order
    assert "makespan 33, mean bubble 27.3%, peak activations 4 (worst group)" in out
    assert lines[-4].split() == ["0", "0", "24", "27.3%", "4"]
    assert lines[-1].split() == ["3", "3", "24", "27.3%", "1"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["GPipe", "--stages", "2", "--microbatches", "3"], "peak activations 3"),
        (["eager1f1b", "--stages", "3", "--microbatches", "4"], "Eager1F1B(num_stages=3)"),
        (["ZeroBubble", "--stages", "3", "--microbatches", "3"], "W2"),
        (
            [
                "Interleaved1F1B",
                "--stages",
                "4",
                "--mpmd-dim",
                "2",
                "--microbatches",
                "4",
                "--fuse-steady-state",
            ],
            "+B",
        ),
        (["KimiK2", "--stages", "4", "--mpmd-dim", "2", "--microbatches", "2"], "F0s2"),
        (
            ["DualPipeV", "--stages", "4", "--microbatches", "4"],
            "DualPipeV(num_stages=4, mpmd_dim=2)",
        ),
        (
            ["Std1F1B", "--stages", "2", "--microbatches", "2", "--latency", "F=0.5,B=1"],
            "latencies F=0.5 B=1 I=1 W=1",
        ),
        (
            ["Std1F1B", "--stages", "2", "--microbatches", "2", "--comm-latency", "0.5"],
            "makespan 10,",
        ),
    ],
)
def test_views(capsys, argv, needle):
    status, out, err = run(capsys, *argv)
    assert status == 0, err
    assert needle in out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["Nope", "--stages", "4", "--microbatches", "8"], "unknown schedule 'Nope'"),
        (["Std1F1B", "--stages", "0", "--microbatches", "8"], "num_stages must be a positive"),
        (["Std1F1B", "--stages", "4"], "needs --stages and --microbatches"),
        (["Std1F1B", "--stages", "x", "--microbatches", "2"], "invalid int value"),
        (["Std1F1B", "--stages", "2", "--microbatches", "2", "--bogus"], "unrecognized arguments"),
        (["Std1F1B", "--stages", "4", "--microbatches", "0"], "got 0"),
        (["ZeroBubble", "--stages", "4", "--microbatches", "2"], "needs at least num_stages=4"),
        (["Interleaved1F1B", "--stages", "8", "--microbatches", "8"], "needs --mpmd-dim"),
        (
            ["Interleaved1F1B", "--stages", "8", "--mpmd-dim", "3", "--microbatches", "8"],
            "not divisible",
        ),
        (
            ["Interleaved1F1B", "--stages", "8", "--mpmd-dim", "4", "--microbatches", "9"],
            "cannot run 9 microbatches",
        ),
        (
            ["GPipe", "--stages", "4", "--microbatches", "8", "--mpmd-dim", "2"],
            "one stage per group",
        ),
        (
            ["GPipe", "--stages", "4", "--microbatches", "8", "--fuse-steady-state"],
            "only applies to Interleaved1F1B",
        ),
        (["DualPipeV", "--stages", "5", "--microbatches", "8"], "exactly 2 * mpmd_dim"),
        (["Std1F1B", "--stages", "2", "--microbatches", "2", "--latency", "X=1"], "--latency"),
        (["Std1F1B", "--stages", "2", "--microbatches", "2", "--latency", "F=-1"], "--latency"),
        (
            ["Std1F1B", "--stages", "2", "--microbatches", "2", "--comm-latency", "-1"],
            "comm-latency",
        ),
        (["Std1F1B", "--stages", "1000", "--microbatches", "1000"], "too large to display"),
        ([], "name a schedule"),
        (["--from-csv", "/nonexistent/s.csv"], "No such file"),
    ],
)
def test_errors_are_one_line_with_status_2(capsys, argv, needle):
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("python -m jaxpp_mpi.schedules: error: ")
    assert needle in err


def test_csv_out_and_in(tmp_path, capsys):
    path = str(tmp_path / "s.csv")
    status, out, _ = run(capsys, "Std1F1B", "--stages", "3", "--microbatches", "4", "--csv", path)
    assert status == 0 and out.rstrip().endswith(f"wrote {path}")
    assert CustomSchedule.from_csv(path).tasks(4) == Std1F1B(3).tasks(4)
    status, out2, _ = run(capsys, "--from-csv", path)
    assert status == 0 and out2.startswith("CustomSchedule(num_stages=3, mpmd_dim=3, ")
    assert out2.split("\n", 1)[1] == out.split("\n", 1)[1].rsplit("\n\nwrote", 1)[0] + "\n"
    status, _, err = run(capsys, "--from-csv", path, "--microbatches", "5")
    assert status == 2 and "written for 4 microbatches" in err
    (tmp_path / "bad.csv").write_text("F0,B0\nB0,F0\n")
    status, _, err = run(capsys, "--from-csv", str(tmp_path / "bad.csv"))
    assert status == 2 and "row 2 (group 1), column 1 ('B0')" in err


def test_module_entry_point():
    env = {**os.environ, "PYTHONPATH": ROOT}
    ok = subprocess.run(
        [sys.executable, "-m", "jaxpp_mpi.schedules", "GPipe", "--stages", "2",
         "--microbatches", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert ok.returncode == 0 and "makespan 9" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "jaxpp_mpi.schedules", "Bogus", "--stages", "2",
         "--microbatches", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_deprecated_mubatches_flag_still_works_and_is_hidden(capsys):
    old = run(capsys, "Std1F1B", "--stages", "4", "--mubatches", "8")
    new = run(capsys, "Std1F1B", "--stages", "4", "--microbatches", "8")
    assert old == new and old[0] == 0
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "--microbatches" in help_text and "--mubatches" not in help_text.replace(
        "--microbatches", ""
    )


def test_viewer_and_short_names_share_one_registry():
    from jaxpp_mpi._src.schedules.cli import _BY_CLASS_NAME
    from jaxpp_mpi.schedules import SCHEDULE_NAMES, schedule_by_name

    assert {type(schedule_by_name(n, 2)) for n in SCHEDULE_NAMES} == set(_BY_CLASS_NAME.values())
