"""bench/schedules.py's runs outside its MPI job: the best single-process `jax.jit` and
torch.distributed.pipelining on the same workload, each with nothing else running.

`while_rank0_runs(comm, fn)`: rank 0 runs `fn` while every other rank sleeps (no MPI
call polling a core), so what `fn` starts runs alone. Rank 0 starts child processes
outside MPI (`child_env`: MPI's and jpprun's variables gone, jaxpp_mpi's settings at
import off), each under a time limit; a child that fails or runs over gives an `error`
entry, never a hang, and the MPI job goes on.
  - `jit_alone`: the reference step (`schedules.reference_step`) in one process, once
    with XLA's default threading on every core this process may use, once with one
    thread pinned to rank 0's core(s) (this file run as a script: `--threads`);
  - `torch_pipelining`: bench/_torch_pipeline.py, one process per rank, each pinned to
    that rank's cores with one thread (skipped, with the reason, without torch).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/_common.py, schedules.py

from _common import child_env  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_HINT = ("pip install torch --index-url https://download.pytorch.org/whl/cpu "
              "into .venv (an optional bench dependency)")


def while_rank0_runs(comm, fn: Callable[[], Any]) -> Any:
    """`fn()` on rank 0 while the other ranks sleep; its result on rank 0 (None elsewhere).

    The ranks meet in a non-blocking barrier that each tests every 20 ms, sleeping in
    between: a blocking MPI call would poll a core the whole time.
    """
    result = fn() if comm.rank == 0 else None
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.02)
    return result


def _run_child(argv: Sequence[str], env: Mapping[str, str], limit_s: float, out: str
               ) -> dict[str, Any]:
    """Runs one child to its end (its JSON `out`), or an `error` entry saying why not."""
    try:
        proc = subprocess.run(list(argv), env=dict(env), capture_output=True, text=True,
                              timeout=limit_s)
    except subprocess.TimeoutExpired:
        return {"error": f"{' '.join(argv[:2])} ran over {limit_s:.0f} s: killed"}
    if proc.returncode != 0 or not os.path.exists(out):
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"}
    with open(out) as f:
        return json.load(f)


def workload_options(args: argparse.Namespace) -> list[str]:
    """bench/schedules.py's workload options, for a child."""
    return ["--width", str(args.width), "--ffn", str(args.ffn), "--blocks", str(args.blocks),
            "--rows", str(args.rows), "--microbatches", str(args.num_microbatches)]


