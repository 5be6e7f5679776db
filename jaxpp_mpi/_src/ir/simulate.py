"""Rendezvous dry run of a Program: verification and makespan prediction."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence

from jaxpp_mpi._src.ir.program import (
    Aval,
    Free,
    GroupProgram,
    Instr,
    Program,
    ProgramError,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi._src.ir.passes import Matching, match_messages, recv_half, send_half

__all__ = [
    "Event",
    "ProgramError",
    "SimResult",
    "default_latency",
    "format_grid",
    "simulate",
    "verify",
]

Latency = Callable[[Run], float]
Transfer = Callable[[Aval], float]

_TASK_LATENCY = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def default_latency(instr: Run) -> float:
    """Latency of a Run from its task label: F=1, B=2, I=1, W=1, '' = 0.

    Fused labels joined with '+' ('F3s1+B1s1') sum their parts.

    Raises:
      ValueError: if a part does not start with F, B, I or W.
    """
    if not instr.task:
        return 0.0
    total = 0.0
    for part in instr.task.split("+"):
        if not part or part[0] not in _TASK_LATENCY:
            raise ValueError(f"no default latency for task {part!r} of `{instr}`")
        total += _TASK_LATENCY[part[0]]
    return total


def _no_transfer(aval: Aval) -> float:
    return 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One executed instruction of one group, for Gantt charts and traces."""

    index: int
    instr: Instr
    start: float
    end: float


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


# ----------------------------------------------------------------------------- static checks


def _where(g: int, i: int, instr: Instr) -> str:
    return f"group {g} #{i} {instr}"


def _check_peers(program: Program) -> None:
    n = program.num_groups
    for g in program.groups:
        a = g.mpmd_idx
        for i, instr in enumerate(g.instrs):
            for half, way in ((send_half(instr), "to"), (recv_half(instr), "from")):
                if half is None:
                    continue
                peer, tag = half[1], half[2]
                if peer == a or not 0 <= peer < n:
                    why = "itself" if peer == a else f"group {peer} (there are {n} groups)"
                    raise ProgramError(
                        "bad_peer", f"{_where(a, i, instr)}: message {way} {why}", (a,), i
                    )
                if tag < 0:
                    raise ProgramError(
                        "bad_tag",
                        f"{_where(a, i, instr)}: negative tag {tag} (run assign_tags)",
                        (a,),
                        i,
                    )


def _check_buffers(g: GroupProgram, check_leaks: bool) -> None:
    """Walks one group in program order, tracking which buffers are live."""
    a, avals = g.mpmd_idx, g.aval_map
    live: dict[int, int] = {}  # buffer -> index of its definition (-1: an input)
    dead: dict[int, tuple[int, str]] = {}  # buffer -> (index, 'freed' | 'donated')

    def fail(kind: str, i: int | None, msg: str) -> None:
        where = f"group {a} inputs" if i is None else _where(a, i, g.instrs[i])
        raise ProgramError(kind, f"{where}: {msg}", (a,), i)

    def use(i: int, b: int) -> None:
        if b not in live:
            if b in dead:
                j, how = dead[b]
                fail("use_after_free", i, f"%{b} was {how} at #{j} {g.instrs[j]}")
            fail("undefined", i, f"%{b} is not defined")

    def define(i: int | None, b: int) -> None:
        if b in live:
            j = live[b]
            at = "an input" if j < 0 else f"defined at #{j} {g.instrs[j]}"
            fail("redefined", i, f"%{b} is still live ({at})")
        if b not in avals:
            fail("undefined", i, f"%{b} has no aval")
        live[b] = -1 if i is None else i
        dead.pop(b, None)

    def kill(i: int, b: int, how: str) -> None:
        use(i, b)
        del live[b]
        dead[b] = (i, how)

    for b, _ in g.inputs:
        define(None, b)
    for i, instr in enumerate(g.instrs):
        match instr:
            case Run():
                for b in instr.ins:
                    use(i, b)
                for b in instr.donate:
                    kill(i, b, "donated")
                for b in instr.outs:
                    define(i, b)
            case Send():
                use(i, instr.buf)
            case Recv() | SendRecv():
                if isinstance(instr, SendRecv):
                    use(i, instr.send_buf)
                b = recv_half(instr)[0]
                define(i, b)
                if avals[b] != instr.aval:
                    fail("aval_mismatch", i, f"receives {instr.aval} but %{b} has {avals[b]}")
            case Free():
                for b in instr.bufs:
                    kill(i, b, "freed")
    for b, k in g.outputs:
        if b not in live:
            how = f"was {dead[b][1]} at #{dead[b][0]}" if b in dead else "is never defined"
            raise ProgramError(
                "use_after_free" if b in dead else "undefined",
                f"group {a} outputs: output {k} (%{b}) {how}",
                (a,),
            )
    if check_leaks:
        leaked = sorted(live.keys() - {b for b, _ in g.outputs})
        if leaked:
            b, j = leaked[0], live[leaked[0]]
            at = "an input" if j < 0 else f"defined at #{j} {g.instrs[j]}"
            names = " ".join(f"%{x}" for x in leaked[:8]) + (" ..." if len(leaked) > 8 else "")
            raise ProgramError(
                "leak",
                f"group {a}: {len(leaked)} buffer(s) never freed and not outputs: {names} "
                f"(%{b} is {at})",
                (a,),
                None if j < 0 else j,
            )


