"""Across hosts: message bandwidth between two hosts, and the pipelined step on two hosts
against one, with the link free and shaped.

Run as root (it makes hosts: network namespaces on a bridge, tests/hosts/netns.py; no
MPI launcher around it, it starts every launch itself):

    .venv/bin/python bench/hosts.py --out bench/results/hosts_$(date +%F).json

- `bandwidth`: bench/p2p.py's ping-pong between one rank on each of two hosts, Open MPI
  over TCP only, for each link setting (`--rates`: free, then `tc` token buckets on both
  hosts' links): the runtime's message chains (`jaxpp_mpi_GBps`) against mpi4py's
  Send/Recv of the same bytes (`mpi4py_GBps`), taking turns rep by rep; `ratio` =
  jaxpp_mpi / mpi4py (the goal: >= 0.8 from 4 MiB).
- `step`: bench/pipeline.py's 1F1B step (a tanh MLP, one 512x512 layer per stage, 8
  microbatches of 256 rows, one rank per stage) on one host (shared memory, Open MPI's
  default transports), on one host over TCP only (loopback: what TCP itself costs), and on
  two hosts over TCP, for each link setting; `vs_one_host` = step / the one-host step.
  `messages_ms` is the time a step's messages take on the link alone (bytes / mpi4py's
  bandwidth at 4 MiB under that setting; 16 messages of 512 KiB a step) and `hidden` =
  1 - (step - one-host step) / messages_ms: the share of that time the schedule hides
  behind compute (1: all of it; clipped to [0, 1]).
Every setting is launched once per round (`--rounds`, the order rotating), and the
figures are medians over the rounds; only the runs of one invocation compare (the
machine changes between runs: `load` is the range of the 1-minute load average).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _hosts  # noqa: E402
from _common import metadata, write_json  # noqa: E402
from _hosts import ROOT, netns  # noqa: E402

SIZES_MIB = (4, 16)
STEP_MESSAGES = 16  # 1F1B on 2 stages: a forward and a backward message per microbatch
MESSAGE_BYTES = 256 * 512 * 4  # --rows x --width float32


def _bandwidth(hosts: netns.Hosts, reps: int) -> list[dict[str, Any]]:
    rows = _hosts.launch_json(hosts, lambda out: hosts.jpprun_argv([1, 1], [
        "python", "bench/_hosts_p2p.py", out, str(reps), *map(str, SIZES_MIB)]),
        "bandwidth")
    return [{"bytes": r["bytes"], "jaxpp_mpi_GBps": r["jaxpp_mpi_GBps"],
             "mpi4py_GBps": r["mpi4py_GBps"], "ratio": r["bandwidth_ratio"]} for r in rows]


def _step(hosts: netns.Hosts, per_host: list[int], steps: int, tcp: bool) -> dict[str, Any]:
    def argv(out: str) -> list[str]:
        program = ["python", "bench/pipeline.py", "--schedule", "1f1b", "--steps",
                   str(steps), "--out", out]
        if tcp:
            return hosts.jpprun_argv(per_host, program)
        return hosts.exec_argv("h1", [str(ROOT / "launch" / "jpprun"), "-n",
                                      str(sum(per_host)), *program])
    result = _hosts.launch_json(hosts, argv, f"step on {per_host}")
    return {"step_ms": result["step_ms"], "predicted_ms": result["predicted_ms"]}


def _shape(hosts: netns.Hosts, rate: str | None) -> None:
    for host in hosts.names:
        if rate is None:
            hosts.unshape(host)
        else:
            hosts.shape(host, rate)


def _setting(rate: str | None) -> str:
    return f"2 hosts, TCP, {rate or 'link free'}"


def run(rates: list[str | None], reps: int, steps: int, rounds: int, workdir: str
        ) -> dict[str, Any]:
    """Every measurement of the module docstring, on 2 hosts made for it: `rounds`
    rounds, each launching every setting once (the order rotating round by round, so a
    busy spell of the machine does not fall on one setting); medians over the rounds."""
    settings: list[tuple[str, str | None]] = [("1 host, shared memory", None),
                                              ("1 host, TCP", None)]
    settings += [(_setting(rate), rate) for rate in rates]
    steps_ms: dict[str, list[float]] = {name: [] for name, _ in settings}
    predicted: dict[str, list[float]] = {name: [] for name, _ in settings}
    bandwidth: dict[str, list[list[dict[str, Any]]]] = {_setting(r): [] for r in rates}
    loads: list[float] = []
    with netns.make_hosts(2, workdir) as hosts:
        for k in range(rounds):
            for name, rate in settings[k % len(settings):] + settings[:k % len(settings)]:
                loads.append(_hosts.load_average())
                if name.startswith("1 host"):
                    _shape(hosts, None)
                    row = _step(hosts, [2, 0], steps, tcp=name.endswith("TCP"))
                else:
                    _shape(hosts, rate)
                    bandwidth[name].append(_bandwidth(hosts, reps))
                    row = _step(hosts, [1, 1], steps, tcp=True)
                steps_ms[name].append(row["step_ms"])
                predicted[name].append(row["predicted_ms"])
                print(f"round {k}: {name}: step {row['step_ms']:.1f} ms", flush=True)
    result: dict[str, Any] = {"benchmark": "hosts", **metadata(),
                              "date": datetime.date.today().isoformat(),
                              "commit": _hosts.commit(), "rounds": rounds,
                              "load": [min(loads), max(loads)], "bandwidth": [],
                              "step": []}
    for name, runs in bandwidth.items():
        rows = []
        for i, size in enumerate(SIZES_MIB):
            mine = [r[i]["jaxpp_mpi_GBps"] for r in runs]
            raw = [r[i]["mpi4py_GBps"] for r in runs]
            rows.append({"bytes": size << 20, "jaxpp_mpi_GBps": statistics.median(mine),
                         "mpi4py_GBps": statistics.median(raw),
                         "ratio": statistics.median(r[i]["ratio"] for r in runs)})
        result["bandwidth"].append({"setting": name, "rows": rows})
        ratios = ", ".join(f"{r['bytes'] >> 20} MiB {r['ratio']:.2f}" for r in rows)
        print(f"{name}: bandwidth ratio {ratios}; mpi4py {rows[0]['mpi4py_GBps']:.2f} GB/s "
              "at 4 MiB", flush=True)
    one_host = statistics.median(steps_ms[settings[0][0]])
    for name, _ in settings:
        row = {"setting": name, "step_ms": statistics.median(steps_ms[name]),
               "step_ms_rounds": steps_ms[name],
               "predicted_ms": statistics.median(predicted[name])}
        row["vs_one_host"] = row["step_ms"] / one_host
        if name in bandwidth:
            gbps = next(b["rows"][0]["mpi4py_GBps"] for b in result["bandwidth"]
                        if b["setting"] == name)
            messages_ms = STEP_MESSAGES * MESSAGE_BYTES / (gbps * 1e6)
            exposed = row["step_ms"] - one_host
            row.update(messages_ms=messages_ms,
                       hidden=min(1.0, max(0.0, 1 - exposed / messages_ms)))
        result["step"].append(row)
        print(f"{name}: step {row['step_ms']:.1f} ms ({row['vs_one_host']:.2f}x one host"
              + (f", messages {row['messages_ms']:.0f} ms on the link, hidden "
                 f"{row['hidden']:.2f})" if "hidden" in row else ")"), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None,
                        help="JSON result (default bench/results/hosts_DATE.json)")
    parser.add_argument("--rates", default="free,25gbit,10gbit,1gbit",
                        help="link settings, comma-separated: free or tc rates")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/jaxpp_mpi_bench_hosts")
    args = parser.parse_args()
    reason = netns.unavailable()
    if reason:
        raise SystemExit(f"bench/hosts.py: cannot make hosts here: {reason}")
    rates = [None if r == "free" else r for r in args.rates.split(",")]
    result = run(rates, args.reps, args.steps, args.rounds, args.workdir)
    out = args.out or f"bench/results/hosts_{result['date']}.json"
    write_json(out, result)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
