"""JAXPP_MPI_STAGED_MESSAGES: parsing, where it stages messages, and how the lowering
times the sends it leads to (`Note: staged messages` in mpi/staged.py; no MPI here)."""

from __future__ import annotations

import pytest

from jaxpp_mpi._src.base.config import parse_options, stages_messages
from jaxpp_mpi._src.ir.simulate import runtime_sends


@pytest.mark.parametrize("value, parsed", [
    (None, "auto"), ("auto", "auto"), (" AUTO ", "auto"), ("1", "1"),
    ("on", "1"), ("true", "1"), ("0", "0"), ("off", "0"), ("False", "0")])
def test_option_values(value, parsed):
    env = {} if value is None else {"JAXPP_MPI_STAGED_MESSAGES": value}
    assert parse_options(env).staged_messages == parsed


@pytest.mark.parametrize("value", ["2", "staged", "cuda", ""])
def test_a_bad_value_names_the_variable_and_its_values(value):
    with pytest.raises(ValueError, match=r"JAXPP_MPI_STAGED_MESSAGES=.*use auto, 1 or 0"):
        parse_options({"JAXPP_MPI_STAGED_MESSAGES": value})


# (option, MPI4JAX_USE_CUDA_MPI) -> staged on (cpu, cuda, rocm)
@pytest.mark.parametrize("value, cuda_mpi, want", [
    ("auto", None, (False, True, True)),  # off CPU, MPI takes host buffers only
    ("auto", "1", (False, False, False)),  # MPI takes device buffers: chains
    ("auto", "True", (False, False, False)),
    ("auto", "0", (False, True, True)),
    ("1", None, (True, True, True)),
    ("1", "1", (True, True, True)),
    ("0", None, (False, False, False)),
])
def test_where_messages_are_staged(value, cuda_mpi, want):
    env = {"JAXPP_MPI_STAGED_MESSAGES": value}
    if cuda_mpi is not None:
        env["MPI4JAX_USE_CUDA_MPI"] = cuda_mpi
    options = parse_options(env)
    assert tuple(stages_messages(options, p) for p in ("cpu", "cuda", "rocm")) == want


@pytest.mark.parametrize("platform, posted_sends, staged, want", [
    ("cpu", True, False, "posted"),
    ("cpu", False, False, "blocking"),
    ("cpu", False, True, "posted"),  # a staged send never holds the group either
    ("cuda", True, False, "blocking"),
    ("cuda", True, True, "posted"),
    ("cuda", False, True, "posted"),
])
def test_the_lowering_times_staged_sends_as_posted(platform, posted_sends, staged, want):
    assert runtime_sends(platform, posted_sends, staged) == want


def test_default_options_stage_gpu_messages_only():
    options = parse_options({})
    assert options.staged_messages == "auto" and not options.cuda_mpi
    for platform, want in (("cpu", "posted"), ("cuda", "posted")):
        staged = stages_messages(options, platform)
        assert runtime_sends(platform, options.posted_sends, staged) == want
