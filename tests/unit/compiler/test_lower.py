"""Tests for lowering a TaskGraph to a verified Program."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from jaxpp_mpi._src.compiler.lower import (
    build_program,
    build_program_with_names,
    live_buffer_profile,
)
from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode
from jaxpp_mpi._src.ir.passes import add_frees, assign_tags, recv_half, send_half
from jaxpp_mpi._src.ir.program import (
    Aval,
    GroupProgram,
    Program,
    ProgramError,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi._src.ir.simulate import simulate, verify

ACT = Aval((4, 16), "float32", ("data",))
W = Aval((16, 16), "float32")

Order = list[list[tuple[str, int, int]]]  # per group: (kind 'F'|'B', stage_idx, microbatch_idx)

# ----------------------------------------------------------------------------- orders


def gpipe(num_stages: int, num_microbatches: int) -> Order:
    """All forwards, then all backwards; one stage per group."""
    return [
        [("F", s, m) for m in range(num_microbatches)]
        + [("B", s, m) for m in range(num_microbatches)]
        for s in range(num_stages)
    ]


def one_f_one_b(num_stages: int, num_microbatches: int) -> Order:
    """1F1B: `num_stages - 1 - s` warm-up forwards, then F/B pairs, then the cool-down."""
    order = []
    for s in range(num_stages):
        warmup = min(num_stages - 1 - s, num_microbatches)
        o = [("F", s, m) for m in range(warmup)]
        for m in range(num_microbatches - warmup):
            o += [("F", s, warmup + m), ("B", s, m)]
        o += [("B", s, m) for m in range(num_microbatches - warmup, num_microbatches)]
        order.append(o)
    return order


def interleaved(num_stages: int, num_microbatches: int) -> Order:
    """Megatron interleaved 1F1B: 2 stages per group, stage s on group s % num_groups."""
    groups, chunks = num_stages // 2, 2
    assert num_microbatches % groups == 0
    order = []
    for r in range(groups):
        total = num_microbatches * chunks
        warmup = min((chunks - 1) * groups + 2 * (groups - 1 - r), total)
        count: dict[tuple[str, int], int] = {}

        def take(kind: str, chunk: int, r: int = r, count: dict = count) -> tuple[str, int, int]:
            s = chunk * groups + r
            m = count.get((kind, s), 0)
            count[(kind, s)] = m + 1
            return (kind, s, m)

        def fwd(i: int) -> tuple[str, int, int]:
            return take("F", (i // groups) % chunks)

        def bwd(i: int) -> tuple[str, int, int]:
            return take("B", chunks - 1 - (i // groups) % chunks)

        o = [fwd(i) for i in range(warmup)]
        for i in range(total - warmup):
            o += [fwd(warmup + i), bwd(i)]
        o += [bwd(i) for i in range(total - warmup, total)]
        order.append(o)
    return order


# ----------------------------------------------------------------------------- graphs


def pipeline_graph(num_stages: int, num_microbatches: int, order: Order) -> TaskGraph:
    """A training step: FWD(s, m) -> act, residual; BWD(s, m) -> grad, accumulator.

    Step inputs: x@m (microbatch m, index m), w{s} (index M + s), acc{s}@init (index
    M + S + s); step outputs: the last accumulator of each stage (index s). BWD donates
    its residual and the previous accumulator.
    """
    S, M = num_stages, num_microbatches
    group_of = {s: g for g, o in enumerate(order) for _, s, _ in o}
    last_acc = {s: f"acc{s}@init" for s in range(S)}
    tasks = []
    for g, o in enumerate(order):
        ts = []
        for kind, s, m in o:
            if kind == "F":
                x = f"x@{m}" if s == 0 else f"act{s - 1}@{m}"
                outs = (f"act{s}@{m}",) if s < S - 1 else ()
                ts.append(
                    TaskNode(f"F{m}s{s}", g, f"fwd{s}", (f"w{s}", x), outs + (f"res{s}@{m}",))
                )
            else:
                grad_in = (f"grad{s + 1}@{m}",) if s < S - 1 else ()
                prev, res = last_acc[s], f"res{s}@{m}"
                outs = ((f"grad{s}@{m}",) if s > 0 else ()) + (f"acc{s}@{m}",)
                ins = (f"w{s}", res) + grad_in + (prev,)
                ts.append(TaskNode(f"B{m}s{s}", g, f"bwd{s}", ins, outs, donate=(res, prev)))
                last_acc[s] = f"acc{s}@{m}"
        tasks.append(tuple(ts))
    inputs = [(f"x@{m}", group_of[0], m) for m in range(M)]
    inputs += [(f"w{s}", group_of[s], M + s) for s in range(S)]
    inputs += [(f"acc{s}@init", group_of[s], M + S + s) for s in range(S)]
    values = {v for v, _, _ in inputs} | {v for ts in tasks for t in ts for v in t.outs}
    avals = {v: W if v.startswith(("w", "acc")) else ACT for v in sorted(values)}
    outputs = [(last_acc[s], s) for s in range(S)]
    return TaskGraph(len(order), tuple(tasks), tuple(inputs), tuple(outputs), avals)


def cross_edges(graph: TaskGraph) -> set[tuple[str, int]]:
    """(value, consumer group) pairs where the consumer is not the producer's group."""
    prod = {v: g for v, (g, _) in graph.producers().items()}
    return {(v, t.group) for ts in graph.tasks for t in ts for v in t.ins if prod[v] != t.group}


