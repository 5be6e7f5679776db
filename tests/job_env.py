"""The environment of an MPI job that a test starts (tests/jobs)."""

from __future__ import annotations

import os
import sys

_DEVICES = "--xla_force_host_platform_device_count"


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment for a job's ranks: `JAXPP_MPI_PYTHON` set to this
    interpreter, `extra` added, and `XLA_FLAGS` without the test session's device count
    (tests/conftest.py), so the ranks see JAX's default devices (a program that needs more
    sets its own); the session's other XLA flags (its optimization level) are kept."""
    env = dict(os.environ, JAXPP_MPI_PYTHON=sys.executable, **extra)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(_DEVICES)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    return env
