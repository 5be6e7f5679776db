"""The hosts themselves (tests/hosts/netns.py): names, addresses, a 2 x 2 MPI hello across
them under plain mpirun and jpprun, a link cut and restored, a host killed, shaping, and
cleanup however the owner ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import netns
import pytest

HELLO = "tests/hosts/programs/hello.py"


def _on(hosts: netns.Hosts, host: str, script: str, timeout: float = 30
        ) -> subprocess.CompletedProcess:
    return subprocess.run(hosts.exec_argv(host, ["sh", "-c", script]), capture_output=True,
                          text=True, timeout=timeout)


def test_each_host_has_its_name_address_and_hosts_file(module_hosts):
    hosts = module_hosts(2)
    assert hosts.names == ("h1", "h2")
    for host in hosts.names:
        out = _on(hosts, host, "hostname; ip -4 -o addr show dev eth0; cat /etc/hosts")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == host
        assert f"inet {hosts.address(host)}/24" in lines[1]
        assert "192.0.2.1 h1" in lines and "192.0.2.2 h2" in lines
    assert subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip() \
        not in hosts.names  # this machine keeps its own name


def _hello_lines(out: str) -> list[dict[str, str]]:
    rows = [dict(f.split("=", 1) for f in line.split()[1:])
            for line in out.splitlines() if line.startswith("hello ")]
    return sorted(rows, key=lambda r: int(r["rank"]))


@pytest.mark.parametrize("launcher", ["mpirun", "jpprun"])
def test_hello_on_2_hosts_x_2_ranks(module_hosts, host_env, launcher):
    hosts = module_hosts(2)
    if launcher == "mpirun":
        argv = hosts.mpirun_argv(2, [sys.executable, HELLO])
    else:
        argv = hosts.jpprun_argv(2, ["python", HELLO])
    proc = hosts.run(argv, env=host_env, timeout=120)
    assert proc.returncode == 0, netns.describe(proc)
    rows = _hello_lines(proc.stdout)
    assert [(r["rank"], r["host"], r["local"]) for r in rows] == [
        ("0", "h1", "0/2"), ("1", "h1", "1/2"), ("2", "h2", "0/2"), ("3", "h2", "1/2")]
    assert all(r["hosts"] == "h1,h1,h2,h2" and r["sum"] == "6" for r in rows)


def test_ranks_alternating_hosts(module_hosts, host_env):
    hosts = module_hosts(2)
    proc = hosts.run(hosts.mpirun_argv(2, [sys.executable, HELLO], map_by="node"),
                     env=host_env, timeout=120)
    assert proc.returncode == 0, netns.describe(proc)
    assert _hello_lines(proc.stdout)[0]["hosts"] == "h1,h2,h1,h2"


_SERVE = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 5555)); s.listen(4); print("ready", flush=True)
    while True:
        c, _ = s.accept(); c.sendall(b"pong"); c.close()
""")
_CALL = ("import socket; s = socket.create_connection(('{addr}', 5555), timeout=1.5); "
         "print(s.recv(4).decode())")


def test_link_down_cuts_both_ways_and_up_restores(make_hosts):
    hosts = make_hosts(2)
    server = hosts.popen(hosts.exec_argv("h2", [sys.executable, "-c", _SERVE]),
                         stdout=subprocess.PIPE, text=True)
    assert server.stdout.readline().strip() == "ready"
    call = hosts.exec_argv("h1", [sys.executable, "-c", _CALL.format(addr="192.0.2.2")])
    assert subprocess.run(call, capture_output=True, text=True, timeout=30).stdout == "pong\n"
    hosts.link_down("h2")
    cut = subprocess.run(call, capture_output=True, text=True, timeout=30)
    assert cut.returncode != 0 and "timed out" in cut.stderr, cut.stderr
    ping_back = hosts.exec_argv("h2", [sys.executable, "-c", _CALL.format(addr="192.0.2.1")])
    assert subprocess.run(ping_back, capture_output=True, timeout=30).returncode != 0
    hosts.link_up("h2")
    assert subprocess.run(call, capture_output=True, text=True, timeout=30).stdout == "pong\n"


def test_kill_host_ends_every_process_on_it_only(make_hosts):
    hosts = make_hosts(2)
    for host in hosts.names:
        hosts.popen(hosts.exec_argv(host, ["sh", "-c", "sleep 300 & sleep 300 & wait"]))
    deadline = time.monotonic() + 10
    while len(hosts.pids("h2")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(hosts.pids("h2")) >= 3
    assert hosts.kill_host("h2") >= 3
    assert hosts.pids("h2") == [] and len(hosts.pids("h1")) >= 3


def test_shape_sets_a_rate_on_both_ends(make_hosts):
    hosts = make_hosts(2)
    hosts.shape("h2", "10gbit")
    for where, dev in ((hosts.namespace("h2"), "eth0"), (f"jpph{hosts.run_id}sw", "h2")):
        shown = subprocess.run(["tc", "-n", where, "qdisc", "show", "dev", dev],
                               capture_output=True, text=True).stdout
        assert "tbf" in shown and "10Gbit" in shown, shown
    hosts.unshape("h2")
    shown = subprocess.run(["tc", "-n", hosts.namespace("h2"), "qdisc", "show", "dev",
                            "eth0"], capture_output=True, text=True).stdout
    assert "tbf" not in shown


def _objects(run_id: str) -> list[str]:
    names = [n for n in netns._namespaces() if n.startswith(f"jpph{run_id}")]
    etc = netns._NETNS_ETC
    if etc.is_dir():
        names += [p.name for p in etc.iterdir() if p.name.startswith(f"jpph{run_id}")]
    return names


_OWNER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    import netns
    with netns.make_hosts(2, {where!r}) as hosts:
        hosts.popen(hosts.exec_argv("h2", ["sleep", "300"]))
        while not hosts.pids("h2"):  # the sleeper inside h2 before the owner says so
            time.sleep(0.02)
        print(hosts.run_id, flush=True)
        time.sleep(300)
""")


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie awaiting its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_nothing_left_behind_however_the_owner_ends(tmp_path, how):
    if netns.unavailable():
        pytest.skip(f"no hosts on this machine: {netns.unavailable()}")
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER.format(here=os.path.dirname(netns.__file__),
                                             where=str(tmp_path))],
        stdout=subprocess.PIPE, text=True)
    run_id = owner.stdout.readline().strip()
    assert run_id and _objects(run_id)
    sleeper = netns._pids_in(f"jpph{run_id}002")
    assert sleeper
    owner.send_signal(how)
    owner.wait(timeout=30)
    if how == signal.SIGKILL:  # nothing runs in the owner: the next run's sweep cleans up
        assert _objects(run_id)
        assert any(n.startswith(f"jpph{run_id}") for n in netns.sweep_stale())
    assert _objects(run_id) == []
    assert not any(_alive(pid) for pid in sleeper)
    assert not (netns.REGISTRY / run_id).exists()
