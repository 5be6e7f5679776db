"""The checks of task nodes, task graphs and the loop order name the first problem with
the same words however they are computed; the loop task nodes of a plan pass dense
ints with one name each, and a schedule's microbatch out of range is named all the same."""

from __future__ import annotations

import dataclasses

import pytest
from models import make_step, mlp

from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler import build
from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode
from jaxpp_mpi._src.ir.program import Aval
from jaxpp_mpi._src.schedules.tasks import Task, TaskType
from jaxpp_mpi.schedules import Std1F1B

A = Aval((), "float32")
T = TaskNode


def _graph(tasks, inputs=(), outputs=(), avals=None) -> TaskGraph:
    """A graph of `tasks` whose every value has an aval unless `avals` is given."""
    values = {v for ts in tasks for t in ts for v in (*t.ins, *t.outs)}
    values |= {v for v, _, _ in inputs}
    return TaskGraph(len(tasks), tasks, inputs, outputs,
                     {v: A for v in sorted(values)} if avals is None else avals)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: T("a b", 0, "e", (), ()), "task 'a b': bad name 'a b'"),
    (lambda: T("A", 0, "", (), ()), "task 'A': bad exe ''"),
    (lambda: T("A", 0, "e x", (), ()), "task 'A': bad exe 'e x'"),
    (lambda: T(3, 0, "e", (), ()), "task 3: bad name 3"),
    (lambda: T("A", 0, "e", (), ("a", "b", "a")),
     "task A: an output value is repeated in ('a', 'b', 'a')"),
    (lambda: T("A", 0, "e", ("y",), (), ("x",)),
     "task A: donated value 'x' must appear exactly once in ins ('y',) and once in "
     "donate ('x',)"),
    (lambda: T("A", 0, "e", ("x", "x"), (), ("x",)),
     "task A: donated value 'x' must appear exactly once in ins ('x', 'x') and once in "
     "donate ('x',)"),
    (lambda: T("A", 0, "e", ("x",), (), ("x", "x")),
     "task A: donated value 'x' must appear exactly once in ins ('x',) and once in "
     "donate ('x', 'x')"),
])
def test_bad_node(make, message):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value) == message


def test_a_node_may_read_a_value_twice_and_donate_another():
    t = T("A", 0, "e", ["i", "i", "x", "z"], ["o"], ["x", "z"])
    assert (t.ins, t.outs, t.donate) == (("i", "i", "x", "z"), ("o",), ("x", "z"))


@pytest.mark.parametrize(("make", "message"), [
    (lambda: _graph([[T("A", 0, "e", (), ("a",))]], inputs=[("a", 0, 0)]),
     "value 'a' is produced twice: by an input of group 0 and by task A on group 0"),
    (lambda: _graph([[T("A", 0, "e", (), ("a",))], [T("B", 1, "e", (), ("a",))]]),
     "value 'a' is produced twice: by task A on group 0 and by task B on group 1"),
    (lambda: _graph([[T("A", 0, "e", ("ghost", "d"), ("a",))]]),
     "task A on group 0: input 'ghost' is never produced"),
    # the first problem in input order: a donated value, then one never produced
    (lambda: _graph([[T("D", 0, "e", ("d",), (), ("d",)),
                      T("A", 0, "e", ("d", "ghost"), ("a",))]], inputs=[("d", 0, 0)]),
     "task A on group 0 uses 'd', which task D donated"),
    (lambda: _graph([[T("D", 0, "e", ("d",), (), ("d",)),
                      T("A", 0, "e", ("ghost", "d"), ("a",))]], inputs=[("d", 0, 0)]),
     "task A on group 0: input 'ghost' is never produced"),
    # a received copy, donated, then read again on the same group
    (lambda: _graph([[T("D", 0, "e", ("r",), (), ("r",)), T("A", 0, "e", ("r",), ("a",))],
                     [T("R", 1, "e", (), ("r",))]]),
     "task A on group 0 uses 'r', which task D donated"),
    (lambda: _graph([[T("A", 0, "e", ("b",), ("a",)), T("B", 0, "e", (), ("b",))]]),
     "task A on group 0 uses 'b' before task B produces it there"),
    (lambda: _graph([[T("A", 0, "e", ("x",), ("a",), ("x",))]], inputs=[("x", 0, 0)],
                    outputs=[("x", 0)]),
     "task A on group 0 donates step output 'x'"),
    (lambda: _graph([[T("A", 0, "e", (), ("a", "b"))]], avals={"b": A}),
     "value 'a' has no aval"),
    (lambda: _graph([[T("A", 0, "e", (), ("a",))]], outputs=[("z", 0)]),
     "output 0 ('z') is never produced"),
    (lambda: _graph([[T("A", 1, "e", (), ("a",))], []]),
     "task A has group 1 but is listed on 0"),
    (lambda: _graph([[T("A", 0, "e", (), ("a",)), T("A", 0, "e", (), ("b",))]]),
     "task name 'A' is used twice"),
])
def test_bad_graph(make, message):
    with pytest.raises(ValueError) as info:
        make().validate()
    assert str(info.value) == message


