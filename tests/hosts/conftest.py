"""Tests across hosts: jobs launched over hosts made on this machine (tests/hosts/netns.py).

Each host is a network namespace with its own address, hostname and /etc/hosts; Open MPI
starts its daemons on the other hosts through a remote-shell agent and its ranks talk
over TCP only. Like tests/jobs, these tests run in one plain pytest process and check
what whole jobs did (exit status, output, files). They need root (namespaces); without
it, or without `ip`/`unshare`, every test here is skipped, naming why.

Fixtures:
  make_hosts: a factory, `make_hosts(n) -> Hosts`; every Hosts it made is torn down at
    the end of the test (processes killed, namespaces removed), pass or fail.
  module_hosts: the same, shared by a module's tests (one Hosts per n, torn down after
    the module); for tests that leave the hosts as they found them (no link left down).
  host_env: the environment for a job's ranks (tests/job_env.py's, with this
    interpreter as `JAXPP_MPI_PYTHON`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import netns
import pytest
from job_env import job_env


def _skip_reason() -> str | None:
    reason = netns.unavailable()
    return f"no hosts on this machine: {reason}" if reason else None


@contextlib.contextmanager
def _factory(where) -> Iterator[Callable[[int], netns.Hosts]]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        def make(n: int) -> netns.Hosts:
            return stack.enter_context(netns.make_hosts(n, where()))

        yield make


@pytest.fixture
def make_hosts(tmp_path) -> Iterator[Callable[[int], netns.Hosts]]:
    """`make_hosts(n)`: n fresh hosts for this test, removed when it ends."""
    with _factory(lambda: tmp_path) as make:
        yield make


@pytest.fixture(scope="module")
def module_hosts(tmp_path_factory) -> Iterator[Callable[[int], netns.Hosts]]:
    """`module_hosts(n)`: n hosts shared by the module's tests (made once per n)."""
    cache: dict[int, netns.Hosts] = {}
    with _factory(lambda: tmp_path_factory.mktemp("hosts")) as make:
        def get(n: int) -> netns.Hosts:
            if n not in cache:
                cache[n] = make(n)
            return cache[n]

        yield get


@pytest.fixture
def host_env() -> dict[str, str]:
    """The environment a job across hosts starts with (on its first host)."""
    return job_env()
