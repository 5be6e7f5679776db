"""The host cost of dispatching one instruction: µs per Run, Send and Recv (and, in local
mode, per transfer), against `jax.jit`'s dispatch of the same executables and raw mpi4py.

    .venv/bin/python bench/dispatch.py                        # local mode, 2 CPU devices
    launch/jpprun -n 2 .venv/bin/python bench/dispatch.py     # MPI mode, 2 ranks

Each mode writes its own section ("local", "mpi") of `--out` (bench/results/dispatch.json),
keeping the other's, and prints a table.

On a GPU a stage pays a fixed host cost per executable call, and the runtime adds its
own per-instruction cost on top; this measures both with work too small to matter, so
a step's wall time is its dispatch. Every instruction computes or moves one float32[8]
(32 bytes). Programs are built by hand, one instruction type each, `--count` (K)
instructions of it per group, and run by the runtime's executors as a compiled step
would be: `LocalExecutor`; `MpiExecutor` (rank r runs group r) with this process's
default options, watchdog included.

- Run: each group a chain of K Runs of `jax.jit(lambda x: (x + 1,))`, each donating
  the previous result. References: the same jitted function called K times in a Python
  loop threading its result, one `block_until_ready` at the end (`jit`), and with one
  after every call (`jit_sync`).
- Transfer (local mode): group 0 sends one value K times to group 1 (a matched message
  is `jax.device_put` to the receiver's sharding, `Note: local order`). References: K
  `jax.device_put` calls of the same value to the same sharding, the copies kept as the
  program keeps its buffers (`jit`, `jit_sync`), and to the receiver's device itself
  instead of its sharding (`put_device`).
- Send (MPI mode): rank 0 sends one value K times (made by one Run first, so that no
  send is of a step input or output, which a staged step waits for), on each message
  path, the path's options set and the rest left at this process's defaults:
  - posted (CPU's default, `Note: posted sends`): the step; references mpi4py `Isend`
    of the same 32 bytes from a numpy buffer K times (`mpi4py`; its requests waited
    for after the clock stops, as the runtime reaps its own later) and blocking `Send`
    (`mpi4py_blocking`);
  - chained (JAXPP_MPI_STAGED_MESSAGES=0 with JAXPP_MPI_POSTED_SENDS=0; a GPU's with
    MPI taking device buffers, `Note: message chains`): the step until its last chain
    finished; references the same compiled send chain called K times directly (`jit`,
    `jit_sync`) and mpi4py `Send` (`mpi4py`);
  - staged (JAXPP_MPI_STAGED_MESSAGES=1; a GPU's default, `Note: staged messages`,
    needs MPI_THREAD_MULTIPLE): the step, which only queues its sends (`runtime`:
    the dispatching thread's cost), and until the sender thread has completed them
    all (`done`); reference mpi4py `Isend`.
  Rank 1 takes every contender's messages with mpi4py `Recv`, so a sender that outruns
  MPI's buffers waits for the same receiver.
- Recv (MPI mode): rank 1 receives K values, sent by mpi4py and past a barrier before
  its clock starts, so the step is the receive's own cost:
  - chained (CPU's default): the step until its last chain finished; references the
    same compiled receive chain called K times directly, the values kept (`jit`,
    `jit_sync`), and mpi4py `Recv` into a numpy buffer (`mpi4py`);
  - staged: the step, which takes each value from the receiver thread (a window of 4
    messages ahead); reference mpi4py `Recv`.

Each round times every contender once (inputs placed beforehand; barriers between
them in MPI mode; the order flips each round). Reported per instruction: each
contender's median step over the rounds / K, and `overhead_us` = the median over the
rounds of (runtime's step - reference's step) / K, the reference being `jit` (JAX's
dispatch of the same executables) or, where the runtime calls no executable (posted
and staged messages), mpi4py: what the runtime adds per instruction. A step's one-off
costs (binding inputs, collecting outputs, the watchdog's start and end, the sending
step's one Run) are on the runtime's side, shared over K.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common.py

from _common import metadata, write_json  # noqa: E402

from jaxpp_mpi._src.ir.program import (  # noqa: E402 - no JAX import
    Aval,
    Free,
    GroupProgram,
    Program,
    Recv,
    Run,
    Send,
)
from jaxpp_mpi._src.launch.env import launcher_world_size  # noqa: E402

VALUE = Aval((8,), "float32")
COLUMNS = ("runtime", "done", "jit", "jit_sync", "put_device", "mpi4py", "mpi4py_blocking")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=1000, help="instructions per program (K)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--out", default="bench/results/dispatch.json")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- programs


def run_program(groups: int, k: int) -> Program:
    """Per group: step input g, a chain of `k` Runs of `add`, each donating the last."""
    return Program(tuple(
        GroupProgram(g, {0: g}, [Run("add", (i,), (i + 1,), f"F{i}s{g}", donate=(i,))
                                 for i in range(k)],
                     {k: g}, dict.fromkeys(range(k + 1), VALUE))
        for g in range(groups)))


def send_program(k: int) -> Program:
    """Group 0 sends a value to group 1 `k` times (one Run makes it, so that no send is
    of a step input or output, which a staged step would wait for); group 1 frees all
    `k` at the end."""
    return Program((
        GroupProgram(0, {0: 0}, [Run("add", (0,), (1,), donate=(0,)),
                                 *(Send(1, 1, i) for i in range(k)), Free((1,))],
                     {}, {0: VALUE, 1: VALUE}),
        GroupProgram(1, {}, [*(Recv(i + 1, 0, i, VALUE) for i in range(k)),
                             Free(tuple(range(1, k + 1)))], {},
                     dict.fromkeys(range(1, k + 1), VALUE)),
    ))


# ----------------------------------------------------------------------------- timing


def _clock(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Rows:
    """Per (instruction, where): each contender's step times and the overhead pairs."""

    def __init__(self, k: int):
        self.k = k
        self.times: dict[tuple[str, str], dict[str, list[float]]] = {}
        self.reference: dict[tuple[str, str], str] = {}

    def add(self, instr: str, where: str, name: str, seconds: float) -> None:
        self.times.setdefault((instr, where), {}).setdefault(name, []).append(seconds)

    def rows(self) -> list[dict[str, Any]]:
        import numpy as np

        out = []
        for (instr, where), times in self.times.items():
            ref = self.reference[instr, where]
            row: dict[str, Any] = {"instr": instr, "where": where, "count": self.k,
                                   "rounds": len(times["runtime"]), "overhead_vs": ref}
            for name in COLUMNS:
                if name in times:
                    row[f"{name}_us"] = float(np.median(times[name])) / self.k * 1e6
            pairs = np.subtract(times["runtime"], times[ref])
            row["overhead_us"] = float(np.median(pairs)) / self.k * 1e6
            out.append(row)
        return out


