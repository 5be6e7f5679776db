"""The one rendezvous player: every group of a Program played together, blocking sends.

Note: rendezvous play.
  All groups advance together, each through its instructions in program order. Run,
  Free and AllReduce complete at once. A Send (or the send half of a SendRecv)
  completes only when its destination has reached the matching Recv (or receive half),
  and the other way round; the two halves then *match*, one joint event of both
  groups. A SendRecv completes once both of its halves have matched. Which receive a
  send meets is fixed statically by `match_messages`. A program whose play ends with
  some group short of its end would deadlock under MPI without eager buffering
  (`ProgramError` kind 'deadlock').

  The play is deterministic: groups are visited in sweeps, in increasing group order;
  a visited group advances until it blocks, and a group whose instruction is unblocked
  by another is visited again later in the same sweep if its index is larger, else in
  the next sweep. Which groups finish, and where the others block, do not depend on
  this order; the order of `Completed` and `Matched` events does (the local executor
  runs in it, see `Note: local order` in runtime/local.py).

  An AllReduce is a collective of the R ranks that run one group's program, one per
  pipeline replica (`Note: replica reductions` in ir/reductions.py), yet it is played as
  completing at once, and one play stands for all R replicas. That is sound: every
  replica runs the same programs and messages never cross replicas, so the R replicas
  can replay this play in lockstep, each event in all of them at once: a Run, a Free
  or a matched message concerns one replica at a time, and an AllReduce of group g
  finds the R copies of group g all at it, so it completes. If this play finishes,
  that lockstep play of the R replicas finishes too. Nor can another interleaving
  deadlock: each rank's program is a fixed sequence and its messages' partners are
  fixed (`match_messages`), so where a rank blocks depends only on what the others
  have reached, not on the order they reached it in (the argument that makes the
  sweep order irrelevant above).

  The verifier and simulator (ir/simulate.py) and the local executor's global order
  (runtime/local.py) consume this play. Lowering (compiler/lower.py) does not: it
  builds the program in an order that is itself a rendezvous play (see `Note: global
  order` there).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator, Sequence

from jaxpp_mpi._src.ir.passes import Loc, Matching, match_messages
from jaxpp_mpi._src.ir.program import (
    INSTR_TYPES,
    AllReduce,
    Free,
    GroupProgram,
    Program,
    ProgramError,
    Run,
    SendRecv,
)

__all__ = ["Completed", "Matched", "format_grid", "play", "play_through"]


@dataclasses.dataclass(frozen=True, slots=True)
class Completed:
    """Instruction `index` of group `group` completes; the group moves past it.

    For a message instruction this comes after the `Matched` event of each of its halves.
    """

    group: int
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class Matched:
    """A send half meets its receive half; both groups are at those instructions.

    Attributes:
      send: (group, instruction index) of the send half.
      recv: (group, instruction index) of the receive half.
    """

    send: Loc
    recv: Loc


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


_SEND, _RECV = 1, 2  # bits of a group's matched halves at its current instruction


def _deadlock(
    program: Program,
    matching: Matching,
    pcs: list[int],
    done: list[int],
) -> ProgramError:
    """The 'deadlock' error for a play stuck at `pcs`, naming each blocked group's wait."""
    lines, blocked = [], []
    for g in program.groups:
        a, pc = g.mpmd_idx, pcs[g.mpmd_idx]
        if pc == len(g.instrs):
            continue
        instr = g.instrs[pc]
        blocked.append(a)
        line = f"group {a} blocked at #{pc} {instr}"
        # the task of the latest Run it ran
        task = next((r.task for r in reversed(g.instrs[:pc]) if isinstance(r, Run)), "")
        if task:
            line += f" (task {task})"
        for half, peers in ((_SEND, matching.recv_of), (_RECV, matching.send_of)):
            if done[a] & half or pc not in peers[a]:
                continue
            h, j = peers[a][pc]
            at = "finished" if pcs[h] == len(program.groups[h].instrs) else f"at #{pcs[h]}"
            line += f"; waits for group {h} #{j} (group {h} is {at})"
        lines.append("  " + line)
    return ProgramError(
        "deadlock",
        f"{len(blocked)} of {program.num_groups} groups blocked\n"
        + "\n".join(lines)
        + "\n"
        + format_grid(program, pcs),
        blocked,
        pcs[blocked[0]],
    )


