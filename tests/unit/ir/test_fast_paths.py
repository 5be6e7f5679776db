"""The IR's fast paths give what the general ones give: constructors that keep fields
already canonical, per-channel message matching, the buffer walk's error reports, the
event-less play, and instruction subclasses (matched as `isinstance` would)."""

import dataclasses

import pytest

from jaxpp_mpi._src.ir import rendezvous
from jaxpp_mpi._src.ir.instructions import INSTR_TYPES, instr_kind
from jaxpp_mpi._src.ir.passes import add_frees, match_messages
from jaxpp_mpi._src.ir.program import (
    AllReduce,
    Aval,
    Free,
    GroupProgram,
    Program,
    ProgramError,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi._src.ir.simulate import verify

F32 = Aval((4,), "float32")


class _Int(int):
    pass


def _group(a, instrs, inputs=(), outputs=(), bufs=range(8)):
    return GroupProgram(a, dict(inputs), tuple(instrs), dict(outputs), {b: F32 for b in bufs})


# ----------------------------------------------------------------------------- constructors


def test_instructions_keep_ints_and_convert_the_rest():
    run = Run("f", [1, True, _Int(2)], (3,), "", [True])
    assert run.ins == (1, 1, 2) and run.donate == (1,) and run.outs == (3,)
    assert all(type(b) is int for b in run.ins + run.outs + run.donate)
    ins = (4, 5)
    assert Run("f", ins, ()).ins is ins  # already canonical: kept
    send = Send(True, _Int(1), 2.0)
    assert (send.buf, send.dst, send.tag) == (1, 1, 2)
    assert all(type(v) is int for v in (send.buf, send.dst, send.tag))
    sr = SendRecv(0, _Int(1), 0, 1, 1, False, F32)
    assert type(sr.dst) is int and type(sr.recv_tag) is int
    assert sr == SendRecv(0, 1, 0, 1, 1, 0, F32)
    with pytest.raises(ValueError, match=r"buffer ids must be >= 0, got -1"):
        Recv(-1, 0, 0, F32)
    with pytest.raises(ValueError, match=r"donated buffers \(1, 7\) are not all inputs of f"):
        Run("f", (1, 2), (), "", (7, 1, 1))


def test_group_program_avals_in_any_form_give_one_group():
    items = ((0, F32), (2, Aval((2,), "int32")), (5, F32))
    forms = [items, dict(reversed(items)), [list(p) for p in items], ((True, F32),) + items[1:]]
    groups = [GroupProgram(0, (), (), (), avals) for avals in forms]
    assert groups[0].avals is items
    assert groups[1] == groups[0] and groups[2] == groups[0]
    assert groups[3].avals[0] == (1, F32) and type(groups[3].avals[0][0]) is int
    with pytest.raises(ValueError, match="two avals for buffer %2"):
        GroupProgram(0, (), (), (), ((2, F32), (2, F32)))
    with pytest.raises(TypeError, match="aval of %5 is not an Aval: 'x'"):
        GroupProgram(0, (), (), (), ((0, F32), (5, "x")))


def test_with_instrs_is_replace():
    g = _group(0, [Run("f", (0,), (1,)), Free((0, 1))], inputs={0: 0})
    instrs = [Run("g", (0,), (2,)), Free((0,)), Free((2,))]
    assert g.with_instrs(instrs) == dataclasses.replace(g, instrs=tuple(instrs))
    with pytest.raises(TypeError, match=r"group 0 #1: not an instruction: 'free %0'"):
        g.with_instrs([instrs[0], "free %0"])


def test_instr_kind_is_isinstance():
    class MyFree(Free):
        pass

    assert [instr_kind(t) for t in INSTR_TYPES] == list(INSTR_TYPES)
    assert instr_kind(MyFree) is Free and instr_kind(int) is None
    g = _group(0, [Run("f", (0,), (1,)), MyFree((0,))], inputs={0: 0}, outputs={1: 0})
    verify(Program((g,)))
    assert add_frees(Program((g,))) == Program((g,))  # the subclass frees too


# ----------------------------------------------------------------------------- matching


def test_match_messages_pairs_each_tag_in_order_in_a_mixed_channel():
    g0 = _group(0, [Send(0, 1, 1), Send(1, 1, 0), Send(2, 1, 0)], inputs={0: 0, 1: 1, 2: 2})
    g1 = _group(1, [Recv(0, 0, 0, F32), Recv(1, 0, 1, F32), Recv(2, 0, 0, F32)])
    m = match_messages(Program((g0, g1)))
    assert m.recv_of[0] == {0: (1, 1), 1: (1, 0), 2: (1, 2)}
    assert m.send_of[1] == {0: (0, 1), 1: (0, 0), 2: (0, 2)}


@pytest.mark.parametrize(
    "g0_instrs, g1_instrs, message",
    [
        (  # a mixed channel: the second send of tag 0 is left over
            [Send(0, 1, 0), Send(1, 1, 0), Send(2, 1, 1)],
            [Recv(0, 0, 0, F32), Recv(1, 0, 1, F32)],
            "group 0 #1 send %1 -> 1 tag=0: no matching recv (channel 0->1 tag=0: "
            "2 sends in group 0, 1 receives in group 1)",
        ),
        (  # a receive from a group that does not exist
            [],
            [Recv(0, 5, 0, F32)],
            "group 1 #0 recv %0 <- 5 tag=0 float32[4]: no matching send (channel 5->1 "
            "tag=0: 0 sends in group 5, 1 receives in group 1)",
        ),
        (  # a send to a group that does not exist, after one that matches
            [Send(0, 1, 0), Send(1, -1, 0)],
            [Recv(0, 0, 0, F32)],
            "group 0 #1 send %1 -> -1 tag=0: no matching recv (channel 0->-1 tag=0: "
            "1 sends in group 0, 0 receives in group -1)",
        ),
    ],
)
def test_match_messages_names_the_first_leftover(g0_instrs, g1_instrs, message):
    program = Program((_group(0, g0_instrs, inputs={0: 0, 1: 1, 2: 2}), _group(1, g1_instrs)))
    with pytest.raises(ProgramError, match="unmatched") as e:
        match_messages(program)
    assert str(e.value) == "unmatched: " + message


# ----------------------------------------------------------------------------- verify


@pytest.mark.parametrize(
    "instrs, outputs, message",
    [
        (  # freed, defined again, freed again: the report names the latest Free
            [Run("f", (0,), (1,)), Free((1,)), Run("g", (0,), (1,), "", (0,)), Free((1,)),
             Run("h", (1,), (2,))],
            {2: 0},
            "use_after_free: group 0 #4 run h (%1) -> (%2): %1 was freed at #3 free %1",
        ),
        (  # donated input read again
            [Run("f", (0,), (1,), "", (0,)), Run("g", (0,), (2,))],
            {1: 0, 2: 1},
            "use_after_free: group 0 #1 run g (%0) -> (%2): %0 was donated at #0 "
            "run f (%0) -> (%1)  donate=(%0)",
        ),
        (  # an output freed after it was defined again
            [Free((0,)), Run("f", (), (0,)), Free((0,))],
            {0: 0},
            "use_after_free: group 0 outputs: output 0 (%0) was freed at #2",
        ),
        (  # freed twice in one Free
            [Free((0, 0))],
            {},
            "use_after_free: group 0 #0 free %0 %0: %0 was freed at #0 free %0 %0",
        ),
        (  # defined while live
            [Run("f", (0,), (0,))],
            {0: 0},
            "redefined: group 0 #0 run f (%0) -> (%0): %0 is still live (an input)",
        ),
        (  # defined without an aval
            [Run("f", (0,), (9,)), Free((0,))],
            {9: 0},
            "undefined: group 0 #0 run f (%0) -> (%9): %9 has no aval",
        ),
        (  # reduced after it was freed
            [Free((0,)), AllReduce((0,))],
            {},
            "use_after_free: group 0 #1 allreduce (%0) op=sum: %0 was freed at #0 free %0",
        ),
    ],
)
def test_verify_reports_the_latest_death(instrs, outputs, message):
    program = Program((_group(0, instrs, inputs={0: 0}, outputs=outputs),))
    with pytest.raises(ProgramError) as e:
        verify(program)
    assert str(e.value) == message


def test_play_through_raises_the_deadlock_play_raises():
    g0 = _group(0, [Send(0, 1, 0), Recv(1, 1, 0, F32), Free((1,))], inputs={0: 0},
                outputs={0: 0})
    g1 = _group(1, [Send(0, 0, 0), Recv(1, 0, 0, F32), Free((1,))], inputs={0: 0},
                outputs={0: 0})
    program = Program((g0, g1))
    with pytest.raises(ProgramError, match="deadlock") as through:
        rendezvous.play_through(program, match_messages(program))
    with pytest.raises(ProgramError, match="deadlock") as events:
        list(rendezvous.play(program))
    assert str(through.value) == str(events.value)
    assert through.value.groups == events.value.groups == (0, 1)
