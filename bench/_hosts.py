"""What bench/hosts.py and bench/ranks.py share: hosts made on this machine (the test
suite's, tests/hosts/netns.py), a launch on them that writes a JSON result, and the
environment of such a launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "hosts"))  # netns.py: the hosts of the test suite

import netns  # noqa: E402

LIMIT_S = 900


def env(**extra: str) -> dict[str, str]:
    """This process's environment for a launch, `JAXPP_MPI_PYTHON` set to this Python."""
    return dict(os.environ, JAXPP_MPI_PYTHON=sys.executable, **extra)


def launch_json(hosts: netns.Hosts, argv_for: Callable[[str], Sequence[str]],
                label: str) -> dict[str, Any]:
    """Runs `argv_for(out)` (a launch on `hosts` writing JSON to `out`) and reads it.

    Raises:
      SystemExit: naming `label`, the status and the output's end, when it fails.
    """
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    try:
        proc = hosts.run(argv_for(out), env=env(), timeout=LIMIT_S)
        if proc.returncode != 0 or os.path.getsize(out) == 0:
            raise SystemExit(f"bench: {label}: exit {proc.returncode}\n"
                             f"{(proc.stdout + proc.stderr)[-3000:]}")
        with open(out) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"bench: {label}: no result in {LIMIT_S} s") from None
    finally:
        os.unlink(out)


def commit() -> str:
    """The repository's commit, short (what the figures were measured on)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True)
    return out.stdout.strip()


def load_average() -> float:
    """The machine's 1-minute load average (a busy machine's figures say little)."""
    return os.getloadavg()[0]