def _halves(kind: type) -> int:
    """How many halves an instruction of class `kind` matches before it completes: 0
    for a Run, Free or AllReduce (they complete at once), 2 for a SendRecv, else 1."""
    if issubclass(kind, (Run, Free, AllReduce)):
        return 0
    return 2 if issubclass(kind, SendRecv) else 1


_HALVES = {kind: _halves(kind) for kind in INSTR_TYPES}


def play(program: Program, matching: Matching | None = None) -> Iterator[Completed | Matched]:
    """Plays every group of `program` together (see `Note: rendezvous play`).

    Args:
      program: the program.
      matching: `match_messages(program)`, if the caller has it already.

    Yields:
      A `Matched` event for each send half meeting its receive half, and a `Completed`
      event for each instruction, in the order of the play. Each group's `Completed`
      events come in its program order.

    Raises:
      ProgramError: kind 'unmatched' (from `match_messages`) if a message has no
        partner; kind 'deadlock' once no group can advance and some have not finished,
        naming where each blocked group is and which group it waits for, with a grid
        of the last instructions reached (`format_grid`).
    """
    if matching is None:
        matching = match_messages(program)
    yield from _play(program, matching, True)


def play_through(program: Program, matching: Matching) -> None:
    """Plays `program` as `play` does, to its end, without making its events.

    Args:
      program: the program.
      matching: `match_messages(program)`.

    Raises:
      ProgramError: kind 'deadlock', as `play`.
    """
    for _ in _play(program, matching, False):
        pass  # yields nothing


def _play(program: Program, matching: Matching, events: bool) -> Iterator[Completed | Matched]:
    """The play of `play`, yielding its events only if `events`."""
    instrs = [g.instrs for g in program.groups]
    n = len(instrs)
    pcs = [0] * n
    done = [0] * n  # per group: the halves (_SEND, _RECV) matched at its current pc
    queue = [(0, a) for a in range(n)]  # (sweep, group): a sorted list is a heap
    queued = [0] * n  # per group: the sweep it is queued for, -1 if not queued
    halves = dict(_HALVES)  # and those of subclasses, once met
    heappop, heappush = heapq.heappop, heapq.heappush

    while queue:
        sweep, a = heappop(queue)
        queued[a] = -1
        code, pc = instrs[a], pcs[a]
        # the peer (group, index) of a send half of group a, of a receive half
        to_peer, from_peer = matching.recv_of[a], matching.send_of[a]
        while pc < len(code):
            instr = code[pc]
            need = halves.get(type(instr))
            if need is None:
                need = halves[type(instr)] = _halves(type(instr))
            if need:
                for half, peer in ((_SEND, to_peer.get(pc)), (_RECV, from_peer.get(pc))):
                    if peer is None or done[a] & half or pcs[peer[0]] != peer[1]:
                        continue
                    h = peer[0]
                    if events:
                        yield Matched((a, pc), peer) if half == _SEND else Matched(peer, (a, pc))
                    done[a] |= half
                    done[h] |= _RECV if half == _SEND else _SEND
                    if queued[h] < 0:  # wake group h, in this sweep if it comes later
                        queued[h] = sweep if h > a else sweep + 1
                        heappush(queue, (queued[h], h))
                if (done[a] & _SEND) + (done[a] >> 1) < need:
                    break
                done[a] = 0
            if events:
                yield Completed(a, pc)
            pc += 1
            pcs[a] = pc
    if any(pc < len(code) for pc, code in zip(pcs, instrs, strict=True)):
        raise _deadlock(program, matching, pcs, done)