def jit_alone(args: argparse.Namespace, one_thread_cores: Sequence[int], repeats: int,
              limit_s: float = 600.0) -> dict[str, Any]:
    """The reference step alone, with default threading then one thread (rank 0 only).

    Returns:
      `default_threads` and `one_thread`: each `step_ms` (median), `steps_ms`, `cores`
      (its affinity mask) and `loss`, or `error`; `best`: which of the two is faster.
    """
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="jaxpp_alone_") as tmp:
        for key, threads, cores in (("default_threads", "default", "all"),
                                    ("one_thread", "1", ",".join(map(str, one_thread_cores)))):
            path = os.path.join(tmp, f"{key}.json")
            argv = [sys.executable, os.path.abspath(__file__), "--threads", threads,
                    "--cores", cores, "--repeats", str(repeats), "--out", path,
                    *workload_options(args)]
            out[key] = _run_child(argv, child_env(os.environ, one_thread=threads == "1"),
                                  limit_s, path)
    timed = {k: v["step_ms"] for k, v in out.items() if "step_ms" in v}
    if timed:
        out["best"] = min(timed, key=timed.get)
        out["best_ms"] = timed[out["best"]]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torch_pipelining(args: argparse.Namespace, rank_cores: Sequence[Sequence[int]],
                     repeats: int, limit_s: float = 900.0) -> dict[str, Any]:
    """torch.distributed.pipelining's GPipe and 1F1B on the workload (rank 0 only).

    Args:
      args: the workload's options.
      rank_cores: each MPI rank's cores: torch's process `r` is pinned to `rank_cores[r]`.
      repeats: timed steps per schedule.
      limit_s: how long the process group may take.

    Returns:
      Per schedule `step_ms` (median), `steps_ms` and `loss`; `torch` (its version); or
      `skipped` (torch is not installed) or `error`.
    """
    if importlib.util.find_spec("torch") is None:
        return {"skipped": f"torch is not installed: {TORCH_HINT}"}
    with tempfile.TemporaryDirectory(prefix="jaxpp_torch_") as tmp:
        path = os.path.join(tmp, "torch.json")
        port = _free_port()
        env = child_env(os.environ, one_thread=True)
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "_torch_pipeline.py"), "--rank", str(r),
                 "--world", str(len(rank_cores)), "--port", str(port),
                 "--cores", ",".join(map(str, cores)), "--repeats", str(repeats),
                 "--out", path, *workload_options(args)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r, cores in enumerate(rank_cores)
        ]
        deadline = time.monotonic() + limit_s
        logs = []
        for p in procs:
            try:
                logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
            except subprocess.TimeoutExpired:
                for q in procs:  # the ones this function started, each by its handle
                    q.kill()
                return {"error": f"torch's process group ran over {limit_s:.0f} s: killed"}
        if any(p.returncode for p in procs) or not os.path.exists(path):
            return {"error": "torch's processes failed: " + " | ".join(x[-1500:] for x in logs)}
        with open(path) as f:
            result = json.load(f)
    for entry in result["schedules"].values():
        entry["step_ms"] = sorted(entry["steps_ms"])[len(entry["steps_ms"]) // 2]
    return result


def torch_match(name: str, torch: Mapping[str, Any]) -> tuple[str, float] | None:
    """torch's counterpart of schedule `name` ('1f1b+chained' counts as '1f1b'): torch's
    schedule of that name where it has one, else its fastest; (its name, its step_ms), or
    None when torch did not run."""
    timed = {k: v["step_ms"] for k, v in torch.get("schedules", {}).items()}
    if not timed:
        return None
    base = name.split("+")[0]
    key = base if base in timed else min(timed, key=timed.get)
    return key, timed[key]


def alone_phase(args: argparse.Namespace, comm, reference_loss: float) -> dict[str, Any]:
    """Both runs alone (`--no-jit-alone`, `--no-torch` leave one out), rank 0 starting
    them while the other ranks sleep; each run's loss checked against the MPI job's
    jax.jit loss (`loss_ok`). The result on rank 0, None elsewhere."""
    rank_cores = comm.allgather(sorted(os.sched_getaffinity(0)))

    def run() -> dict[str, Any]:
        out: dict[str, Any] = {"jit_alone": {"skipped": "--no-jit-alone"},
                               "torch_pipelining": {"skipped": "--no-torch"}}
        if not args.no_jit_alone:
            out["jit_alone"] = jit_alone(args, rank_cores[0], args.repeats)
        if not args.no_torch:
            out["torch_pipelining"] = torch_pipelining(args, rank_cores, args.repeats)
        entries = [out["jit_alone"][k] for k in ("default_threads", "one_thread")
                   if k in out["jit_alone"]]
        entries += list(out["torch_pipelining"].get("schedules", {}).values())
        for e in entries:
            if "loss" in e:
                e["loss_ok"] = abs(e["loss"] - reference_loss) <= 1e-4 * abs(reference_loss)
        return out

    return while_rank0_runs(comm, run)


# ----------------------------------------------------------------------------- the child


def _main() -> None:
    """One process's reference step: `--threads default|1`, pinned to `--cores`."""
    p = argparse.ArgumentParser(description="the reference step alone (bench/_alone.py)")
    p.add_argument("--threads", choices=("default", "1"), required=True)
    p.add_argument("--cores", required=True, help="'all', or comma-separated cores")
    p.add_argument("--repeats", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--ffn", type=int, required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--microbatches", dest="num_microbatches", type=int, required=True)
    args = p.parse_args()
    # Every CPU the machine has: the kernel keeps those of this process's cpuset.
    cores = (range(os.cpu_count() or 1) if args.cores == "all"
             else [int(c) for c in args.cores.split(",")])
    os.sched_setaffinity(0, cores)
    import jax
    import numpy as np
    from _common import timed_call_ms
    from schedules import make_data, reference_step

    np_params, np_batch = make_data(args)
    params = jax.tree.map(jax.numpy.asarray, np_params)
    batch = jax.tree.map(jax.numpy.asarray, np_batch)
    step = jax.jit(reference_step(args.num_microbatches)).lower(params, batch).compile()
    loss = float(jax.block_until_ready(step(params, batch))[0])
    timed_call_ms(step, (params, batch), ())
    steps = [timed_call_ms(step, (params, batch), ()) for _ in range(args.repeats)]
    with open(args.out, "w") as f:
        json.dump({"step_ms": float(np.median(steps)), "steps_ms": steps, "loss": loss,
                   "cores": sorted(os.sched_getaffinity(0)),
                   "xla_flags": os.environ.get("XLA_FLAGS")}, f)


if __name__ == "__main__":
    _main()
