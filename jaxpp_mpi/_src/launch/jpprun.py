"""Builds the MPI launcher command line for `launch/jpprun` (stdlib only, no JAX, no MPI).

`launch/jpprun` runs this file as a script by path; it imports only the standard library,
`env.py` and base/variables.py (stdlib only too), so it starts in milliseconds. A
malformed `$JAXPP_MPI_THREADS_PER_RANK` or `$JAXPP_MPI_GPUS_PER_RANK` ends it with the
variable's message and status 2 before anything starts; the ranks check the others.

Note: Launcher settings.
  Everything a workstation launch needs lives here and nowhere else:
  - Open MPI refuses to run as root unless told (`--allow-run-as-root`); we add it only
    when the user is root.
  - Open MPI refuses more ranks than cores unless told (`--oversubscribe`); we add it
    only when ranks x threads-per-rank exceeds the usable cores.
  - One rank = T compute threads (default 1): XLA's CPU flags alone do not hold a
    process to T cores, so ranks are also bound to cores by the launcher when they fit
    (`--map-by slot:PE=T --bind-to core`); when oversubscribed they are left unbound
    (binding would stack ranks on the same cores).
  - A Python program runs as `python -m mpi4py prog`, so an uncaught exception or a
    non-zero exit on one rank aborts the whole job instead of leaving the others
    waiting in their next message.
  - The thread settings reach every rank through the environment (`XLA_FLAGS`,
    `OMP_NUM_THREADS`, `JAXPP_MPI_THREADS_PER_RANK`), exported with `-x` under Open MPI
    and `-genv` under MPICH/Hydra. A rank started by another launcher gets the same
    settings and core from `import jaxpp_mpi` (Note: Settings at import in auto.py).
  - Ranks on other hosts (`--host`, `--hostfile`, or an allocation mpirun reads itself)
    start from the remote shell's environment, not jpprun's: Open MPI passes on only what
    `-x` names. So besides what jpprun sets, the variables that change what a rank
    computes or how it talks are named too when set (`forwarded_names`: `JAXPP_MPI_*`,
    `JAX_*`, `XLA_*`, `MPI4JAX_*`, `PYTHONPATH`), and a remote rank starts as a local
    one does. Hydra's mpiexec passes the whole environment by default.
  - Several hosts: mpirun is given them as jpprun was (`--hostfile FILE`, or `--host`
    as `-hosts` to Hydra); binding and oversubscription are decided for the busiest
    host (Note: Ranks per host in hosts.py), and each rank binds by its local rank on
    its own host.
  - GPUs (`--gpus-per-rank K`, or by default the visible GPUs shared evenly when there are
    at least as many as ranks; with fewer, a note and no GPU binding, so a CPU test run
    on a one-GPU machine still starts): mpirun cannot give each rank different environment
    values, so every rank starts through `python -m jaxpp_mpi.launch --gpus-per-rank K --`,
    which reads its local rank and sets `CUDA_VISIBLE_DEVICES` to its K GPUs before
    exec'ing the program (Note: Device binding in bind.py). `JAXPP_MPI_GPUS_PER_RANK` is
    exported too, so a script's own `bind_local_devices()` agrees. `--gpus-per-rank 0`,
    `JAX_PLATFORMS=cpu` or no visible GPU: CPU only, no wrapper.

Note: Signals to the launcher.
  A SIGTERM to jpprun (a scheduler preempting it, `kill`) must become the ranks'
  graceful stop (`Note: preemption`: save, exit 0), not a kill. Open MPI's mpirun
  (prterun) answers SIGTERM by killing every rank (SIGTERM, then SIGKILL a few seconds
  later: seen to leave checkpoints saved in 3 runs of 4), but forwards SIGUSR1 and
  SIGUSR2 to every rank untouched. So jpprun forwards the first SIGTERM to mpirun as
  SIGUSR1, which `PreemptionGuard` catches like SIGTERM; a second SIGTERM goes on as
  SIGTERM (mpirun then kills the job). SIGUSR1/SIGUSR2 to jpprun are passed on as they
  are. jpprun then waits for mpirun and exits with its status. MPICH's Hydra mpiexec is
  sent the same SIGUSR1 (untested here: no MPICH on the test machine). jpprun also
  reads mpirun's output on its way through (`Note: Watching the launcher` in
  launcher_watch.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from types import FrameType

from jaxpp_mpi._src.launch import env as launch_env
from jaxpp_mpi._src.launch import hosts as launch_hosts
from jaxpp_mpi._src.launch import launcher_watch
from jaxpp_mpi._src.launch.env import GPUS_PER_RANK_ENV, THREADS_PER_RANK_ENV
from jaxpp_mpi._src.launch.hosts import HostSlots

# Variables of the user's environment that every rank must see, on every host (Note:
# Launcher settings); per-process facts (a local rank given by hand) are left out.
FORWARDED_PREFIXES = ("JAXPP_MPI_", "JAX_", "XLA_", "MPI4JAX_")
FORWARDED_NAMES = ("PYTHONPATH",)
NOT_FORWARDED = ("JAXPP_MPI_LOCAL_RANK", "JAXPP_MPI_LOCAL_SIZE")


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What jpprun will run: the argv and the environment entries it adds."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    vendor: str
    notes: tuple[str, ...] = ()
    layout: str = ""

    def command_line(self) -> str:
        """The command as a shell line, environment first (what `--dry-run` prints)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env)
        return (env + " " if env else "") + shlex.join(self.argv)