def _check_message_avals(program: Program, matching: Matching) -> None:
    for g in program.groups:
        for i, (h, j) in sorted(matching.recv_of[g.mpmd_idx].items()):
            sent = g.aval(send_half(g.instrs[i])[0])
            recv = program.groups[h].instrs[j]
            got = recv_half(recv)[3]
            if sent.shape != got.shape or sent.dtype != got.dtype:
                raise ProgramError(
                    "aval_mismatch",
                    f"{_where(g.mpmd_idx, i, g.instrs[i])} sends {sent} but "
                    f"{_where(h, j, recv)} receives {got}",
                    (g.mpmd_idx, h),
                    i,
                )


def _check_static(program: Program, check_leaks: bool) -> Matching:
    _check_peers(program)
    for g in program.groups:
        _check_buffers(g, check_leaks)
    matching = match_messages(program)
    _check_message_avals(program, matching)
    return matching


# ----------------------------------------------------------------------------- the play


def format_grid(program: Program, pcs: Sequence[int], depth: int = 6, width: int = 40) -> str:
    """A step x group grid of the last `depth` instructions each group reached.

    Row 0 holds the instruction at `pcs[g]` (marked '>'), rows -1, -2, ... the ones
    before it; a finished group shows '(finished)'.

    Args:
      program: the program.
      pcs: per group, the index of the instruction it is at (len(instrs) if finished).
      depth: number of rows.
      width: characters per cell; longer instructions are cut.

    Returns:
      The grid as text, one row per line.
    """

    def cell(g: GroupProgram, k: int) -> str:
        idx = pcs[g.mpmd_idx] + k
        if k == 0 and idx >= len(g.instrs):
            text = "  (finished)"
        elif 0 <= idx < len(g.instrs):
            text = f"{'>' if k == 0 else ' '}#{idx} {g.instrs[idx]}"
        else:
            text = ""
        return (text if len(text) <= width else text[: width - 3] + "...").ljust(width)

    rows = ["step | " + " | ".join(f"group {g.mpmd_idx}".ljust(width) for g in program.groups)]
    for k in range(1 - depth, 1):
        rows.append(f"{k:>4} | " + " | ".join(cell(g, k) for g in program.groups))
    return "\n".join(row.rstrip() for row in rows)


def _deadlock(
    program: Program,
    matching: Matching,
    pcs: list[int],
    tasks: list[str],
    pending: list[dict[str, float]],
) -> None:
    lines, blocked = [], []
    for g in program.groups:
        a, pc = g.mpmd_idx, pcs[g.mpmd_idx]
        if pc == len(g.instrs):
            continue
        instr = g.instrs[pc]
        blocked.append(a)
        line = f"group {a} blocked at #{pc} {instr}"
        if tasks[a]:
            line += f" (task {tasks[a]})"
        for half, peers in (("send", matching.recv_of), ("recv", matching.send_of)):
            if half in pending[a] or pc not in peers[a]:
                continue
            h, j = peers[a][pc]
            at = "finished" if pcs[h] == len(program.groups[h].instrs) else f"at #{pcs[h]}"
            line += f"; waits for group {h} #{j} (group {h} is {at})"
        lines.append("  " + line)
    raise ProgramError(
        "deadlock",
        f"{len(blocked)} of {program.num_groups} groups blocked\n"
        + "\n".join(lines)
        + "\n"
        + format_grid(program, pcs),
        blocked,
        pcs[blocked[0]],
    )