def naive_program(graph: TaskGraph) -> Program:
    """Send right after the producing task, receive right before the consuming one."""
    prod = {v: g for v, (g, _) in graph.producers().items()}
    consumers: dict[str, set[int]] = {}
    for ts in graph.tasks:
        for t in ts:
            for v in t.ins:
                if prod[v] != t.group:
                    consumers.setdefault(v, set()).add(t.group)
    groups = []
    for g, ts in enumerate(graph.tasks):
        ids, bufs, instrs = itertools.count(), {}, []
        inputs = [(bufs.setdefault(v, next(ids)), k) for v, h, k in graph.inputs if h == g]
        for v, _, _ in graph.inputs:
            if prod[v] == g:
                instrs += [Send(bufs[v], c, -1) for c in sorted(consumers.get(v, ()))]
        for t in ts:
            for v in t.ins:
                if v not in bufs:
                    bufs[v] = next(ids)
                    instrs.append(Recv(bufs[v], prod[v], -1, graph.avals[v]))
            outs = tuple(bufs.setdefault(v, next(ids)) for v in t.outs)
            donate = tuple(bufs[v] for v in t.donate)
            instrs.append(Run(t.exe, tuple(bufs[v] for v in t.ins), outs, t.name, donate))
            for v in t.outs:
                instrs += [Send(bufs[v], c, -1) for c in sorted(consumers.get(v, ()))]
        outputs = [(bufs[v], k) for v, k in graph.outputs if prod[v] == g]
        avals = {b: graph.avals[v] for v, b in bufs.items()}
        groups.append(GroupProgram(g, inputs, instrs, outputs, avals))
    return assign_tags(add_frees(Program(tuple(groups))))


def n_messages(program: Program) -> int:
    return sum(send_half(i) is not None for g in program.groups for i in g.instrs)


ORDERS: dict[str, Callable[[int, int], Order]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
}
GRID = [(name, s, m) for name in ORDERS for s, m in [(2, 2), (4, 4), (4, 8)]]
GRID += [("1f1b", 1, 3), ("gpipe", 3, 5), ("1f1b", 3, 5), ("interleaved", 6, 6)]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name,num_stages,num_microbatches", GRID)
def test_pipeline_lowers_and_verifies(name, num_stages, num_microbatches):
    order = ORDERS[name](num_stages, num_microbatches)
    graph = pipeline_graph(num_stages, num_microbatches, order)
    program, names = build_program_with_names(graph)
    verify(program)
    assert Program.parse(str(program)) == program
    for g, ts in enumerate(graph.tasks):
        runs = [i for i in program.group(g).instrs if isinstance(i, Run)]
        assert [r.task for r in runs] == [t.name for t in ts]
        assert set(names[g]) == {b for b, _ in program.group(g).avals}
    edges = cross_edges(graph)
    assert n_messages(program) == len(edges)
    if len(order) > 1:
        assert len(edges) == 2 * (num_stages - 1) * num_microbatches
    # Outputs: the last accumulator of each stage, on the stage's group.
    out = {k: (g.mpmd_idx, names[g.mpmd_idx][b]) for g in program.groups for b, k in g.outputs}
    group_of = {s: g for g, o in enumerate(order) for _, s, _ in o}
    assert out == {s: (group_of[s], f"acc{s}@{num_microbatches - 1}") for s in range(num_stages)}
    ins = {k: names[g.mpmd_idx][b] for g in program.groups for b, k in g.inputs}
    assert sorted(ins) == list(range(num_microbatches + 2 * num_stages))


def test_1f1b_pairs_opposite_messages_where_naive_order_deadlocks():
    graph = pipeline_graph(4, 8, one_f_one_b(4, 8))
    with pytest.raises(ProgramError) as e:
        verify(naive_program(graph))
    assert e.value.kind == "deadlock"
    program = build_program(graph)
    assert any(isinstance(i, SendRecv) for g in program.groups for i in g.instrs)


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_makespan_is_ideal(name):
    S, M = 4, 8
    program = build_program(pipeline_graph(S, M, ORDERS[name](S, M)))
    assert simulate(program).makespan == (M + S - 1) * 3


def test_1f1b_live_activations_bounded_by_stage_count():
    S, M = 4, 8
    program, names = build_program_with_names(pipeline_graph(S, M, one_f_one_b(S, M)))
    g0 = program.group(0)
    assert live_buffer_profile(g0, names[0], lambda v: v.startswith("res")) == S
    assert live_buffer_profile(g0, names[0], lambda v: v.startswith(("res", "act"))) <= S + 1
    gpipe_prog, gpipe_names = build_program_with_names(pipeline_graph(S, M, gpipe(S, M)))
    assert live_buffer_profile(gpipe_prog.group(0), gpipe_names[0], lambda v: v[:3] == "res") == M


