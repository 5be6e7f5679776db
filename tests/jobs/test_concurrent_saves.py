"""Two saves into one checkpoint folder at once (`Note: Save lock` in checkpoint/lock.py):
the second is refused (on every rank of its job), naming the first's writer (host, pid),
and changes nothing; the first completes and its checkpoint is whole. A writer killed
mid-save leaves its lock to the next save.

Two MPI jobs (tests/jobs/harness/concurrent_saves.py), and a plain child process saving
beside this test's own saves. The first save waits on a slow leaf until the second has
been tried, so the two saves overlap every time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from job_env import job_env

from jaxpp_mpi import checkpoint
from jaxpp_mpi._src.checkpoint import lock as save_lock

ROOT = Path(__file__).resolve().parents[2]
JPPRUN = ROOT / "launch" / "jpprun"
SCRIPT = "tests/jobs/harness/concurrent_saves.py"
LIMIT_S = 240


def _holder(lock: Path, first: subprocess.Popen, pid: int | None = None) -> dict:
    """The writer recorded in `lock` once the process `first` holds it (with `pid`, once
    that pid is the one recorded)."""
    end = time.monotonic() + LIMIT_S
    while time.monotonic() < end and first.poll() is None:
        try:
            holder = json.loads(lock.read_text())
            if holder.get("pid") and pid in (None, holder["pid"]):
                return holder
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    first.kill()
    out, err = first.communicate()
    pytest.fail(f"the first save never took the lock {lock}:\n{out}\n{err}")


def _leftovers(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".ckpt"))


# -- two MPI jobs -------------------------------------------------------------------


def _job_values() -> dict:
    """What the first job saves (harness/concurrent_saves.py's `tree("hold")` and its
    slow leaf)."""
    out = {f"w{i}": np.arange(64, dtype=np.float32) + i for i in range(3)}
    return {**out, "slow": np.full(8, 5.0, np.float32)}


def test_second_job_saving_to_the_same_folder_is_refused(tmp_path):
    env = job_env()
    first = subprocess.Popen([str(JPPRUN), "-n", "2", "python", SCRIPT, "hold", str(tmp_path)],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        holder = _holder(tmp_path / ".ckpt.lock", first)
        second = subprocess.run([str(JPPRUN), "-n", "2", "python", SCRIPT, "second",
                                 str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=LIMIT_S)
    finally:
        (tmp_path / "go").touch()
        try:
            out, err = first.communicate(timeout=LIMIT_S)
        except subprocess.TimeoutExpired:
            first.kill()
            out, err = first.communicate()
    assert second.returncode == 0, second.stdout + second.stderr
    who = f"pid {holder['pid']} on host {socket.gethostname()}"
    refused = [line for line in second.stdout.splitlines() if ": refused: " in line]
    assert len(refused) == 2, second.stdout
    assert all("another save to" in line and who in line for line in refused), refused
    assert first.returncode == 0, out + err
    assert sorted(line for line in out.splitlines() if line.endswith(": saved")) == [
        "rank 0: saved", "rank 1: saved"]
    got = checkpoint.load_whole(str(tmp_path / "ckpt"))
    assert checkpoint.read_manifest(str(tmp_path / "ckpt")).step == 1
    want = _job_values()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value)
    assert _leftovers(tmp_path) == []


# -- a child process and this one --------------------------------------------------

# A child process saving {"a": arange, "slow": arange * 7} to PATH, step 1; the "slow"
# leaf is read from storage that answers only once the file GO exists.
_CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from jaxpp_mpi import checkpoint as ck
    path, go = sys.argv[1], sys.argv[2]

    class Slow:
        shape, dtype = (4,), np.dtype("float32")

        def __array__(self, dtype=None, copy=None):
            end = time.monotonic() + {limit}
            while not os.path.exists(go) and time.monotonic() < end:
                time.sleep(0.05)
            return np.arange(4, dtype=np.float32) * 7

    ck.save(path, {{"a": np.arange(3, dtype=np.int32), "slow": Slow()}}, step=1)
    print("saved")
""").format(limit=LIMIT_S)


def _first_tree() -> dict:
    return {"a": np.arange(3, dtype=np.int32), "slow": np.arange(4, dtype=np.float32) * 7}


def _second_tree() -> dict:
    return {"a": np.full(3, -1, np.int32), "slow": np.full(4, -1.0, np.float32)}


def _start_child(path: str, go: str) -> subprocess.Popen:
    """The saving child, once it holds the save lock of `path`."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD, path, go],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _holder(Path(save_lock.lock_path(os.path.abspath(path))), child, child.pid)
    return child


def test_a_second_save_is_refused_naming_the_first(tmp_path):
    path, go = str(tmp_path / "ckpt"), str(tmp_path / "go")
    child = _start_child(path, go)
    try:
        before = _leftovers(tmp_path)
        want = f"another save to {path} is in progress.*pid {child.pid} on host " \
               f"{socket.gethostname()}"
        with pytest.raises(checkpoint.CheckpointError, match=want):
            checkpoint.save(path, _second_tree(), step=2, overwrite=True)
        with pytest.raises(checkpoint.CheckpointError, match=f"pid {child.pid}"):
            checkpoint.save(path, _second_tree(), step=2)
        assert _leftovers(tmp_path) == before  # the first save's temp dir and lock
        assert not os.path.exists(path)
    finally:
        open(go, "w").close()
        out, err = child.communicate(timeout=LIMIT_S)
    assert child.returncode == 0 and "saved" in out, err
    got = checkpoint.load_whole(path)
    for key, value in _first_tree().items():
        np.testing.assert_array_equal(got[key], value)
    assert checkpoint.read_manifest(path).step == 1
    assert _leftovers(tmp_path) == []


def test_a_dead_writers_lock_is_taken_over(tmp_path):
    path, go = str(tmp_path / "ckpt"), str(tmp_path / "go")
    child = _start_child(path, go)
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=LIMIT_S)
    assert any(n.startswith(".ckpt.tmp-") for n in _leftovers(tmp_path))
    checkpoint.save(path, _second_tree(), step=2)
    got = checkpoint.restore(path, _second_tree())
    for key, value in _second_tree().items():
        np.testing.assert_array_equal(got[key], value)
    assert _leftovers(tmp_path) == []