def _play(
    program: Program, latency: Latency, transfer: Transfer, check_leaks: bool, record: bool
) -> SimResult:
    matching = _check_static(program, check_leaks)
    n = program.num_groups
    instrs = [g.instrs for g in program.groups]
    pcs = [0] * n
    now = [0.0] * n  # per group: the time it reached instrs[pc]
    busy = [0.0] * n
    tasks = [""] * n  # per group: the task of its latest Run, for error messages
    pending: list[dict[str, float]] = [{} for _ in range(n)]  # halves done at the current pc
    events: list[list[Event]] = [[] for _ in range(n)]
    work = deque(range(n))
    while work:
        a = work.popleft()
        code = instrs[a]
        while pcs[a] < len(code):
            pc, instr = pcs[a], code[pcs[a]]
            start = now[a]
            if isinstance(instr, Run):
                end = start + latency(instr)
                busy[a] += end - start
                tasks[a] = instr.task
            elif isinstance(instr, Free):
                end = start
            else:
                done = pending[a]
                for half, peers, other in (
                    ("send", matching.recv_of, "recv"),
                    ("recv", matching.send_of, "send"),
                ):
                    peer = peers[a].get(pc)
                    if peer is None or half in done:
                        continue
                    h, j = peer
                    if pcs[h] != j:
                        continue
                    recv_loc = peer if half == "send" else (a, pc)
                    aval = recv_half(instrs[recv_loc[0]][recv_loc[1]])[3]
                    done[half] = pending[h][other] = max(start, now[h]) + transfer(aval)
                    if len(pending[h]) == (2 if isinstance(instrs[h][j], SendRecv) else 1):
                        work.append(h)
                if len(done) < (2 if isinstance(instr, SendRecv) else 1):
                    break
                end = max(done.values())
                pending[a] = {}
            if record:
                events[a].append(Event(pc, instr, start, end))
            now[a] = end
            pcs[a] = pc + 1
    if any(pcs[g] < len(instrs[g]) for g in range(n)):
        _deadlock(program, matching, pcs, tasks, pending)
    return SimResult(
        finish=tuple(now),
        makespan=max(now, default=0.0),
        events=tuple(tuple(e) for e in events),
        busy=tuple(busy),
    )


def verify(program: Program, *, check_leaks: bool = True) -> None:
    """Proves that `program` runs to completion under rendezvous send/recv.

    Plays all groups together: Run and Free complete at once; a Send (or a send half)
    completes only when its destination has reached the matching Recv (or receive half),
    and the other way round; a SendRecv completes when both halves have. See
    `Note: program invariants` for the buffer and matching rules checked.

    Args:
      program: the program.
      check_leaks: also reject buffers that are never freed and are not outputs.

    Raises:
      ProgramError: with `kind` 'bad_peer', 'bad_tag', 'undefined', 'use_after_free',
        'redefined', 'leak', 'unmatched', 'aval_mismatch' or 'deadlock', and a message
        naming the group(s) and instruction(s) involved.
    """
    _play(program, lambda instr: 0.0, _no_transfer, check_leaks, record=False)


def simulate(
    program: Program,
    latency: Latency | None = None,
    transfer: Transfer | None = None,
    *,
    check_leaks: bool = True,
) -> SimResult:
    """Plays `program` as `verify` does, with time.

    A Run takes `latency(instr)`; a message completes at the later of the times its
    sender and its receiver reached it, plus `transfer(aval)`; Free takes no time.

    Args:
      program: the program.
      latency: time of a Run; `default_latency` if None.
      transfer: time of a message given the received aval; 0 if None.
      check_leaks: as in `verify`.

    Returns:
      Finish times, makespan, per-instruction events and busy time per group.

    Raises:
      ProgramError: as `verify`.
    """
    return _play(
        program, latency or default_latency, transfer or _no_transfer, check_leaks, record=True
    )
