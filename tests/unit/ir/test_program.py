"""Tests for the program IR: text form, hash and lowering passes."""

import dataclasses

import pytest

from jaxpp_mpi._src.ir.passes import (
    add_frees,
    assign_tags,
    match_messages,
    pair_exchanges,
)
from jaxpp_mpi._src.ir.program import (
    Aval,
    Free,
    GroupProgram,
    Program,
    ProgramError,
    Recv,
    Run,
    Send,
    SendRecv,
    parse_instr,
)
from jaxpp_mpi._src.ir.simulate import verify

F32 = Aval((4, 16), "float32")
ACT = Aval((4, 16), "float32", ("data",))


@pytest.mark.parametrize(
    "aval, text",
    [
        (Aval((8, 16), "float32"), "float32[8,16]"),
        (Aval((), "int32"), "int32[]"),
        (Aval((8, 16), "bfloat16", ("data", None)), "bfloat16[8,16]{data}"),
        (Aval((8, 16), "bfloat16", (None, "data")), "bfloat16[8,16]{_,data}"),
        (Aval((8, 16), "float32", (("data", "model"), None)), "float32[8,16]{(data,model)}"),
        (Aval((8, 16, 2), "float32", (None, ("data", "model"), "pp")), None),
        (Aval((8,), "float32", (("data",),)), "float32[8]{(data)}"),
        (Aval((8,), "float32", ((),)), "float32[8]{()}"),
        (Aval((0, 3), "float8_e4m3fn"), "float8_e4m3fn[0,3]"),
    ],
)
def test_aval_round_trip(aval, text):
    if text is not None:
        assert str(aval) == text
    assert Aval.parse(str(aval)) == aval


def test_aval_trailing_none_is_normalised():
    assert Aval((8, 16), "float32", (None, None)) == Aval((8, 16), "float32")
    assert Aval([8, 16], "float32", ["data", ["a", "b"]]).spec == ("data", ("a", "b"))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(shape=(8,), dtype="float32", spec=("a", "b")),
        dict(shape=(8,), dtype="float32", spec=("_",)),
        dict(shape=(8,), dtype="float32", spec=("a b",)),
        dict(shape=(-1,), dtype="float32"),
        dict(shape=(8,), dtype="float 32"),
    ],
)
def test_aval_rejects_bad_input(kwargs):
    with pytest.raises(ValueError):
        Aval(**kwargs)


@pytest.mark.parametrize("text", ["float32", "float32[8", "float32[8]{", "f[a]"])
def test_aval_parse_rejects_garbage(text):
    with pytest.raises(ValueError):
        Aval.parse(text)


INSTRS = [
    (Run("fwd_s0", (0, 1), (2,), task="F0s0"), "run fwd_s0 (%0, %1) -> (%2)  task=F0s0"),
    (Run("init", (), ()), "run init () -> ()"),
    (
        Run("bwd_s0", (3, 2, 1), (4, 5), task="B0s0+F1s0", donate=(3, 2)),
        "run bwd_s0 (%3, %2, %1) -> (%4, %5)  task=B0s0+F1s0  donate=(%2, %3)",
    ),
    (Run("upd", (1, 4), (6,), donate=(4,)), "run upd (%1, %4) -> (%6)  donate=(%4)"),
    (Send(2, 1, 0), "send %2 -> 1 tag=0"),
    (Send(2, 1, -1), "send %2 -> 1 tag=-1"),
    (Recv(5, 1, 3, ACT), "recv %5 <- 1 tag=3 float32[4,16]{data}"),
    (
        Recv(5, 0, 3, Aval((4, 16), "bfloat16", (("data", "model"), None))),
        "recv %5 <- 0 tag=3 bfloat16[4,16]{(data,model)}",
    ),
    (
        SendRecv(2, 1, 0, 5, 3, 7, Aval((4, 16), "float32", (None, "model"))),
        "sendrecv %2 -> 1 tag=0, %5 <- 3 tag=7 float32[4,16]{_,model}",
    ),
    (Free((2, 3)), "free %2 %3"),
    (Free((9,)), "free %9"),
]


@pytest.mark.parametrize("instr, text", INSTRS)
def test_instruction_text_round_trip(instr, text):
    assert str(instr) == text
    assert parse_instr(text) == instr
    assert parse_instr(f"#12 {text}") == instr


