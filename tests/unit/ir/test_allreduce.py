"""AllReduce through the IR: text form, verifier, passes, simulator, local executor."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpp_mpi._src.ir.layouts import infer_layouts
from jaxpp_mpi._src.ir.passes import (
    add_frees,
    assign_tags,
    match_messages,
    pair_exchanges,
)
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
from jaxpp_mpi._src.ir.reductions import add_replica_reductions
from jaxpp_mpi._src.ir.rendezvous import Completed, format_grid, play
from jaxpp_mpi._src.ir.simulate import MessageCost, ring_allreduce, simulate, verify
from jaxpp_mpi._src.runtime.local import LocalExecutor, local_order
from jaxpp_mpi._src.timeline.timing import collect_task_times_ms

ACT = Aval((16, 1024), "float32")  # 64 KiB
W = Aval((4, 4), "float32")  # 64 bytes


def pipeline(reduce: bool) -> Program:
    """Two stages, one microbatch; each group reduces its weight gradient if `reduce`.

    Group 0: F, send the activation, receive its gradient, B -> gradient %4 (output).
    Group 1: receive, F+B -> weight gradient %2 (output) and input gradient %3, send %3.
    """
    ar0 = (AllReduce((4,), "sum"),) if reduce else ()
    ar1 = (AllReduce((2,), "sum"),) if reduce else ()
    g0 = GroupProgram(
        0,
        {0: 0, 1: 1},
        (
            Run("f", (0, 1), (2,), task="F0s0"),
            Send(2, 1, -1),
            Recv(3, 1, -1, ACT),
            Run("b", (0, 2, 3), (4,), task="B0s0"),
            *ar0,
        ),
        {4: 0},
        {0: W, 1: ACT, 2: ACT, 3: ACT, 4: W},
    )
    g1 = GroupProgram(
        1,
        {0: 2},
        (
            Recv(1, 0, -1, ACT),
            Run("fb", (0, 1), (2, 3), task="F0s1+B0s1"),
            Send(3, 0, -1),  # what group 0 waits for goes before the reduction
            *ar1,
        ),
        {2: 1},
        {0: W, 1: ACT, 2: W, 3: ACT},
    )
    return add_frees(assign_tags(Program((g0, g1))))


# ----------------------------------------------------------------------------- text, verifier


def test_text_round_trip():
    program = pipeline(reduce=True)
    text = str(program)
    assert "  allreduce (%4) op=sum\n" in text and "  allreduce (%2) op=sum\n" in text
    assert Program.parse(text) == program
    assert Program.parse(program.format(numbered=True)) == program
    bucket = GroupProgram(0, {0: 0, 1: 1}, (AllReduce((1, 0), "bor"),), {0: 0, 1: 1}, {0: W, 1: W})
    assert str(bucket.instrs[0]) == "allreduce (%1, %0) op=bor"
    assert GroupProgram.parse(str(bucket)) == bucket
    assert (
        Program((bucket,)).hash()
        != Program((dataclasses.replace(bucket, instrs=(AllReduce((1, 0), "max"),)),)).hash()
    )


def test_verifier_accepts_allreduce_after_its_definition():
    program = pipeline(reduce=True)
    verify(program)
    # The reduced buffers stay live (outputs at the end); group 1's AllReduce follows
    # the Send of the other result, which it does not touch.
    assert [type(i).__name__ for i in program.group(1).instrs] == [
        "Recv",
        "Run",
        "Free",
        "Send",
        "Free",
        "AllReduce",
    ]
    # An AllReduce is no message: the matching is the one without it.
    plain = pipeline(reduce=False)
    ours, theirs = match_messages(program), match_messages(plain)
    assert sum(map(len, ours.recv_of)) == sum(map(len, theirs.recv_of)) == 2


def _with(program: Program, g: int, at: int, instr) -> Program:
    gp = program.group(g)
    instrs = gp.instrs[:at] + (instr,) + gp.instrs[at:]
    groups = list(program.groups)
    groups[g] = dataclasses.replace(gp, instrs=instrs)
    return Program(tuple(groups))


def test_verifier_rejects_allreduce_of_undefined_buffer():
    program = pipeline(reduce=False)
    # %4 is defined by group 0's last Run (#4, after `free`s): reduce it before that.
    bad = _with(program, 0, 0, AllReduce((4,), "sum"))
    with pytest.raises(
        ProgramError,
        match=r"undefined: group 0 #0 allreduce \(%4\) op=sum: "
        r"%4 is not defined",
    ) as err:
        verify(bad)
    assert err.value.groups == (0,) and err.value.index == 0


def test_verifier_rejects_allreduce_of_freed_buffer():
    program = pipeline(reduce=False)
    g0 = program.group(0).instrs
    k = next(i for i, instr in enumerate(g0) if isinstance(instr, Free) and 2 in instr.bufs)
    bad = _with(program, 0, k + 1, AllReduce((2,), "max"))
    with pytest.raises(
        ProgramError,
        match=rf"use_after_free: group 0 #{k + 1} allreduce "
        rf"\(%2\) op=max: %2 was freed at #{k} free",
    ):
        verify(bad)


def test_format_grid_shows_allreduce():
    program = pipeline(reduce=True)
    pcs = [len(program.group(0).instrs) - 1, 5]
    grid = format_grid(program, pcs, depth=2, width=60)
    assert ">#5 allreduce (%2) op=sum" in grid
    last = program.group(0).instrs[-1]
    assert f">#{pcs[0]} {last}" in grid


def test_play_completes_allreduce_without_a_partner():
    program = pipeline(reduce=True)
    done = [(e.group, e.index) for e in play(program) if isinstance(e, Completed)]
    assert sorted(done) == [(g.mpmd_idx, i) for g in program.groups for i in range(len(g.instrs))]


# ----------------------------------------------------------------------------- add_frees


def test_add_frees_keeps_a_buffer_alive_until_its_allreduce():
    # %1 is read by `use` and then reduced; %2 is only reduced. Neither is an output.
    g = GroupProgram(
        0,
        {0: 0},
        (
            Run("make", (0,), (1, 2)),
            Run("use", (1,), (3,)),
            AllReduce((1, 2), "sum"),
            Run("last", (3,), (4,)),
        ),
        {4: 0},
        {0: W, 1: W, 2: W, 3: W, 4: W},
    )
    out = add_frees(Program((g,))).group(0).instrs
    assert out == (
        Run("make", (0,), (1, 2)),
        Free((0,)),
        Run("use", (1,), (3,)),
        AllReduce((1, 2), "sum"),
        Free((1, 2)),
        Run("last", (3,), (4,)),
        Free((3,)),
    )
    assert add_frees(add_frees(Program((g,)))) == add_frees(Program((g,)))
    verify(add_frees(Program((g,))))


def test_message_passes_leave_allreduce_in_place():
    # An exchange that pair_exchanges fuses, with AllReduces before the Send and after
    # the Recv: the SendRecv forms as without them, and they stay where they were.
    def group(a: int, reduce: bool) -> GroupProgram:
        pre = (AllReduce((1,), "sum"),) if reduce else ()
        post = (AllReduce((2,), "max"),) if reduce else ()
        instrs = (Run("p", (0,), (1,)), *pre, Send(1, 1 - a, -1), Recv(2, 1 - a, -1, W), *post)
        return GroupProgram(a, {0: 0}, instrs, {1: 0, 2: 1}, {0: W, 1: W, 2: W})

    with_ar = pair_exchanges(assign_tags(Program((group(0, True), group(1, True)))))
    without = pair_exchanges(assign_tags(Program((group(0, False), group(1, False)))))
    for g, ref in zip(with_ar.groups, without.groups, strict=True):
        assert [i for i in g.instrs if not isinstance(i, AllReduce)] == list(ref.instrs)
        assert isinstance(g.instrs[2], SendRecv)
        assert g.instrs[1] == AllReduce((1,), "sum") and g.instrs[3] == AllReduce((2,), "max")
    verify(add_frees(with_ar))


# ----------------------------------------------------------------------------- reductions


def _sized(nbytes: int) -> Aval:
    return Aval((nbytes // 4,), "float32")


def test_replica_reductions_placement_and_buckets():
    # One Run defines five buffers of 16, 16, 40, 8 and 8 bytes; a Recv defines %9 and
    # an input %0 is reduced too.
    sizes = {1: 16, 2: 16, 3: 40, 4: 8, 5: 8}
    avals = {b: _sized(n) for b, n in sizes.items()} | {0: W, 6: W, 9: W}
    g0 = GroupProgram(
        0,
        {0: 0},
        (
            Run("grads", (0,), (1, 2, 3, 4, 5), task="B0s0"),
            Run("next", (0,), (6,), task="B1s0"),
            Recv(9, 1, -1, W),
        ),
        {b: k for k, b in enumerate((0, 1, 2, 3, 4, 5, 6, 9))},
        avals,
    )
    g1 = GroupProgram(1, {0: 0}, (Send(0, 0, -1),), {0: 0}, {0: W})
    program = assign_tags(Program((g0, g1)))
    reductions = {
        0: [(1, "sum"), (2, "sum"), (3, "sum"), (5, "max"), (4, "sum"), (9, "sum"), (0, "max")]
    }
    out = add_replica_reductions(program, reductions, bucket_bytes=32)
    assert out.group(1) == program.group(1)
    assert out.group(0).instrs == (
        AllReduce((0,), "max"),  # an input: at the start
        program.group(0).instrs[0],
        AllReduce((1, 2), "sum"),  # 16 + 16 = 32 <= 32
        AllReduce((3,), "sum"),  # 40 > 32: alone
        AllReduce((4,), "sum"),  # after 40, its own bucket
        AllReduce((5,), "max"),  # another op: another bucket, after the sum ones
        program.group(0).instrs[1],
        program.group(0).instrs[2],
        AllReduce((9,), "sum"),  # a received buffer: right after the Recv
    )
    verify(add_frees(out))
    # bucket_bytes <= 0: one bucket per instruction and op.
    whole = add_replica_reductions(program, reductions, bucket_bytes=0).group(0).instrs
    assert whole[2:4] == (AllReduce((1, 2, 3, 4), "sum"), AllReduce((5,), "max"))
    # A bucket large enough for everything gives the same.
    assert add_replica_reductions(program, reductions, bucket_bytes=88) == add_replica_reductions(
        program, reductions, bucket_bytes=-1
    )
    # Deterministic.
    assert add_replica_reductions(program, reductions, 32) == out


def test_replica_reductions_after_sendrecv_and_before_existing_frees():
    g = GroupProgram(
        0,
        {0: 0},
        (SendRecv(0, 1, 0, 1, 1, 0, W), Free((0,))),
        {1: 0},
        {0: W, 1: W},
    )
    h = GroupProgram(1, {0: 0}, (SendRecv(0, 0, 0, 1, 0, 0, W), Free((0, 1))), {}, {0: W, 1: W})
    out = add_replica_reductions(Program((g, h)), {0: [(1, "bor")], 1: [(1, "sum")]}, 1)
    # past a Free of another buffer; before a Free of its own
    assert out.group(0).instrs == (*g.instrs, AllReduce((1,), "bor"))
    assert out.group(1).instrs == (h.instrs[0], AllReduce((1,), "sum"), h.instrs[1])
    verify(out)


@pytest.mark.parametrize(
    "reductions, message",
    [
        ({0: [(7, "sum")]}, r"group 0: cannot reduce %7 across replicas: it is not defined"),
        ({1: [(2, "sum"), (2, "sum")]}, r"group 1: %2 is reduced twice"),
        ({1: [(2, "min")]}, r"group 1: reduction of %2 has op 'min'"),
        ({2: [(0, "sum")]}, r"replica reductions for group 2, but the program has 2 groups"),
    ],
)
def test_replica_reductions_reject_bad_requests(reductions, message):
    with pytest.raises(ValueError, match=message):
        add_replica_reductions(pipeline(reduce=False), reductions, 0)


def test_replica_reductions_go_after_the_sends_that_follow_but_before_sending_their_own():
    act = Aval((4,), "float32")
    g = GroupProgram(0, {}, (Run("b", (), (1, 2, 3)), Send(3, 1, 0), Send(1, 1, 1),
                             Run("c", (2,), (4,))), {4: 0}, {1: act, 2: act, 3: act, 4: act})
    h = GroupProgram(1, {}, (Recv(3, 0, 0, act), Recv(1, 0, 1, act)), {}, {1: act, 3: act})
    out = add_replica_reductions(Program((g, h)), {0: [(1, "sum"), (2, "sum")]}, 0)
    # %3 is sent first (not reduced); %1 is reduced, so its own send waits for it
    assert out.group(0).instrs == (g.instrs[0], g.instrs[1], AllReduce((1, 2), "sum"),
                                   *g.instrs[2:])
    verify(add_frees(out))


def test_replica_reductions_reject_a_buffer_defined_twice():
    g = GroupProgram(0, {}, (Run("a", (), (1,)), Free((1,)), Run("a", (), (1,))), {1: 0}, {1: W})
    with pytest.raises(ValueError, match=r"group 0: cannot reduce %1 .* defined 2 times"):
        add_replica_reductions(Program((g,)), {0: [(1, "sum")]}, 0)


def test_replica_reductions_on_pipeline_match_the_hand_written_one():
    out = add_replica_reductions(
        assign_tags(_unfreed(pipeline(reduce=False))), {0: [(4, "sum")], 1: [(2, "sum")]}, 1 << 20
    )
    assert add_frees(out) == pipeline(reduce=True)


def _unfreed(program: Program) -> Program:
    return Program(
        tuple(
            dataclasses.replace(g, instrs=tuple(i for i in g.instrs if not isinstance(i, Free)))
            for g in program.groups
        )
    )


# ----------------------------------------------------------------------------- layouts


def test_layouts_leave_allreduce_and_its_buffer_alone():
    def resolve(g, exe, ins, outs, fixed):  # every free result replicated but `f`'s
        return tuple(
            o.spec if f else (("data",) if exe == "f" else ()) for o, f in zip(outs, fixed)
        )

    groups = {}
    for reduce in (False, True):
        program = pipeline(reduce)
        out, _ = infer_layouts(program, resolve, local_groups={0, 1})
        groups[reduce] = out
        verify(out)
    for g, ref in zip(groups[True].groups, groups[False].groups, strict=True):
        assert g.avals == ref.avals
        assert [i for i in g.instrs if not isinstance(i, AllReduce)] == list(ref.instrs)
    assert groups[True].group(0).aval(2).spec == ("data",)


# ----------------------------------------------------------------------------- simulator


COST = MessageCost(latency=0.04, bandwidth=65536 / 0.01)  # 64 KiB: 0.01 + 0.04


def test_simulate_one_replica_is_unchanged():
    plain, reduced = pipeline(reduce=False), pipeline(reduce=True)
    # F (1) -> 64 KiB message -> F+B (3) -> message -> B (2), messages 0.05 each.
    expected = 1 + 0.05 + 3 + 0.05 + 2
    for transfer in (None, COST):
        ref = simulate(plain, transfer=transfer).makespan
        assert simulate(reduced, transfer=transfer).makespan == ref
        assert simulate(reduced, transfer=transfer, replicas=1).makespan == ref
    assert simulate(reduced, transfer=COST).makespan == pytest.approx(expected)
    # Free messages make the default ring free whatever R.
    assert simulate(reduced, replicas=4).makespan == 6.0


def test_simulate_four_replicas_adds_the_ring_time():
    plain, reduced = pipeline(reduce=False), pipeline(reduce=True)
    base = simulate(plain, transfer=COST).makespan
    result = simulate(reduced, transfer=COST, replicas=4)
    # Group 0 reduces its 64-byte gradient last, on the critical path: a ring over
    # R = 4 takes 2(R-1)/R * 64 B / bandwidth + 2(R-1) * latency.
    ring = 2 * 3 / 4 * 64 / (65536 / 0.01) + 2 * 3 * 0.04
    assert ring == pytest.approx(0.24 + 1.5 * 64 / 6553600)
    # Group 1 sends the gradient group 0 waits for before its own reduction, which then
    # overlaps group 0's B: one ring on the critical path.
    assert result.makespan == pytest.approx(base + ring)
    assert result.busy == simulate(plain, transfer=COST).busy  # reductions are not compute
    ev = result.events[0][-1]
    assert ev.kind == "allreduce" and ev.instr == AllReduce((4,), "sum")
    assert ev.end - ev.start == pytest.approx(ring)
    assert [e.kind for e in result.events[1] if e.kind != "free"] == [
        "message",
        "task",
        "message",
        "allreduce",
    ]


def test_simulate_custom_allreduce_cost():
    calls = []

    def cost(nbytes: float, replicas: int) -> float:
        calls.append((nbytes, replicas))
        return 10.0

    result = simulate(pipeline(reduce=True), replicas=3, allreduce_cost=cost)
    assert sorted(calls) == [(64.0, 3), (64.0, 3)]
    assert result.makespan == 6.0 + 10.0  # group 1's overlaps group 0's B


def test_ring_model_of_a_general_transfer():
    # 2(R-1) messages of n/R bytes each, through any transfer function.
    ring = ring_allreduce(lambda aval: 1.0 + aval.shape[0] / 100)
    assert ring(400, 4) == 6 * (1.0 + 100 / 100)
    assert ring(400, 1) == 0.0
    assert ring_allreduce(None)(400, 8) == 0.0
    assert ring_allreduce(MessageCost(0.5, 100.0))(400, 2) == pytest.approx(
        2 * 1 / 2 * 400 / 100 + 2 * 0.5
    )


def test_simulate_rejects_no_replicas():
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        simulate(pipeline(reduce=True), replicas=0)


# ----------------------------------------------------------------------------- local executor


def test_local_executor_runs_allreduce_as_identity():
    devices = jax.devices()[:2]

    def sharding(g: int, aval: Aval) -> NamedSharding:
        return NamedSharding(jax.sharding.Mesh(np.array(devices[g : g + 1]), ("data",)), P())

    def on(g: int, fn):
        return jax.jit(fn, out_shardings=sharding(g, W))

    executables = [
        {"f": on(0, lambda w, x: (x @ w,)), "b": on(0, lambda w, h, d: (h.T @ d + w,))},
        {"fb": on(1, lambda w, h: (w * 2.0, jnp.tanh(h @ w)))},
    ]
    program = pipeline(reduce=True)
    act = Aval((8, 4), "float32")
    program = Program(
        tuple(
            dataclasses.replace(
                g,
                avals={b: act if a == ACT else a for b, a in g.avals},
                instrs=tuple(
                    dataclasses.replace(i, aval=act) if isinstance(i, Recv) else i for i in g.instrs
                ),
            )
            for g in program.groups
        )
    )
    verify(program)
    assert sorted((g, op) for g, op in local_order(program) if isinstance(op, AllReduce)) == [
        (0, AllReduce((4,), "sum")),
        (1, AllReduce((2,), "sum")),
    ]
    executor = LocalExecutor(program, executables, sharding)
    rng = np.random.default_rng(0)
    w0, w1 = rng.normal(size=(4, 4)).astype("float32"), rng.normal(size=(4, 4)).astype("float32")
    x = rng.normal(size=(8, 4)).astype("float32")
    h = x @ w0
    expected = [h.T @ np.tanh(h @ w1) + w0, w1 * 2.0]
    for timed in (False, True):
        with collect_task_times_ms(enabled=timed):
            out = executor.run([w0, x, w1])
        for got, want in zip(out, expected, strict=True):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_replica_reductions_wait_for_not_before_unless_used_earlier():
    act = Aval((4,), "float32")
    g = GroupProgram(0, {}, (Run("f", (), (1, 2), task="F0s0"), Run("c", (2,), (3,)),
                             Run("b", (), (4,), task="B0s0")), {1: 0, 3: 1, 4: 2},
                     {1: act, 2: act, 3: act, 4: act})
    out = add_replica_reductions(Program((g,)), {0: [(1, "sum"), (2, "sum"), (4, "sum")]},
                                 0, not_before={0: 2})
    # %1 (read by nothing) waits for the last backward; %2 is read by `c`, so not
    assert out.group(0).instrs == (g.instrs[0], AllReduce((2,), "sum"), g.instrs[1],
                                   g.instrs[2], AllReduce((1,), "sum"),
                                   AllReduce((4,), "sum"))
    verify(add_frees(out))
