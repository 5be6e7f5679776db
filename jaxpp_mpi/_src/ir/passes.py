"""Lowering passes over the program IR: message matching, tags, frees, paired exchanges
(replica reductions: ir/reductions.py)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from itertools import repeat

from jaxpp_mpi._src.ir.program import (
    AllReduce,
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
from jaxpp_mpi._src.ir.trusted import new_free, new_recv, new_send, new_sendrecv

Loc = tuple[int, int]  # (mpmd_idx, instruction index)


def send_half(instr: Instr) -> tuple[int, int, int] | None:
    """(buf, dst, tag) of the send half of `instr`, or None."""
    kind = type(instr)
    if kind is Send:
        return instr.buf, instr.dst, instr.tag
    if kind is SendRecv:
        return instr.send_buf, instr.dst, instr.send_tag
    return None


def recv_half(instr: Instr) -> tuple[int, int, int, Aval] | None:
    """(buf, src, tag, aval) of the receive half of `instr`, or None."""
    kind = type(instr)
    if kind is Recv:
        return instr.buf, instr.src, instr.tag, instr.aval
    if kind is SendRecv:
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
    # per group, per peer: the indexes and tags of its send halves to that peer, and of
    # its receive halves from that peer, in program order
    sends: list[dict[int, tuple[list[int], list[int]]]] = []
    recvs: list[dict[int, tuple[list[int], list[int]]]] = []
    for g in program.groups:
        out: dict[int, tuple[list[int], list[int]]] = {}
        inc: dict[int, tuple[list[int], list[int]]] = {}
        for i, instr in enumerate(g.instrs):
            kind = type(instr)
            if kind is Send or kind is SendRecv:
                idx, tags = out.get(instr.dst) or out.setdefault(instr.dst, ([], []))
                idx.append(i)
                tags.append(instr.tag if kind is Send else instr.send_tag)
            if kind is Recv or kind is SendRecv:
                idx, tags = inc.get(instr.src) or inc.setdefault(instr.src, ([], []))
                idx.append(i)
                tags.append(instr.tag if kind is Recv else instr.recv_tag)
        sends.append(out)
        recvs.append(inc)
    n = program.num_groups
    recv_of: tuple[dict[int, Loc], ...] = tuple({} for _ in range(n))
    send_of: tuple[dict[int, Loc], ...] = tuple({} for _ in range(n))
    leftover: list[tuple[Loc, str, tuple[int, int, int], int, int]] = []
    channels = {(a, peer) for a, out in enumerate(sends) for peer in out}
    channels.update((peer, a) for a, inc in enumerate(recvs) for peer in inc)
    for src, dst in channels:
        ss = sends[src].get(dst, ((), ())) if 0 <= src < n else ((), ())
        rs = recvs[dst].get(src, ((), ())) if 0 <= dst < n else ((), ())
        if ss[1] == rs[1]:  # the k-th of each tag is the k-th of the channel: pair in order
            recv_of[src].update(zip(ss[0], zip(repeat(dst), rs[0])))
            send_of[dst].update(zip(rs[0], zip(repeat(src), ss[0])))
        else:
            _match_tags(src, dst, ss, rs, recv_of, send_of, leftover)
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


def _match_tags(
    src: int,
    dst: int,
    sends: tuple[Sequence[int], Sequence[int]],
    recvs: tuple[Sequence[int], Sequence[int]],
    recv_of: tuple[dict[int, Loc], ...],
    send_of: tuple[dict[int, Loc], ...],
    leftover: list[tuple[Loc, str, tuple[int, int, int], int, int]],
) -> None:
    """`match_messages` for the channel src -> dst, tag by tag: `sends` and `recvs` are
    the (indexes, tags) of its send halves in group src and receive halves in group dst;
    the first of each tag's sends or receives left over goes to `leftover`."""
    by_tag: dict[int, tuple[list[int], list[int]]] = {}
    for i, tag in zip(*sends, strict=True):
        by_tag.setdefault(tag, ([], []))[0].append(i)
    for j, tag in zip(*recvs, strict=True):
        by_tag.setdefault(tag, ([], []))[1].append(j)
    for tag, (ss, rs) in by_tag.items():
        if ss and rs:  # then src and dst are groups
            recv_of[src].update(zip(ss, zip(repeat(dst), rs)))
            send_of[dst].update(zip(rs, zip(repeat(src), ss)))
        if len(ss) > len(rs):
            leftover.append(((src, ss[len(rs)]), "send", (src, dst, tag), len(ss), len(rs)))
        elif len(rs) > len(ss):
            leftover.append(((dst, rs[len(ss)]), "recv", (src, dst, tag), len(ss), len(rs)))


