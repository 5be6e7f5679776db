"""Every JAXPP_MPI_* variable that jaxpp_mpi's Python reads: bad values refused by name,
with the value and what it takes; good values taken; the defaults when unset.

The expected values are written out here, not computed from the definitions in
base/variables.py: they are the reference the definitions must meet.
"""

from __future__ import annotations

import re

import pytest

from jaxpp_mpi._src.base import variables
from jaxpp_mpi._src.base.config import Options, VariableError, parse_options

SECONDS = ["JAXPP_MPI_STEP_TIMEOUT", "JAXPP_MPI_WATCHDOG_FLOOR", "JAXPP_MPI_WATCHDOG_GRACE",
           "JAXPP_MPI_DEADLINE", "JAXPP_MPI_ABORT_WAIT"]
NUMERIC = [*SECONDS, "JAXPP_MPI_REPLICA_BUCKET_MB"]
SWITCHES = ["JAXPP_MPI_ABORT_ON_EXCEPTION", "JAXPP_MPI_HEAP_TUNING", "JAXPP_MPI_POSTED_SENDS",
            "JAXPP_MPI_SHARED_COMPILES", "JAXPP_MPI_AUTO_SETTINGS"]
COUNTS = {"JAXPP_MPI_THREADS_PER_RANK": (1, 4096), "JAXPP_MPI_GPUS_PER_RANK": (0, 256),
          "JAXPP_MPI_LOCAL_RANK": (0, 4095), "JAXPP_MPI_LOCAL_SIZE": (1, 4096)}
BLANK = ["", "  "]
NOT_NUMBERS = ["nan", "inf", "-inf", "abc", "1e12", "-1", "10s", "0x10"]

# variable -> values it refuses (an unknown word, no number, out of range, empty)
BAD = {
    **{name: [*NOT_NUMBERS, *BLANK] for name in NUMERIC},
    **{name: ["maybe", "2", "-1", "enabled", "yes please", *BLANK] for name in SWITCHES},
    "JAXPP_MPI_STAGED_MESSAGES": ["2", "staged", "cuda", *BLANK],
    "JAXPP_MPI_PROGRAM_CACHE": ["1", "yes", "cache", *BLANK],
    "JAXPP_MPI_CHECKPOINT_PAUSE_AT": ["now", "writes", "1", *BLANK],
    **{name: ["abc", "1.5", "nan", "inf", "1e3", str(low - 1), str(high + 1), "99999999",
              *BLANK] for name, (low, high) in COUNTS.items()},
}


def test_every_variable_read_by_python_has_its_bad_values_here():
    read = {v.name for v in variables.VARIABLES if v.read_by in variables.PYTHON_READERS}
    assert set(BAD) == read


@pytest.mark.parametrize("name, raw", [(n, r) for n, values in BAD.items() for r in values])
def test_bad_values_are_refused_naming_the_variable_the_value_and_what_it_takes(name, raw):
    with pytest.raises(VariableError, match=rf"^{name}={re.escape(repr(raw))}: .*use ") as e:
        parse_options({name: raw})
    assert isinstance(e.value, ValueError)
    if name in COUNTS:
        low, high = COUNTS[name]
        assert f"an integer from {low} to {high}" in str(e.value)
    elif name in SWITCHES:
        assert str(e.value).endswith("use 1 or 0")


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "abc", "1e12"])
def test_bad_numbers_are_refused_naming_the_variable_and_its_range(name, raw):
    with pytest.raises(ValueError, match=rf"{name}='{raw}': use a number of .* from 0 to"):
        parse_options({name: raw})


def test_the_ranges_are_stated():
    with pytest.raises(ValueError, match=r"from 0 to 600$"):
        parse_options({"JAXPP_MPI_WATCHDOG_GRACE": "1e9"})
    with pytest.raises(ValueError, match=r"from 0 to 2592000 \(30 days\), auto or off$"):
        parse_options({"JAXPP_MPI_STEP_TIMEOUT": "2592001"})
    with pytest.raises(ValueError, match=r"a number of MiB from 0 to 1048576$"):
        parse_options({"JAXPP_MPI_REPLICA_BUCKET_MB": "-0.5"})
    with pytest.raises(ValueError, match=r"'': empty; unset it for the default, or use auto"):
        parse_options({"JAXPP_MPI_STAGED_MESSAGES": ""})


def test_the_grace_period_cannot_postpone_an_abort_for_ever():
    with pytest.raises(ValueError, match="from 0 to 600"):
        parse_options({"JAXPP_MPI_WATCHDOG_GRACE": "1e9"})
    assert parse_options({"JAXPP_MPI_WATCHDOG_GRACE": "600"}).watchdog_grace_s == 600.0