def test_deterministic():
    def build() -> Program:
        return build_program(pipeline_graph(4, 8, interleaved(4, 8)))

    assert build().hash() == build().hash()
    graph = pipeline_graph(4, 8, one_f_one_b(4, 8))
    shuffled = TaskGraph(
        graph.num_groups,
        graph.tasks,
        tuple(reversed(graph.inputs)),
        tuple(reversed(graph.outputs)),
        dict(reversed(list(graph.avals.items()))),
    )
    assert build_program(shuffled).hash() == build_program(graph).hash()


def test_buffer_ids_inputs_first_then_definition_order():
    program, names = build_program_with_names(pipeline_graph(2, 2, one_f_one_b(2, 2)))
    g1 = program.group(1)
    assert [b for b, _ in g1.inputs] == [0, 1]
    assert names[1][0] == "w1" and names[1][1] == "acc1@init"
    first = next(i for i in g1.instrs if recv_half(i) is not None)
    assert recv_half(first)[0] == 2 and names[1][2] == "act0@0"


def _graph(tasks: list[list[TaskNode]], inputs=(), outputs=()) -> TaskGraph:
    values = {v for ts in tasks for t in ts for v in t.ins + t.outs} | {v for v, *_ in inputs}
    return TaskGraph(
        len(tasks), tuple(map(tuple, tasks)), inputs, outputs, dict.fromkeys(values, W)
    )


def T(name: str, group: int, ins=(), outs=(), donate=()) -> TaskNode:  # noqa: N802
    return TaskNode(name, group, "exe_" + name, tuple(ins), tuple(outs), tuple(donate))


def test_input_sent_to_other_group_and_post_task():
    graph = _graph(
        [
            [T("pre0", 0, ["w"], ["a"]), T("post0", 0, ["b", "a"], ["loss"])],
            [T("mid1", 1, ["w", "a"], ["b"])],
        ],
        inputs=[("w", 0, 0)],
        outputs=[("loss", 0)],
    )
    program = build_program(graph)
    assert n_messages(program) == len(cross_edges(graph)) == 3
    assert program.group(0).outputs == ((3, 0),)  # w, a, b (received), loss


def test_donated_value_is_sent_before_the_donating_task():
    graph = _graph(
        [[T("P", 0, [], ["v"]), T("D", 0, ["v"], ["u"], donate=["v"])], [T("U", 1, ["v"], [])]]
    )
    program = build_program(graph)
    instrs = program.group(0).instrs
    send_at = next(k for k, i in enumerate(instrs) if isinstance(i, Send))
    donate_at = next(k for k, i in enumerate(instrs) if isinstance(i, Run) and i.donate)
    assert send_at < donate_at


@pytest.mark.parametrize(
    "tasks,inputs,outputs,match",
    [
        ([[T("A", 0, ["ghost"], ["a"])]], [], [], "'ghost' is never produced"),
        ([[T("A", 0, [], ["a"]), T("B", 0, [], ["a"])]], [], [], "produced twice"),
        ([[T("A", 0, ["b"], ["a"]), T("B", 0, [], ["b"])]], [], [], "before task B produces"),
        (
            [[T("P", 0, [], ["v"]), T("D", 0, ["v"], [], donate=["v"]), T("U", 0, ["v"], [])]],
            [],
            [],
            "uses 'v', which task D donated",
        ),
        ([[T("D", 0, ["v"], [], donate=["v"])]], [("v", 0, 0)], [("v", 0)], "donates step out"),
        ([[T("A", 1, [], ["a"])]], [], [], "has group 1 but is listed on 0"),
        ([[T("A", 0, [], ["a"])]], [], [("b", 0)], "output 0 .* never produced"),
        ([[T("A", 0, [], ["a"]), T("A", 0, [], ["b"])]], [], [], "used twice"),
    ],
)
def test_invalid_graph(tasks, inputs, outputs, match):
    with pytest.raises(ValueError, match=match):
        build_program(_graph(tasks, inputs, outputs))


def test_cycle_names_stuck_tasks():
    graph = _graph(
        [
            [T("A", 0, ["y"], ["a"]), T("B", 0, [], ["x"])],
            [T("C", 1, ["x"], ["c"]), T("D", 1, [], ["y"])],
        ]
    )
    graph.validate()  # each group's own order is fine; the cycle spans groups
    with pytest.raises(ValueError, match="no progress") as e:
        build_program(graph)
    assert "group 0: task A waits for y (from group 1)" in str(e.value)
    assert "group 1: task C waits for x (from group 0)" in str(e.value)


def test_missing_aval():
    graph = TaskGraph(1, ((T("A", 0, [], ["a"]),),), (), (), {})
    with pytest.raises(ValueError, match="'a' has no aval"):
        graph.validate()
