"""A built step's task graph names its values by dense ints (`Note: dense values`): the
names come back wherever a user or a developer reads them, and the lowering makes the
program it makes of the same graph named by strings."""

from __future__ import annotations

import pytest
from models import make_step, mlp

from jaxpp_mpi._src.compiler import build, step_entry
from jaxpp_mpi._src.compiler.lower import build_program_with_names
from jaxpp_mpi._src.compiler.task_graph import NamedBuffers, TaskGraph, TaskNode, ValueNames
from jaxpp_mpi._src.ir.program import Aval
from jaxpp_mpi.schedules import Interleaved1F1B, Std1F1B, ZeroBubble

A = Aval((), "float32")


def test_blocks_and_singles_are_named_and_counted_in_order():
    names = ValueNames()
    assert names.intern("in0") == 0
    v = names.block("v12", 3)
    assert list(v) == [1, 2, 3]
    assert names.intern("x4g1") == 4 and names.intern("in0") == 0
    assert [names.name(i) for i in range(5)] == ["in0", "v12@0", "v12@1", "v12@2", "x4g1"]
    assert names.size == 5 and names.name("plain") == "plain"
    with pytest.raises(KeyError, match="no value 5"):
        names.name(5)


def test_the_digest_changes_with_a_name_and_with_a_count():
    def made(head, n):
        names = ValueNames()
        names.intern("in0")
        names.block(head, n)
        return names.digest()

    assert made("v1", 2) == made("v1", 2)
    assert made("v1", 2) != made("v2", 2)
    assert made("v1", 2) != made("v1", 3)


def test_named_buffers_read_as_a_dict_of_names():
    names = ValueNames()
    a, b = names.intern("a"), names.block("w", 2)[1]
    buffers = NamedBuffers({0: b, 1: a}, names)
    assert buffers == {0: "w@1", 1: "a"} and dict(buffers) == {0: "w@1", 1: "a"}
    assert len(buffers) == 2 and list(buffers) == [0, 1] and buffers[1] == "a"


def _as_ints(graph: TaskGraph) -> TaskGraph:
    """`graph` with each value name made an int of a new `ValueNames`."""
    names = ValueNames()
    v = names.intern
    tasks = [[TaskNode(t.name, t.group, t.exe, [v(x) for x in t.ins],
                       [v(x) for x in t.outs], [v(x) for x in t.donate]) for t in ts]
             for ts in graph.tasks]
    return TaskGraph(graph.num_groups, tasks, [(v(x), g, k) for x, g, k in graph.inputs],
                     [(v(x), k) for x, k in graph.outputs],
                     {v(x): a for x, a in graph.avals.items()}, names)


def _as_names(graph: TaskGraph) -> TaskGraph:
    """`graph` with each value its name (the graph a string-named builder would make)."""
    n = graph.value_name
    tasks = [[TaskNode(t.name, t.group, t.exe, [n(x) for x in t.ins], [n(x) for x in t.outs],
                       [n(x) for x in t.donate]) for t in ts] for ts in graph.tasks]
    return TaskGraph(graph.num_groups, tasks, [(n(x), g, k) for x, g, k in graph.inputs],
                     [(n(x), k) for x, k in graph.outputs],
                     {n(x): a for x, a in graph.avals.items()})


@pytest.mark.parametrize(("tasks", "inputs", "message"), [
    ([[TaskNode("A", 0, "e", ("b@3",), ("a",)), TaskNode("B", 0, "e", (), ("b@3",))]], (),
     "task A on group 0 uses 'b@3' before task B produces it there"),
    ([[TaskNode("D", 0, "e", ("d",), (), ("d",)), TaskNode("A", 0, "e", ("d",), ("a",))]],
     [("d", 0, 0)], "task A on group 0 uses 'd', which task D donated"),
    ([[TaskNode("A", 0, "e", (), ("a",))], [TaskNode("B", 1, "e", (), ("a",))]], (),
     "value 'a' is produced twice: by task A on group 0 and by task B on group 1"),
])
def test_an_invalid_graph_of_ints_names_its_values(tasks, inputs, message):
    values = {x for ts in tasks for t in ts for x in (*t.ins, *t.outs)} | {x for x, _, _ in inputs}
    graph = TaskGraph(len(tasks), tasks, inputs, (), {x: A for x in sorted(values)})
    with pytest.raises(ValueError) as info:
        _as_ints(graph).validate()
    assert str(info.value) == message


def test_a_stuck_walk_names_the_values_it_waits_for():
    # each group first waits for what the other makes after: a cycle across groups
    tasks = [[TaskNode("A", 0, "e", ("y@1",), ("x@0",))],
             [TaskNode("B", 1, "e", ("x@0",), ("y@1",))]]
    graph = _as_ints(TaskGraph(2, tasks, (), (), {"x@0": A, "y@1": A}))
    with pytest.raises(ValueError, match=r"task A waits for y@1 \(from group 1\)"):
        build_program_with_names(graph)


def _built_graph(monkeypatch, sched, n) -> TaskGraph:
    """The task graph `build_step` lowers for the MLP step under `sched`."""
    seen = []

    def stop(graph, *args):
        seen.append(graph)
        raise KeyboardInterrupt  # not caught by the plan

    monkeypatch.setattr(step_entry, "lower_cached", stop)
    params, batch, loss_fn = mlp(sched.num_stages, n, width=4, rows=2)
    step, optimizer = make_step(loss_fn, sched)
    with pytest.raises(KeyboardInterrupt):
        build.build_step(step, (optimizer.init(params), params, batch), sched.mpmd_dim)
    return seen[0]


@pytest.mark.parametrize(("sched", "n"), [
    (Std1F1B(2), 4), (ZeroBubble(2), 4), (Interleaved1F1B(4, mpmd_dim=2), 4),
])
@pytest.mark.parametrize("task_ms", [None, {"F0s0": 1.0, "B0s0": 2.5, "F1s1": 1.2}])
def test_a_built_graph_lowers_as_the_same_graph_named_by_strings(monkeypatch, sched, n,
                                                                  task_ms):
    graph = _built_graph(monkeypatch, sched, n)
    values = {x for ts in graph.tasks for t in ts for x in (*t.ins, *t.outs)}
    values |= {x for x, _, _ in graph.inputs}
    assert all(type(x) is int and 0 <= x < graph.names.size for x in values)
    program, names = build_program_with_names(graph, task_ms)
    named_program, named = build_program_with_names(_as_names(graph), task_ms)
    assert program == named_program
    assert names == named and all(isinstance(b, NamedBuffers) for b in names)
