"""Tests for the rendezvous verifier and the makespan simulator."""

import dataclasses
import itertools

import pytest

from jaxpp_mpi._src.ir.passes import add_frees, assign_tags, pair_exchanges
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
    Event,
    default_latency,
    format_grid,
    simulate,
    verify,
)

F32 = Aval((4, 16), "float32")
ACT = Aval((4, 16), "float32", ("data",))


def one_f_one_b(num_groups: int, num_microbatches: int) -> Program:
    """A 1F1B pipeline, one stage per group, with tags and frees but unpaired sends."""
    groups = []
    for s in range(num_groups):
        ids, avals = itertools.count(), {}

        def new(aval: Aval = ACT, ids=ids, avals=avals) -> int:
            b = next(ids)
            avals[b] = aval
            return b

        w, acc = new(F32), new(F32)
        inputs = [(w, 0), (acc, 1)]
        xs = {}
        if s == 0:
            for m in range(num_microbatches):
                xs[m] = new()
                inputs.append((xs[m], 2 + m))
        warmup = min(num_groups - 1 - s, num_microbatches)
        order = [("F", m) for m in range(warmup)]
        for m in range(num_microbatches - warmup):
            order += [("F", warmup + m), ("B", m)]
        order += [("B", m) for m in range(num_microbatches - warmup, num_microbatches)]
        instrs, resid = [], {}
        for kind, m in order:
            task = f"{kind}{m}s{s}"
            if kind == "F":
                x = xs.get(m)
                if s > 0:
                    x = new()
                    instrs.append(Recv(x, s - 1, -1, ACT))
                resid[m] = new()
                if s < num_groups - 1:
                    y = new()
                    instrs.append(Run(f"fwd_s{s}", (x, w), (resid[m], y), task=task))
                    instrs.append(Send(y, s + 1, -1))
                else:
                    instrs.append(Run(f"fwd_s{s}", (x, w), (resid[m],), task=task))
            else:
                ins = (resid[m], w, acc)
                if s < num_groups - 1:
                    grad = new()
                    instrs.append(Recv(grad, s + 1, -1, ACT))
                    ins = (grad, *ins)
                acc = new(F32)
                outs = (acc, new()) if s > 0 else (acc,)
                instrs.append(Run(f"bwd_s{s}", ins, outs, task=task, donate=(ins[-1],)))
                if s > 0:
                    instrs.append(Send(outs[1], s - 1, -1))
        groups.append(GroupProgram(s, inputs, instrs, [(acc, s)], avals))
    return add_frees(assign_tags(Program(tuple(groups))))


@pytest.mark.parametrize("num_groups, num_microbatches", [(2, 4), (4, 8), (4, 4), (3, 7)])
def test_one_f_one_b_deadlocks_until_exchanges_are_paired(num_groups, num_microbatches):
    naive = one_f_one_b(num_groups, num_microbatches)
    with pytest.raises(ProgramError, match="deadlock") as e:
        verify(naive)
    assert e.value.kind == "deadlock" and len(e.value.groups) >= 2
    program = pair_exchanges(naive)
    verify(program)
    result = simulate(program)
    # F=1, B=2, no transfer cost: the classic 1F1B makespan (M + S - 1) * (F + B).
    assert result.makespan == (num_microbatches + num_groups - 1) * 3
    assert result.busy == (num_microbatches * 3.0,) * num_groups
    assert result.finish[0] == result.makespan
    assert [len(e) for e in result.events] == [len(g.instrs) for g in program.groups]


def test_one_f_one_b_two_groups_timeline():
    result = simulate(pair_exchanges(one_f_one_b(2, 4)))
    runs = [(e.instr.task, e.start, e.end) for e in result.events[0] if isinstance(e.instr, Run)]
    assert runs == [
        ("F0s0", 0, 1),
        ("F1s0", 1, 2),
        ("B0s0", 4, 6),
        ("F2s0", 6, 7),
        ("B1s0", 7, 9),
        ("F3s0", 9, 10),
        ("B2s0", 10, 12),
        ("B3s0", 13, 15),
    ]
    assert result.finish == (15.0, 13.0)


