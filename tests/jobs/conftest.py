"""Tests that start MPI jobs: each runs `launch/jpprun -n N ...` as a subprocess.

These tests run in one plain pytest process (`make test-unit`, not `--with-mpi`); the
ranks are the subprocesses, and a test checks what the whole job did (exit status,
output, files written). Each starts its job from the repository root in the
environment of tests/job_env.py: `JAXPP_MPI_PYTHON` set to this interpreter, and without
the 8-device count of tests/conftest.py's `XLA_FLAGS`, so the ranks see JAX's default
devices. The programs the jobs run
live in `harness/`: started by these tests, never collected here
(`deliberate_mpi_failure.py` is a pytest file that test_mpi_harness.py runs under MPI).
"""

collect_ignore = ["harness"]