@pytest.mark.parametrize(
    "text", ["jump %1", "send %a -> 1 tag=0", "run f (%1) (%2)", "free", "recv %1 <- 0 tag=0"]
)
def test_parse_instr_rejects_garbage(text):
    with pytest.raises(ValueError, match="cannot parse"):
        parse_instr(text)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Run("a b", (), ()),
        lambda: Run("f", (1,), (), task="F 1"),
        lambda: Run("f", (1,), (), donate=(2,)),
        lambda: Free(()),
        lambda: Send(-1, 0, 0),
        lambda: Recv(0, 0, 0, "float32[4]"),
    ],
)
def test_instructions_reject_bad_fields(make):
    with pytest.raises((ValueError, TypeError)):
        make()


def exchange_program(tag: int = -1) -> Program:
    """Two groups exchanging one activation and one gradient (every instruction kind)."""
    g0 = GroupProgram(
        0,
        inputs={0: 0, 1: 1},
        instrs=(
            Run("fwd_s0", (0, 1), (2,), task="F0s0"),
            Send(2, 1, tag),
            Recv(3, 1, tag, ACT),
            Run("bwd_s0", (3, 1), (4,), task="B0s0", donate=(3,)),
            Free((0, 1, 2)),
        ),
        outputs={4: 0},
        avals={0: ACT, 1: F32, 2: ACT, 3: ACT, 4: F32},
    )
    g1 = GroupProgram(
        1,
        inputs=((0, 2),),
        instrs=(
            Recv(1, 0, tag, ACT),
            Run("fwd_s1", (1, 0), (2,), task="F0s1"),
            Run("bwd_s1", (2, 0), (3, 4), task="B0s1", donate=(2,)),
            Send(3, 0, tag),
            Free((0, 1, 3)),
        ),
        outputs=((4, 1),),
        avals={0: F32, 1: ACT, 2: F32, 3: ACT, 4: F32},
    )
    return Program((g0, g1))


def every_kind_program() -> Program:
    g0 = GroupProgram(
        0,
        inputs=((0, 0),),
        instrs=(
            Run("f", (0,), (1, 2), task="F0s0", donate=(0,)),
            SendRecv(1, 1, 0, 3, 1, 0, ACT),
            Send(2, 1, 1),
            Recv(4, 1, 1, Aval((2,), "int32", ((),))),
            Free((1, 2, 3)),
        ),
        outputs=((4, 0),),
        avals={0: F32, 1: ACT, 2: F32, 3: ACT, 4: Aval((2,), "int32", ((),))},
    )
    g1 = GroupProgram(
        1,
        inputs=((0, 1),),
        instrs=(
            SendRecv(0, 0, 0, 1, 0, 0, ACT),
            Recv(2, 0, 1, F32),
            Run("g", (1, 2), (3,), task="B0s1", donate=(1, 2)),
            Send(3, 0, 1),
            Free((0, 3)),
        ),
        outputs=(),
        avals={0: ACT, 1: ACT, 2: F32, 3: Aval((2,), "int32", ((),))},
    )
    return Program((g0, g1))


def test_program_text_round_trip_every_kind():
    program = every_kind_program()
    verify(program)
    text = str(program)
    assert Program.parse(text) == program
    assert Program.parse(program.format(numbered=True)) == program
    kinds = {type(i) for g in program.groups for i in g.instrs}
    assert kinds == {Run, Send, Recv, SendRecv, Free}


def test_group_text_is_readable_and_parses_alone():
    g = every_kind_program().group(0)
    assert str(g) == (
        "group 0\n"
        "  inputs %0=0\n"
        "  run f (%0) -> (%1, %2)  task=F0s0  donate=(%0)\n"
        "  sendrecv %1 -> 1 tag=0, %3 <- 1 tag=0 float32[4,16]{data}\n"
        "  send %2 -> 1 tag=1\n"
        "  recv %4 <- 1 tag=1 int32[2]{()}\n"
        "  free %1 %2 %3\n"
        "  outputs %4=0\n"
        "  aval %0 float32[4,16]\n"
        "  aval %1 float32[4,16]{data}\n"
        "  aval %2 float32[4,16]\n"
        "  aval %3 float32[4,16]{data}\n"
        "  aval %4 int32[2]{()}\n"
    )
    assert GroupProgram.parse(str(g)) == g
    assert "  #1 sendrecv" in g.format(numbered=True)


