"""The public surface: every exported name resolves, and the package import is light."""

from __future__ import annotations

import subprocess
import sys

import jaxpp_mpi


def test_every_public_name_resolves():
    for name in jaxpp_mpi.__all__:
        assert getattr(jaxpp_mpi, name) is not None, name
    assert set(jaxpp_mpi.__all__) <= set(dir(jaxpp_mpi))


def test_unknown_name_is_an_attribute_error():
    try:
        jaxpp_mpi.not_a_name  # noqa: B018
    except AttributeError as e:
        assert "not_a_name" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_package_import_does_not_load_jax():
    code = "import sys, jaxpp_mpi; sys.exit(1 if 'jax' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# JaxPP's `jaxpp.api` names (its src/jaxpp/api.py) that jaxpp_mpi does not have, and why
# (docs/porting-from-jaxpp.md): multi-controller internals and JaxPP's primitives.
# `mpmd_jit_by_yield` and `cross_mpmd_all_reduce` live in their own modules.
JAXPP_API = {"Add", "BaseSchedule", "Concat", "DualPipeV", "Eager1F1B", "Interleaved1F1B",
             "KimiK2", "Max", "MpmdArray", "MpmdMesh", "MpmdSharding", "Std1F1B",
             "ZeroBubble", "collect_task_times_ms", "mark_stage_end", "mpmd_jit_with_loop",
             "mpmd_to_spmd_reshard", "pipeline_enter_stage", "spmd_to_mpmd_reshard",
             "treduce", "treduce_i"}


def test_api_module_has_jaxpps_names():
    """`import jaxpp_mpi as jaxpp; jaxpp.api.X` finds JaxPP's names, the same objects."""
    assert JAXPP_API <= set(jaxpp_mpi.api.__all__)
    for name in jaxpp_mpi.api.__all__:
        assert getattr(jaxpp_mpi.api, name) is getattr(jaxpp_mpi, name), name


def test_schedules_module_has_jaxpps_schedule_names():
    names = {"BaseSchedule", "InterleavedBaseSchedule", "Std1F1B", "Eager1F1B", "GPipe",
             "ZeroBubble", "Interleaved1F1B", "KimiK2", "DualPipeV", "Task"}
    assert names <= set(jaxpp_mpi.schedules.__all__)
    assert jaxpp_mpi.InterleavedBaseSchedule is jaxpp_mpi.schedules.InterleavedBaseSchedule


def test_process_allgather_is_public_and_says_it_is_collective():
    """The explicit read of results on every rank (Note: reading values): exported at
    the top, in `jaxpp_mpi.api` for ports, and collective by its first docstring line."""
    assert "process_allgather" in jaxpp_mpi.__all__
    assert jaxpp_mpi.api.process_allgather is jaxpp_mpi.process_allgather
    assert jaxpp_mpi.process_allgather.__doc__.startswith("Collective: every rank reads")