def _in_turn(r: int, timed: list[tuple[str, Callable[[], float]]], rows: Rows, instr: str,
             where: str) -> None:
    """Times each (name, fn) once, forwards on even rounds and backwards on odd ones."""
    for name, fn in (timed if r % 2 == 0 else timed[::-1]):
        rows.add(instr, where, name, fn())


def _jit_loops(fn: Callable, x: Any, k: int) -> list[tuple[str, Callable[[], float]]]:
    """`jit` and `jit_sync` of a one-result executable `fn` called `k` times on `x`."""
    import jax

    def loop():
        y = x
        for _ in range(k):
            (y,) = fn(y)
        jax.block_until_ready(y)

    def loop_sync():
        y = x
        for _ in range(k):
            (y,) = fn(y)
            y.block_until_ready()

    return [("jit", lambda: _clock(loop)), ("jit_sync", lambda: _clock(loop_sync))]


# ----------------------------------------------------------------------------- local mode


def local_mode(args) -> dict[str, Any]:
    """Run and Transfer steps of the local executor, 2 groups on 2 CPU devices."""
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    from jaxpp_mpi._src.ir.simulate import verify
    from jaxpp_mpi._src.runtime.local import LocalExecutor

    k = args.count
    devices = jax.devices()[:2]
    if len(devices) < 2:
        raise SystemExit("local mode needs 2 devices (XLA_FLAGS="
                         "--xla_force_host_platform_device_count=2)")
    add = jax.jit(lambda x: (x + 1.0,))
    shardings = lambda g, aval: SingleDeviceSharding(devices[g])  # noqa: E731
    xs = [jax.device_put(np.zeros(8, np.float32), d) for d in devices]
    runs, sends = run_program(2, k), send_program(k)
    verify(runs)
    verify(sends)
    run_ex = LocalExecutor(runs, [{"add": add}, {"add": add}], shardings)
    send_ex = LocalExecutor(sends, [{"add": add}, {}], shardings)

    def run_step():
        jax.block_until_ready(run_ex.run(list(xs)))

    (_, loop0), (_, sync0) = _jit_loops(add, xs[0], k)
    (_, loop1), (_, sync1) = _jit_loops(add, xs[1], k)

    def transfer_step():
        jax.block_until_ready(send_ex.run([xs[0]]))

    def put_loop(target, sync: bool):
        def loop():
            kept = []  # as the program's buffers, live until its Free
            for _ in range(k):
                kept.append(jax.device_put(xs[0], target))
                if sync:
                    kept[-1].block_until_ready()
            jax.block_until_ready(kept)
        return loop

    rows = Rows(k)
    rows.reference["Run", "local"] = rows.reference["Transfer", "local"] = "jit"
    run_timed = [("runtime", lambda: _clock(run_step) / 2),  # 2 groups: 2K Runs
                 ("jit", lambda: (loop0() + loop1()) / 2),
                 ("jit_sync", lambda: (sync0() + sync1()) / 2)]
    to_group1 = shardings(1, VALUE)  # what the executor puts to
    transfer_timed = [("runtime", lambda: _clock(transfer_step)),
                      ("jit", lambda: _clock(put_loop(to_group1, False))),
                      ("jit_sync", lambda: _clock(put_loop(to_group1, True))),
                      ("put_device", lambda: _clock(put_loop(devices[1], False)))]
    for r in range(args.rounds + 1):  # round 0 warms up
        into = rows if r else Rows(k)
        _in_turn(r, run_timed, into, "Run", "local")
        _in_turn(r, transfer_timed, into, "Transfer", "local")
    return {"devices": [str(d) for d in devices], "rows": rows.rows()}


