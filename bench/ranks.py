"""More ranks across hosts: the time from the launch to the first step, and the mesh
agreement's cost, as the job grows from 2 to 16 ranks.

Run as root (it makes 4 hosts, tests/hosts/netns.py, and starts every launch itself):

    .venv/bin/python bench/ranks.py --out bench/results/ranks_$(date +%F).json

Each layout is one launch of `launch/jpprun --hostfile` (Open MPI over TCP between the
hosts) running bench/_ranks_rank.py: the tiny transformer of examples/train.py (hidden
16, one block per stage, 1F1B, a microbatch per stage and replica), compiled and run for
one step. Per layout: `imported`, `mesh`, `compiled`, `first_step` (seconds from the
launch, the slowest rank) and `mesh_s` (make_mpmd_mesh alone, from a barrier). Ranks
beyond the machine's cores share them (16 ranks on 2 cores: compiling dominates); the
persistent compilation cache is off, so every launch compiles all it runs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _hosts  # noqa: E402
from _common import metadata, write_json  # noqa: E402
from _hosts import netns  # noqa: E402

# (ranks per host on h1..h4, replicas)
LAYOUTS = (([1, 1, 0, 0], 1), ([2, 2, 0, 0], 1), ([2, 2, 2, 2], 1), ([4, 4, 0, 0], 2),
           ([4, 4, 4, 4], 2))


def run(layouts, workdir: str) -> dict[str, Any]:
    """Launches every layout once on 4 hosts made for it."""
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    result: dict[str, Any] = {"benchmark": "ranks", **metadata(),
                              "date": datetime.date.today().isoformat(),
                              "commit": _hosts.commit(), "rows": []}
    with netns.make_hosts(4, workdir) as hosts:
        for per_host, replicas in layouts:
            load = _hosts.load_average()
            at = time.time()
            row = _hosts.launch_json(
                hosts, lambda out, p=per_host, at=at, r=replicas: hosts.jpprun_argv(p, [
                    "python", "bench/_ranks_rank.py", out, repr(at), str(r)]),
                f"{per_host} x {replicas} replicas")
            row.update(hosts=sum(1 for c in per_host if c), per_host=per_host, load=load)
            result["rows"].append(row)
            print(f"{row['ranks']:>3} ranks ({row['stages']} stages x {replicas}) on "
                  f"{row['hosts']} hosts: mesh {row['mesh_s'] * 1e3:.0f} ms, first step "
                  f"at {row['first_step']:.1f} s (imported {row['imported']:.1f}, "
                  f"compiled {row['compiled']:.1f})", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="JSON result (default bench/results/ranks_DATE.json)")
    parser.add_argument("--max-ranks", type=int, default=16)
    parser.add_argument("--workdir", default="/tmp/jaxpp_mpi_bench_ranks")
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"bench/ranks.py: cannot make hosts here: {reason}")
    layouts = [(p, r) for p, r in LAYOUTS if sum(p) <= args.max_ranks]
    result = run(layouts, args.workdir)
    out = args.out or f"bench/results/ranks_{result['date']}.json"
    write_json(out, result)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