def test_transfer_and_latency_callables():
    g0 = GroupProgram(
        0,
        {0: 0},
        (Run("f", (0,), (1,), task="F0s0", donate=(0,)), Send(1, 1, 0), Free((1,))),
        {},
        {0: F32, 1: F32},
    )
    g1 = GroupProgram(
        1,
        {},
        (Recv(0, 0, 0, F32), Run("g", (0,), (1,), task="B0s1+W0s1", donate=(0,))),
        {1: 0},
        {0: F32, 1: F32},
    )
    program = Program((g0, g1))
    assert simulate(program).makespan == 1 + 0 + 3
    result = simulate(program, transfer=lambda aval: 0.5)
    assert result.makespan == 4.5 and result.finish == (1.5, 4.5)
    assert result.events[1][0] == Event(0, g1.instrs[0], 0.0, 1.5)
    result = simulate(program, latency=lambda run: 10.0 if run.exe == "g" else 1.0)
    assert result.makespan == 11 and result.busy == (1, 10)


def test_default_latency():
    assert default_latency(Run("x", (), (), task="")) == 0
    assert default_latency(Run("x", (), (), task="F3s1")) == 1
    assert default_latency(Run("x", (), (), task="B0s0+I1s2+W0s0")) == 4
    with pytest.raises(ValueError, match="Q1s1"):
        default_latency(Run("x", (), (), task="Q1s1"))


def test_sendrecv_ring_completes_and_plain_ring_deadlocks():
    n = 3

    def ring(paired: bool) -> Program:
        groups = []
        for a in range(n):
            dst, src = (a + 1) % n, (a - 1) % n
            comm = (
                [SendRecv(0, dst, 0, 1, src, 0, F32)]
                if paired
                else [Send(0, dst, 0), Recv(1, src, 0, F32)]
            )
            instrs = [Run("f", (), (0,), task=f"F0s{a}"), *comm, Free((0,))]
            groups.append(GroupProgram(a, (), instrs, {1: 0}, {0: F32, 1: F32}))
        return Program(tuple(groups))

    assert simulate(ring(True)).makespan == 1
    with pytest.raises(ProgramError) as e:
        verify(ring(False))
    assert e.value.groups == (0, 1, 2)
    assert "group 2 blocked at #1 send %0 -> 0 tag=0 (task F0s2)" in str(e.value)


def test_sendrecv_halves_complete_independently():
    """Group 1's SendRecv meets a plain Recv in 0 and a plain Send in 2, at different times."""
    g0 = GroupProgram(0, (), (Recv(0, 1, 0, F32),), {0: 0}, {0: F32})
    g1 = GroupProgram(
        1,
        {0: 0},
        (SendRecv(0, 0, 0, 1, 2, 0, F32), Free((0,))),
        {1: 0},
        {0: F32, 1: F32},
    )
    g2 = GroupProgram(
        2,
        (),
        (Run("f", (), (0,), task="B0s2"), Send(0, 1, 0), Free((0,))),
        (),
        {0: F32},
    )
    result = simulate(Program((g0, g1, g2)))
    assert result.finish == (0.0, 2.0, 2.0)


# ----------------------------------------------------------------------------- errors


def crossing_program() -> Program:
    """Both groups Send first, then Recv: the classic rendezvous deadlock."""

    def group(a: int) -> GroupProgram:
        instrs = (
            Run("f", (), (0,), task=f"F0s{a}"),
            Send(0, 1 - a, 0),
            Recv(1, 1 - a, 0, F32),
            Free((0, 1)),
        )
        return GroupProgram(a, (), instrs, (), {0: F32, 1: F32})

    return Program((group(0), group(1)))


def test_classic_deadlock_is_reported_and_fixed_by_pairing():
    program = crossing_program()
    with pytest.raises(ProgramError) as e:
        verify(program)
    msg = str(e.value)
    assert e.value.kind == "deadlock" and e.value.groups == (0, 1) and e.value.index == 1
    assert msg.startswith("deadlock: 2 of 2 groups blocked")
    assert "group 0 blocked at #1 send %0 -> 1 tag=0 (task F0s0); waits for group 1 #2" in msg
    assert "group 1 blocked at #1 send %0 -> 0 tag=0 (task F0s1); waits for group 0 #2" in msg
    assert ">#1 send %0 -> 1 tag=0" in msg  # the grid
    with pytest.raises(ProgramError, match="deadlock"):
        simulate(program)
    fixed = pair_exchanges(program)
    verify(fixed)
    assert simulate(fixed).makespan == 1


def test_format_grid():
    program = crossing_program()
    grid = format_grid(program, [1, 4], depth=3, width=34)
    lines = grid.splitlines()
    assert lines[0].split("|")[1].strip() == "group 0"
    assert len(lines) == 4
    assert lines[3].startswith("   0 | >#1 send %0 -> 1 tag=0")
    assert "(finished)" in lines[3] and "#3 free %0 %1" in lines[2]
    assert "#0 run f () -> (%0)  task=F0s0" in lines[2]
    assert "#0 run f () -> (%0)  task=F0s0" not in format_grid(program, [1, 4], 3, 20)