@pytest.mark.parametrize("name,raw,field,value", [
    ("JAXPP_MPI_STEP_TIMEOUT", "120", "step_timeout_s", 120.0),
    ("JAXPP_MPI_STEP_TIMEOUT", " 2592000 ", "step_timeout_s", 2592000.0),
    ("JAXPP_MPI_STEP_TIMEOUT", "0.5", "step_timeout_s", 0.5),
    ("JAXPP_MPI_STEP_TIMEOUT", "AUTO", "watchdog", True),
    ("JAXPP_MPI_STEP_TIMEOUT", "Off", "watchdog", False),
    ("JAXPP_MPI_STEP_TIMEOUT", "0", "watchdog", False),
    ("JAXPP_MPI_STEP_TIMEOUT", "0.0", "watchdog", False),  # 0 s is off, not instant
    ("JAXPP_MPI_STEP_TIMEOUT", "none", "watchdog", False),
    ("JAXPP_MPI_WATCHDOG_FLOOR", "0", "auto_floor_s", 0.0),
    ("JAXPP_MPI_WATCHDOG_FLOOR", "2.5", "auto_floor_s", 2.5),
    ("JAXPP_MPI_WATCHDOG_GRACE", "0", "watchdog_grace_s", 0.0),
    ("JAXPP_MPI_DEADLINE", "7", "deadline_s", 7.0),
    ("JAXPP_MPI_DEADLINE", "off", "deadlines", False),
    ("JAXPP_MPI_REPLICA_BUCKET_MB", "0.5", "replica_bucket_bytes", 1 << 19),
    ("JAXPP_MPI_REPLICA_BUCKET_MB", "0", "replica_bucket_bytes", 0),
    ("JAXPP_MPI_REPLICA_BUCKET_MB", "1048576", "replica_bucket_bytes", 1 << 40),
    ("JAXPP_MPI_STAGED_MESSAGES", " On ", "staged_messages", "1"),
    ("JAXPP_MPI_STAGED_MESSAGES", "no", "staged_messages", "0"),
    ("JAXPP_MPI_STAGED_MESSAGES", "Auto", "staged_messages", "auto"),
    ("JAXPP_MPI_PROGRAM_CACHE", " Auto", "program_cache", "auto"),
    ("JAXPP_MPI_PROGRAM_CACHE", "0", "program_cache", "off"),
    ("JAXPP_MPI_PROGRAM_CACHE", "/tmp/programs", "program_cache", "/tmp/programs"),
])
def test_good_values_are_taken(name, raw, field, value):
    assert getattr(parse_options({name: raw}), field) == value


FIELDS = {"JAXPP_MPI_ABORT_ON_EXCEPTION": "abort_on_exception",
          "JAXPP_MPI_HEAP_TUNING": "heap_tuning", "JAXPP_MPI_POSTED_SENDS": "posted_sends",
          "JAXPP_MPI_SHARED_COMPILES": "shared_compiles"}


@pytest.mark.parametrize("name", SWITCHES)
@pytest.mark.parametrize("raw, on", [("1", True), ("true", True), ("YES", True), (" on", True),
                                     ("0", False), ("False", False), ("no", False),
                                     ("OFF ", False)])
def test_switches_take_their_words(name, raw, on):
    options = parse_options({name: raw})
    if name in FIELDS:
        assert getattr(options, FIELDS[name]) is on
    assert variables.variable(name).parse({name: raw}) is on


@pytest.mark.parametrize("name", COUNTS)
def test_counts_take_integers_in_range(name):
    low, high = COUNTS[name]
    for raw, value in [(str(low), low), (f" {high} ", high), ("2", 2)]:
        parse_options({name: raw})
        assert variables.variable(name).parse({name: raw}) == value


def test_defaults_when_nothing_is_set():
    assert parse_options({}) == Options()
    assert parse_options({}) == Options(
        step_timeout_s=None, watchdog=True, watchdog_grace_s=5.0, abort_on_exception=True,
        heap_tuning=True, auto_floor_s=60.0, deadlines=True, deadline_s=None,
        replica_bucket_bytes=64 << 20, posted_sends=True, staged_messages="auto",
        cuda_mpi=False, shared_compiles=True)
    unset = {name: variables.variable(name).parse({}) for name in COUNTS}
    assert unset == dict.fromkeys(COUNTS)  # None: the launchers' own defaults apply


@pytest.mark.parametrize("step, deadline, want", [
    (None, None, (True, None)),  # automatic, as the step's
    ("10", None, (True, 10.0)),  # follows the step timeout
    ("off", None, (False, None)),
    ("10", "auto", (True, None)),
    ("off", "3", (True, 3.0)),
])
def test_the_deadline_follows_the_step_timeout_unless_set(step, deadline, want):
    env = {k: v for k, v in [("JAXPP_MPI_STEP_TIMEOUT", step), ("JAXPP_MPI_DEADLINE", deadline)]
           if v is not None}
    options = parse_options(env)
    assert (options.deadlines, options.deadline_s) == want


def test_the_first_bad_variable_is_named_when_several_are():
    with pytest.raises(VariableError, match="^JAXPP_MPI_STEP_TIMEOUT="):
        parse_options({"JAXPP_MPI_STEP_TIMEOUT": "x", "JAXPP_MPI_HEAP_TUNING": "x"})


def test_other_variables_are_left_alone():
    # not ours, or read by the shell and the tests (tests/unit/test_variables.py)
    assert parse_options({"JAXPP_MPI_MPI": "x", "JAXPP_MPI_UPDATE_GOLDEN": "x",
                          "SLURM_CPUS_PER_TASK": "x", "OMP_NUM_THREADS": ""}) == Options()
