"""Tests for the simulator's message model (`MessageCost`, `Note: message model`)."""

import math
from pathlib import Path

import pytest

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
)
from jaxpp_mpi._src.ir.simulate import (
    MessageCost,
    aval_nbytes,
    default_latency,
    runtime_sends,
    simulate,
)

GOLDEN = Path(__file__).resolve().parents[2] / "golden"

ACT = Aval((16, 1024), "float32")  # 64 KiB
SMALL = Aval((4,), "bfloat16")  # 8 bytes


def forward_backward(act: Aval) -> Program:
    """Group 0: F, send; later receive the gradient, B. Group 1: receive, F+B, send back."""
    g0 = GroupProgram(
        0,
        (),
        (
            Run("f", (), (0,), task="F0s0"),
            Send(0, 1, 0),
            Free((0,)),
            Recv(1, 1, 1, act),
            Run("b", (1,), (2,), task="B0s0", donate=(1,)),
        ),
        {2: 0},
        {0: act, 1: act, 2: act},
    )
    g1 = GroupProgram(
        1,
        (),
        (
            Recv(0, 0, 0, act),
            Run("fb", (0,), (1,), task="F0s1+B0s1", donate=(0,)),
            Send(1, 0, 1),
            Free((1,)),
        ),
        {},
        {0: act, 1: act},
    )
    return Program((g0, g1))


def test_aval_nbytes():
    assert aval_nbytes(ACT) == 16 * 1024 * 4
    assert aval_nbytes(SMALL) == 8
    assert aval_nbytes(Aval((3, 5), "bool")) == 15
    assert aval_nbytes(Aval((8,), "int4")) == 4
    assert aval_nbytes(Aval((2,), "float8_e4m3fn")) == 2
    assert aval_nbytes(Aval((), "complex64")) == 8


def test_makespan_grows_by_exactly_the_modeled_cost():
    program = forward_backward(ACT)
    free = simulate(program)
    # F (1) -> message -> F+B (3) -> message -> B (2): the critical path crosses 2 messages.
    assert free.makespan == 6.0
    cost = MessageCost(latency=0.04, bandwidth=65536 / 0.01)  # 64 KiB take 0.01 + 0.04
    modeled = simulate(program, transfer=cost)
    assert cost(ACT) == pytest.approx(0.05)
    assert modeled.makespan == pytest.approx(free.makespan + 2 * cost(ACT))
    assert modeled.busy == free.busy  # messages are not compute
    recv = modeled.events[1][0]
    assert isinstance(recv.instr, Recv) and (recv.start, recv.end) == (0.0, pytest.approx(1.05))


def test_latency_and_bandwidth_terms_separately():
    program = forward_backward(ACT)
    base = simulate(program).makespan
    latency_only = simulate(program, transfer=MessageCost(0.5, math.inf)).makespan
    assert latency_only == pytest.approx(base + 2 * 0.5)
    bandwidth_only = simulate(program, transfer=MessageCost(0.0, 65536.0)).makespan
    assert bandwidth_only == pytest.approx(base + 2 * 1.0)  # 64 KiB at 64 KiB per unit


def test_sendrecv_halves_each_pay_their_own_size():
    """An exchange of a big and a small value: each half ends after its own cost."""
    big, small = ACT, SMALL
    g0 = GroupProgram(
        0,
        (),
        (Run("f", (), (0,), task="F0s0"), SendRecv(0, 1, 0, 1, 1, 1, small), Free((0,))),
        {1: 0},
        {0: big, 1: small},
    )
    g1 = GroupProgram(
        1,
        (),
        (Run("g", (), (0,), task="F0s1"), SendRecv(0, 0, 1, 1, 0, 0, big), Free((0,))),
        {1: 1},
        {0: small, 1: big},
    )
    cost = MessageCost(latency=0.0, bandwidth=8.0)  # SMALL: 1 unit, ACT: 8192 units
    result = simulate(Program((g0, g1)), transfer=cost)
    assert result.finish == (pytest.approx(1 + 8192.0), pytest.approx(1 + 8192.0))
    assert simulate(Program((g0, g1))).makespan == 1.0


@pytest.mark.parametrize("latency, bandwidth", [(-1.0, 1.0), (0.0, 0.0), (1.0, -5.0)])
def test_bad_message_cost(latency, bandwidth):
    with pytest.raises(ValueError, match="MessageCost"):
        MessageCost(latency, bandwidth)


# ----------------------------------------------------------------------------- posted sends


