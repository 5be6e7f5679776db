"""Rendezvous dry run of a Program: verification and makespan prediction.

The static checks that come first (peers, tags, buffer lifetimes, message avals) are in
ir/checks.py.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

from jaxpp_mpi._src.ir import rendezvous
from jaxpp_mpi._src.ir.checks import check_static, locate
from jaxpp_mpi._src.ir.passes import Loc, match_messages, recv_half, send_half
from jaxpp_mpi._src.ir.program import (
    AllReduce,
    Aval,
    Free,
    GroupProgram,
    Instr,
    Program,
    ProgramError,
    Run,
)
from jaxpp_mpi._src.ir.reductions import aval_nbytes
from jaxpp_mpi._src.ir.rendezvous import format_grid
from jaxpp_mpi._src.schedules.tasks import label_latency

__all__ = [
    "AllReduceCost",
    "Event",
    "MessageCost",
    "ProgramError",
    "SimResult",
    "aval_nbytes",
    "default_latency",
    "format_grid",
    "posted_order",
    "ring_allreduce",
    "runtime_sends",
    "simulate",
    "verify",
]

Latency = Callable[[Run], float]
Transfer = Callable[[Aval], float]
AllReduceCost = Callable[[float, int], float]
"""(bytes of one AllReduce's buffers together, number of replicas) -> its time."""


def default_latency(instr: Run) -> float:
    """Returns the latency of a Run from its task label (`schedules.tasks.label_latency`).

    F=1, B=2, I=1, W=1, '' = 0; fused labels joined with '+' ('F3s1+B1s1') sum their parts.

    Args:
      instr: the Run.

    Returns:
      Its default latency.

    Raises:
      ValueError: if a part of its label is not a pipeline task.
    """
    try:
        return label_latency(instr.task)
    except ValueError as e:
        raise ValueError(f"{e} of `{instr}`") from None


def _no_transfer(aval: Aval) -> float:
    return 0.0


def runtime_sends(platform: str, posted_sends: bool = True, staged: bool = False) -> str:
    """How the MPI executor sends from a group on `platform`: "posted" on CPU (`Note:
    posted sends` in mpi/posted.py) unless `posted_sends` is off (the option
    JAXPP_MPI_POSTED_SENDS), and wherever messages are `staged` (`Note: staged
    messages` in mpi/staged.py: a staged send never holds the group either; the
    option JAXPP_MPI_STAGED_MESSAGES, resolved by `config.stages_messages`), else
    "blocking" (message chains). The compiler times its candidate orders the same way."""
    return "posted" if staged or (platform == "cpu" and posted_sends) else "blocking"


@dataclasses.dataclass(frozen=True)
class MessageCost:
    """A message's time as `latency + bytes / bandwidth`: a `transfer` for `simulate`.

    Note: message model.
      `simulate` plays messages with rendezvous semantics: a message starts when both
      its sender and its receiver have reached it and ends `transfer(aval)` later;
      both ends wait until then. `MessageCost` is that transfer for a point-to-point
      link measured by ping-pong (`bench/p2p.py`: latency is half the round trip of a
      small message, bandwidth the slope over large ones), in the unit the task
      latencies use (the benchmarks use milliseconds, so `bandwidth` is bytes per ms).
      A SendRecv's two halves are two messages, each charged on its own; an AllReduce
      across replicas is charged as a ring of such messages (`ring_allreduce`). Without a
      transfer, messages are free, which isolates the schedule's own bubbles;
      with a measured one, measured / predicted isolates the runtime's overhead.

      With `sends="posted"` (what the MPI executor does on CPU, `Note: posted sends` in
      mpi/posted.py) a send half completes when its group reaches it, and its message
      arrives `transfer(aval)` later; a receive half completes at the later of the
      time its group reached it and that arrival. The program must still be
      deadlock-free with blocking sends (other platforms block), which is checked first.

    Attributes:
      latency: time of an empty message.
      bandwidth: bytes per time unit; `inf` for latency only.
    """

    latency: float
    bandwidth: float

    def __post_init__(self) -> None:
        if not self.latency >= 0:
            raise ValueError(f"MessageCost latency must be >= 0, got {self.latency!r}")
        if not self.bandwidth > 0:
            raise ValueError(
                f"MessageCost bandwidth must be > 0 bytes per time unit, got "
                f"{self.bandwidth!r} (use float('inf') for latency-only messages)"
            )

    def __call__(self, aval: Aval) -> float:
        """The time of one message carrying a value of `aval`."""
        return self.latency + aval_nbytes(aval) / self.bandwidth


def ring_allreduce(transfer: Transfer | None) -> AllReduceCost:
    """The time of an `AllReduce` as a ring all-reduce over the link `transfer` models.

    A ring all-reduce of n bytes over R ranks takes 2(R-1) steps (reduce-scatter, then
    all-gather), each moving n/R bytes to the next rank. With `MessageCost(latency,
    bandwidth)` that is `2(R-1)/R * n / bandwidth + 2(R-1) * latency`; with another
    transfer, 2(R-1) messages of `ceil(n/R)` bytes (as a uint8 vector). It is 0 with
    one replica or free messages (`transfer` None).

    Args:
      transfer: the point-to-point message model (`Note: message model`), or None.

    Returns:
      `cost(nbytes, replicas)`.
    """

    def cost(nbytes: float, replicas: int) -> float:
        if transfer is None or replicas <= 1:
            return 0.0
        steps = 2 * (replicas - 1)
        if isinstance(transfer, MessageCost):
            return steps / replicas * nbytes / transfer.bandwidth + steps * transfer.latency
        return steps * transfer(Aval((math.ceil(nbytes / replicas),), "uint8"))

    return cost


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One executed instruction of one group, for Gantt charts and traces."""

    index: int
    instr: Instr
    start: float
    end: float

    @property
    def kind(self) -> str:
        """'task' (a Run), 'message' (Send, Recv, SendRecv), 'allreduce' or 'free'; the
        first three are the categories of the runtime's trace events
        (`timeline.timing.TraceEvent.cat`)."""
        if isinstance(self.instr, Run):
            return "task"
        if isinstance(self.instr, AllReduce):
            return "allreduce"
        if isinstance(self.instr, Free):
            return "free"
        return "message"


@dataclasses.dataclass(frozen=True)
class SimResult:
    """The outcome of `simulate`.

    Attributes:
      finish: per group, the time its last instruction completes.
      makespan: the largest finish time.
      events: per group, every instruction with its start and end time.
      busy: per group, the total time spent in Run instructions.
    """

    finish: tuple[float, ...]
    makespan: float
    events: tuple[tuple[Event, ...], ...]
    busy: tuple[float, ...]


# ----------------------------------------------------------------------------- the play


def _play(
    program: Program,
    latency: Latency,
    transfer: Transfer,
    reduce_time: Callable[[AllReduce, GroupProgram], float],
    check_leaks: bool,
) -> SimResult:
    """Times the rendezvous play (`rendezvous.play`) of a statically checked program."""
    matching = check_static(program, check_leaks)
    n = program.num_groups
    instrs = [g.instrs for g in program.groups]
    now = [0.0] * n  # per group: the time it reached its current instruction
    busy = [0.0] * n
    halves: list[list[float]] = [[] for _ in range(n)]  # matched halves' times, current pc
    events: list[list[Event]] = [[] for _ in range(n)]
    for event in rendezvous.play(program, matching):
        if isinstance(event, rendezvous.Matched):
            (s, _), (d, j) = event.send, event.recv
            t = max(now[s], now[d]) + transfer(recv_half(instrs[d][j])[3])
            halves[s].append(t)
            halves[d].append(t)
            continue
        a, pc = event.group, event.index
        instr, start = instrs[a][pc], now[a]
        if isinstance(instr, Run):
            end = start + latency(instr)
            busy[a] += end - start
        elif isinstance(instr, Free):
            end = start
        elif isinstance(instr, AllReduce):
            end = start + reduce_time(instr, program.groups[a])
        else:
            end = max(halves[a])
            halves[a] = []
        events[a].append(Event(pc, instr, start, end))
        now[a] = end
    return _result(now, events, busy)


def _result(now: list[float], events: list[list[Event]], busy: list[float]) -> SimResult:
    """A play's outcome from its per-group clocks, events and busy times."""
    return SimResult(finish=tuple(now), makespan=max(now, default=0.0),
                     events=tuple(tuple(e) for e in events), busy=tuple(busy))


def posted_order(program: Program) -> Iterator[tuple[bool, int, int, Loc | None]]:
    """The instructions of a statically checked `program` in an order its groups can
    run them with posted sends (`Note: message model`): each group advances until a
    receive half whose send half its peer has not reached; a SendRecv posts its send
    half before it waits.

    Yields:
      (posted, group, instruction index, sender): with `posted`, the group has reached
      the send half at that index (once per send half, before the instruction
      completes); else the instruction completes, `sender` being the matching send
      half's location for a receive half (posted before), else None.

    Raises:
      ProgramError: kind 'deadlock' if some receive's send is never reached (cannot
        happen for a program `verify` passes).
    """
    matching = match_messages(program)
    instrs = [g.instrs for g in program.groups]
    pc = [0] * len(instrs)
    posted: set[Loc] = set()
    moved = True
    while moved:
        moved = False
        for a, mine in enumerate(instrs):
            while pc[a] < len(mine):
                k = pc[a]
                if send_half(mine[k]) is not None and (a, k) not in posted:
                    posted.add((a, k))
                    yield True, a, k, None
                sender = matching.send_of[a].get(k)
                if sender is not None and sender not in posted:
                    break
                yield False, a, k, sender
                pc[a], moved = k + 1, True
    stuck = [a for a, mine in enumerate(instrs) if pc[a] < len(mine)]
    if stuck:
        raise ProgramError("deadlock", "posted sends: " + "; ".join(
            locate(a, pc[a], instrs[a][pc[a]]) for a in stuck), stuck, pc[stuck[0]])


def _play_posted(
    program: Program,
    latency: Latency,
    transfer: Transfer,
    reduce_time: Callable[[AllReduce, GroupProgram], float],
    check_leaks: bool,
) -> SimResult:
    """Times `posted_order`: a send half completes when reached, its message arrives
    `transfer` later, a receive half completes at the later of both."""
    verify(program, check_leaks=check_leaks)  # every platform's runtime can run it
    n = program.num_groups
    instrs = [g.instrs for g in program.groups]
    now, busy = [0.0] * n, [0.0] * n
    posted: dict[Loc, float] = {}  # send half -> when it was posted
    events: list[list[Event]] = [[] for _ in range(n)]
    for is_post, a, k, sender in posted_order(program):
        instr, start = instrs[a][k], now[a]
        if is_post:
            posted[(a, k)] = start
            continue
        if isinstance(instr, Run):
            end = start + latency(instr)
            busy[a] += end - start
        elif isinstance(instr, AllReduce):
            end = start + reduce_time(instr, program.groups[a])
        elif sender is not None:
            end = max(start, posted[sender] + transfer(recv_half(instr)[3]))
        else:
            end = start
        events[a].append(Event(k, instr, start, end))
        now[a] = end
    return _result(now, events, busy)


def verify(program: Program, *, check_leaks: bool = True) -> None:
    """Proves that `program` runs to completion under rendezvous send/recv.

    Checks peers, tags, buffer lifetimes and message avals statically
    (`checks.check_static`), then plays all groups together (`rendezvous.play_through`,
    see `Note: rendezvous play`): Run, Free and AllReduce complete at once; a Send (or a
    send half) completes only when its destination has reached the matching Recv (or
    receive half), and the other way round; a SendRecv completes when both halves
    have. See `Note: program invariants` for the buffer and matching rules checked; an
    AllReduce uses its buffers (defined, not freed) and leaves them live, and is no
    message.

    Args:
      program: the program.
      check_leaks: also reject buffers that are never freed and are not outputs.

    Raises:
      ProgramError: with `kind` 'bad_peer', 'bad_tag', 'undefined', 'use_after_free',
        'redefined', 'leak', 'unmatched', 'aval_mismatch' or 'deadlock', and a message
        naming the group(s) and instruction(s) involved.
    """
    rendezvous.play_through(program, check_static(program, check_leaks))


def simulate(
    program: Program,
    latency: Latency | None = None,
    transfer: Transfer | None = None,
    *,
    check_leaks: bool = True,
    replicas: int = 1,
    allreduce_cost: AllReduceCost | None = None,
    sends: str = "blocking",
) -> SimResult:
    """Plays `program` as `verify` does, with time.

    A Run takes `latency(instr)`; a message completes at the later of the times its
    sender and its receiver reached it, plus `transfer(aval)` (blocking sends; posted
    ones: `Note: message model`); Free takes no time; an
    AllReduce occupies its group for `allreduce_cost(nbytes, replicas)`, nbytes being
    the total `aval_nbytes` of its buffers. The `replicas` pipeline replicas are taken
    to run in lockstep (each plays the same program with the same latencies), so one
    replica is played and no replica waits for another at an AllReduce; a replica
    that lags in practice (other data, a slower device) is not modelled.

    Args:
      program: the program.
      latency: time of a Run; `default_latency` if None.
      transfer: time of a message given the received aval; 0 if None (free
        messages). `MessageCost(latency, bandwidth)` is the measured link's model
        (see `Note: message model`).
      check_leaks: as in `verify`.
      replicas: the number of pipeline replicas R, each running this program.
      allreduce_cost: time of an AllReduce from its bytes and R;
        `ring_allreduce(transfer)` if None (0 when R == 1 or messages are free).
      sends: "blocking" (rendezvous) or "posted" (a send completes at once; `Note:
        message model`).

    Returns:
      Finish times, makespan, per-instruction events and busy time (Runs only) per
      group.

    Raises:
      ProgramError: as `verify`.
      ValueError: if `replicas < 1`, or `sends` is neither "blocking" nor "posted".
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if sends not in ("blocking", "posted"):
        raise ValueError(f"sends must be 'blocking' or 'posted', got {sends!r}")
    cost = allreduce_cost or ring_allreduce(transfer)

    def reduce_time(instr: AllReduce, g: GroupProgram) -> float:
        return cost(sum(aval_nbytes(g.aval(b)) for b in instr.bufs), replicas)

    if sends == "posted":
        return _play_posted(program, latency or default_latency, transfer or _no_transfer,
                            reduce_time, check_leaks)
    return _play(
        program,
        latency or default_latency,
        transfer or _no_transfer,
        reduce_time,
        check_leaks,
    )