def replace_instrs(program: Program, a: int, *instrs) -> Program:
    groups = list(program.groups)
    groups[a] = dataclasses.replace(groups[a], instrs=tuple(instrs))
    return Program(tuple(groups))


def ok_program() -> Program:
    """Group 0 sends one buffer to group 1."""
    g0 = GroupProgram(
        0,
        {0: 0},
        (Run("f", (0,), (1,), task="F0s0"), Send(1, 1, 0), Free((0, 1))),
        (),
        {0: F32, 1: F32},
    )
    g1 = GroupProgram(
        1,
        (),
        (Recv(0, 0, 0, ACT), Run("g", (0,), (1,), task="F0s1"), Free((0,))),
        {1: 0},
        {0: ACT, 1: F32},
    )
    return Program((g0, g1))


BAD_PROGRAMS = {
    "unmatched": (
        lambda: replace_instrs(ok_program(), 0, *ok_program().group(0).instrs[:1], Free((0, 1))),
        r"group 1 #0 recv %0 <- 0 tag=0 float32\[4,16\]\{data\}: no matching send",
    ),
    "unmatched_tag": (
        lambda: replace_instrs(
            ok_program(), 0, Run("f", (0,), (1,), task="F0s0"), Send(1, 1, 5), Free((0, 1))
        ),
        r"group 0 #1 send %1 -> 1 tag=5: no matching recv \(channel 0->1 tag=5",
    ),
    "aval_mismatch": (
        lambda: Program(
            (
                ok_program().group(0),
                GroupProgram.parse(
                    str(ok_program().group(1)).replace("float32[4,16]{data}", "float32[4,8]{data}")
                ),
            )
        ),
        r"group 0 #1 send %1 -> 1 tag=0 sends float32\[4,16\] but group 1 #0 recv .* "
        r"receives float32\[4,8\]\{data\}",
    ),
    "aval_mismatch_table": (
        lambda: replace_instrs(
            ok_program(), 1, Recv(0, 0, 0, F32), Run("g", (0,), (1,), task="F0s1"), Free((0,))
        ),
        r"group 1 #0 recv %0 <- 0 tag=0 float32\[4,16\]: receives float32\[4,16\] but %0 has "
        r"float32\[4,16\]\{data\}",
    ),
    "use_after_free": (
        lambda: replace_instrs(
            ok_program(), 0, Run("f", (0,), (1,)), Free((1,)), Send(1, 1, 0), Free((0,))
        ),
        r"group 0 #2 send %1 -> 1 tag=0: %1 was freed at #1 free %1",
    ),
    "use_after_donate": (
        lambda: replace_instrs(
            ok_program(), 0, Run("f", (0,), (1,), donate=(0,)), Send(1, 1, 0), Free((0, 1))
        ),
        r"group 0 #2 free %0 %1: %0 was donated at #0 run f \(%0\) -> \(%1\)  donate=\(%0\)",
    ),
    "double_free": (
        lambda: replace_instrs(
            ok_program(), 0, Run("f", (0,), (1,)), Send(1, 1, 0), Free((0, 1)), Free((1,))
        ),
        r"group 0 #3 free %1: %1 was freed at #2",
    ),
    "undefined": (
        lambda: replace_instrs(
            ok_program(), 0, Run("f", (0, 7), (1,)), Send(1, 1, 0), Free((0, 1))
        ),
        r"group 0 #0 run f \(%0, %7\) -> \(%1\): %7 is not defined",
    ),
    "undefined_aval": (
        lambda: replace_instrs(
            ok_program(), 0, Run("f", (0,), (1, 9)), Send(1, 1, 0), Free((0, 1, 9))
        ),
        r"group 0 #0 run f \(%0\) -> \(%1, %9\): %9 has no aval",
    ),
    "undefined_output": (
        lambda: dataclasses.replace(
            ok_program(), groups=(ok_program().group(0), _with_outputs(ok_program().group(1)))
        ),
        r"group 1 outputs: output 1 \(%4\) is never defined",
    ),
    "freed_output": (
        lambda: replace_instrs(
            ok_program(),
            1,
            Recv(0, 0, 0, ACT),
            Run("g", (0,), (1,), task="F0s1"),
            Free((0, 1)),
        ),
        r"group 1 outputs: output 0 \(%1\) was freed at #2",
    ),
    "redefined": (
        lambda: replace_instrs(
            ok_program(), 0, Run("f", (0,), (0,), task="F0s0"), Send(0, 1, 0), Free((0,))
        ),
        r"group 0 #0 run f \(%0\) -> \(%0\)  task=F0s0: %0 is still live \(an input\)",
    ),
    "leak": (
        lambda: replace_instrs(ok_program(), 0, Run("f", (0,), (1,)), Send(1, 1, 0)),
        r"group 0: 2 buffer\(s\) never freed and not outputs: %0 %1 \(%0 is an input\)",
    ),
    "bad_peer": (
        lambda: replace_instrs(ok_program(), 0, Run("f", (0,), (1,)), Send(1, 0, 0), Free((0, 1))),
        r"group 0 #1 send %1 -> 0 tag=0: message to itself",
    ),
    "bad_peer_range": (
        lambda: replace_instrs(
            ok_program(), 1, Recv(0, 5, 0, ACT), Run("g", (0,), (1,)), Free((0,))
        ),
        r"group 1 #0 recv %0 <- 5 .*: message from group 5 \(there are 2 groups\)",
    ),
    "bad_tag": (
        lambda: replace_instrs(ok_program(), 0, Run("f", (0,), (1,)), Send(1, 1, -1), Free((0, 1))),
        r"group 0 #1 send %1 -> 1 tag=-1: negative tag -1 \(run assign_tags\)",
    ),
}


