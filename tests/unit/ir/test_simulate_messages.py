"""Tests for the simulator's message model (`MessageCost`, `Note: message model`)."""

import math

import pytest

from jaxpp_mpi._src.ir.program import Aval, Free, GroupProgram, Program, Recv, Run, Send, SendRecv
from jaxpp_mpi._src.ir.simulate import MessageCost, aval_nbytes, simulate

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
