"""The transformer example (examples/train.py) as a job across hosts, for the tests here.

Not a test module: the options of a small, fast model, the launch of the example on given
hosts (jpprun or a plain mpirun), and what its output says. The example checks itself
against `jax.jit` on rank 0 (the same steps in one process, no pipeline) and exits 1 on a
mismatch, so a job that ends with status 0 and prints both comparison lines matched
`jax.jit`.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Sequence

import netns

TRAIN = "examples/train.py"
# A model small enough to compile in seconds on 2 cores; 8 layers whatever the stage
# count, so a checkpoint moves between 2-, 4- and 8-stage pipelines.
TINY = ("--hidden", "16", "--heads", "2", "--seq", "8", "--vocab", "32",
        "--microbatch-size", "2", "--layers", "8")
LIMIT_S = 300
# What a plain mpirun must be told to pass on (jpprun names these itself): the test
# session's XLA flags and compilation cache, so every host compiles alike and reuses it.
FORWARD = ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR",
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


def forward_args(env: dict[str, str]) -> list[str]:
    """Open MPI's `-x NAME` for each of `FORWARD` set in `env`."""
    return [a for name in FORWARD if name in env for a in ("-x", name)]


def train_argv(hosts: netns.Hosts, ranks_per_host: int | Sequence[int], args: Sequence[str],
               *, launcher: str = "jpprun", map_by: str | None = None,
               env: dict[str, str]) -> list[str]:
    """The example on `hosts`, `ranks_per_host` ranks each, with `args` after `TINY`."""
    if launcher == "jpprun":
        return hosts.jpprun_argv(ranks_per_host, ["python", TRAIN, *TINY, *args],
                                 map_by=map_by)
    return hosts.mpirun_argv(ranks_per_host, [sys.executable, TRAIN, *TINY, *args],
                             map_by=map_by, extra=forward_args(env))


def run_train(hosts: netns.Hosts, ranks_per_host: int | Sequence[int], args: Sequence[str],
              *, env: dict[str, str], launcher: str = "jpprun", map_by: str | None = None,
              timeout: float = LIMIT_S) -> subprocess.CompletedProcess:
    """Runs the example to its end (see `train_argv`)."""
    return hosts.run(train_argv(hosts, ranks_per_host, args, launcher=launcher,
                                map_by=map_by, env=env), env=env, timeout=timeout)


def matched_jax_jit(proc: subprocess.CompletedProcess, steps: int) -> tuple[float, float]:
    """Asserts the job ended well after its check against `jax.jit` over `steps` steps.

    Returns:
      The largest loss and parameter differences it printed.
    """
    text = netns.describe(proc)
    assert proc.returncode == 0, text
    loss = re.search(rf"max \|loss - jax.jit loss\| over {steps} steps: (\S+)", proc.stdout)
    param = re.search(r"max \|param - jax.jit param\| on \d+ rank\(s\): (\S+)", proc.stdout)
    assert loss and param, text
    return float(loss.group(1)), float(param.group(1))


def rank_pids(hosts: netns.Hosts) -> dict[str, list[int]]:
    """Per host, the pids of the example's ranks (Python processes running it)."""
    found: dict[str, list[int]] = {}
    for host in hosts.names:
        for pid in hosts.pids(host):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if argv[0].rsplit("/", 1)[-1].startswith("python") and TRAIN in argv:
                found.setdefault(host, []).append(pid)
    return found