def assign_tags(program: Program) -> Program:
    """Numbers the messages of each channel, replacing every Send/Recv/SendRecv tag.

    The k-th send from group a to group b, in a's program order, gets tag k; the k-th
    receive from a in b's program order gets tag k. Tags depend only on the program,
    so every rank computes the same ones (see `Note: program invariants`). They name
    the pairing; the MPI executor matches it by MPI's posting order on one wire tag per
    shard (`Note: messages` in runtime/mpi_messages.py), so no channel outgrows MPI_TAG_UB.

    Args:
      program: a program, typically built with tag=-1.

    Returns:
      The program with tags assigned.

    Raises:
      ProgramError: kind 'unmatched' if a channel's send and receive counts differ.
    """
    n_sent: dict[tuple[int, int], int] = defaultdict(int)
    n_recv: dict[tuple[int, int], int] = defaultdict(int)
    groups = []
    for g in program.groups:
        a, instrs = g.mpmd_idx, []
        sent: dict[int, int] = defaultdict(int)  # dst -> sends to it so far
        got: dict[int, int] = defaultdict(int)  # src -> receives from it so far
        # The fields kept are those of an instruction of exact class, and the tags are
        # counts: the new instruction is made unchecked (`Note: trusted instructions`).
        for instr in g.instrs:
            kind = type(instr)
            if kind is Send:
                dst = instr.dst
                instr = new_send(instr.buf, dst, sent[dst])
                sent[dst] += 1
            elif kind is Recv:
                src = instr.src
                instr = new_recv(instr.buf, src, got[src], instr.aval)
                got[src] += 1
            elif kind is SendRecv:
                dst, src = instr.dst, instr.src
                instr = new_sendrecv(instr.send_buf, dst, sent[dst], instr.recv_buf, src,
                                     got[src], instr.aval)
                sent[dst] += 1
                got[src] += 1
            instrs.append(instr)
        groups.append(g.with_instrs(instrs, checked=True))
        n_sent.update(((a, dst), k) for dst, k in sent.items())
        n_recv.update(((src, a), k) for src, k in got.items())
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
    """The buffers `instr` reads. An AllReduce reads its buffers and updates them in
    place: a use that keeps them live, not a new definition (so not in `_writes`)."""
    if isinstance(instr, Run):
        return instr.ins
    if isinstance(instr, AllReduce):
        return instr.bufs
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
    # Whether every buffer in `last` is an int >= 0 as a Free keeps it: those of
    # instructions of exact class are (their constructors checked them), the inputs
    # are ints but may be negative, and a subclass may keep anything.
    trusted = not last or min(last) >= 0
    for i, instr in enumerate(g.instrs):
        # per instruction: its reads, then the buffers it frees or donates, then its
        # writes (`_reads`, `_writes`), written out for the exact instruction types
        kind = type(instr)
        if kind is Run:
            for b in instr.ins:
                if b in last:
                    last[b] = i
            for b in instr.donate:
                last.pop(b, None)
            for b in instr.outs:
                last[b] = i
        elif kind is Send:
            if instr.buf in last:
                last[instr.buf] = i
        elif kind is Recv:
            last[instr.buf] = i
        elif kind is Free:
            for b in instr.bufs:
                last.pop(b, None)
        elif kind is SendRecv:
            if instr.send_buf in last:
                last[instr.send_buf] = i
            last[instr.recv_buf] = i
        else:  # AllReduce, or a subclass of an instruction type
            trusted = trusted and kind is AllReduce  # an AllReduce defines nothing
            for b in _reads(instr):
                if b in last:
                    last[b] = i
            for b in instr.bufs if isinstance(instr, Free) else getattr(instr, "donate", ()):
                last.pop(b, None)
            for b in _writes(instr):
                last[b] = i
    for b in keep:  # the outputs stay live (a few buffers; many are freed)
        last.pop(b, None)
    frees_after: dict[int, list[int]] = defaultdict(list)
    for b, i in last.items():
        frees_after[i].append(b)
    if not frees_after:
        return g
    make_free = new_free if trusted else Free  # `Note: trusted instructions`
    instrs: list[Instr] = []
    start = 0  # the next instruction to copy
    for i in sorted(frees_after):
        instrs += g.instrs[start:i + 1]
        instrs.append(make_free(tuple(sorted(frees_after[i]))))
        start = i + 1
    instrs.extend(g.instrs[start:])
    return g.with_instrs(instrs, checked=True)


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


def pair_exchanges(program: Program) -> Program:
    """Fuses opposite Send/Recv pairs between two groups into SendRecv.

    Where group a runs `Send(x -> b)` followed (Frees aside) by `Recv(y <- b)`, and
    group b runs the `Send(y' -> a)` that this Recv matches followed (Frees aside) by
    the `Recv(x' <- a)` that a's Send matches, each of a and b would wait at its Send
    for the other to reach its Recv: a certain deadlock under rendezvous semantics.
    Both pairs become one SendRecv placed at the Send, with the intervening Frees
    moved after it. Nothing else changes: tags, message order per channel and data flow
    stay as they were, and a pair whose send and receive buffers coincide is left
    alone (a SendRecv cannot send and define the same buffer), and so is a pair with an
    AllReduce between its send and its receive (only Frees are stepped over;
    `add_replica_reductions` never puts one there, it follows a definition). Since the
    rewritten pattern could never complete, a program that verified before still
    verifies.

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
        recv_of, end = matching.recv_of[a], len(instrs)
        for i, send in enumerate(instrs):
            if not isinstance(send, Send) or send.dst == a:
                continue
            j = i + 1  # the next instruction but a Free
            while j < end and isinstance(instrs[j], Free):
                j += 1
            if j == end or not isinstance(instrs[j], Recv):
                continue
            recv = instrs[j]
            if recv.src != send.dst or recv.buf == send.buf:
                continue
            b, b_recv = recv_of[i]
            b_instrs = program.groups[b].instrs
            b_send = b_recv - 1  # the instruction before but a Free
            while b_send >= 0 and isinstance(b_instrs[b_send], Free):
                b_send -= 1
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
        start = 0  # the next instruction to copy
        for i in sorted(fuse):
            send, j = g.instrs[i], fuse[i]
            recv = g.instrs[j]
            instrs.extend(g.instrs[start:i])
            fields = (send.buf, send.dst, send.tag, recv.buf, recv.src, recv.tag, recv.aval)
            # from a Send and a Recv of exact class: unchecked (`Note: trusted instructions`)
            exact = type(send) is Send and type(recv) is Recv
            instrs.append(new_sendrecv(*fields) if exact else SendRecv(*fields))
            instrs.extend(g.instrs[i + 1 : j])
            start = j + 1
        instrs.extend(g.instrs[start:])
        groups.append(g.with_instrs(instrs, checked=True))
    return Program(tuple(groups))
