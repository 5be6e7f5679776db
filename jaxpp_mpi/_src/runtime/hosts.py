"""Which host each rank runs on: learnt once, at mesh setup, for the reports of faults.

Note: rank hosts.
  A fault across hosts (a link down, a host lost) shows first on the ranks that wait
  for a peer; to act on their report one needs the peer's host, not only its rank. So
  `make_mpmd_mesh`'s argument agreement carries each rank's host name
  (`MeshReport.host`: no collective of its own) and hands the gathered names here
  (`note_hosts`), kept by rank of MPI_COMM_WORLD. The runtime asks `hosts_of(comm)`
  for the host of every rank of one of its communicators (the pipeline's, the
  replicas', the job's) on the thread that calls MPI (translating ranks between
  groups is an MPI call), and passes the names down as data: to the watchdog's words
  (`describe_instr` in runtime/mpi.py) and to a deadline's report (`deadline` in
  failure.py: the peers an agreement waits for, `describe_peers`, and where all the
  ranks run, `describe_hosts`). Unknown (a stand-in communicator, no mesh yet): no
  host is named.
  Nothing here imports mpi4py; an MPI call is made only on a communicator handed in.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from jaxpp_mpi._src.arrays.mesh_agreement import rank_ranges

__all__ = ["describe_hosts", "describe_peers", "host_of", "hosts_of", "note_hosts"]

_by_world: dict[int, str] = {}  # world rank -> host name


def _world_ranks(comm: Any, size: int) -> list[int] | None:
    """The MPI_COMM_WORLD rank of each rank of `comm`; None for a stand-in or before MPI."""
    mpi = sys.modules.get("mpi4py.MPI")
    if (mpi is None or not isinstance(comm, mpi.Comm) or not mpi.Is_initialized()
            or mpi.Is_finalized()):
        return None
    group, world = comm.Get_group(), mpi.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in mpi.Group.Translate_ranks(group, list(range(size)), world)]
    finally:
        group.Free()
        world.Free()


def note_hosts(comm: Any, hosts: Sequence[str]) -> None:
    """Records the host of every rank of `comm` (`Note: rank hosts`).

    Args:
      comm: the communicator the names were gathered over.
      hosts: element r is rank r's host name ("" where unknown).
    """
    ranks = _world_ranks(comm, len(hosts)) or list(range(len(hosts)))
    for rank, host in zip(ranks, hosts):
        if host:
            _by_world[rank] = host


def hosts_of(comm: Any) -> tuple[str | None, ...]:
    """The host of each rank of `comm` (None where unknown); empty for a communicator
    without `Get_size`."""
    get_size = getattr(comm, "Get_size", None)
    if get_size is None:
        return ()
    size = int(get_size())
    ranks = _world_ranks(comm, size) or list(range(size))
    return tuple(_by_world.get(r) for r in ranks)


def host_of(hosts: Sequence[str | None], rank: int) -> str:
    """` on host H` for rank `rank` of `hosts` (`hosts_of`'s answer), "" when unknown."""
    host = hosts[rank] if 0 <= rank < len(hosts) else None
    return f" on host {host}" if host else ""


def describe_hosts(hosts: Sequence[str | None]) -> str:
    """Where a communicator's ranks run, e.g. `ranks 0-1 on h1, rank 2 on h2`; "" when
    their hosts are unknown or all the same (nothing a reader could act on)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host or "an unknown host", []).append(rank)
    if len(by_host) < 2:
        return ""
    return ", ".join(f"{rank_ranges(ranks)} on {host}" for host, ranks in by_host.items())


def describe_peers(ranks: Sequence[int], hosts: Sequence[str | None]) -> str:
    """The peers `ranks` and their hosts, e.g. `rank 3 on host h2` or `ranks 1-2 on host
    h1, rank 5 on host h3` (`rank 3` alone where its host is unknown)."""
    by_host: dict[str | None, list[int]] = {}
    for rank in sorted(ranks):
        by_host.setdefault(hosts[rank] if 0 <= rank < len(hosts) else None, []).append(rank)
    return ", ".join(rank_ranges(peers) + (f" on host {host}" if host else "")
                     for host, peers in by_host.items())
