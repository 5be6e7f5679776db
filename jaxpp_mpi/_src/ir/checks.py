"""Static checks of a Program: message peers and tags, buffer lifetimes, message avals.

The first half of `simulate.verify`, which then plays the program (`Note: rendezvous
play` in ir/rendezvous.py); the rules checked are `Note: program invariants` in
ir/program.py.
"""

from __future__ import annotations

from jaxpp_mpi._src.ir.passes import Matching, match_messages, recv_half, send_half
from jaxpp_mpi._src.ir.program import (
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


def locate(g: int, i: int, instr: Instr) -> str:
    """Where instruction `i` of group `g` is, for error messages."""
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
                        "bad_peer", f"{locate(a, i, instr)}: message {way} {why}", (a,), i
                    )
                if tag < 0:
                    raise ProgramError(
                        "bad_tag",
                        f"{locate(a, i, instr)}: negative tag {tag} (run assign_tags)",
                        (a,),
                        i,
                    )


def _check_buffers(g: GroupProgram, check_leaks: bool) -> None:
    """Walks one group in program order, tracking which buffers are live."""
    a, avals = g.mpmd_idx, g.aval_map
    live: dict[int, int] = {}  # buffer -> index of its definition (-1: an input)
    dead: dict[int, tuple[int, str]] = {}  # buffer -> (index, 'freed' | 'donated')

    def fail(kind: str, i: int | None, msg: str) -> None:
        where = f"group {a} inputs" if i is None else locate(a, i, g.instrs[i])
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
            case AllReduce():
                for b in instr.bufs:  # reduced in place: still live, same aval
                    use(i, b)
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
                    f"{locate(g.mpmd_idx, i, g.instrs[i])} sends {sent} but "
                    f"{locate(h, j, recv)} receives {got}",
                    (g.mpmd_idx, h),
                    i,
                )


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
