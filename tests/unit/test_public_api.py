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