def test_group_program_normalises_fields():
    g = every_kind_program().group(0)
    again = GroupProgram(0, dict(g.inputs), list(g.instrs), dict(g.outputs), dict(g.avals))
    assert again == g and hash(again) == hash(g)
    assert g.aval(3) == ACT and g.aval_map[4].dtype == "int32"


def test_program_checks_group_order():
    g = every_kind_program().group(1)
    with pytest.raises(ValueError, match="mpmd_idx 1"):
        Program((g,))


def test_parse_errors_name_the_line():
    text = str(every_kind_program()).replace("send %2 -> 1 tag=1", "send %2 => 1 tag=1")
    with pytest.raises(ValueError, match="line 5"):
        Program.parse(text)
    with pytest.raises(ValueError, match="expected 'group N'"):
        Program.parse("  free %1\n")


def test_hash_is_stable_and_tracks_changes():
    a, b = every_kind_program(), every_kind_program()
    assert a.hash() == b.hash() == Program.parse(str(a)).hash()
    assert len(a.hash()) == 64 and a.group(0).hash() != a.group(1).hash()
    g0 = a.group(0)
    changed = dataclasses.replace(g0, instrs=(*g0.instrs[:2], Send(2, 1, 7), *g0.instrs[3:]))
    other = Program((changed, a.group(1)))
    assert other.hash() != a.hash()
    assert other.group(1).hash() == a.group(1).hash()
    assert changed.hash() != g0.hash()


# ----------------------------------------------------------------------------- assign_tags


def test_assign_tags_numbers_each_channel_in_order():
    g0 = GroupProgram(
        0,
        inputs=((0, 0), (1, 1)),
        instrs=(
            Send(0, 1, -1),
            Send(1, 2, -1),
            SendRecv(0, 1, -1, 2, 2, -1, F32),
            Send(1, 1, -1),
            Recv(3, 1, -1, F32),
            Free((0, 1, 2, 3)),
        ),
        outputs=(),
        avals={b: F32 for b in range(4)},
    )
    g1 = GroupProgram(
        1,
        inputs=((0, 0),),
        instrs=(
            Recv(1, 0, -1, F32),
            Recv(2, 0, -1, F32),
            Recv(3, 0, -1, F32),
            Send(0, 0, -1),
            Free((0, 1, 2, 3)),
        ),
        outputs=(),
        avals={b: F32 for b in range(4)},
    )
    g2 = GroupProgram(
        2,
        inputs=((0, 0),),
        instrs=(Recv(1, 0, -1, F32), Send(0, 0, -1), Free((0, 1))),
        outputs=(),
        avals={b: F32 for b in range(2)},
    )
    tagged = assign_tags(Program((g0, g1, g2)))
    assert [str(i) for i in tagged.group(0).instrs[:5]] == [
        "send %0 -> 1 tag=0",
        "send %1 -> 2 tag=0",
        "sendrecv %0 -> 1 tag=1, %2 <- 2 tag=0 float32[4,16]",
        "send %1 -> 1 tag=2",
        "recv %3 <- 1 tag=0 float32[4,16]",
    ]
    assert [i.tag for i in tagged.group(1).instrs[:4]] == [0, 1, 2, 0]
    assert [i.tag for i in tagged.group(2).instrs[:2]] == [0, 0]
    assert assign_tags(tagged) == tagged
    verify(tagged)


def test_assign_tags_rejects_unbalanced_channel():
    program = exchange_program()
    g1 = program.group(1)
    g1 = dataclasses.replace(g1, instrs=g1.instrs[1:])
    with pytest.raises(ProgramError, match=r"channel 0->1: group 0 sends 1 messages, group 1 re"):
        assign_tags(Program((program.group(0), g1)))


def test_match_messages_follows_tags_then_order():
    program = assign_tags(exchange_program())
    m = match_messages(program)
    assert m.recv_of[0] == {1: (1, 0)} and m.send_of[0] == {2: (1, 3)}
    assert m.recv_of[1] == {3: (0, 2)} and m.send_of[1] == {0: (0, 1)}


# ----------------------------------------------------------------------------- add_frees


