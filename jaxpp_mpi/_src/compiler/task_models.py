"""Task-time models, and the makespans and scores of lowered programs under them.

The lowering (lower.py) walks a task graph into several candidate programs
(walks.py) and keeps the one these scores favour (`Note: timed order` in timed_walk.py):
each candidate is played from its walk's events (`play_walk`) with every task at its
time under each model of `MODELS` (`walk_scores`), or at measured times
(`measured_estimate`, `walk_makespan`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode
from jaxpp_mpi._src.compiler.walks import Event, WalkIndex
from jaxpp_mpi._src.schedules.tasks import parse_label

__all__ = ["ESTIMATES", "MODELS", "ScorePlay", "TaskModel", "dataflow_scores", "estimate",
           "group_work", "label_kinds", "label_times", "label_times_models",
           "measured_estimate", "model_latencies", "play_walk", "walk_makespan",
           "walk_scores"]

# Task-time models, (F, B, I, W) per kind letter (`kind_latency`). Each drives timed
# walks (`ESTIMATES`: the first the one the walks used alone before); the lowering keeps
# the candidate with the best mean over `MODELS`.
TaskModel = tuple[float, float, float, float]
MODELS: tuple[TaskModel, ...] = (
    (1.0, 2.0, 1.0, 1.0),  # the schedules' defaults (`DEFAULT_LATENCIES`)
    (1.0, 3.0, 1.0, 2.0),  # weight gradients twice the input gradients
    (1.0, 4.0, 1.0, 3.0),  # ... three times (accumulation bound)
    (1.0, 3.0, 2.0, 1.0),  # input gradients twice the weight gradients
)
ESTIMATES: tuple[TaskModel, ...] = (MODELS[1], MODELS[0], MODELS[2], MODELS[3])
_KIND_INDEX = {"F": 0, "B": 1, "I": 2, "W": 3}


_PIPELINE_PART = re.compile(r"([FBIW])\d+s\d+")


def label_kinds(label: str) -> tuple[int, ...]:
    """The model indexes of a task label's parts; () for a segment (no pipeline label).

    A part spelt as the compiler spells pipeline tasks (`F3s1`) is read by one match;
    any other part as `parse_label` reads it.
    """
    out = []
    for text in label.split("+"):
        m = _PIPELINE_PART.fullmatch(text)
        if m is not None:
            out.append(_KIND_INDEX[m[1]])
        else:
            out.extend(_KIND_INDEX[p.kind] for p in parse_label(text) if p.kind in _KIND_INDEX)
    return tuple(out)


def kind_latency(model: TaskModel, label: str) -> float:
    """A task's time under `model`: the sum over its label's parts; 0 for a segment."""
    return sum(model[k] for k in label_kinds(label))


def estimate(graph: TaskGraph, model: TaskModel) -> dict[str, float]:
    """Per task name, its time under `model` (`label_times`).

    For a model of `MODELS`, the dict is the one `walk_scores` times that model with,
    made once per set of names (`model_latencies`): read it, do not change it.
    """
    names = frozenset(t.name for ts in graph.tasks for t in ts)
    if model in MODELS:
        return model_latencies(names)[MODELS.index(model)]
    return label_times(names, model)


def label_times(names: set[str], model: TaskModel) -> dict[str, float]:
    """Per task name of `names`, its time under `model`; a W part without its I task
    does both.

    The compiler emits no I task where no input gradient is needed (the first stage),
    so that W computes what I would have (the gradients inside the stage).
    """
    return label_times_models(names, (model,))[0]


def label_times_models(names: Iterable[str], models: Sequence[TaskModel]
                       ) -> list[dict[str, float]]:
    """`label_times` under each of `models`, each label read once."""
    counts = _kind_counts(frozenset(names))
    distinct = set(counts.values())  # a handful: labels differ in numbers, not kinds
    out = []
    for model in models:
        time_of = {count: sum(c * t for c, t in zip(count, model) if c) for count in distinct}
        out.append({name: time_of[count] for name, count in counts.items()})
    return out


@functools.lru_cache(maxsize=2)
def _kind_counts(names: frozenset[str]) -> dict[str, tuple[int, int, int, int]]:
    """Per name, its parts of each kind (`label_kinds`; a W part without its I task
    counts as both); kept for the next call, as the lowering asks for a graph's task
    times under each model in turn."""
    parts = {label for name in names for label in name.split("+")}
    counts: dict[str, tuple[int, int, int, int]] = {}
    for name in names:
        count = [0, 0, 0, 0]
        for label in name.split("+"):
            for k in label_kinds(label):
                count[k] += 1
            if label.startswith("W") and "I" + label[1:] not in parts:
                for k in label_kinds("I" + label[1:]):
                    count[k] += 1
        counts[name] = tuple(count)
    return counts


def play_walk(events: Sequence[Event], num_groups: int,
              latencies: Sequence[Mapping[str, float]],
              sends: str = "blocking") -> list[tuple[float, float]]:
    """Per set of task times, (makespan, busiest group's work) of the program a walk
    emits, played from the walk's events alone (`Note: walk events` in walks.py).

    The makespan is `simulate.simulate`'s with free messages and `sends` (the winner is
    checked by `simulate.verify`): a Run ends its task's time after it starts; a
    blocking message when both sides have reached it, a posted one when its receiver
    has reached it and its sender had. Each of `latencies` is one set of times, per
    task label (every label the events run).
    """
    posted = sends == "posted"
    out = []
    for latency in latencies:  # one set of times at a time: a tight loop per event
        clock = [0.0] * num_groups
        work = [0.0] * num_groups
        _play(events, clock, work, latency, posted)
        out.append((max(clock, default=0.0), max(work, default=0.0)))
    return out


def _play(events: Sequence[Event], clock: list[float], work: list[float],
          latency: Mapping[str, float], posted: bool) -> None:
    """Plays `events` on the groups' clocks and work so far (`play_walk`)."""
    for e in events:
        if len(e) == 2:
            g = e[0]
            t = latency[e[1]]
            clock[g] += t
            work[g] += t
        elif posted and not e[2]:  # the sender went on when it posted the send
            a, b = e[0], e[1]
            if clock[a] > clock[b]:
                clock[b] = clock[a]
        else:
            a, b = e[0], e[1]
            if clock[a] > clock[b]:
                clock[b] = clock[a]
            else:
                clock[a] = clock[b]


