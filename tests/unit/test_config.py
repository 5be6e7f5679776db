"""Numeric JAXPP_MPI_* variables: finite, in range, refused by name otherwise."""

import pytest

from jaxpp_mpi._src.base.config import parse_options

NUMERIC = ["JAXPP_MPI_STEP_TIMEOUT", "JAXPP_MPI_WATCHDOG_FLOOR", "JAXPP_MPI_WATCHDOG_GRACE",
           "JAXPP_MPI_DEADLINE", "JAXPP_MPI_REPLICA_BUCKET_MB"]


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "-1", "abc", "1e12"])
def test_bad_numbers_are_refused_naming_the_variable_and_its_range(name, raw):
    with pytest.raises(ValueError, match=rf"{name}='{raw}': use a number of .* from 0 to"):
        parse_options({name: raw})


def test_the_grace_period_cannot_postpone_an_abort_for_ever():
    with pytest.raises(ValueError, match="from 0 to 600"):
        parse_options({"JAXPP_MPI_WATCHDOG_GRACE": "1e9"})
    assert parse_options({"JAXPP_MPI_WATCHDOG_GRACE": "600"}).watchdog_grace_s == 600.0


@pytest.mark.parametrize("name,raw,field,value", [
    ("JAXPP_MPI_STEP_TIMEOUT", "120", "step_timeout_s", 120.0),
    ("JAXPP_MPI_WATCHDOG_FLOOR", "0", "auto_floor_s", 0.0),
    ("JAXPP_MPI_REPLICA_BUCKET_MB", "0.5", "replica_bucket_bytes", 1 << 19),
])
def test_good_numbers_are_taken(name, raw, field, value):
    assert getattr(parse_options({name: raw}), field) == value