def test_add_frees_places_frees_after_last_use():
    g = GroupProgram(
        0,
        inputs={0: 0, 1: 1, 7: 2},
        instrs=(
            Run("a", (0, 1), (2, 3), task="F0s0"),
            Run("b", (2,), (4,), task="F1s0"),
            Run("c", (3, 1), (5,), task="B0s0", donate=(3,)),
            Run("d", (4, 5), (6,), task="B1s0"),
        ),
        outputs={6: 0, 1: 1},
        avals={b: F32 for b in range(8)},
    )
    out = add_frees(Program((g,))).group(0)
    assert [str(i) for i in out.instrs] == [
        "free %7",
        "run a (%0, %1) -> (%2, %3)  task=F0s0",
        "free %0",
        "run b (%2) -> (%4)  task=F1s0",
        "free %2",
        "run c (%3, %1) -> (%5)  task=B0s0  donate=(%3)",
        "run d (%4, %5) -> (%6)  task=B1s0",
        "free %4 %5",
    ]
    verify(Program((out,)))
    assert add_frees(Program((out,))).group(0) == out


def test_add_frees_frees_unread_definitions_and_respects_existing_frees():
    g = GroupProgram(
        0,
        inputs={0: 0},
        instrs=(Run("a", (0,), (1, 2)), Free((0,)), Run("b", (1,), (3,))),
        outputs={3: 0},
        avals={b: F32 for b in range(4)},
    )
    out = add_frees(Program((g,))).group(0)
    assert [str(i) for i in out.instrs] == [
        "run a (%0) -> (%1, %2)",
        "free %2",
        "free %0",
        "run b (%1) -> (%3)",
        "free %1",
    ]


def test_add_frees_then_verify_exchange():
    program = exchange_program()
    stripped = Program(
        tuple(
            dataclasses.replace(g, instrs=tuple(i for i in g.instrs if not isinstance(i, Free)))
            for g in program.groups
        )
    )
    with pytest.raises(ProgramError, match="leak"):
        verify(assign_tags(stripped))
    verify(add_frees(assign_tags(stripped)))


# ----------------------------------------------------------------------------- pair_exchanges


def crossing_program(tag: int = -1, same_buf: bool = False) -> Program:
    """Both groups Send first, then Recv: the classic rendezvous deadlock."""

    def group(a: int) -> GroupProgram:
        recv_buf = 0 if same_buf else 1
        instrs = [Run("f", (), (0,), task=f"F0s{a}"), Send(0, 1 - a, tag)]
        instrs += [Free((0,))] if same_buf else []
        instrs += [Recv(recv_buf, 1 - a, tag, F32), Run("g", (recv_buf,), (2,), task=f"B0s{a}")]
        instrs += [Free((recv_buf,))] if same_buf else []
        return GroupProgram(a, (), instrs, {2: 0}, {0: F32, 1: F32, 2: F32})

    return Program((group(0), group(1)))


def test_pair_exchanges_fuses_crossing_sends():
    program = add_frees(crossing_program())
    assert [str(i) for i in program.group(0).instrs] == [
        "run f () -> (%0)  task=F0s0",
        "send %0 -> 1 tag=-1",
        "free %0",
        "recv %1 <- 1 tag=-1 float32[4,16]",
        "run g (%1) -> (%2)  task=B0s0",
        "free %1",
    ]
    paired = assign_tags(pair_exchanges(program))
    assert [str(i) for i in paired.group(1).instrs[:3]] == [
        "run f () -> (%0)  task=F0s1",
        "sendrecv %0 -> 0 tag=0, %1 <- 0 tag=0 float32[4,16]",
        "free %0",
    ]
    verify(paired)
    assert pair_exchanges(paired) == paired


def test_pair_exchanges_moves_frees_between_send_and_recv():
    program = crossing_program()
    g0 = program.group(0)
    instrs = list(g0.instrs)
    instrs[2:2] = [Free((0,))]
    instrs.append(Free((1,)))
    program = Program((dataclasses.replace(g0, instrs=tuple(instrs)), program.group(1)))
    paired = pair_exchanges(program).group(0)
    assert [str(i) for i in paired.instrs[1:3]] == [
        "sendrecv %0 -> 1 tag=-1, %1 <- 1 tag=-1 float32[4,16]",
        "free %0",
    ]


def test_pair_exchanges_leaves_same_buffer_exchange_alone():
    program = crossing_program(same_buf=True)
    assert pair_exchanges(program) == program


def test_pair_exchanges_leaves_safe_orders_alone():
    program = assign_tags(exchange_program())
    assert pair_exchanges(program) == program
    verify(program)