def group_work(graph: TaskGraph, latencies: Sequence[Mapping[str, float]]
               ) -> list[list[float]]:
    """Per set of task times (`model_latencies`' or measured ones), per group: its
    tasks' times added in its order (as `play_walk` adds them up as the busiest group's
    work, bit for bit)."""
    out = []
    for latency in latencies:
        work = []
        for ts in graph.tasks:
            w = 0.0
            for t in ts:
                w += latency[t.name]
            work.append(w)
        out.append(work)
    return out


class ScorePlay:
    """A walk's events played under sets of task times while the walk goes on (`Note:
    hopeless walks` in lower.py): under `model_latencies(labels)`, `scores` at the end
    equals `walk_scores`, bit for bit (the same additions and maxima, in the same
    order), and `floor` before the end bounds them from below; under any times,
    `makespans` at the end equals `walk_makespan`'s and `ends` bounds it.

    Args:
      tasks: the graph's tasks, per group in its order.
      latencies: the sets of times, per task name (every task of the graph):
        `model_latencies` of the graph's task names, or measured ones.
      work: `group_work(graph, latencies)`.
      tails: per index into `latencies`, per task name, the longest path from its start
        to the end of the step with those times (`WalkIndex.tails`), or None where not
        known yet: then the group's own remaining work bounds it.
      sends: as `walk_scores`'.
    """

    def __init__(self, tasks: Sequence[Sequence[TaskNode]],
                 latencies: Sequence[Mapping[str, float]], work: list[list[float]],
                 tails: Callable[[int], Mapping[str, float] | None], sends: str = "blocking"):
        n = len(tasks)
        self.tasks, self.work, self.tails = tasks, work, tails
        self.latencies = latencies
        self.posted = sends == "posted"
        self.clocks = [[0.0] * n for _ in self.latencies]
        self.done = [[0.0] * n for _ in self.latencies]  # work played so far
        self.ran = [0] * n  # per group, the tasks it ran so far
        self.played = 0

    def advance(self, events: Sequence[Event]) -> None:
        """Plays the events not played yet (`events` extends those given before)."""
        new = events[self.played:]
        for clock, done, latency in zip(self.clocks, self.done, self.latencies):
            _play(new, clock, done, latency, self.posted)
        ran = self.ran
        for e in new:
            if len(e) == 2:
                ran[e[0]] += 1
        self.played = len(events)

    def ends(self) -> list[float]:
        """Per set of times, a lower bound of the final makespan: no group's next task
        starts before its clock, and the longest path from there to the end (else the
        rest of the group's own tasks) still takes its time (up to rounding: lower.py
        leaves a margin)."""
        nexts = [ts[k].name if k < len(ts) else None for ts, k in zip(self.tasks, self.ran)]
        out = []
        for m, (clock, work, done) in enumerate(zip(self.clocks, self.work, self.done)):
            tail = self.tails(m)
            if tail is None:
                ends = (c + (w - d) for c, w, d in zip(clock, work, done))
            else:
                ends = (c if t is None else c + tail[t] for c, t in zip(clock, nexts))
            out.append(max(ends, default=0.0))
        return out

    def floor(self) -> tuple[float, ...]:
        """Per set of times, a lower bound of the final score (`ends` over the busiest
        group's work)."""
        return tuple(_ratio(end, max(work, default=0.0))
                     for end, work in zip(self.ends(), self.work))

    def makespans(self) -> list[float]:
        """The final makespans, once every event is played (`walk_makespan`'s)."""
        return [max(clock, default=0.0) for clock in self.clocks]

    def scores(self) -> tuple[float, ...]:
        """The final scores, once every event is played (`walk_scores`')."""
        return tuple(_ratio(max(clock, default=0.0), max(done, default=0.0))
                     for clock, done in zip(self.clocks, self.done))


