"""Static checks of a Program: message peers and tags, buffer lifetimes, message avals.

The first half of `simulate.verify`, which then plays the program (`Note: rendezvous
play` in ir/rendezvous.py); the rules checked are `Note: program invariants` in
ir/program.py.
"""

from __future__ import annotations

from jaxpp_mpi._src.ir.instructions import instr_kind
from jaxpp_mpi._src.ir.passes import Matching, match_messages, recv_half, send_half
from jaxpp_mpi._src.ir.program import (
    INSTR_TYPES,
    AllReduce,
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

__all__ = ["check_static", "locate"]

_TYPES = frozenset(INSTR_TYPES)


def locate(g: int, i: int, instr: Instr) -> str:
    """Where instruction `i` of group `g` is, for error messages."""
    return f"group {g} #{i} {instr}"


def _check_half(n: int, a: int, i: int, instr: Instr, way: str, peer: int, tag: int) -> None:
    """Checks the peer and the tag of one half of message instruction `i` of group `a`."""
    if peer == a or not 0 <= peer < n:
        why = "itself" if peer == a else f"group {peer} (there are {n} groups)"
        raise ProgramError("bad_peer", f"{locate(a, i, instr)}: message {way} {why}", (a,), i)
    if tag < 0:
        raise ProgramError(
            "bad_tag", f"{locate(a, i, instr)}: negative tag {tag} (run assign_tags)", (a,), i
        )


def _check_peers(program: Program) -> None:
    n = program.num_groups
    for g in program.groups:
        a = g.mpmd_idx
        for i, instr in enumerate(g.instrs):
            # the halves are those of `send_half` and `recv_half`; `_check_half` is
            # called (to raise) only on a half that breaks its rule
            kind = type(instr)
            if kind is Send:
                peer, tag = instr.dst, instr.tag
                if peer == a or not 0 <= peer < n or tag < 0:
                    _check_half(n, a, i, instr, "to", peer, tag)
            elif kind is Recv:
                peer, tag = instr.src, instr.tag
                if peer == a or not 0 <= peer < n or tag < 0:
                    _check_half(n, a, i, instr, "from", peer, tag)
            elif kind is SendRecv:
                dst, src = instr.dst, instr.src
                if (dst == a or src == a or not (0 <= dst < n and 0 <= src < n)
                        or instr.send_tag < 0 or instr.recv_tag < 0):
                    _check_half(n, a, i, instr, "to", dst, instr.send_tag)
                    _check_half(n, a, i, instr, "from", src, instr.recv_tag)


def _check_buffers(g: GroupProgram, check_leaks: bool) -> None:
    """Walks one group in program order, tracking which buffers are live.

    Each rule is tested inline; the helpers below only report a broken one.
    """
    a, avals, instrs = g.mpmd_idx, g.aval_map, g.instrs
    live: dict[int, int] = {}  # buffer -> index of its definition (-1: an input)
    # buffer -> index of the Free or Run that last freed or donated it; for a buffer
    # not live, that is how it died (unless it never lived)
    dead: dict[int, int] = {}

    def how(j: int) -> str:
        return "freed" if isinstance(instrs[j], Free) else "donated"

    def fail(kind: str, i: int | None, msg: str) -> None:
        where = f"group {a} inputs" if i is None else locate(a, i, instrs[i])
        raise ProgramError(kind, f"{where}: {msg}", (a,), i)

    def use(i: int, b: int) -> None:  # reports the use of `b`, not live, at #i
        if b in dead:
            j = dead[b]
            fail("use_after_free", i, f"%{b} was {how(j)} at #{j} {instrs[j]}")
        fail("undefined", i, f"%{b} is not defined")

    def define(i: int | None, b: int) -> None:  # reports `b`, live or without aval
        if b in live:
            j = live[b]
            at = "an input" if j < 0 else f"defined at #{j} {instrs[j]}"
            fail("redefined", i, f"%{b} is still live ({at})")
        fail("undefined", i, f"%{b} has no aval")

    for b, _ in g.inputs:
        if b in live or b not in avals:
            define(None, b)
        live[b] = -1
    for i, instr in enumerate(instrs):
        kind = type(instr)
        if kind not in _TYPES:
            kind = instr_kind(kind)  # a subclass: matched as `isinstance` would
        if kind is Free:
            for b in instr.bufs:  # kill: a use, then dead
                if live.pop(b, None) is None:
                    use(i, b)
                dead[b] = i
        elif kind is Run:
            for b in instr.ins:
                if b not in live:
                    use(i, b)
            for b in instr.donate:  # kill
                if live.pop(b, None) is None:
                    use(i, b)
                dead[b] = i
            for b in instr.outs:  # define
                if b in live or b not in avals:
                    define(i, b)
                live[b] = i
        elif kind is Send:
            if instr.buf not in live:
                use(i, instr.buf)
        elif kind is Recv or kind is SendRecv:
            if kind is SendRecv and instr.send_buf not in live:
                use(i, instr.send_buf)
            b = recv_half(instr)[0]
            if b in live or b not in avals:
                define(i, b)
            live[b] = i
            if avals[b] is not instr.aval and avals[b] != instr.aval:
                fail("aval_mismatch", i, f"receives {instr.aval} but %{b} has {avals[b]}")
        elif kind is AllReduce:
            for b in instr.bufs:  # reduced in place: still live, same aval
                if b not in live:
                    use(i, b)
    for b, k in g.outputs:
        if b not in live:
            state = f"was {how(dead[b])} at #{dead[b]}" if b in dead else "is never defined"
            raise ProgramError(
                "use_after_free" if b in dead else "undefined",
                f"group {a} outputs: output {k} (%{b}) {state}",
                (a,),
            )
    if check_leaks:
        leaked = sorted(live.keys() - {b for b, _ in g.outputs})
        if leaked:
            b, j = leaked[0], live[leaked[0]]
            at = "an input" if j < 0 else f"defined at #{j} {instrs[j]}"
            names = " ".join(f"%{x}" for x in leaked[:8]) + (" ..." if len(leaked) > 8 else "")
            raise ProgramError(
                "leak",
                f"group {a}: {len(leaked)} buffer(s) never freed and not outputs: {names} "
                f"(%{b} is {at})",
                (a,),
                None if j < 0 else j,
            )


def _aval_mismatch(program: Program, a: int, i: int, h: int, j: int) -> ProgramError | None:
    """The 'aval_mismatch' error if the send half at #i of group `a` and the receive half
    at #j of group `h` disagree on their value's shape or dtype, else None."""
    g = program.groups[a]
    sent = g.aval(send_half(g.instrs[i])[0])
    recv = program.groups[h].instrs[j]
    got = recv_half(recv)[3]
    if sent is got or (sent.shape == got.shape and sent.dtype == got.dtype):
        return None
    return ProgramError(
        "aval_mismatch",
        f"{locate(a, i, g.instrs[i])} sends {sent} but {locate(h, j, recv)} receives {got}",
        (a, h),
        i,
    )


def _check_message_avals(program: Program, matching: Matching) -> None:
    for g in program.groups:
        a, instrs, avals = g.mpmd_idx, g.instrs, g.aval_map
        recv_of = matching.recv_of[a]
        for i, (h, j) in recv_of.items():  # quick pass; a mismatch is reported below
            send, recv = instrs[i], program.groups[h].instrs[j]
            sent = avals[send.buf if type(send) is Send else send.send_buf]
            got = recv.aval
            if sent is not got and (sent.shape != got.shape or sent.dtype != got.dtype):
                break
        else:
            continue
        for i, (h, j) in sorted(recv_of.items()):  # the first mismatch in program order
            if (error := _aval_mismatch(program, a, i, h, j)) is not None:
                raise error


def check_static(program: Program, check_leaks: bool) -> Matching:
    """Checks what `verify` checks before it plays `program` (`Note: program
    invariants`): message peers and tags, each group's buffer lifetimes, that every
    message is matched, and that both ends of a message agree on its aval.

    Args:
      program: the program.
      check_leaks: also reject buffers that are never freed and are not outputs.

    Returns:
      The matching of its send and receive halves (`passes.match_messages`).

    Raises:
      ProgramError: with `kind` 'bad_peer', 'bad_tag', 'undefined', 'use_after_free',
        'redefined', 'leak', 'unmatched' or 'aval_mismatch'.
    """
    _check_peers(program)
    for g in program.groups:
        _check_buffers(g, check_leaks)
    matching = match_messages(program)
    _check_message_avals(program, matching)
    return matching
