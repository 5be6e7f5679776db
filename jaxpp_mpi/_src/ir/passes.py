"""Lowering passes over the program IR: message matching, tags, frees, paired exchanges."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

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

Loc = tuple[int, int]  # (mpmd_idx, instruction index)


def send_half(instr: Instr) -> tuple[int, int, int] | None:
    """(buf, dst, tag) of the send half of `instr`, or None."""
    if isinstance(instr, Send):
        return instr.buf, instr.dst, instr.tag
    if isinstance(instr, SendRecv):
        return instr.send_buf, instr.dst, instr.send_tag
    return None


def recv_half(instr: Instr) -> tuple[int, int, int, Aval] | None:
    """(buf, src, tag, aval) of the receive half of `instr`, or None."""
    if isinstance(instr, Recv):
        return instr.buf, instr.src, instr.tag, instr.aval
    if isinstance(instr, SendRecv):
        return instr.recv_buf, instr.src, instr.recv_tag, instr.aval
    return None


@dataclasses.dataclass(frozen=True)
class Matching:
    """Which receive each send meets, and back.

    Attributes:
      recv_of: per group, {instr index of a send half: (group, instr index) of its receive}.
      send_of: per group, {instr index of a receive half: (group, instr index) of its send}.
    """

    recv_of: tuple[dict[int, Loc], ...]
    send_of: tuple[dict[int, Loc], ...]


def match_messages(program: Program) -> Matching:
    """Pairs every send half with its receive half, statically.

    Blocking operations are posted in program order, so MPI's rules (same source,
    destination and tag; non-overtaking among equal tags) make the k-th send on
    (src, dst, tag) meet the k-th receive on (src, dst, tag).

    Raises:
      ProgramError: kind 'unmatched', naming the first send or receive left over.
    """
    sends: dict[tuple[int, int, int], list[Loc]] = defaultdict(list)
    recvs: dict[tuple[int, int, int], list[Loc]] = defaultdict(list)
    for g in program.groups:
        for i, instr in enumerate(g.instrs):
            if (s := send_half(instr)) is not None:
                sends[(g.mpmd_idx, s[1], s[2])].append((g.mpmd_idx, i))
            if (r := recv_half(instr)) is not None:
                recvs[(r[1], g.mpmd_idx, r[2])].append((g.mpmd_idx, i))
    n = program.num_groups
    recv_of: tuple[dict[int, Loc], ...] = tuple({} for _ in range(n))
    send_of: tuple[dict[int, Loc], ...] = tuple({} for _ in range(n))
    leftover: list[tuple[Loc, str, tuple[int, int, int], int, int]] = []
    for key in sends.keys() | recvs.keys():
        ss, rs = sends.get(key, []), recvs.get(key, [])
        for s, r in zip(ss, rs, strict=False):
            recv_of[s[0]][s[1]] = r
            send_of[r[0]][r[1]] = s
        if len(ss) > len(rs):
            leftover.append((ss[len(rs)], "send", key, len(ss), len(rs)))
        elif len(rs) > len(ss):
            leftover.append((rs[len(ss)], "recv", key, len(ss), len(rs)))
    if leftover:
        (g, i), what, (src, dst, tag), n_send, n_recv = min(leftover)
        instr = program.groups[g].instrs[i]
        raise ProgramError(
            "unmatched",
            f"group {g} #{i} {instr}: no matching {'recv' if what == 'send' else 'send'} "
            f"(channel {src}->{dst} tag={tag}: {n_send} sends in group {src}, "
            f"{n_recv} receives in group {dst})",
            (g,),
            i,
        )
    return Matching(recv_of, send_of)


def assign_tags(program: Program) -> Program:
    """Numbers the messages of each channel, replacing every Send/Recv/SendRecv tag.

    The k-th send from group a to group b, in a's program order, gets tag k; the k-th
    receive from a in b's program order gets tag k. Tags depend only on the program,
    so every rank computes the same ones (see `Note: program invariants`). MPI only
    guarantees tags up to 32767 (MPI_TAG_UB); longer channels need a larger bound.

    Args:
      program: a program, typically built with tag=-1.

    Returns:
      The program with tags assigned.

    Raises:
      ProgramError: kind 'unmatched' if a channel's send and receive counts differ.
    """
    n_sent: dict[tuple[int, int], int] = defaultdict(int)
    n_recv: dict[tuple[int, int], int] = defaultdict(int)

    def next_tag(counter: dict[tuple[int, int], int], key: tuple[int, int]) -> int:
        counter[key] += 1
        return counter[key] - 1

    groups = []
    for g in program.groups:
        a, instrs = g.mpmd_idx, []
        for instr in g.instrs:
            if isinstance(instr, Send):
                instr = dataclasses.replace(instr, tag=next_tag(n_sent, (a, instr.dst)))
            elif isinstance(instr, Recv):
                instr = dataclasses.replace(instr, tag=next_tag(n_recv, (instr.src, a)))
            elif isinstance(instr, SendRecv):
                instr = dataclasses.replace(
                    instr,
                    send_tag=next_tag(n_sent, (a, instr.dst)),
                    recv_tag=next_tag(n_recv, (instr.src, a)),
                )
            instrs.append(instr)
        groups.append(dataclasses.replace(g, instrs=tuple(instrs)))
    for src, dst in sorted(n_sent.keys() | n_recv.keys()):
        if n_sent[(src, dst)] != n_recv[(src, dst)]:
            raise ProgramError(
                "unmatched",
                f"channel {src}->{dst}: group {src} sends {n_sent[(src, dst)]} messages, "
                f"group {dst} receives {n_recv[(src, dst)]}",
                (src, dst),
            )
    return Program(tuple(groups))


def _reads(instr: Instr) -> tuple[int, ...]:
    if isinstance(instr, Run):
        return instr.ins
    if (s := send_half(instr)) is not None:
        return (s[0],)
    return ()


def _writes(instr: Instr) -> tuple[int, ...]:
    if isinstance(instr, Run):
        return instr.outs
    if (r := recv_half(instr)) is not None:
        return (r[0],)
    return ()


def _add_frees(g: GroupProgram) -> GroupProgram:
    keep = {b for b, _ in g.outputs}
    last: dict[int, int] = {b: -1 for b, _ in g.inputs}  # live buffer -> its last use
    frees_after: dict[int, list[int]] = defaultdict(list)
    for i, instr in enumerate(g.instrs):
        for b in _reads(instr):
            if b in last:
                last[b] = i
        for b in instr.bufs if isinstance(instr, Free) else getattr(instr, "donate", ()):
            last.pop(b, None)
        for b in _writes(instr):
            last[b] = i
    for b, i in last.items():
        if b not in keep:
            frees_after[i].append(b)
    if not frees_after:
        return g
    instrs: list[Instr] = []
    if -1 in frees_after:
        instrs.append(Free(tuple(sorted(frees_after[-1]))))
    for i, instr in enumerate(g.instrs):
        instrs.append(instr)
        if i in frees_after:
            instrs.append(Free(tuple(sorted(frees_after[i]))))
    return dataclasses.replace(g, instrs=tuple(instrs))


def add_frees(program: Program) -> Program:
    """Frees every buffer right after its last use.

    Buffers that are outputs, donated, or already freed are left alone; a buffer that
    is never read is freed right after its definition (an unused input, at the start).
    The buffers freed at one point share one Free, sorted by id. Running the pass twice
    changes nothing (see `Note: program invariants`).

    Args:
      program: a program.

    Returns:
      The program with Free instructions inserted.
    """
    return Program(tuple(_add_frees(g) for g in program.groups))


def _next_non_free(instrs: tuple[Instr, ...], i: int) -> int:
    i += 1
    while i < len(instrs) and isinstance(instrs[i], Free):
        i += 1
    return i


def _prev_non_free(instrs: tuple[Instr, ...], i: int) -> int:
    i -= 1
    while i >= 0 and isinstance(instrs[i], Free):
        i -= 1
    return i


def pair_exchanges(program: Program) -> Program:
    """Fuses opposite Send/Recv pairs between two groups into SendRecv.

    Where group a runs `Send(x -> b)` followed (Frees aside) by `Recv(y <- b)`, and
    group b runs the `Send(y' -> a)` that this Recv matches followed (Frees aside) by
    the `Recv(x' <- a)` that a's Send matches, each of a and b would wait at its Send
    for the other to reach its Recv: a certain deadlock under rendezvous semantics.
    Both pairs become one SendRecv placed at the Send, with the intervening Frees
    moved after it. Nothing else changes: tags, message order per channel and data flow
    stay as they were, and a pair whose send and receive buffers coincide is left
    alone (a SendRecv cannot send and define the same buffer). Since the rewritten
    pattern could never complete, a program that verified before still verifies.

    Args:
      program: a program whose messages all match (`match_messages`).

    Returns:
      The program with the exchanges paired.

    Raises:
      ProgramError: kind 'unmatched' if some message has no partner.
    """
    matching = match_messages(program)
    pairs: list[dict[int, int]] = [{} for _ in program.groups]  # send index -> recv index
    for g in program.groups:
        a, instrs = g.mpmd_idx, g.instrs
        for i, send in enumerate(instrs):
            if not isinstance(send, Send) or send.dst == a:
                continue
            j = _next_non_free(instrs, i)
            if j == len(instrs) or not isinstance(instrs[j], Recv):
                continue
            recv = instrs[j]
            if recv.src != send.dst or recv.buf == send.buf:
                continue
            b, b_recv = matching.recv_of[a][i]
            b_instrs = program.groups[b].instrs
            b_send = _prev_non_free(b_instrs, b_recv)
            if b_send < 0 or not isinstance(b_instrs[b_send], Send):
                continue
            if not isinstance(b_instrs[b_recv], Recv) or matching.recv_of[b][b_send] != (a, j):
                continue
            if b_instrs[b_send].buf == b_instrs[b_recv].buf:
                continue
            pairs[a][i] = j
            pairs[b][b_send] = b_recv
    groups = []
    for g, fuse in zip(program.groups, pairs, strict=True):
        if not fuse:
            groups.append(g)
            continue
        instrs: list[Instr] = []
        i = 0
        while i < len(g.instrs):
            if i not in fuse:
                instrs.append(g.instrs[i])
                i += 1
                continue
            send, j = g.instrs[i], fuse[i]
            recv = g.instrs[j]
            instrs.append(
                SendRecv(send.buf, send.dst, send.tag, recv.buf, recv.src, recv.tag, recv.aval)
            )
            instrs.extend(g.instrs[i + 1 : j])
            i = j + 1
        groups.append(dataclasses.replace(g, instrs=tuple(instrs)))
    return Program(tuple(groups))