def test_posted_send_lets_the_sender_go_on():
    """Group 0 sends, then works; group 1 works longer before it receives. Blocking, the
    sender waits for the receiver; posted, it does not, and the message waits."""
    g0 = GroupProgram(0, (), (Run("f", (), (0,), task="F0s0"), Send(0, 1, 0), Free((0,)),
                              Run("x", (), (1,), task="F1s0")), {1: 0}, {0: ACT, 1: ACT})
    g1 = GroupProgram(1, (), (Run("y", (), (1,), task="B0s1+B1s1"), Recv(0, 0, 0, ACT),
                              Run("z", (0,), (2,), task="F0s1", donate=(0,)), Free((1,))),
                      {2: 1}, {0: ACT, 1: ACT, 2: ACT})
    program, cost = Program((g0, g1)), MessageCost(0.5, math.inf)
    blocking = simulate(program, transfer=cost)
    # group 1's y (2 + 2 = 4) ends at 4; blocking: the message ends at 4.5 on both sides.
    assert blocking.finish == (pytest.approx(4.5 + 1), pytest.approx(4.5 + 1))
    posted = simulate(program, transfer=cost, sends="posted")
    # posted at 1, there at 1.5: group 0 goes on at once, group 1 receives when it gets there.
    assert posted.finish == (pytest.approx(2.0), pytest.approx(4 + 1))
    send = posted.events[0][1]
    assert isinstance(send.instr, Send) and (send.start, send.end) == (1.0, 1.0)
    assert posted.busy == blocking.busy


def test_posted_receive_waits_for_the_message():
    program = forward_backward(ACT)
    cost = MessageCost(latency=0.04, bandwidth=65536 / 0.01)
    # Every message here is on the critical path: posting changes nothing.
    posted = simulate(program, transfer=cost, sends="posted")
    assert posted.makespan == pytest.approx(simulate(program, transfer=cost).makespan)
    recv = posted.events[1][0]
    assert isinstance(recv.instr, Recv) and (recv.start, recv.end) == (0.0, pytest.approx(1.05))


def test_posted_sendrecv_halves_arrive_on_their_own():
    big, small = ACT, SMALL
    g0 = GroupProgram(0, (), (Run("f", (), (0,), task="F0s0"), SendRecv(0, 1, 0, 1, 1, 1, small),
                              Free((0,))), {1: 0}, {0: big, 1: small})
    g1 = GroupProgram(1, (), (Run("g", (), (0,), task="F0s1"), SendRecv(0, 0, 1, 1, 0, 0, big),
                              Free((0,))), {1: 1}, {0: small, 1: big})
    cost = MessageCost(latency=0.0, bandwidth=8.0)  # SMALL: 1 unit, ACT: 8192 units
    result = simulate(Program((g0, g1)), transfer=cost, sends="posted")
    assert result.finish == (pytest.approx(2.0), pytest.approx(1 + 8192.0))


def test_posted_play_still_refuses_what_blocks_elsewhere():
    """Head-to-head blocking sends deadlock; posted they would pass, but other platforms
    block, so the program is refused either way."""
    groups = tuple(
        GroupProgram(g, (), (Run("f", (), (0,), task=f"F0s{g}"), Send(0, 1 - g, 0), Free((0,)),
                             Recv(1, 1 - g, 0, ACT), Free((1,))), {}, {0: ACT, 1: ACT})
        for g in range(2))
    for sends in ("blocking", "posted"):
        with pytest.raises(ProgramError, match="deadlock"):
            simulate(Program(groups), sends=sends)
    with pytest.raises(ValueError, match="sends must be"):
        simulate(forward_backward(ACT), sends="eager")


@pytest.mark.parametrize("name", ["gpipe_s2_m4", "std1f1b_s2_m4", "zerobubble_s2_m4",
                                  "interleaved1f1b_s4_g2_m4", "dualpipev_s4_g2_m4"])
def test_posting_never_makes_a_golden_program_slower(name):
    program = Program.parse((GOLDEN / f"{name}.txt").read_text())
    cost = MessageCost(latency=0.1, bandwidth=65536.0)

    def latency(run: Run) -> float:  # pipeline tasks at their defaults, the rest free
        return default_latency(run) if run.task and run.task[0] in "FBIW" else 0.0

    blocking = simulate(program, latency, transfer=cost)
    posted = simulate(program, latency, transfer=cost, sends="posted")
    assert posted.makespan < blocking.makespan
    assert posted.busy == blocking.busy
    assert all(p <= b + 1e-9 for p, b in zip(posted.finish, blocking.finish))


def test_runtime_sends_by_platform():
    assert runtime_sends("cpu") == "posted"  # Note: posted sends
    assert runtime_sends("cuda") == "blocking"  # message chains
    assert runtime_sends("rocm") == "blocking"


@pytest.mark.parametrize("value, posted", [(None, True), ("1", True), ("0", False), ("off", False)])
def test_posted_sends_option(value, posted):
    from jaxpp_mpi._src.base.config import parse_options

    options = parse_options({} if value is None else {"JAXPP_MPI_POSTED_SENDS": value})
    assert options.posted_sends is posted
    assert runtime_sends("cpu", options.posted_sends) == ("posted" if posted else "blocking")
    with pytest.raises(ValueError, match="JAXPP_MPI_POSTED_SENDS"):
        parse_options({"JAXPP_MPI_POSTED_SENDS": "maybe"})
