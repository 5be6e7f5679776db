"""What each rank runs with on hosts given different rank counts (1, 2 and 1), under
launch/jpprun and a plain mpirun: its host and local rank, a core of its own on its host,
the one-thread settings (Note: Settings at import, Note: Launcher settings), and, under
jpprun, the user's settings on the remote hosts too."""

from __future__ import annotations

import json
import sys

import netns
import pytest

SETTINGS = "tests/hosts/programs/settings.py"
ONE_THREAD = ("--xla_cpu_multi_thread_eigen=false",
              "--xla_cpu_enable_concurrency_optimized_scheduler=false")


@pytest.mark.parametrize("launcher", ["jpprun", "mpirun", "mpirun+bind_local_devices"])
def test_uneven_hosts_each_rank_set_up_for_its_own_host(module_hosts, host_env, launcher):
    hosts = module_hosts(3)
    env = dict(host_env, JAXPP_MPI_STEP_TIMEOUT="77")
    if launcher == "jpprun":
        argv = hosts.jpprun_argv([1, 2, 1], ["python", SETTINGS])
    else:
        extra = ["--bind"] if "bind" in launcher else []
        argv = hosts.mpirun_argv([1, 2, 1], [sys.executable, SETTINGS, *extra])
    proc = hosts.run(argv, env=env, timeout=120)
    assert proc.returncode == 0, netns.describe(proc)
    rows = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("settings ")]
    assert [(r["host"], r["local_rank"], r["local_size"]) for r in rows] == [
        ("h1", 0, 1), ("h2", 0, 2), ("h2", 1, 2), ("h3", 0, 1)]
    for r in rows:
        assert r["cores"] == [r["local_rank"]], r  # its own core on its host
        assert all(f in r["xla_flags"].split() for f in ONE_THREAD), r
        assert (r["omp"], r["threads"]) == ("1", "1"), r
    # jpprun names the user's settings for every host; a plain mpirun passes them only
    # to the ranks on its own host (`-x` is the user's to give).
    timeouts = [r["step_timeout"] for r in rows]
    if launcher == "jpprun":
        assert timeouts == ["77"] * 4
    else:
        assert timeouts == ["77", None, None, None]