# ----------------------------------------------------------------------------- MPI mode

# Message paths: name -> (JAXPP_MPI_STAGED_MESSAGES, JAXPP_MPI_POSTED_SENDS).
PATHS = {"posted": ("0", True), "chained": ("0", False), "staged": ("1", True)}


def mpi_mode(args) -> dict[str, Any] | None:
    """Run on both ranks, Sends on rank 0, Recvs on rank 1; rank 0 returns the section."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from mpi4py import MPI

    from jaxpp_mpi._src.base import config
    from jaxpp_mpi._src.ir.simulate import verify
    from jaxpp_mpi._src.mpi import chains, collectives
    from jaxpp_mpi._src.runtime.mpi import MpiExecutor
    from jaxpp_mpi._src.runtime.shards import Messenger, ShardPlan

    k = args.count
    comm = collectives.world_dup()  # barriers and the mpi4py references
    ex_comm = collectives.world_dup()  # the executors' messages
    chain_comm = collectives.world_dup()  # the chains called directly
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        raise SystemExit(f"MPI mode needs exactly 2 ranks, got {comm.Get_size()}")
    peer = 1 - rank
    device = jax.devices()[0]
    sharding = NamedSharding(jax.make_mesh((1,), ("data",), devices=[device]), PartitionSpec())
    add = jax.jit(lambda x: (x + 1.0,))
    x = jax.device_put(np.zeros(8, np.float32), sharding)
    buf = np.zeros(8, np.float32)
    runs, sends = run_program(2, k), send_program(k)
    verify(runs)
    verify(sends)
    options = config.options()
    run_ex = MpiExecutor(runs, rank, {"add": add}, lambda a: sharding, ex_comm, options)
    msg_ex = {name: MpiExecutor(sends, rank, {"add": add}, lambda a: sharding, ex_comm,
                                dataclasses.replace(options, staged_messages=staging,
                                                    posted_sends=posting))
              for name, (staging, posting) in PATHS.items()}
    staged = msg_ex["staged"]._sends is not None  # needs MPI_THREAD_MULTIPLE
    messenger = Messenger(chain_comm)
    plan = ShardPlan(VALUE, sharding)
    (_, send_chain), (_, recv_chain) = messenger.send(plan, 0, peer), messenger.recv(plan, 0, peer)
    chain = chains.Chain(device)

    def step(ex) -> float:
        start = time.perf_counter()
        jax.block_until_ready(ex.run_replicas([x, x] if ex is run_ex else [x]))
        return time.perf_counter() - start

    def done(ex) -> float:  # the step, until its messages have left (`ex`'s own waits)
        start = time.perf_counter()
        jax.block_until_ready(ex.run_replicas([x]))
        ex._chain.wait()
        for waiter in (ex._posted, ex._sends):
            if waiter is not None:
                waiter.wait()
        return time.perf_counter() - start

    def chain_loop(fn, sync: bool, send: bool) -> float:
        start = time.perf_counter()
        kept = []  # received values, live until the end as the program's are
        for _ in range(k):
            if send:
                (chain.order,) = fn(chain.order, x)
            else:
                chain.order, y = fn(chain.order)
                kept.append(y)
            if sync:
                chain.wait()
        chain.wait()
        return time.perf_counter() - start

    def mpi4py_send(c, blocking: bool = True) -> float:
        start = time.perf_counter()
        if blocking:
            for _ in range(k):
                c.Send(buf, dest=peer, tag=0)
            return time.perf_counter() - start
        requests = [c.Isend(buf, dest=peer, tag=0) for _ in range(k)]
        seconds = time.perf_counter() - start
        MPI.Request.Waitall(requests)  # after the clock, as the runtime reaps its later
        return seconds

    def mpi4py_recv(c) -> float:
        start = time.perf_counter()
        for _ in range(k):
            c.Recv(buf, source=peer, tag=0)
        return time.perf_counter() - start

    def sending(name: str, sender: Callable[[], float], over) -> tuple[str, Callable]:
        """Rank 0 times `sender`; rank 1 takes the messages with mpi4py over `over`, the
        same for every contender (a sender that outruns MPI's buffers waits alike)."""
        def timed() -> float:
            comm.Barrier()
            seconds = sender() if rank == 0 else mpi4py_recv(over)
            comm.Barrier()
            return seconds
        return name, timed

    def receiving(name: str, over, receiver: Callable[[], float]) -> tuple[str, Callable]:
        """Rank 0 sends K messages with mpi4py over `over` before a barrier; rank 1
        times `receiver` after it."""
        def timed() -> float:
            comm.Barrier()
            if rank == 0:
                mpi4py_send(over)
            comm.Barrier()
            seconds = receiver() if rank == 1 else 0.0
            comm.Barrier()
            return seconds
        return name, timed

    def barriered(name: str, fn: Callable[[], float]) -> tuple[str, Callable]:
        def timed() -> float:
            comm.Barrier()
            return fn()
        return name, timed

    cases: list[tuple[str, str, str, list]] = [  # (instr, where, reference, contenders)
        ("Run", f"rank {rank}", "jit", [
            barriered("runtime", lambda: step(run_ex)),
            *(barriered(name, fn) for name, fn in _jit_loops(add, x, k))]),
        ("Send (posted)", "rank 0", "mpi4py", [
            sending("runtime", lambda: step(msg_ex["posted"]), ex_comm),
            sending("mpi4py", lambda: mpi4py_send(comm, blocking=False), comm),
            sending("mpi4py_blocking", lambda: mpi4py_send(comm), comm)]),
        ("Send (chained)", "rank 0", "jit", [
            sending("runtime", lambda: done(msg_ex["chained"]), ex_comm),
            sending("jit", lambda: chain_loop(send_chain, False, True), chain_comm),
            sending("jit_sync", lambda: chain_loop(send_chain, True, True), chain_comm),
            sending("mpi4py", lambda: mpi4py_send(comm), comm)]),
        ("Recv (chained)", "rank 1", "jit", [
            receiving("runtime", ex_comm, lambda: step(msg_ex["posted"])),
            receiving("jit", chain_comm, lambda: chain_loop(recv_chain, False, False)),
            receiving("jit_sync", chain_comm, lambda: chain_loop(recv_chain, True, False)),
            receiving("mpi4py", comm, lambda: mpi4py_recv(comm))]),
    ]
    if staged:
        cases += [
            ("Send (staged)", "rank 0", "mpi4py", [
                sending("runtime", lambda: step(msg_ex["staged"]), ex_comm),
                sending("done", lambda: done(msg_ex["staged"]), ex_comm),
                sending("mpi4py", lambda: mpi4py_send(comm, blocking=False), comm)]),
            ("Recv (staged)", "rank 1", "mpi4py", [
                receiving("runtime", ex_comm, lambda: step(msg_ex["staged"])),
                receiving("mpi4py", comm, lambda: mpi4py_recv(comm))]),
        ]
    rows = Rows(k)
    for instr, where, reference, _ in cases:
        rows.reference[instr, where] = reference
    for r in range(args.rounds + 1):  # round 0 warms up
        for instr, where, _, contenders in cases:
            mine = r and where == f"rank {rank}"
            _in_turn(r, contenders, rows if mine else Rows(k), instr, where)
    every = comm.gather(rows.rows(), root=0)
    if rank:
        return None
    return {"ranks": comm.Get_size(), "mpi": collectives.library_version(),
            "watchdog": options.watchdog, "staged": staged,
            "rows": sorted((row for part in every for row in part),
                           key=lambda row: ORDER.index(row["instr"]))}


ORDER = ("Run", "Transfer", "Send (posted)", "Send (chained)", "Send (staged)",
         "Recv (chained)", "Recv (staged)")


# ----------------------------------------------------------------------------- output


def _us(row: dict[str, Any], name: str) -> str:
    value = row.get(f"{name}_us")
    return f"{value:>9.2f}" if value is not None else f"{'-':>9}"


def print_table(mode: str, section: dict[str, Any]) -> None:
    print(f"{mode}: µs per instruction, median over {section['rows'][0]['rounds']} rounds "
          f"of {section['rows'][0]['count']}")
    print(f"{'instr':<15} {'where':<7} {'runtime':>9} {'done':>9} {'jit':>9} {'jit_sync':>9} "
          f"{'to_device':>9} {'mpi4py':>9} {'blocking':>9} {'overhead':>9}  vs")
    for row in section["rows"]:
        print(f"{row['instr']:<15} {row['where']:<7} " + " ".join(
            _us(row, name) for name in COLUMNS) + f" {row['overhead_us']:>9.2f}  "
            f"{row['overhead_vs']}")


def main() -> None:
    args = parse_args()
    mode = "mpi" if launcher_world_size(os.environ) > 1 else "local"
    flag = "--xla_force_host_platform_device_count"
    if mode == "local" and flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {flag}=2").strip()
    section = local_mode(args) if mode == "local" else mpi_mode(args)
    if section is None:
        return
    result: dict[str, Any] = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    result.update({"benchmark": "dispatch", **metadata()})
    result[mode] = section
    write_json(args.out, result)
    print_table(mode, section)
    print(f"wrote {args.out} ({mode})", flush=True)


if __name__ == "__main__":
    main()