def detect_vendor(mpirun: str) -> str:
    """Returns 'openmpi', 'mpich' or 'unknown' from `mpirun --version`."""
    try:
        out = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "openrte" in text or "prte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return "unknown"


def find_mpirun() -> str:
    """The mpirun next to this Python (the venv's embedded MPI) or else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(local, os.X_OK):
        return local
    found = shutil.which("mpirun") or shutil.which("mpiexec")
    if found is None:
        raise SystemExit("jpprun: no mpirun found (run `make install`, or put your MPI on PATH)")
    return found


def usable_cores() -> int:
    """Cores this process may run on (affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def plain_mpirun_argv(num_ranks: int, command: Sequence[str], *, mpirun: str,
                      is_root: bool, cores: int) -> list[str]:
    """Open MPI's mpirun as a user types it, with only what Open MPI demands here:
    `--allow-run-as-root` when `is_root`, `--oversubscribe` with fewer usable `cores`
    than ranks. No binding, mapping or environment options and no `-m mpi4py`: a plain
    launch, whose per-rank settings `import jaxpp_mpi` applies (`Note: Settings at
    import` in launch/auto.py); tests and benchmarks set it against jpprun's.
    """
    argv = [mpirun, "-n", str(num_ranks)]
    if is_root:
        argv.append("--allow-run-as-root")
    if cores < num_ranks:
        argv.append("--oversubscribe")
    return argv + list(command)


def forwarded_names(base_env: Mapping[str, str]) -> list[str]:
    """The variables of `base_env` every rank gets by name (Note: Launcher settings)."""
    return sorted(k for k in base_env
                  if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES)
                  and k not in NOT_FORWARDED)


def _given(args: Sequence[str], *options: str) -> bool:
    return any(a == o or a.startswith(o + "=") for a in args for o in options)


