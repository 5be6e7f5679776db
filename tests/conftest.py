"""Test-wide settings: CPU device count, and the MPI abort-on-failure harness.

Layout: tests/unit (plain pytest, no MPI), tests/local (one process, every MPMD group's
devices here), tests/jobs (tests that start MPI jobs, see its conftest), tests/mpi (run
on every rank under `launch/jpprun -n N python -m pytest --with-mpi`), tests/golden
(program dumps compared by tests/unit/compiler/test_golden.py).

Note: MPI harness.
  Under `mpirun ... pytest --with-mpi`, a failing test (or a collection error) on one rank
  would leave the other ranks waiting forever in their next message. So the first failure
  on any rank prints that rank's report to stderr, prefixed with `[rank r]`, and calls
  `MPI.COMM_WORLD.Abort(1)`, which ends the whole job at once with a non-zero status.
  Every test also has a pytest-timeout (a timeout is a failure, so it aborts too), and
  the Makefile puts a hard `timeout` around each mpirun.
"""

from __future__ import annotations

import os
import sys

import pytest

# Single-process tests (unit, local, jobs) see 8 CPU devices: enough for a 4-group x 2-device
# local-mode mesh. Must be set before JAX creates its CPU backend; MPI runs set their own.
_FLAG = "--xla_force_host_platform_device_count"
if "--with-mpi" not in sys.argv and _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_FLAG}=8").strip()


# XLA's CPU backend compiles the tests' executables at LLVM -O0: the tests check what this
# library builds and runs against jax.jit compiled the same way (the same HLO passes, so
# the same fusions, FLOPs and layouts), not LLVM's code, and -O0 takes about 40% less
# compile CPU (a transformer parity test and tests/local/test_back_to_back.py: 81 s -> 47 s
# of CPU). `make example` runs at XLA's default level. A level already in XLA_FLAGS wins.
# For the same reason the tests' fusions are emitted by XLA's CPU elemental emitter rather
# than its MLIR fusion emitters, which compile slower; the tests and the jax.jit they
# compare with compile alike (a transformer parity test 14-18 -> 9-10 s of CPU;
# tests/local/test_back_to_back.py, test_group_sharding.py and test_planner.py from a
# cold cache 140 -> 96 s). Flags already in XLA_FLAGS win.
_FLAGS = {"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"}
for _flag, _value in _FLAGS.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {_flag}={_value}").strip()


# Compiled XLA executables are cached on disk for the test session (keyed by the HLO's
# fingerprint, so a hit is the same program): the parity tests compile the same stage
# tasks under many schedules, and the MPI runs reuse what the local runs compiled.
_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      ".cache", "jax-tests")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture
def no_persistent_cache():
    """JAX's persistent compilation cache off for one test (the session turns it on,
    above): for what it changes, e.g. `Note: shared compiles`, which it turns off."""
    import jax
    from jax._src import compilation_cache

    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", before)
    compilation_cache.reset_cache()


def _mpi_world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _under_mpi(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "with_mpi", False))


def pytest_report_header(config: pytest.Config) -> list[str]:
    if not _under_mpi(config):
        return []
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    vendor = MPI.Get_library_version().splitlines()[0].strip().strip("\x00")
    return [f"MPI: {vendor} | rank {comm.rank} of {comm.size}"]


def _abort_with(report_text: str, what: str) -> None:
    comm = _mpi_world()
    lines = "\n".join(f"[rank {comm.rank}] {line}" for line in report_text.splitlines())
    sys.stderr.write(f"\n[rank {comm.rank}] {what}; aborting the MPI job\n{lines}\n")
    sys.stderr.flush()
    sys.stdout.flush()
    comm.Abort(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _under_mpi(item.config) and _mpi_world().size > 1:
        _abort_with(report.longreprtext, f"{item.nodeid} failed in {report.when}")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed and "--with-mpi" in sys.argv and _mpi_world().size > 1:
        _abort_with(report.longreprtext, f"collecting {report.nodeid} failed")
