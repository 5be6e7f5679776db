"""Tests for lowering a TaskGraph to a verified Program."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import program_plays
import pytest

from jaxpp_mpi._src.compiler import lower, task_models, timed_walk, walks
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
from jaxpp_mpi._src.schedules.tasks import (
    DEFAULT_LATENCIES,
    TaskType,
    entry_tasks,
    parse_label,
    task_label,
)
from jaxpp_mpi.schedules import (
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1B,
    KimiK2,
    Std1F1B,
    ZeroBubble,
    analyze_schedule,
)

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


@pytest.mark.parametrize("eager", [True, False])
def test_timed_walk_names_stuck_tasks_after_progress(eager):
    """A cycle met after some values moved: each walk names only the inputs still
    missing (p reached group 1 before it got stuck)."""
    graph = _graph(
        [
            [T("P", 0, [], ["p"]), T("A", 0, ["y"], ["a"]), T("B", 0, [], ["x"])],
            [T("C", 1, ["p", "x"], ["c"]), T("D", 1, [], ["y"])],
        ]
    )
    graph.validate()
    latency = {t.name: 1.0 for ts in graph.tasks for t in ts}
    for walk in (walks.RoundWalk(graph), timed_walk.TimedWalk(graph, latency, eager)):
        with pytest.raises(ValueError, match="no progress") as e:
            walk.run()
        assert "group 0: task A waits for y (from group 1)" in str(e.value)
        assert "group 1: task C waits for x (from group 0)\n" in str(e.value) + "\n"


def test_missing_aval():
    graph = TaskGraph(1, ((T("A", 0, [], ["a"]),),), (), (), {})
    with pytest.raises(ValueError, match="'a' has no aval"):
        graph.validate()


# ----------------------------------------------------------------------------- timed order


def schedule_graph(schedule, num_microbatches: int) -> TaskGraph:
    """A training step laid out by a library schedule, as the compiler lays it out.

    FWD(s, m) -> act, residual; BWD (or BWD_I) (s, m) takes the residual and the next
    stage's gradient and gives this stage's gradient (none on stage 0); BWD_I also
    gives what BWD_W needs; BWD and BWD_W donate what they finish with and the stage's
    previous accumulator. Each entry is one task labelled as the schedule labels it
    (fused parts: one task). As in the compiler (`Note: loop tasks`), stage 0 of a
    split backward has no BWD_I task (no input gradient): its BWD_W takes the residual
    and the gradient itself.
    """
    S, M = schedule.num_stages, num_microbatches
    acc = {s: f"acc{s}@init" for s in range(S)}
    tasks = []
    for g, row in enumerate(schedule.tasks(M)):
        ts = []
        for entry in row:
            ins: list[str] = []
            outs: list[str] = []
            donate: list[str] = []
            parts = [t for t in entry_tasks(entry) if (t.type, t.stage_id) != (TaskType.BWD_I, 0)]
            if not parts:
                continue
            for t in parts:
                s, m, kind = t.stage_id, t.microbatch, t.type
                if kind is TaskType.FWD:
                    ins += [f"w{s}", f"x@{m}" if s == 0 else f"act{s - 1}@{m}"]
                    outs += ([f"act{s}@{m}"] if s < S - 1 else []) + [f"res{s}@{m}"]
                elif kind is TaskType.BWD_W:
                    if s == 0:  # no BWD_I task: the residual and gradient come directly
                        own = ["w0", f"res0@{m}"] + ([f"grad1@{m}"] if S > 1 else [])
                    else:
                        own = [f"wres{s}@{m}"]
                    ins += own + [acc[s]]
                    donate += [own[1] if s == 0 else own[0], acc[s]]
                    acc[s] = f"acc{s}@{m}"
                    outs.append(acc[s])
                else:
                    ins += [f"w{s}", f"res{s}@{m}"] + ([f"grad{s + 1}@{m}"] if s < S - 1 else [])
                    outs += [f"grad{s}@{m}"] if s > 0 else []
                    if kind is TaskType.BWD_I:
                        outs.append(f"wres{s}@{m}")
                    else:
                        ins.append(acc[s])
                        donate += [f"res{s}@{m}", acc[s]]
                        acc[s] = f"acc{s}@{m}"
                        outs.append(acc[s])
            local = [v for v in ins if v not in outs]  # a fused part's input from its sibling
            ins_d = list(dict.fromkeys(local))
            label = task_label(parts[0] if len(parts) == 1 else tuple(parts))
            ts.append(
                TaskNode(
                    label,
                    g,
                    label.replace("+", "_"),
                    ins_d,
                    outs,
                    [v for v in donate if v in ins_d],
                )
            )
        tasks.append(tuple(ts))
    group_of = {s: schedule.get_mpmd_idx(s) for s in range(S)}
    inputs = [(f"x@{m}", group_of[0], m) for m in range(M)]
    inputs += [(f"w{s}", group_of[s], M + s) for s in range(S)]
    inputs += [(f"acc{s}@init", group_of[s], M + S + s) for s in range(S)]
    values = {v for v, _, _ in inputs} | {v for ts in tasks for t in ts for v in t.outs}
    avals = {v: W if v.startswith(("w", "acc")) else ACT for v in sorted(values)}
    outputs = [(acc[s], s) for s in range(S)]
    return TaskGraph(schedule.mpmd_dim, tuple(tasks), tuple(inputs), tuple(outputs), avals)


def kind_latency(times: dict[TaskType, float]) -> Callable[[Run], float]:
    """A Run's time from its label's kinds (fused parts summed)."""
    by_letter = {k.value: v for k, v in times.items()}
    return lambda run: sum(by_letter[p.kind] for p in parse_label(run.task))


# bench/lowering.py (no JAX at import): the schedule's own timeline, as the benchmark computes it.
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import lowering as bench  # noqa: E402

DEFAULT = dict(DEFAULT_LATENCIES)
SPLIT = {TaskType.FWD: 1.0, TaskType.BWD: 3.0, TaskType.BWD_I: 1.0, TaskType.BWD_W: 2.0}
SCHEDULES = {
    "gpipe": lambda g: GPipe(g),
    "1f1b": lambda g: Std1F1B(g),
    "eager1f1b": lambda g: Eager1F1B(g),
    "interleaved": lambda g: Interleaved1F1B(2 * g, g),
    "kimik2": lambda g: KimiK2(2 * g, g),
    "zerobubble": lambda g: ZeroBubble(g),
    "dualpipev": lambda g: DualPipeV(2 * g, g),
}


@pytest.mark.parametrize(
    "name,groups,num_microbatches,times",
    [
        ("zerobubble", 2, 8, SPLIT),  # F=1, I=1, W=2: the weight half is the heavier one
        ("zerobubble", 2, 8, DEFAULT),
        ("interleaved", 2, 8, DEFAULT),
        ("interleaved", 2, 8, SPLIT),
        ("kimik2", 2, 16, DEFAULT),
        ("dualpipev", 2, 8, DEFAULT),
        ("1f1b", 4, 8, DEFAULT),
    ],
)
def test_lowered_program_has_the_schedules_makespan(name, groups, num_microbatches, times):
    schedule = SCHEDULES[name](groups)
    program = build_program(schedule_graph(schedule, num_microbatches))
    task_ms = bench.label_times(program, lambda label, kind, stage: times[TaskType(kind)])
    own = bench.workload.schedule_makespan(schedule, num_microbatches, task_ms, 0.0)
    assert simulate(program, kind_latency(times)).makespan == own
    if not schedule.is_partial_bwd:  # the library's own analysis agrees (same tasks)
        assert own == analyze_schedule(schedule, num_microbatches, times).makespan


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("groups,num_microbatches", [(2, 4), (2, 8), (4, 8)])
def test_never_slower_than_the_round_order(name, groups, num_microbatches):
    graph = schedule_graph(SCHEDULES[name](groups), num_microbatches)
    program = build_program(graph)
    rounds, _ = lower._finish(walks.RoundWalk(graph))
    for times in (DEFAULT, SPLIT):
        latency = kind_latency(times)
        new = simulate(program, latency).makespan
        assert new <= simulate(rounds, latency, check_leaks=False).makespan
    # Every candidate order verifies on its own (no deadlock, buffers, matching).
    for model in task_models.ESTIMATES:
        for eager in (True, False):
            timed = timed_walk.TimedWalk(graph, task_models.estimate(graph, model), eager)
            verify(add_frees(lower._finish(timed)[0]))


@pytest.mark.parametrize(
    "name,groups,num_microbatches,times,claim",
    [
        # Four groups: the walks under other estimates than `split` reach the schedule's
        # own timeline where the round order and the `split` walk did not.
        ("interleaved", 4, 8, DEFAULT, 57.0),  # round order: 62
        ("kimik2", 4, 16, DEFAULT, 105.0),  # round order: 122
        ("kimik2", 4, 16, SPLIT, 140.0),  # round order: 175
        # Blocking sends cannot reach these timelines (a message whose sender and
        # receiver are never free at one instant between its making and its use):
        ("zerobubble", 4, 8, SPLIT, 37.0),  # own 35, round order 38
        ("dualpipev", 4, 8, SPLIT, 73.0),  # own 67, round order 74
        ("dualpipev", 2, 8, SPLIT, 65.0),  # own 65, round order 66
    ],
)
def test_lowered_makespan_within_claim(name, groups, num_microbatches, times, claim):
    schedule = SCHEDULES[name](groups)
    graph = schedule_graph(schedule, num_microbatches)
    program = build_program(graph)
    verify(program)
    task_ms = bench.label_times(program, lambda label, kind, stage: times[TaskType(kind)])
    own = bench.workload.schedule_makespan(schedule, num_microbatches, task_ms, 0.0)
    makespan = simulate(program, kind_latency(times)).makespan
    assert own <= makespan <= claim


def test_zero_bubble_sends_the_activation_before_the_weight_task():
    # The round order used to run `F2s0; recv grad1; W1s0; send act2`, so group 1's
    # F2s1 waited for a whole W. Now act2 leaves right after F2s0.
    program, names = build_program_with_names(schedule_graph(ZeroBubble(2), 8))
    instrs = program.group(0).instrs
    runs = {i.task: k for k, i in enumerate(instrs) if isinstance(i, Run)}
    sent = {names[0][s[0]]: k for k, i in enumerate(instrs) if (s := send_half(i)) is not None}
    for m in range(1, 7):
        assert runs[f"F{m + 1}s0"] < sent[f"act0@{m + 1}"] < runs[f"W{m}s0"]


def test_timed_order_deterministic_and_parses_back():
    graph = schedule_graph(DualPipeV(8, 4), 8)
    program = build_program(graph)
    assert build_program(graph).hash() == program.hash()
    assert Program.parse(str(program)) == program
    assert n_messages(program) == len(cross_edges(graph))


def test_bench_compares_with_the_schedules_own_timeline():
    # bench/lowering.py's comparison (the schedule's own timeline from bench/schedules.py)
    # on the zero-bubble case: the program waits nowhere the schedule does not.
    schedule = ZeroBubble(2)
    program = build_program(schedule_graph(schedule, 8))
    task_ms = bench.label_times(program, lambda label, kind, stage: SPLIT[TaskType(kind)])
    r = bench.makespans(program, schedule, 8, task_ms, None, ACT)
    assert r["lowered"] == r["schedule"] == 33.0
    assert bench.compare(program, schedule, 8, task_ms, None, ACT)["rounds_lowered"] == 34.0


# Measured-like task times (bench/schedules.py's workload on 2 ranks: I and W each ~1.4 F,
# the first stage's W, which also does I's work, ~2.5 F). With these times given, the
# lowering keeps the fastest program under them.
MEASURED = {TaskType.FWD: 1.0, TaskType.BWD: 2.8, TaskType.BWD_I: 1.4, TaskType.BWD_W: 1.4}


def _measured_times(program, first_w: float = 2.5):
    def per(label, kind, stage):
        return first_w if (kind == "W" and stage == 0) else MEASURED[TaskType(kind)]

    return bench.label_times(program, per)


@pytest.mark.parametrize(
    "name,groups,num_microbatches,gains,within",
    [
        # (gains: strictly faster than the program lowered without times; within: the
        # makespan under the given times over the schedule's own timeline, at most)
        # 31.5 either way (32.5 before the candidates' scores timed the first stage's W,
        # which has no I task, as I + W), own 31.4
        ("zerobubble", 2, 8, False, 1.005),
        ("dualpipev", 4, 8, True, 1.05),  # 68.7 -> 66.7, own 64.0
        ("interleaved", 2, 8, False, 1.0),  # already at its own timeline
        ("dualpipev", 2, 8, False, 1.02),  # 62.5 either way, own 61.8
    ],
)
def test_given_task_times_never_lose_and_approach_the_schedules_timeline(
    name, groups, num_microbatches, gains, within
):
    schedule = SCHEDULES[name](groups)
    graph = schedule_graph(schedule, num_microbatches)
    default = build_program(graph)
    task_ms = _measured_times(default)
    tuned, _ = build_program_with_names(graph, task_ms)
    verify(tuned)
    latency = lambda run: sum(task_ms[p] for p in run.task.split("+"))  # noqa: E731
    own = bench.workload.schedule_makespan(schedule, num_microbatches, task_ms, 0.0)
    t_default = simulate(default, latency).makespan
    t_tuned = simulate(tuned, latency).makespan
    assert own <= t_tuned <= t_default
    assert (t_tuned < t_default) == gains
    assert t_tuned <= own * within + 1e-9
    measured = task_models.measured_estimate(graph, task_ms)
    assert program_plays.makespan(tuned, measured) == pytest.approx(t_tuned)


def test_given_task_times_fill_missing_labels_by_kind():
    graph = schedule_graph(ZeroBubble(2), 4)
    estimate = task_models.measured_estimate(graph, {"F0s0": 2.0, "F1s0": 4.0, "W0s1": 5.0})
    assert estimate["F0s0"] == 2.0
    assert estimate["F3s1"] == 3.0  # the mean of the given F tasks
    assert estimate["W2s0"] == 5.0
    assert estimate["I1s1"] == pytest.approx(11.0 / 3)  # no I given: the mean of all


def test_a_weight_task_without_its_input_task_is_timed_as_both():
    """The first stage has no I task: its W computes the stage's inner gradients too, in
    the walks' estimates and in the candidates' scores alike."""
    times = task_models.label_times({"F0s0", "W0s0", "I0s1", "W0s1", "W1s0+F2s0"},
                                    (1.0, 2.0, 1.5, 1.0))
    assert times == {"F0s0": 1.0, "W0s0": 2.5, "I0s1": 1.5, "W0s1": 1.0, "W1s0+F2s0": 3.5}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_posted_play_times_as_the_simulator(name):
    graph = schedule_graph(SCHEDULES[name](2), 8)
    program = build_program_with_names(graph, sends="posted")[0]
    for model in task_models.MODELS:
        times = task_models.estimate(graph, model)
        ((makespan, _),) = program_plays.play(
            program, lambda label, t=times: (t.get(label, 0.0),), 1, "posted")
        want = simulate(program, lambda run, t=times: t.get(run.task, 0.0), sends="posted")
        assert makespan == pytest.approx(want.makespan)


@pytest.mark.parametrize("name", ["interleaved", "zerobubble", "dualpipev"])
@pytest.mark.parametrize("groups", [2, 4])
def test_lowered_for_posted_sends_never_slower_than_the_round_order(name, groups):
    graph = schedule_graph(SCHEDULES[name](groups), 8)
    program = build_program_with_names(graph, sends="posted")[0]
    verify(program)  # still deadlock-free with blocking sends
    rounds, _ = lower._finish(walks.RoundWalk(graph))
    for model in task_models.MODELS:
        times = task_models.estimate(graph, model)
        latency = lambda run, t=times: t.get(run.task, 0.0)  # noqa: E731
        new = simulate(program, latency, sends="posted").makespan
        assert new <= simulate(rounds, latency, check_leaks=False, sends="posted").makespan