def gpus_for_ranks(
    num_ranks: int, gpus_per_rank: int | None, visible_gpus: int, base_env: Mapping[str, str]
) -> tuple[int, str | None]:
    """GPUs each rank gets: the given count, else the visible GPUs shared evenly (0: CPU).

    Args:
      num_ranks: ranks on this machine.
      gpus_per_rank: `--gpus-per-rank`, or None to decide from what is visible.
      visible_gpus: GPUs this process may use (CUDA_VISIBLE_DEVICES, else the node's).
      base_env: the environment (`JAX_PLATFORMS=cpu` means no GPU).

    Returns:
      GPUs per rank (0 for a CPU-only run), and a note for the user when GPUs are visible
      but not bound.

    Raises:
      ValueError: when the GPUs asked for do not go round the ranks.
    """
    if gpus_per_rank is None:
        if visible_gpus == 0 or base_env.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
            return 0, None
        if visible_gpus < num_ranks:
            return 0, (f"{visible_gpus} GPU(s) for {num_ranks} ranks: GPUs not bound "
                       "(--gpus-per-rank K to bind, 0 to silence this)")
        return visible_gpus // num_ranks, None
    if gpus_per_rank < 0:
        raise ValueError(f"jpprun: --gpus-per-rank must be >= 0, got {gpus_per_rank}")
    if num_ranks * gpus_per_rank > visible_gpus:
        raise ValueError(f"jpprun: {num_ranks} ranks x {gpus_per_rank} GPU(s) need "
                         f"{num_ranks * gpus_per_rank} GPUs, {visible_gpus} visible")
    return gpus_per_rank, None


def build_plan(
    num_ranks: int,
    command: Sequence[str],
    *,
    threads_per_rank: int = 1,
    gpus_per_rank: int | None = 0,
    visible_gpus: int = 0,
    python: str = "python3",
    mpirun: str,
    vendor: str,
    cores: int,
    is_root: bool,
    base_env: Mapping[str, str],
    extra_mpi_args: Sequence[str] = (),
    hosts: Sequence[HostSlots] = (),
    host_args: Sequence[str] = (),
) -> LaunchPlan:
    """Computes the launch command (pure: every fact about the machine is an argument).

    Args:
      num_ranks: MPI ranks to start (one per pipeline group).
      command: the program and its arguments, e.g. ("python", "train.py").
      threads_per_rank: compute threads per rank (see Note: Launcher settings).
      gpus_per_rank: GPUs per rank; None decides from `visible_gpus` (`gpus_for_ranks`).
      visible_gpus: GPUs this process may use.
      python: the interpreter that runs the per-rank GPU binding wrapper.
      mpirun: path of the MPI launcher.
      vendor: 'openmpi', 'mpich' or 'unknown' (see `detect_vendor`).
      cores: usable cores on this machine.
      is_root: whether the user is root.
      base_env: the environment jpprun was started with.
      extra_mpi_args: passed to mpirun verbatim, before the program (a `--map-by` or
        `--bind-to` there replaces jpprun's own).
      hosts: the hosts and their slots (`--host`/`--hostfile`; empty: this machine, or
        what mpirun reads from an allocation). Each is taken to have `cores` cores and
        `visible_gpus` GPUs (Note: Ranks per host in hosts.py).
      host_args: how mpirun is told the hosts (e.g. `("--hostfile", path)`).

    Returns:
      The LaunchPlan.

    Raises:
      ValueError: on a non-positive rank or thread count, an empty command, more ranks
        than the hosts' slots, or GPUs that do not go round a host's ranks.
    """
    if num_ranks < 1:
        raise ValueError(f"jpprun: -n must be >= 1, got {num_ranks}")
    if threads_per_rank < 1:
        raise ValueError(f"jpprun: --threads-per-rank must be >= 1, got {threads_per_rank}")
    if not command:
        raise ValueError("jpprun: no program given (e.g. `jpprun -n 2 python train.py`)")
    layout = ""
    per_host = num_ranks  # ranks on the busiest host
    if hosts:
        counts = launch_hosts.ranks_per_host(num_ranks, hosts, cores)
        per_host, layout = max(counts), launch_hosts.describe_layout(hosts, counts)
    env = launch_env.thread_env(threads_per_rank, base_env)
    gpus, note = gpus_for_ranks(per_host, gpus_per_rank, visible_gpus, base_env)
    if gpus:
        env[GPUS_PER_RANK_ENV] = str(gpus)
        command = [python, "-m", "jaxpp_mpi.launch", "--gpus-per-rank", str(gpus), "--",
                   *command]
    oversubscribed = per_host * threads_per_rank > cores
    own_map = not _given(extra_mpi_args, "--map-by", "-map-by")
    own_bind = not _given(extra_mpi_args, "--bind-to", "-bind-to")
    argv: list[str] = [mpirun, "-n", str(num_ranks)]
    if vendor == "openmpi":
        argv += host_args
        if is_root:
            argv.append("--allow-run-as-root")
        if oversubscribed:
            argv.append("--oversubscribe")
            argv += ["--bind-to", "none"] if own_bind else []
        else:
            argv += ["--map-by", f"slot:PE={threads_per_rank}"] if own_map else []
            argv += ["--bind-to", "core"] if own_bind else []
        for key in [*env, *(k for k in forwarded_names(base_env) if k not in env)]:
            argv += ["-x", key]
    elif vendor == "mpich":
        if hosts:
            argv += ["-hosts", ",".join(f"{h.name}:{h.slots or cores}" for h in hosts)]
        if not oversubscribed and own_bind:
            argv += ["-bind-to", f"core:{threads_per_rank}"]
        for key, value in env.items():
            argv += ["-genv", key, value]
    else:
        argv += host_args
    argv += list(extra_mpi_args)
    argv += list(command)
    return LaunchPlan(argv=tuple(argv), env=tuple(sorted(env.items())), vendor=vendor,
                      notes=(note,) if note else (), layout=layout)


