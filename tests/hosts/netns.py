"""Hosts of our own on this machine: Linux network namespaces joined by a switch.

`make_hosts(n)` is a context manager yielding `Hosts`: n hosts named `h1` ... `hN`, each
a network namespace with its own address (192.0.2.1 ... in the documentation range
192.0.2.0/24; nothing here sends to any other address but loopback), its own hostname (a
UTS namespace per process started there) and its own `/etc/hosts` (which `ip netns exec`
bind-mounts from `/etc/netns/NAME/hosts`). Each host has one link, `eth0`, a veth whose
other end sits on a bridge inside a switch namespace: nothing is made in the machine's
own namespace, and deleting the namespaces removes every link.

Open MPI (the venv's, `find_mpirun`) reaches the other hosts as it would over ssh: its
launcher runs on `h1` and starts its daemons on the others through `agent.sh`, a
remote-shell agent (`--prtemca plm_ssh_agent`) that runs the daemon's command inside the
host's namespace, with its hostname, from a clean environment (ssh's PATH and HOME
only), so a remote rank gets only what the launcher forwards (`-x`). Messages go over
TCP only (`Hosts.mpi_options`).

The API (stable; tests/hosts/conftest.py makes it a fixture):

    with make_hosts(2, workdir) as hosts:
        hosts.names                                  # ("h1", "h2")
        hosts.address("h2")                          # "192.0.2.2"
        hosts.hostfile([2, 2])                       # Path of "h1 slots=2\\nh2 slots=2"
        argv = hosts.mpirun_argv([2, 2], [python, "prog.py"])      # plain mpirun
        argv = hosts.jpprun_argv([2, 2], ["python", "prog.py"])    # launch/jpprun
        proc = hosts.run(argv, env=env, timeout=120)               # CompletedProcess
        proc = hosts.popen(argv, env=env, stdout=..., stderr=...)  # for faults
        hosts.link_down("h2"); hosts.link_up("h2")   # both directions, like a cable
        hosts.kill_host("h2")                        # SIGKILL every process there
        hosts.pids("h2")                             # the processes running there
        hosts.kill_all()                             # every process on every host
        hosts.shape("h2", "10gbit"); hosts.unshape("h2")   # tc tbf on both directions
        hosts.exec_argv("h2", argv)                  # argv run on h2, as h2
        hosts.namespace("h2"), hosts.tmpdir("h2"), hosts.run_id, hosts.workdir

`mpirun_argv`/`jpprun_argv` take ranks per host (an int for every host, or one count per
host, a 0 leaving a host out), `map_by` (e.g. "node" to alternate ranks between
hosts) and `extra` mpirun arguments; the launch runs on the first host used.

Cleanup is guaranteed: every object is named `jpph<run id>...` (run id: 5 hex digits),
the owner's pid is recorded in `REGISTRY`, and `Hosts.close` (context exit, `atexit`, a
SIGTERM or SIGINT while the hosts exist) kills every process in the namespaces,
deletes them and their `/etc/netns` entries. `sweep_stale` (run before making hosts)
removes what runs whose owner is gone left behind (a SIGKILLed pytest), never another
live run's hosts. `unavailable()` says why hosts cannot be made here (not root, no
`ip`, no namespaces), for a skip naming it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "jpph"
SUBNET = "192.0.2.0/24"
REGISTRY = Path("/run/jpphosts") if os.access("/run", os.W_OK) else Path("/tmp/jpphosts")
_NETNS_ETC = Path("/etc/netns")
_CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class HostsError(RuntimeError):
    """A host could not be made, reached or torn down."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise HostsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _tc(*args: str) -> None:
    proc = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise HostsError(f"tc {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


def unavailable() -> str | None:
    """Why hosts cannot be made on this machine, or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (run the host tests as root, as CI does)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2 / util-linux) to make hosts with"
    name = f"{PREFIX}probe{os.getpid()}"[:15]
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids_in(namespace: str) -> list[int]:
    out = _ip("netns", "pids", namespace, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _kill_all_in(namespace: str, sig: int = signal.SIGKILL) -> int:
    """Sends `sig` to every process in `namespace` until none is left; the count killed."""
    killed: set[int] = set()
    for _ in range(100):
        pids = [p for p in _pids_in(namespace) if p != os.getpid()]
        if not pids:
            return len(killed)
        for pid in pids:  # one pass over all of them: no process outlives its neighbours
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        killed.update(pids)
        if sig != signal.SIGKILL:
            return len(killed)
        time.sleep(0.05)
    raise HostsError(f"processes in {namespace} survive SIGKILL: {_pids_in(namespace)}")


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(run_id: str) -> bool:
    try:
        pid_text, started = (REGISTRY / run_id).read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid_text)) == started


def _remove_namespace(name: str) -> None:
    _kill_all_in(name)
    _ip("netns", "del", name, check=False)
    shutil.rmtree(_NETNS_ETC / name, ignore_errors=True)


def sweep_stale() -> list[str]:
    """Removes the `jpph*` namespaces and `/etc/netns` entries of runs whose owner died.

    Returns:
      The names removed.
    """
    names = set(_namespaces())
    if _NETNS_ETC.is_dir():
        names |= {p.name for p in _NETNS_ETC.iterdir()}
    removed = []
    for name in sorted(n for n in names if n.startswith(PREFIX)):
        if _owner_alive(name[len(PREFIX):len(PREFIX) + 5]):
            continue
        _remove_namespace(name)
        removed.append(name)
    if REGISTRY.is_dir():
        for entry in REGISTRY.iterdir():
            if not _owner_alive(entry.name):
                entry.unlink(missing_ok=True)
    return removed


def find_mpirun() -> str:
    """The venv's mpirun (the MPI the library was built against)."""
    local = Path(sys.executable).parent / "mpirun"
    if not os.access(local, os.X_OK):
        raise HostsError(f"no mpirun next to {sys.executable} (run `make install`)")
    return str(local)


def _counts(per_host: int | Sequence[int], n: int) -> list[int]:
    counts = [per_host] * n if isinstance(per_host, int) else list(per_host)
    if len(counts) > n or any(c < 0 for c in counts) or sum(counts) == 0:
        raise ValueError(f"ranks per host {per_host!r} do not fit {n} hosts")
    return counts


class Hosts:
    """N hosts made by `make_hosts`; see the module docstring for the API."""

    def __init__(self, n: int, workdir: Path) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"1 to 200 hosts, got {n}")
        self.run_id = secrets.token_hex(3)[:5]
        self.names = tuple(f"h{i + 1}" for i in range(n))
        self.workdir = Path(workdir) / f"{PREFIX}{self.run_id}"
        self.agent = self.workdir / "agent.sh"
        self._switch = f"{PREFIX}{self.run_id}sw"
        self._closed = False
        self._procs: list[subprocess.Popen] = []

    # -- names ------------------------------------------------------------------------
    def namespace(self, host: str) -> str:
        """The network namespace of `host`."""
        return f"{PREFIX}{self.run_id}{self._index(host) + 1:03d}"

    def address(self, host: str) -> str:
        """The IPv4 address of `host` (192.0.2.1 for h1, ...)."""
        return f"192.0.2.{self._index(host) + 1}"

    def _index(self, host: str) -> int:
        if host not in self.names:
            raise ValueError(f"no host {host!r} (hosts: {', '.join(self.names)})")
        return self.names.index(host)

    def tmpdir(self, host: str) -> Path:
        """The host's own TMPDIR (Open MPI's session files), as if its /tmp."""
        return self.workdir / host / "tmp"

    # -- making and tearing down ------------------------------------------------------
    def _make(self) -> None:
        REGISTRY.mkdir(parents=True, exist_ok=True)
        (REGISTRY / self.run_id).write_text(f"{os.getpid()} {_start_time(os.getpid())}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        sw = self._switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        hosts_text = "127.0.0.1 localhost\n" + "".join(
            f"{self.address(h)} {h}\n" for h in self.names)
        for host in self.names:
            ns = self.namespace(host)
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", host,
                "netns", sw)
            _ip("-n", sw, "link", "set", host, "master", "br0")
            _ip("-n", sw, "link", "set", host, "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            (_NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
            (_NETNS_ETC / ns / "hosts").write_text(hosts_text)
            self.tmpdir(host).mkdir(parents=True, exist_ok=True)
        self._write_agent()

    def _write_agent(self) -> None:
        cases = "".join(f"  {h}) ns={self.namespace(h)}; tmp={self.tmpdir(h)} ;;\n"
                        for h in self.names)
        self.agent.write_text(
            "#!/bin/sh\n"
            "# Remote-shell agent for Open MPI: agent [options] HOST COMMAND...\n"
            "# runs COMMAND on HOST as ssh would: in its namespace, with its hostname,\n"
            "# from a clean environment, in its home directory.\n"
            'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
            'host=$1; shift\n'
            'case "$host" in\n' + cases +
            '  *) echo "agent: unknown host $host" >&2; exit 255 ;;\n'
            'esac\n'
            'exec ip netns exec "$ns" unshare --uts -- env -i '
            f'PATH={_CLEAN_PATH} HOME="${{HOME:-/root}}" TMPDIR="$tmp" '
            'sh -c \'hostname "$0" && cd && exec sh -c "$1"\' "$host" "$*"\n')
        self.agent.chmod(0o755)

    def close(self) -> None:
        """Kills every process on the hosts and removes every object made (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for host in self.names:
            try:
                _remove_namespace(self.namespace(host))
            except HostsError as e:
                errors.append(str(e))
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        _remove_namespace(self._switch)
        (REGISTRY / self.run_id).unlink(missing_ok=True)
        if errors:
            raise HostsError("; ".join(errors))

    # -- launching --------------------------------------------------------------------
    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `host`: in its namespace, with its hostname and TMPDIR."""
        return ["ip", "netns", "exec", self.namespace(host), "unshare", "--uts", "--",
                "env", f"TMPDIR={self.tmpdir(host)}", "sh", "-c",
                'hostname "$0" && exec "$@"', host, *argv]

    def hostfile(self, ranks_per_host: int | Sequence[int]) -> Path:
        """A hostfile giving each host its count of slots (hosts with 0 left out)."""
        counts = _counts(ranks_per_host, len(self.names))
        text = "".join(f"{h} slots={c}\n" for h, c in zip(self.names, counts) if c)
        path = self.workdir / ("hostfile_" + "_".join(map(str, counts)))
        path.write_text(text)
        return path

    def mpi_options(self) -> list[str]:
        """Open MPI's options for these hosts: TCP only, on their subnet, daemons
        started through the agent, no tree spawn."""
        return ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", SUBNET,
                "--prtemca", "oob_tcp_if_include", SUBNET,
                "--prtemca", "plm_ssh_agent", str(self.agent),
                "--prtemca", "plm_ssh_no_tree_spawn", "1"]

    def _first(self, counts: Sequence[int]) -> str:
        return next(h for h, c in zip(self.names, counts) if c)

    def mpirun_argv(self, ranks_per_host: int | Sequence[int], command: Sequence[str], *,
                    map_by: str | None = None, extra: Sequence[str] = (),
                    mpirun: str | None = None) -> list[str]:
        """Plain `mpirun` across the hosts, started on the first host used.

        Args:
          ranks_per_host: ranks on every host (int) or on each host in order.
          command: the program each rank runs.
          map_by: Open MPI's `--map-by` (default: fill each host's slots in order).
          extra: more mpirun arguments, before the program.
          mpirun: the launcher (default: the venv's).

        Returns:
          The argv, for `run` or `popen`.
        """
        counts = _counts(ranks_per_host, len(self.names))
        argv = [mpirun or find_mpirun(), "-n", str(sum(counts)),
                "--hostfile", str(self.hostfile(counts))]
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        if map_by:
            argv += ["--map-by", map_by]
        argv += [*self.mpi_options(), *extra, *command]
        return self.exec_argv(self._first(counts), argv)

    def jpprun_argv(self, ranks_per_host: int | Sequence[int], command: Sequence[str], *,
                    map_by: str | None = None, jpprun_args: Sequence[str] = (),
                    extra: Sequence[str] = ()) -> list[str]:
        """`launch/jpprun --hostfile` across the hosts, started on the first host used.

        Args:
          ranks_per_host: ranks on every host (int) or on each host in order.
          command: the program as given to jpprun (e.g. ["python", "prog.py"]).
          map_by: passed as `--map-by` (default: jpprun's own per-host mapping).
          jpprun_args: more jpprun options (e.g. ["--threads-per-rank", "1"]).
          extra: more mpirun arguments (each passed as `--mpi-arg=...`).

        Returns:
          The argv, for `run` or `popen`.
        """
        counts = _counts(ranks_per_host, len(self.names))
        mpi = [*self.mpi_options(), *extra]
        if map_by:
            mpi = ["--map-by", map_by, *mpi]
        argv = [str(ROOT / "launch" / "jpprun"), "--hostfile", str(self.hostfile(counts)),
                "-n", str(sum(counts)), *jpprun_args,
                *(f"--mpi-arg={a}" for a in mpi), *command]
        return self.exec_argv(self._first(counts), argv)

    def popen(self, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Starts `argv` (e.g. from `mpirun_argv`) in its own session; killed by `close`."""
        kwargs.setdefault("cwd", ROOT)
        proc = subprocess.Popen(list(argv), start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
        """Runs `argv` to its end, output captured; past `timeout` every process on the
        hosts is killed and `subprocess.TimeoutExpired` raised (its output attached)."""
        proc = self.popen(argv, env=None if env is None else dict(env),
                          cwd=cwd or ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    # -- faults and shaping -----------------------------------------------------------
    def pids(self, host: str) -> list[int]:
        """The processes now running on `host`."""
        return _pids_in(self.namespace(host))

    def kill_host(self, host: str) -> int:
        """SIGKILLs every process on `host` at once, as if it lost power.

        Returns:
          How many processes were killed.
        """
        return _kill_all_in(self.namespace(host))

    def kill_all(self) -> None:
        """SIGKILLs every process on every host and every process `popen` started."""
        for host in self.names:
            _kill_all_in(self.namespace(host))
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def link_down(self, host: str) -> None:
        """Cuts `host`'s link at the switch: nothing goes in or out (TCP sees silence,
        no reset, as with a pulled cable or a dead switch port)."""
        _ip("-n", self._switch, "link", "set", host, "down")

    def link_up(self, host: str) -> None:
        """Restores `host`'s link (connections that survived resume)."""
        _ip("-n", self._switch, "link", "set", host, "up")

    def shape(self, host: str, rate: str, *, burst: str = "1mb",
              latency: str = "50ms") -> None:
        """Holds `host`'s link to `rate` (tc's units, e.g. "10gbit") in both directions,
        with a token bucket (tbf) on each end of its veth."""
        self.unshape(host)
        for where in (["-n", self.namespace(host)], ["-n", self._switch]):
            dev = "eth0" if where[1] != self._switch else host
            _tc(*where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                "burst", burst, "latency", latency)

    def unshape(self, host: str) -> None:
        """Removes `shape`'s limits from `host`'s link (no error when there are none)."""
        for where, dev in ((self.namespace(host), "eth0"), (self._switch, host)):
            subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"],
                           capture_output=True, timeout=30)