def walk_scores(events: Sequence[Event], num_groups: int, sends: str = "blocking",
                labels: frozenset[str] | None = None) -> tuple[float, ...]:
    """Per model of `MODELS`: the makespan over the busiest group's work (`play_walk`),
    each task at its time under the model as the walks estimate it (`estimate`).

    `labels`: every label the events run, or more (the graph's task names, the same
    for all its walks); found from the events if None.
    """
    if labels is None:
        labels = frozenset(e[1] for e in events if len(e) == 2)
    played = play_walk(events, num_groups, model_latencies(labels), sends)
    return tuple(_ratio(*x) for x in played)


def walk_makespan(events: Sequence[Event], num_groups: int, latency: Mapping[str, float],
                  sends: str = "blocking") -> float:
    """The makespan of the program a walk emits (`play_walk`), each Run taking its
    task's time in `latency` (0 if it has none)."""
    times = {e[1]: latency.get(e[1], 0.0) for e in events if len(e) == 2}
    return play_walk(events, num_groups, (times,), sends)[0][0]


def _ratio(makespan: float, busiest: float) -> float:
    """A score: the makespan over the busiest group's work (the makespan if no work)."""
    return makespan / busiest if busiest > 0 else makespan


@functools.lru_cache(maxsize=2)
def model_latencies(labels: frozenset[str]) -> list[dict[str, float]]:
    """Per model of `MODELS`, per label, its time (`label_times_models`); kept for the
    next call, as a graph's estimates and candidates all time the same tasks. Read
    them, do not change them."""
    return label_times_models(labels, MODELS)


def dataflow_scores(graph: TaskGraph, index: WalkIndex | None = None) -> tuple[float, ...]:
    """Per model of `MODELS`, `walk_scores`' ratio for the graph's own dataflow timeline.

    A task starts when its group has finished the task before it and every input it
    takes exists (messages free). No program running each group's tasks in the graph's
    order does better, so a round order at this bound under every model needs no
    timed walk. The tasks are timed in the dataflow's order (`index.order`, of the
    given `WalkIndex` or a new one), where each comes after everything it waits for;
    a task waits for its inputs from other groups only (`index.waits`): its own
    group's are done by the group's clock (`Note: what a task waits for` in
    task_graph.py).
    """
    index = index if index is not None else WalkIndex(graph)
    if not index.complete:  # cannot happen for a graph the lowering walked
        return (0.0,) * len(MODELS)
    order, waits, sent = index.order, index.order_waits, index.sent
    names = [t.name for t in order]
    groups = [t.group for t in order]
    scores = []
    for latency in model_latencies(frozenset(names)):  # one plain sweep per model
        finish = dict.fromkeys((v for v, _, _ in graph.inputs), 0.0)  # waited-for values
        free = [0.0] * graph.num_groups
        busy = [0.0] * graph.num_groups
        for g, name, waited in zip(groups, names, waits):
            clock = free[g]
            for v in waited:
                done = finish[v]
                if done > clock:
                    clock = done
            time = latency[name]
            free[g] = clock = clock + time
            busy[g] += time
            for v in sent[name]:
                finish[v] = clock
        scores.append(_ratio(max(free, default=0.0), max(busy, default=0.0)))
    return tuple(scores)


def measured_estimate(graph: TaskGraph, task_ms: Mapping[str, float]) -> dict[str, float]:
    """Per task name, its time in `task_ms` (keyed by task label, as
    `collect_task_times_ms` gives them); a task missing there is the sum over its label's
    parts ('F3s1+B1s1'): a part's own time if given, else the mean time of the given
    single-part tasks of its kind (of all given tasks where none is of that kind); a
    segment (no pipeline label) missing there takes 0."""
    by_kind: dict[int, list[float]] = {}
    for label, t in task_ms.items():
        kinds = label_kinds(label)
        if len(kinds) == 1:
            by_kind.setdefault(kinds[0], []).append(float(t))
    given = [float(t) for t in task_ms.values()]
    overall = sum(given) / len(given) if given else 0.0
    mean = {k: sum(ts) / len(ts) for k, ts in by_kind.items()}
    out = {}
    for ts in graph.tasks:
        for t in ts:
            if t.name in task_ms:
                out[t.name] = float(task_ms[t.name])
                continue
            total = 0.0
            for part in t.name.split("+"):
                if part in task_ms:
                    total += float(task_ms[part])
                else:
                    total += sum(mean.get(k, overall) for k in label_kinds(part))
            out[t.name] = total
    return out