_PY_FLAGS_WITH_VALUE = ("-X", "-W", "-Q")


def with_abort_on_error(command: Sequence[str], python: str) -> list[str]:
    """Runs a Python program through `python -m mpi4py`, which aborts the whole MPI job
    when this rank ends with an uncaught exception or a non-zero exit (otherwise the
    other ranks wait forever in their next message). Other programs are left alone.

    Args:
      command: the program and its arguments as given to jpprun.
      python: the interpreter to use for `python`, `python3` or `python3.N`.

    Returns:
      The command to start on every rank.
    """
    command = list(command)
    if not command or not re.fullmatch(r"python(3(\.\d+)?)?", os.path.basename(command[0])):
        return command
    head, rest = [python], command[1:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        flag = rest.pop(0)
        head.append(flag)
        if flag in _PY_FLAGS_WITH_VALUE and rest:
            head.append(rest.pop(0))
    if rest[:2] == ["-m", "mpi4py"]:
        return head + rest
    return head + ["-m", "mpi4py"] + rest


def _parse(argv: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
    """jpprun's command line; the defaults of its counts come from `env`.

    Raises:
      BindError: when `$JAXPP_MPI_THREADS_PER_RANK` or `$JAXPP_MPI_GPUS_PER_RANK` is
        malformed (naming it, its value and what it takes).
    """
    threads = launch_env.env_int(env, THREADS_PER_RANK_ENV)
    gpus = launch_env.env_int(env, GPUS_PER_RANK_ENV)
    parser = argparse.ArgumentParser(
        prog="jpprun",
        description="Start a jaxpp_mpi program under MPI, one pipeline group per rank.",
        usage="jpprun -n N [--host H1:N1,H2:N2 | --hostfile FILE] [--gpus-per-rank K] "
              "[--threads-per-rank T] [--dry-run] [--mpi-arg ARG]... PROGRAM [ARGS...]",
    )
    parser.add_argument("-n", "--np", dest="num_ranks", type=int, default=None,
                        help="ranks to start (default with hosts: every slot)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--host", default=None,
                       help="hosts and their slots, e.g. h1:2,h2:2 (Open MPI's --host)")
    where.add_argument("--hostfile", default=None,
                       help="Open MPI hostfile: `name slots=N` per line")
    parser.add_argument(
        "--threads-per-rank",
        type=int,
        default=1 if threads is None else threads,
        help=f"compute threads per rank (default 1, or ${THREADS_PER_RANK_ENV})",
    )
    parser.add_argument(
        "--gpus-per-rank",
        type=int,
        default=gpus,
        help="GPUs per rank, bound by local rank (default: the visible GPUs shared "
             f"evenly, or ${GPUS_PER_RANK_ENV}; 0: CPU only)",
    )
    parser.add_argument("--mpirun", default=None, help="MPI launcher (default: the venv's)")
    parser.add_argument("--mpi-arg", action="append", default=[], help="extra mpirun argument")
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def _hosts(args: argparse.Namespace) -> tuple[list[HostSlots], list[str]]:
    """The hosts jpprun was given, and the mpirun arguments that give them."""
    if args.host:
        return launch_hosts.parse_host_list(args.host), ["--host", args.host]
    if args.hostfile:
        try:
            with open(args.hostfile) as f:
                text = f.read(1 << 20)
        except OSError as e:
            raise ValueError(f"jpprun: cannot read --hostfile: {e}") from None
        hosts = launch_hosts.parse_hostfile(text, source=args.hostfile)
        return hosts, ["--hostfile", args.hostfile]
    return [], []


def run_forwarding_signals(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """Runs the launcher, forwarding signals to it (see `Note: Signals to the launcher`).

    Args:
      argv: the launcher's command line.
      env: its environment.

    Returns:
      The launcher's exit status (128 + N when a signal N ended it).
    """
    proc = subprocess.Popen(list(argv), env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    terms = 0

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal terms
        sig = signal.Signals(signum)
        if sig == signal.SIGTERM:
            terms += 1
            if terms == 1:
                print("jpprun: SIGTERM: asking the ranks to stop after their current step "
                      "(SIGUSR1 to mpirun); a second SIGTERM kills the job",
                      file=sys.stderr, flush=True)
                sig = signal.SIGUSR1
        if proc.poll() is None:
            proc.send_signal(sig)

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        status = wait_watched(proc, env)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - status if status < 0 else status


def wait_watched(proc: subprocess.Popen, env: Mapping[str, str]) -> int:
    """Waits for the launcher `proc` (its output piped), ending it when it outstays a
    rank's abort and failing a job that lost a host (`Note: Watching the launcher` in
    launcher_watch.py); the job's exit status."""
    watch = launcher_watch.LauncherWatch(launcher_watch.abort_wait_s(env))
    status, word = launcher_watch.wait_watched(proc, sys.stdout.buffer, sys.stderr.buffer,
                                               watch)
    if word:
        print(word, file=sys.stderr, flush=True)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `launch/jpprun`."""
    try:
        args = _parse(sys.argv[1:] if argv is None else argv, os.environ)
    except launch_env.BindError as e:
        print(f"jpprun: {e}", file=sys.stderr)
        return 2
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    command = with_abort_on_error(command, sys.executable)  # the venv's Python on every rank
    mpirun = args.mpirun or find_mpirun()
    try:
        hosts, host_args = _hosts(args)
        num_ranks = args.num_ranks
        if num_ranks is None:
            if not hosts:
                raise ValueError("jpprun: -n N is required (or --host/--hostfile)")
            num_ranks = sum(launch_hosts.ranks_per_host(None, hosts, usable_cores()))
        plan = build_plan(
            num_ranks,
            command,
            threads_per_rank=args.threads_per_rank,
            gpus_per_rank=args.gpus_per_rank,
            visible_gpus=len(launch_env.visible_gpus(os.environ, launch_env.count_node_gpus())),
            python=sys.executable,
            mpirun=mpirun,
            vendor=detect_vendor(mpirun),
            cores=usable_cores(),
            is_root=hasattr(os, "geteuid") and os.geteuid() == 0,
            base_env=os.environ,
            extra_mpi_args=args.mpi_arg,
            hosts=hosts,
            host_args=host_args,
        )
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"jpprun: note: {note}", file=sys.stderr)
    if plan.layout:
        print(f"jpprun: {plan.layout}", file=sys.stderr)
    print(f"jpprun: {plan.command_line()}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    env = dict(os.environ)
    env.update(plan.env)
    return run_forwarding_signals(plan.argv, env)


if __name__ == "__main__":
    sys.exit(main())
