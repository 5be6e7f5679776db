"""The hosts a job runs on, as jpprun is given them (stdlib only, no JAX, no MPI).

Note: Ranks per host.
  `jpprun --hostfile FILE` (Open MPI's format: `name [slots=N]` per line, `#` comments)
  or `--host h1:2,h2:2` (Open MPI's `--host`: a name without `:N` is one slot) names the
  hosts. jpprun passes them to mpirun as given and works out, for itself, how many ranks
  each host gets: Open MPI's default mapping, which fills each host's slots in order
  (`ranks_per_host`); a hostfile line without `slots=` counts as many slots as this
  machine has cores, which is what Open MPI counts on a host of the same kind. The busiest
  host then decides what one host decides on a single machine: whether the ranks are
  oversubscribed (its ranks x threads against the cores), and how the visible GPUs are
  shared (the hosts are taken to be alike). On each host a rank then binds itself by its
  local rank (`OMPI_COMM_WORLD_LOCAL_RANK` among `OMPI_COMM_WORLD_LOCAL_SIZE`: that
  host's count), so hosts with different rank counts each share their own cores and GPUs.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """One host and its slots (None: not given, as many as its cores)."""

    name: str
    slots: int | None


def parse_hostfile(text: str, *, source: str = "hostfile") -> list[HostSlots]:
    """Reads Open MPI's hostfile format: `name [slots=N] [max_slots=M]` per line.

    Args:
      text: the file's contents.
      source: its name, for error messages.

    Returns:
      The hosts in file order (a name given twice adds its slots, as Open MPI does).

    Raises:
      ValueError: on a line that is not `name [key=value]...`, a bad slot count, or a
        file naming no host.
    """
    hosts: dict[str, int | None] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *fields = line.split()
        slots = None
        for field in fields:
            key, sep, value = field.partition("=")
            if not sep:
                raise ValueError(f"{source}:{number}: {field!r} is not key=value ({raw!r})")
            if key in ("slots", "count"):
                if not value.isdigit() or int(value) < 1:
                    raise ValueError(f"{source}:{number}: slots must be a positive "
                                     f"integer, got {value!r}")
                slots = int(value)
        if name in hosts and slots is not None:
            slots += hosts[name] or 0
        hosts[name] = slots if slots is not None else hosts.get(name)
    if not hosts:
        raise ValueError(f"{source} names no host")
    return [HostSlots(n, s) for n, s in hosts.items()]


def parse_host_list(spec: str) -> list[HostSlots]:
    """Reads Open MPI's `--host` list, e.g. `h1:2,h2:2` (a name alone is one slot).

    Raises:
      ValueError: on an empty list or a bad count.
    """
    hosts: dict[str, int] = {}
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"([^:\s]+)(?::(\d+))?", item)
        if m is None or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"--host {spec!r}: {item!r} is not NAME or NAME:SLOTS "
                             "(SLOTS >= 1)")
        hosts[m.group(1)] = hosts.get(m.group(1), 0) + int(m.group(2) or 1)
    return [HostSlots(n, s) for n, s in hosts.items()]


def ranks_per_host(num_ranks: int | None, hosts: Sequence[HostSlots], cores: int
                   ) -> list[int]:
    """How many ranks each host gets under Open MPI's default mapping (Note: Ranks per host).

    Args:
      num_ranks: ranks to start (None: every slot).
      hosts: the hosts, in order.
      cores: cores per host (a host without slots has this many).

    Returns:
      Ranks per host, in the hosts' order (0 for a host left unused).

    Raises:
      ValueError: when the ranks outnumber the slots.
    """
    slots = [h.slots if h.slots is not None else cores for h in hosts]
    total = sum(slots)
    if num_ranks is None:
        num_ranks = total
    if num_ranks > total:
        names = ", ".join(f"{h.name}:{s}" for h, s in zip(hosts, slots))
        raise ValueError(f"jpprun: -n {num_ranks} is more than the {total} slots of the "
                         f"hosts ({names}); give each host more slots")
    counts, left = [], num_ranks
    for s in slots:
        counts.append(min(s, left))
        left -= counts[-1]
    return counts


def describe_layout(hosts: Sequence[HostSlots], counts: Sequence[int]) -> str:
    """One line, e.g. `4 ranks on 2 hosts: h1 2, h2 2`."""
    used = [(h.name, c) for h, c in zip(hosts, counts) if c]
    return (f"{sum(counts)} ranks on {len(used)} host(s): "
            + ", ".join(f"{name} {c}" for name, c in used))