def _with_outputs(g: GroupProgram) -> GroupProgram:
    return dataclasses.replace(g, outputs=((1, 0), (4, 1)))


@pytest.mark.parametrize("name", sorted(BAD_PROGRAMS))
def test_error_kinds(name):
    make, pattern = BAD_PROGRAMS[name]
    program = make()
    kind = {
        "unmatched_tag": "unmatched",
        "aval_mismatch_table": "aval_mismatch",
        "use_after_donate": "use_after_free",
        "double_free": "use_after_free",
        "undefined_aval": "undefined",
        "undefined_output": "undefined",
        "freed_output": "use_after_free",
        "bad_peer_range": "bad_peer",
    }.get(name, name)
    for check in (verify, simulate):
        with pytest.raises(ProgramError, match=pattern) as e:
            check(program)
        assert e.value.kind == kind
        assert isinstance(e.value, ValueError) and str(e.value).startswith(kind + ": ")


def test_ok_program_passes_and_leak_check_is_switchable():
    verify(ok_program())
    leaky = BAD_PROGRAMS["leak"][0]()
    verify(leaky, check_leaks=False)
    assert simulate(leaky, check_leaks=False).makespan == 1


def test_redefinition_after_free_and_in_place_donation_are_fine():
    g = GroupProgram(
        0,
        {0: 0},
        (
            Run("step", (0,), (0,), task="W0s0", donate=(0,)),
            Run("f", (0,), (1,)),
            Free((1,)),
            Run("f", (0,), (1,)),
            Free((1,)),
        ),
        {0: 0},
        {0: F32, 1: F32},
    )
    verify(Program((g,)))


def test_large_program_is_linear():
    """28k instructions: a quadratic scan would take minutes."""
    n = 1000
    program = pair_exchanges(one_f_one_b(4, n))
    assert sum(len(g.instrs) for g in program.groups) > 28_000
    assert simulate(program).makespan == (n + 3) * 3


def test_deadlock_report_names_only_the_pending_half():
    g0 = GroupProgram(
        0,
        {0: 0, 2: 1},
        (SendRecv(0, 1, 0, 1, 2, 0, F32), Send(2, 1, 1), Free((0, 1, 2))),
        (),
        {0: F32, 1: F32, 2: F32},
    )
    g1 = GroupProgram(
        1,
        (),
        (Recv(0, 0, 0, F32), Recv(1, 0, 1, F32), Send(0, 2, 0), Free((0, 1))),
        (),
        {0: F32, 1: F32},
    )
    g2 = GroupProgram(2, (), (Recv(0, 1, 0, F32), Send(0, 0, 0), Free((0,))), (), {0: F32})
    with pytest.raises(ProgramError) as e:
        verify(Program((g0, g1, g2)))
    lines = str(e.value).splitlines()
    assert lines[0] == "deadlock: 3 of 3 groups blocked"
    assert lines[1].endswith("float32[4,16]; waits for group 2 #1 (group 2 is at #0)")
    assert lines[2] == (
        "  group 1 blocked at #1 recv %1 <- 0 tag=1 float32[4,16]; "
        "waits for group 0 #1 (group 0 is at #0)"
    )
