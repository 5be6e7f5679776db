"""Walks sharing one `WalkIndex` equal walks on their own; the index's tails are the
longest paths to the end of the step; a task waits for its inputs from other groups
(`TaskGraph.waits`); a plan is built with the collector paused."""

from __future__ import annotations

import functools
import gc

import jax
import models
import pytest
from test_lower import SCHEDULES, schedule_graph

import jaxpp_mpi as jp
from jaxpp_mpi._src.compiler import lower, step_entry, task_models, timed_walk, walks
from jaxpp_mpi._src.compiler.build import build_step
from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode
from jaxpp_mpi.schedules import Std1F1B


def longest_tails(graph, latency):
    """Per task, the longest path from its start to the end of the step, by plain
    recursion over group order and dataflow (the reference)."""
    producer = {v: t.name for ts in graph.tasks for t in ts for v in t.outs}
    after = {t.name: set() for ts in graph.tasks for t in ts}
    for ts in graph.tasks:
        for a, b in zip(ts, ts[1:]):
            after[a.name].add(b.name)
        for t in ts:
            for v in t.ins:
                if producer.get(v, t.name) != t.name:
                    after[producer[v]].add(t.name)

    @functools.cache
    def tail(name):
        return latency[name] + max((tail(y) for y in after[name]), default=0.0)

    return {name: tail(name) for name in after}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_walks_sharing_an_index_equal_walks_on_their_own(name):
    graph = schedule_graph(SCHEDULES[name](4), 8)
    index = walks.WalkIndex(graph)
    shared = [lower._finish(walks.RoundWalk(graph, index))]
    alone = [lower._finish(walks.RoundWalk(graph))]
    for model in task_models.ESTIMATES:
        estimate = task_models.estimate(graph, model)
        for eager in (True, False):
            shared.append(lower._finish(timed_walk.TimedWalk(graph, estimate, eager, index)))
            alone.append(lower._finish(timed_walk.TimedWalk(graph, estimate, eager)))
    assert shared == alone


def waits_by_definition(graph):
    """Per group and task: its inputs whose producer (or binding) is another group, each
    once, in argument order (the reference)."""
    prod = graph.producers()
    return tuple(tuple(tuple(dict.fromkeys(v for v in t.ins if prod[v][0] != g)) for t in ts)
                 for g, ts in enumerate(graph.tasks))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_a_task_waits_for_its_inputs_from_other_groups(name):
    graph = schedule_graph(SCHEDULES[name](4), 8)
    assert graph.waits == waits_by_definition(graph)
    assert sum(map(len, (w for ws in graph.waits for w in ws))) < sum(
        len(t.ins) for ts in graph.tasks for t in ts)


def test_waits_keep_argument_order_once_each_and_bound_inputs_of_other_groups():
    graph = TaskGraph(2, (
        (TaskNode("a", 0, "e", ("x", "w0"), ("y",)),
         TaskNode("c", 0, "e", ("z", "w0", "z", "w1", "y"), ("u",), donate=("y",))),
        (TaskNode("b", 1, "e", ("y", "w1", "x"), ("z",)),),
    ), inputs=(("x", 0, 0), ("w0", 0, 1), ("w1", 1, 2)), outputs=(("u", 0),),
        avals={v: None for v in ("x", "w0", "w1", "y", "z", "u")})
    assert graph.waits == (((), ("z", "w1")), (("y", "x"),))
    assert graph.waits == waits_by_definition(graph)


def test_an_invalid_graph_keeps_no_waits():
    graph = TaskGraph(1, ((TaskNode("a", 0, "e", ("y",), ("z",)),
                           TaskNode("b", 0, "e", (), ("y",))),),
                      inputs=(), outputs=(), avals={"y": None, "z": None})
    for _ in range(2):  # raised each time: nothing kept
        with pytest.raises(ValueError, match="uses 'y' before task b produces it"):
            graph.waits  # noqa: B018


def dataflow_ratio(graph, latency):
    """The dataflow timeline's makespan over the busiest group's work: each task ends
    its time after its group's previous task and every input made on another group (the
    reference, by recursion over every input)."""
    made = {v: t for ts in graph.tasks for t in ts for v in t.outs}
    before = {b.name: a for ts in graph.tasks for a, b in zip(ts, ts[1:])}

    @functools.cache
    def end(t):
        start = end(before[t.name]) if t.name in before else 0.0
        for v in t.ins:
            if v in made and made[v].group != t.group:
                start = max(start, end(made[v]))
        return start + latency[t.name]

    makespan = max(end(ts[-1]) for ts in graph.tasks if ts)
    return makespan / max(sum(latency[t.name] for t in ts) for ts in graph.tasks)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_dataflow_scores_are_the_dataflow_timeline(name):
    graph = schedule_graph(SCHEDULES[name](4), 8)
    names = frozenset(t.name for ts in graph.tasks for t in ts)
    assert task_models.dataflow_scores(graph) == tuple(
        dataflow_ratio(graph, latency) for latency in task_models.model_latencies(names))


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zerobubble"])
def test_tails_are_the_longest_paths_to_the_end(name):
    graph = schedule_graph(SCHEDULES[name](3), 6)
    index = walks.WalkIndex(graph)
    for model in task_models.ESTIMATES:
        estimate = task_models.estimate(graph, model)
        assert index.tails(estimate) == longest_tails(graph, estimate)
        assert index.tails(estimate) is index.tails(estimate)  # computed once per estimate


@pytest.mark.parametrize("enabled", [True, False])
def test_a_plan_is_built_with_the_collector_paused(monkeypatch, enabled):
    params, batch, loss_fn = models.mlp(2, 4, width=4, rows=2)
    step, optimizer = models.make_step(loss_fn, Std1F1B(2))
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    seen = []
    original = step_entry.lower_cached

    def spy(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(step_entry, "lower_cached", spy)
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        build_step(step, (optimizer.init(params), params, batch), 2, mesh=mesh)
        assert seen == [False]
        assert gc.isenabled() is enabled  # left as it was
    finally:
        (gc.enable if was else gc.disable)()