def test_producers_are_found_once_and_each_call_gets_its_own_dict():
    graph = _graph([[T("A", 0, "e", ("c",), ("a",))], [T("C", 1, "e", ("x",), ("c",))]],
                   inputs=[("x", 1, 0)])
    graph.validate()  # a value read across groups before it is made there is fine
    first = graph.producers()
    assert first == {"x": (1, ""), "a": (0, "A"), "c": (1, "C")}
    first.clear()
    assert graph.producers() == {"x": (1, ""), "a": (0, "A"), "c": (1, "C")}
    assert graph.producers() is not graph.producers()


@dataclasses.dataclass(frozen=True)
class _Edited(Std1F1B):
    """1F1B with its task lists edited by `edit(lists, num_microbatches)`."""

    edit: object = None

    def tasks(self, num_microbatches):
        lists = [list(ts) for ts in super().tasks(num_microbatches)]
        self.edit(lists, num_microbatches)
        return lists


def _extra_microbatch(lists, n):
    for s, ts in enumerate(lists):
        ts += [Task(s, n, TaskType.FWD), Task(s, n, TaskType.BWD)]


def _plan(edit, n=4):
    sched = _Edited(2, edit=edit)
    params, batch, loss_fn = mlp(2, n, width=4, rows=2)
    step, optimizer = make_step(loss_fn, sched)
    return build.build_step(step, (optimizer.init(params), params, batch), 2)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda lists, n: lists[0].pop(), "never runs B of stage 0 for microbatch 3 (1 task(s) "
                                      "missing)"),
    (lambda lists, n: lists[1].append(lists[1][0]), "runs task F0s1 twice"),
    (lambda lists, n: lists[0].append(Task(1, 0, TaskType.FWD)),
     "runs task F0s1 on group 0, but get_mpmd_idx puts stage 1 on group 1"),
])
def test_bad_schedule(edit, message):
    with pytest.raises(CompileError) as info:
        _plan(edit)
    assert message in str(info.value)


def _loop_nodes(monkeypatch, edit):
    """The loop task nodes of the MLP step's plan under 1F1B edited by `edit`."""
    seen = []

    def stop(nodes, *args, **kwargs):
        seen.append(nodes)
        raise KeyboardInterrupt  # not caught by the plan

    monkeypatch.setattr(build, "lowered_entry", stop)
    with pytest.raises(KeyboardInterrupt):
        _plan(edit)
    return seen[0]


def test_loop_nodes_values_are_dense_ints_with_one_name_each(monkeypatch):
    nodes = _loop_nodes(monkeypatch, lambda lists, n: None)
    name = nodes.names.name
    values = {v for ts in nodes.tasks for t in ts for v in (*t.ins, *t.outs)}
    assert all(type(v) is int and 0 <= v < nodes.names.size for v in values)
    assert len({name(v) for v in values}) == len(values)
    made = {v for ts in nodes.tasks for t in ts for v in t.outs}
    reads = [v for ts in nodes.tasks for t in ts for v in t.ins if "@" in name(v)]
    assert reads and set(reads) <= made
    assert all(v in nodes.avals for v in made if "@" in name(v))
    # a body value's name and microbatch, as the tasks of that microbatch pass it
    f3 = next(t for ts in nodes.tasks for t in ts if t.name == "F3s0")
    assert f3.outs and all(name(v).endswith("@3") for v in f3.outs)


def test_a_microbatch_out_of_range_is_named_like_the_others(monkeypatch):
    nodes = _loop_nodes(monkeypatch, _extra_microbatch)
    name = nodes.names.name
    extra = [t for ts in nodes.tasks for t in ts if t.name in ("F4s0", "B4s0")]
    assert len(extra) == 2
    values = [v for t in extra for v in (*t.ins, *t.outs)
              if "@" in name(v) and "acc" not in name(v)]
    assert values and all(name(v).endswith("@4") and v not in nodes.avals for v in values)
    plain = {name(v).split("@")[0] for ts in nodes.tasks for t in ts if t.name == "F3s0"
             for v in t.outs}
    assert {name(v).split("@")[0] for v in extra[0].outs} == plain
