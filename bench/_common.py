"""What the benchmarks share: run metadata, JSON output, the measured message model,
inputs of given avals, one timed call, and the environment of a launch or child process
without a launcher's per-rank settings."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxpp_mpi._src.ir.simulate import MessageCost  # no JAX import
from jaxpp_mpi._src.launch import env as launch_env  # stdlib only
from jaxpp_mpi.schedules import SCHEDULE_NAMES  # no JAX import


def metadata() -> dict[str, Any]:
    """Machine, core count and versions, for the top of a result file."""
    import jax

    return {"machine": platform.node(), "cpus": os.cpu_count(), "jax": jax.__version__}


def write_json(path: str, result: Mapping[str, Any]) -> None:
    """Writes `result` to `path` (creating its folder), indented."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


# What launch/jpprun exports to its ranks (Note: Launcher settings in
# jaxpp_mpi/_src/launch/jpprun.py) and the variables that set what `import jaxpp_mpi` does.
RANK_SETTINGS_VARS = (launch_env.THREADS_PER_RANK_ENV, launch_env.GPUS_PER_RANK_ENV,
                      "OMP_NUM_THREADS", launch_env.AUTO_SETTINGS_ENV, "JAXPP_MPI_LOCAL_RANK",
                      "JAXPP_MPI_LOCAL_SIZE")
# Variables an MPI launcher gives its ranks (Open MPI, PMIx, PRRTE).
MPI_VAR_PREFIXES = ("OMPI_", "PMIX_", "PRTE_")


def without_rank_settings(env: Mapping[str, str]) -> dict[str, str]:
    """`env` as a user's shell has it: `RANK_SETTINGS_VARS` gone and jpprun's one-thread
    flags taken out of `XLA_FLAGS` (the user's other flags kept)."""
    out = {k: v for k, v in env.items() if k not in RANK_SETTINGS_VARS}
    one_thread = {f.split("=")[0] for f in launch_env.thread_env(1, {})["XLA_FLAGS"].split()}
    flags = [f for f in out.pop("XLA_FLAGS", "").split() if f.split("=")[0] not in one_thread]
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    return out


def child_env(env: Mapping[str, str], *, one_thread: bool) -> dict[str, str]:
    """The environment of a process a rank starts outside MPI: no rank settings, no MPI
    launcher's variables, jaxpp_mpi's settings at import off; with `one_thread`, the
    one-thread settings jpprun gives a rank (`env.thread_env(1)`)."""
    out = {k: v for k, v in without_rank_settings(env).items()
           if not k.startswith(MPI_VAR_PREFIXES)}
    out[launch_env.AUTO_SETTINGS_ENV] = "0"
    if one_thread:
        out.update(launch_env.thread_env(1, out))
    return out


def random_arrays(avals: Sequence[Any], seed: int) -> list[Any]:
    """Arrays of `avals` (anything with `shape` and `dtype`) on the default device:
    integers 0 (microbatch indexes, token ids), floats small normal values (no overflow,
    no denormals), numpy seed `seed`."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for a in avals:
        dt = np.dtype(a.dtype)
        if np.issubdtype(dt, np.floating):
            out.append(jnp.asarray((0.05 * rng.standard_normal(a.shape)).astype(dt)))
        else:
            out.append(jnp.zeros(a.shape, dt))
    return out


def timed_call_ms(fn: Callable[..., Any], args: Sequence[Any],
                  donated: Sequence[int]) -> float:
    """One call of `fn(*args)` in ms, to its results being ready; the arguments at
    positions `donated` (pytrees) get fresh copies first, outside the timed part."""
    import jax

    args = list(args)
    for k in donated:
        args[k] = jax.tree.map(lambda x: x.copy(), args[k])
    jax.block_until_ready([args[k] for k in donated])
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) * 1e3


def fit_message_cost(rows: Sequence[Mapping[str, Any]], path: str = "jaxpp_mpi") -> MessageCost:
    """The least-squares line `latency + bytes / bandwidth` through ping-pong rows.

    Args:
      rows: `bench/p2p.py` rows: `bytes` and `{path}_latency_us` (half a round trip).
      path: which transfer path's times to fit.

    Returns:
      The model in milliseconds (`bandwidth` in bytes per ms), as the task times are.

    Raises:
      ValueError: with fewer than two distinct sizes, or a fit without a positive slope.
    """
    xs = [float(r["bytes"]) for r in rows]
    ys = [float(r[f"{path}_latency_us"]) * 1e-3 for r in rows]
    if len(set(xs)) < 2:
        raise ValueError(f"fitting a message model needs two or more sizes, got {sorted(set(xs))}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError(f"ping-pong times do not grow with size ({list(zip(xs, ys))}): rerun")
    return MessageCost(latency=max(0.0, my - slope * mx), bandwidth=1.0 / slope)


def load_message_cost(path: str) -> MessageCost:
    """The message model fitted to the rows of a `bench/p2p.py` JSON file."""
    with open(path) as f:
        data = json.load(f)
    rows = data.get("rows") if isinstance(data, dict) else None
    if not rows:
        raise ValueError(f"{path} is not a bench/p2p.py result (no 'rows')")
    return fit_message_cost(rows)


def add_block_options(p: argparse.ArgumentParser, *, schedules: Sequence[str], width: int,
                      ffn: int, repeats: int, repeats_help: str, quick_help: str) -> None:
    """The options of bench/schedules.py's workload (residual MLP blocks), which
    bench/replicas.py shares: --schedules, --width, --ffn, --blocks, --rows,
    --microbatches, --repeats and --quick; `block_options` finishes them after parsing.

    Args:
      p: the script's parser.
      schedules: the default schedule names.
      width, ffn, repeats: the script's defaults for them.
      repeats_help, quick_help: what a round is, what --quick makes of the run.
    """
    p.add_argument("--schedules", default=",".join(schedules),
                   help=f"comma-separated, from {', '.join(SCHEDULE_NAMES)}")
    p.add_argument("--width", type=int, default=width)
    p.add_argument("--ffn", type=int, default=ffn)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--microbatches", dest="num_microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    p.add_argument("--quick", action="store_true", help=quick_help)


def block_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """`args` after `add_block_options`' options are parsed: --quick applied (d=256,
    ffn=1024, 3 rounds) and --schedules split into a checked list (`p.error` otherwise)."""
    if args.quick:
        args.width, args.ffn, args.repeats = 256, 1024, 3
    args.schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in args.schedules if s not in SCHEDULE_NAMES]
    if unknown:
        p.error(f"unknown schedule(s) {unknown}; the names are {', '.join(SCHEDULE_NAMES)}")
    return args