_LIVE: list[Hosts] = []


def _close_live() -> None:
    while _LIVE:
        with contextlib.suppress(Exception):
            _LIVE.pop().close()


atexit.register(_close_live)


def _on_term(signum: int, frame: object) -> None:
    _close_live()
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def make_hosts(n: int, workdir: str | Path) -> Iterator[Hosts]:
    """Makes n hosts (see the module docstring), yields them, then removes everything.

    Args:
      n: how many hosts (`h1` ... `hN`).
      workdir: where the agent, hostfiles and the hosts' TMPDIRs go (a shared
        filesystem: every host sees it, as a cluster sees its home directories).

    Yields:
      The Hosts.

    Raises:
      HostsError: when they cannot be made (`unavailable()` says why first).
    """
    reason = unavailable()
    if reason:
        raise HostsError(reason)
    sweep_stale()
    hosts = Hosts(n, Path(workdir))
    _LIVE.append(hosts)
    previous = None
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        with contextlib.suppress(ValueError):  # not the main thread: atexit still holds
            previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        hosts._make()
        yield hosts
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(ValueError):
            _LIVE.remove(hosts)
        hosts.close()


def describe(proc: subprocess.CompletedProcess) -> str:
    """A finished launch for an assertion message: its command, status and output."""
    return (f"$ {shlex.join(proc.args)}\nexit {proc.returncode}\n"
            f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
