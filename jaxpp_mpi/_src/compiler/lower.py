"""Lowering: a TaskGraph becomes a deadlock-free, verified Program."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping

from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode, Value
from jaxpp_mpi._src.ir import passes as program_passes
from jaxpp_mpi._src.ir import rendezvous, simulate
from jaxpp_mpi._src.ir.program import (
    Free,
    GroupProgram,
    Instr,
    Program,
    Recv,
    Run,
    Send,
)
from jaxpp_mpi._src.schedules.tasks import parse_label

__all__ = ["build_program", "build_program_with_names", "live_buffer_profile"]

BufferNames = tuple[dict[int, Value], ...]  # per group: buffer id -> value name


@dataclasses.dataclass(frozen=True, slots=True)
class _Message:
    """One transfer of `value` from group `src` to group `dst`."""

    value: Value
    src: int
    dst: int


@dataclasses.dataclass
class _Group:
    """The lowering's mutable state for one group."""

    tasks: tuple[TaskNode, ...]
    instrs: list[Instr] = dataclasses.field(default_factory=list)
    bufs: dict[Value, int] = dataclasses.field(default_factory=dict)  # value -> live buffer
    names: dict[int, Value] = dataclasses.field(default_factory=dict)  # buffer -> value
    pos: int = 0  # index of the next task

    def define(self, v: Value) -> int:
        """A fresh buffer for `v`; ids count up in order of definition."""
        b = len(self.names)
        self.bufs[v] = b
        self.names[b] = v
        return b

    @property
    def next_task(self) -> TaskNode | None:
        return self.tasks[self.pos] if self.pos < len(self.tasks) else None

    def missing(self) -> tuple[Value, ...]:
        """The inputs of the next task not present on this group, in argument order."""
        t = self.next_task
        return () if t is None else tuple(dict.fromkeys(v for v in t.ins if v not in self.bufs))


class _Lowering:
    """Walks the graph in rounds and appends each group's instructions.

    Note: global order
      Every instruction is appended at one point of a single sequential order of events:
      a Run is an event of its group, and a message is one joint event of both groups
      (Send on the sender, Recv on the receiver). A pair of opposite messages between
      two groups is one joint event too, an *exchange*: each side gets its Send, then
      its Recv, which is the crossing pattern that `passes.pair_exchanges` fuses into
      one SendRecv per side (no other pair of messages forms it: two separate events
      would have to come in opposite orders on the two groups). After that pass, played
      in this order, every blocking send meets its receive at once, so the order is
      itself a rendezvous execution (`Note: rendezvous play`) and the program cannot
      deadlock. Rounds, groups and channels are visited in sorted order, so every rank
      builds the same program.

      The lowering does not drive `rendezvous.play`: that player walks instruction
      lists that already exist, while here the instructions do not exist until the
      lowering decides them, from every group's next task at once (which values are
      missing, which exist, which opposite messages pair up). Playing the result again
      is `simulate.verify`'s job, done once at the end of `build_program_with_names`.
    """

    def __init__(self, graph: TaskGraph):
        self.graph = graph
        self.prod = {v: g for v, (g, _) in graph.producers().items()}
        self.groups = [_Group(ts) for ts in graph.tasks]
        self.available: set[Value] = set()  # values produced somewhere so far
        # value -> consumer groups other than its producer, not yet delivered to
        self.undelivered: dict[Value, set[int]] = {}
        for g, ts in enumerate(graph.tasks):
            for t in ts:
                for v in t.ins:
                    if self.prod[v] != g:
                        self.undelivered.setdefault(v, set()).add(g)
        self.input_bufs: dict[Value, int] = {}
        for v, g, _ in sorted(graph.inputs, key=lambda x: (x[1], x[2], x[0])):
            self.input_bufs[v] = self.groups[g].define(v)
            self.available.add(v)

    def run(self) -> None:
        """Rounds until every group has run all its tasks.

        Raises:
          ValueError: if a round makes no progress, naming each stuck task.
        """
        while any(gs.next_task is not None for gs in self.groups):
            ran = [self._run_task(g) for g in range(len(self.groups))]
            delivered = self._deliver(self._needed())
            if not any(ran) and not delivered:
                raise ValueError(self._stuck_message())

    def _run_task(self, g: int) -> bool:
        """Runs group g's next task if all its inputs are present; returns whether it ran."""
        gs = self.groups[g]
        t = gs.next_task
        if t is None or gs.missing():
            return False
        # A donated buffer dies in the task: send it to its other consumers first.
        early = [
            _Message(v, g, dst)
            for v in t.donate
            if self.prod[v] == g
            for dst in sorted(self.undelivered.get(v, ()))
        ]
        self._deliver(early)
        ins = tuple(gs.bufs[v] for v in t.ins)
        donate = tuple(gs.bufs.pop(v) for v in t.donate)
        outs = tuple(gs.define(v) for v in t.outs)
        gs.instrs.append(Run(t.exe, ins, outs, t.name, donate))
        self.available.update(t.outs)
        gs.pos += 1
        return True

    def _needed(self) -> list[_Message]:
        """Messages whose receiver's next task waits for them and whose value exists."""
        return [
            _Message(v, self.prod[v], g)
            for g, gs in enumerate(self.groups)
            for v in gs.missing()
            if v in self.available
        ]

    def _deliver(self, messages: list[_Message]) -> bool:
        """Appends `messages` as joint events, opposite ones as exchanges.

        Channels between a pair of groups are visited in sorted order; within a channel,
        messages keep their order. The k-th message of lo->hi is paired with the k-th of
        hi->lo into an exchange (`_exchange`); the rest become Send/Recv.
        """
        by_pair: dict[tuple[int, int], tuple[list[_Message], list[_Message]]] = {}
        for m in messages:
            lo, hi = sorted((m.src, m.dst))
            by_pair.setdefault((lo, hi), ([], []))[m.src != lo].append(m)
        for key in sorted(by_pair):
            up, down = by_pair[key]
            for k in range(max(len(up), len(down))):
                if k < len(up) and k < len(down):
                    self._exchange(up[k], down[k])
                else:
                    self._send((up if k < len(up) else down)[k])
        return bool(messages)

    def _take(self, m: _Message) -> tuple[int, int]:
        """(sender's buffer, receiver's fresh buffer) of `m`; marks `m` delivered."""
        self.undelivered[m.value].discard(m.dst)
        return self.groups[m.src].bufs[m.value], self.groups[m.dst].define(m.value)

    def _send(self, m: _Message) -> None:
        sbuf, rbuf = self._take(m)
        self.groups[m.src].instrs.append(Send(sbuf, m.dst, -1))
        self.groups[m.dst].instrs.append(Recv(rbuf, m.src, -1, self.graph.avals[m.value]))

    def _exchange(self, m: _Message, r: _Message) -> None:
        """`m` (a->b) and `r` (b->a) as Send then Recv on each side.

        The crossing pattern becomes one SendRecv per side in `pair_exchanges` (see
        `Note: global order`).
        """
        a, b = m.src, m.dst
        m_send, m_recv = self._take(m)
        r_send, r_recv = self._take(r)
        avals = self.graph.avals
        self.groups[a].instrs += [Send(m_send, b, -1), Recv(r_recv, b, -1, avals[r.value])]
        self.groups[b].instrs += [Send(r_send, a, -1), Recv(m_recv, a, -1, avals[m.value])]

    def _stuck_message(self) -> str:
        lines = []
        for g, gs in enumerate(self.groups):
            t = gs.next_task
            if t is None:
                continue
            waits = ", ".join(
                f"{v} (from group {self.prod[v]})" if self.prod[v] != g else v for v in gs.missing()
            )
            lines.append(f"  group {g}: task {t.name} waits for {waits}")
        return "lowering made no progress (a cycle in the task order?):\n" + "\n".join(lines)

    def program(self) -> tuple[Program, BufferNames]:
        """The Program (exchanges unpaired, tags unassigned, no Frees) and buffer names."""
        groups = []
        for g, gs in enumerate(self.groups):
            inputs = [(self.input_bufs[v], k) for v, h, k in self.graph.inputs if h == g]
            outputs = [(gs.bufs[v], k) for v, k in self.graph.outputs if self.prod[v] == g]
            avals = {b: self.graph.avals[v] for b, v in gs.names.items()}
            groups.append(GroupProgram(g, inputs, tuple(gs.instrs), outputs, avals))
        return Program(tuple(groups)), tuple(dict(gs.names) for gs in self.groups)


# ----------------------------------------------------------------------------- timed order

# Task-time models, (F, B, I, W) per kind letter (`_kind_latency`). Each drives timed
# walks (`_ESTIMATES`: the first the one the walks used alone before); the lowering keeps
# the candidate with the best mean over `_MODELS`.
TaskModel = tuple[float, float, float, float]
_MODELS: tuple[TaskModel, ...] = (
    (1.0, 2.0, 1.0, 1.0),  # the schedules' defaults (`DEFAULT_LATENCIES`)
    (1.0, 3.0, 1.0, 2.0),  # weight gradients twice the input gradients
    (1.0, 4.0, 1.0, 3.0),  # ... three times (accumulation bound)
    (1.0, 3.0, 2.0, 1.0),  # input gradients twice the weight gradients
)
_ESTIMATES: tuple[TaskModel, ...] = (_MODELS[1], _MODELS[0], _MODELS[2], _MODELS[3])
_KIND_INDEX = {"F": 0, "B": 1, "I": 2, "W": 3}


@functools.lru_cache(maxsize=4096)
def _label_kinds(label: str) -> tuple[int, ...]:
    """The model indexes of a task label's parts; () for a segment (no pipeline label)."""
    try:
        parts = parse_label(label)
    except ValueError:
        return ()
    return tuple(_KIND_INDEX[p.kind] for p in parts if p.kind in _KIND_INDEX)


def _kind_latency(model: TaskModel, label: str) -> float:
    """A task's time under `model`: the sum over its label's parts; 0 for a segment."""
    return sum(model[k] for k in _label_kinds(label))


def _estimate(graph: TaskGraph, model: TaskModel) -> dict[str, float]:
    """Per task name, its time under `model` (`_label_times`)."""
    return _label_times({t.name for ts in graph.tasks for t in ts}, model)


def _label_times(names: set[str], model: TaskModel) -> dict[str, float]:
    """Per task name of `names`, its time under `model`; a W part without its I task
    does both.

    The compiler emits no I task where no input gradient is needed (the first stage),
    so that W computes what I would have (the gradients inside the stage).
    """
    parts = {label for name in names for label in name.split("+")}
    out = {}
    for name in names:
        total = 0.0
        for label in name.split("+"):
            total += _kind_latency(model, label)
            if label.startswith("W") and "I" + label[1:] not in parts:
                total += _kind_latency(model, "I" + label[1:])
        out[name] = total
    return out


class _TimedLowering(_Lowering):
    """Walks the graph in estimated time and appends each group's instructions.

    Note: timed order
      The round walk (`_Lowering.run`) gives every task one round, so with tasks of
      different lengths a message lands on its sender after tasks that, in time, come
      after the receiver needs it (a backward twice a forward, a long weight-gradient
      task before a send). This walk plays the groups in estimated time instead
      (`latency` per task; messages take no time): each group is busy until `time[g]`;
      the earliest group acts next (ties by index): it first delivers its pending
      messages with each peer that is there at the same time (both idle: they cost
      neither), then runs its next task if its inputs are present, else waits for the
      next event. Before running a task while a value it made is still owed to a busy
      peer, it compares the estimated end of the step both ways (`tail`: the longest
      path from a task's start to the end of the step, along group order and data) and
      waits for the peer when that ends earlier. Donated values are delivered before
      their task runs (`Note: donation`), waiting for the peer if needed.

      The best order depends on task times the compiler does not know, and a walk on
      a wrong estimate can wait where the round walk does not. So `_lower_best` builds
      the round order and the eager and lazy timed orders under each of four estimates
      (`_ESTIMATES`, the task-time models of `_MODELS`: no single estimate wins
      everywhere: on 4 groups Interleaved and KimiK2 reach their own timeline under
      every model when walked with B four times F, ZeroBubble and DualPipeV gain only
      from the lazy walk on the defaults) and simulates each under every model, each
      task at its time under the model as the walks estimated it (`_label_times`: the
      first stage's W, which has no I task, does both), and with the runtime's sends
      (`sends`: blocking, or posted where the MPI executor posts them, `Note: posted
      sends` in mpi/posted.py; every candidate is deadlock-free with blocking sends
      either way); a timed order replaces the round order only if it is no slower
      under any model, and the one with the best mean wins. bench/lowering.py measures the result
      against each schedule's own dataflow timeline. When the user gives measured task
      times (`task_times_ms`), there is nothing to hedge: the walks also run on those
      times and the program fastest under them wins (`_lower_measured`).

      With `eager`, two idle groups exchange every value one owes the other; without,
      only what the receiver's next task needs or what a receiver with nothing ready
      takes (a receive before an independent Run could make that Run wait on the
      sender, if the estimate is wrong). Each event is still appended at one point of a
      single global order, both sides of a message at once, so `Note: global order`'s
      argument (rendezvous play, no deadlock) holds unchanged.
    """

    def __init__(self, graph: TaskGraph, latency: Mapping[str, float], eager: bool):
        super().__init__(graph)
        self.latency = latency
        self.eager = eager
        n = len(self.groups)
        self.time = [0.0] * n
        self.first_use: list[dict[Value, int]] = []  # per group: value -> first task reading it
        for ts in graph.tasks:
            first: dict[Value, int] = {}
            for i, t in enumerate(ts):
                for v in t.ins:
                    first.setdefault(v, i)
            self.first_use.append(first)
        self.pending: list[dict[tuple[Value, int], _Message]] = [{} for _ in range(n)]
        for v in self.input_bufs:
            self._owe(v)
        self.tail = self._tails(graph)

    def _tails(self, graph: TaskGraph) -> dict[str, float]:
        """Per task: the estimated longest path from its start to the end of the step."""
        producer = {v: t.name for ts in graph.tasks for t in ts for v in t.outs}
        succ: dict[str, set[str]] = {t.name: set() for ts in graph.tasks for t in ts}
        for ts in graph.tasks:
            for a, b in zip(ts, ts[1:]):
                succ[a.name].add(b.name)
            for t in ts:
                for v in t.ins:
                    if v in producer and producer[v] != t.name:
                        succ[producer[v]].add(t.name)
        tail: dict[str, float] = {}
        for root in succ:  # iterative post-order: the task graph is acyclic once it lowers
            stack = [(root, False)]
            while stack:
                x, expanded = stack.pop()
                if x in tail:
                    continue
                if expanded:
                    tail[x] = self.latency[x] + max((tail[y] for y in succ[x]), default=0.0)
                else:
                    stack.append((x, True))
                    stack.extend((y, False) for y in succ[x] if y not in tail)
        return tail

    def _owe(self, v: Value) -> None:
        """Records the messages of the new value `v` with the groups waiting for it."""
        src = self.prod[v]
        for dst in sorted(self.undelivered.get(v, ())):
            m = _Message(v, src, dst)
            self.pending[src][(v, dst)] = self.pending[dst][(v, dst)] = m

    def _deliver_timed(self, messages: list[_Message]) -> None:
        """Delivers `messages` pair by pair (sorted), in the order receivers need them."""
        by_pair: dict[tuple[int, int], list[_Message]] = {}
        for m in messages:
            by_pair.setdefault((min(m.src, m.dst), max(m.src, m.dst)), []).append(m)
        for (a, b), ms in sorted(by_pair.items()):
            ms.sort(key=lambda m: (self.first_use[m.dst][m.value], m.value, m.dst))
            self._deliver(ms)
            for m in ms:
                del self.pending[m.src][(m.value, m.dst)], self.pending[m.dst][(m.value, m.dst)]
            self.time[a] = self.time[b] = max(self.time[a], self.time[b])

    def _takes_now(self, m: _Message) -> bool:
        """Whether m's receiver, idle, should take m now (see `Note: timed order`)."""
        if self.eager:
            return True
        r = self.groups[m.dst]
        t = r.next_task
        return t is None or m.value in t.ins or bool(r.missing())

    def run(self) -> None:
        """Plays the groups in estimated time until all tasks ran and all values arrived.

        Raises:
          ValueError: if no group can act (the task order has a cycle across groups).
        """
        n = len(self.groups)
        while True:
            live = [g for g in range(n) if self.groups[g].next_task is not None or self.pending[g]]
            if not live:
                return
            if not any(self._act(g, live) for g in sorted(live, key=lambda g: (self.time[g], g))):
                raise ValueError(self._stuck_message())

    def _act(self, g: int, live: list[int]) -> bool:
        """One step of group g at its time; returns whether anything changed."""
        t, gs = self.time[g], self.groups[g]
        pending = sorted(self.pending[g].values(), key=lambda m: (m.value, m.dst))
        here = [
            m
            for m in pending
            if self.time[m.src if m.dst == g else m.dst] <= t and self._takes_now(m)
        ]
        if here:
            self._deliver_timed(here)
            return True
        task = gs.next_task
        if task is not None and not gs.missing():
            owed = [m for m in pending if m.src == g and self.time[m.dst] > t]
            forced = [m.dst for m in owed if m.value in task.donate]
            wait = [self.time[h] for h in forced] or [
                self.time[m.dst] for m in owed if self._worth_waiting(m, task, t)
            ]
            if wait:
                self.time[g] = min(wait)
                return True
            self._run_task(g)
            self.available.update(task.outs)
            for v in task.outs:
                self._owe(v)
            self.time[g] = t + self.latency[task.name]
            return True
        later = [self.time[h] for h in live if self.time[h] > t]
        if later:
            self.time[g] = min(later)
            return True
        return False

    def _worth_waiting(self, m: _Message, task: TaskNode, t: float) -> bool:
        """Whether g should wait for busy m.dst to send m before running `task` at t."""
        h = self.groups[m.dst]
        th = self.time[m.dst]
        use = self.first_use[m.dst][m.value]
        before = sum(self.latency[x.name] for x in h.tasks[h.pos : use])
        consumer = self.tail[h.tasks[use].name]
        end_wait = max(th + self.tail[task.name], th + before + consumer)
        end_run = max(
            t + self.tail[task.name], max(th + before, t + self.latency[task.name]) + consumer
        )
        return end_wait < end_run


def _finish(lowering: _Lowering) -> tuple[Program, BufferNames]:
    """Runs `lowering`; its program with exchanges paired and tags assigned (no Frees)."""
    lowering.run()
    return _passes(lowering)


def _passes(lowering: _Lowering) -> tuple[Program, BufferNames]:
    """The program of a finished `lowering`, exchanges paired and tags assigned."""
    program, names = lowering.program()
    return program_passes.assign_tags(program_passes.pair_exchanges(program)), names


def _play(program: Program, times: Callable[[str], tuple[float, ...]], k: int,
          sends: str = "blocking") -> list[tuple[float, float]]:
    """Per set of task times, (makespan, busiest group's work) of `program`.

    The makespan is `simulate.simulate`'s with free messages and `sends`, for every set
    of times from one play (`rendezvous.play`, or `simulate.posted_order` for posted
    sends; the candidates are checked once, the winner by `simulate.verify`): a Run
    ends its task's time after it starts; a blocking message when both sides have
    reached it, a posted one when its receiver has reached it and its sender had.
    `times(label)` gives a task's time in each of the `k` sets.
    """
    instrs = [g.instrs for g in program.groups]
    now = [[0.0] * len(instrs) for _ in range(k)]
    busy = [[0.0] * len(instrs) for _ in range(k)]
    cache: dict[str, tuple[float, ...]] = {}

    def run_task(g: int, run: Run) -> None:
        ts = cache.get(run.task)
        if ts is None:
            ts = cache[run.task] = times(run.task)
        for clock, work, t in zip(now, busy, ts):
            clock[g] += t
            work[g] += t

    if sends == "posted":
        posted: dict[tuple[int, int], list[float]] = {}
        for is_post, g, i, sender in simulate.posted_order(program):
            if is_post:
                posted[(g, i)] = [clock[g] for clock in now]
            elif sender is not None:
                for clock, t in zip(now, posted[sender]):
                    clock[g] = max(clock[g], t)
            elif isinstance(run := instrs[g][i], Run):
                run_task(g, run)
    else:
        for e in rendezvous.play(program):
            if isinstance(e, rendezvous.Matched):
                (s, _), (d, _) = e.send, e.recv
                for clock in now:
                    clock[s] = clock[d] = max(clock[s], clock[d])
            elif isinstance(run := instrs[e.group][e.index], Run):
                run_task(e.group, run)
    return [(max(clock, default=0.0), max(work, default=0.0)) for clock, work in zip(now, busy)]


def _ratio(makespan: float, busiest: float) -> float:
    """A score: the makespan over the busiest group's work (the makespan if no work)."""
    return makespan / busiest if busiest > 0 else makespan


def _scores(program: Program, sends: str = "blocking") -> tuple[float, ...]:
    """Per model of `_MODELS`: the makespan over the busiest group's work (`_play`),
    each task at its time under the model as the walks estimate it (`_estimate`)."""
    labels = {r.task for g in program.groups for r in g.instrs if isinstance(r, Run)}
    per_model = [_label_times(labels, m) for m in _MODELS]
    played = _play(program, lambda label: tuple(t.get(label, 0.0) for t in per_model),
                   len(_MODELS), sends)
    return tuple(_ratio(*x) for x in played)


def _dataflow_scores(graph: TaskGraph) -> tuple[float, ...]:
    """Per model of `_MODELS`, `_scores`' ratio for the graph's own dataflow timeline.

    A task starts when its group has finished the task before it and every input it
    takes exists (messages free). No program running each group's tasks in the graph's
    order does better, so a round order at this bound under every model needs no
    timed walk.
    """
    estimates = [_estimate(graph, model) for model in _MODELS]  # as `_scores` times
    ready = {v: 0.0 for v, _, _ in graph.inputs}
    finish = [dict(ready) for _ in _MODELS]
    free = [[0.0] * graph.num_groups for _ in _MODELS]
    busy = [[0.0] * graph.num_groups for _ in _MODELS]
    nxt = [0] * graph.num_groups
    left = sum(len(ts) for ts in graph.tasks)
    while left:
        progressed = False
        for g, ts in enumerate(graph.tasks):
            while nxt[g] < len(ts) and all(v in finish[0] for v in ts[nxt[g]].ins):
                task = ts[nxt[g]]
                for m, times in enumerate(estimates):
                    t = times[task.name]
                    start = max([free[m][g], *(finish[m][v] for v in task.ins)])
                    free[m][g] = start + t
                    busy[m][g] += t
                    for v in task.outs:
                        finish[m][v] = start + t
                nxt[g] += 1
                left -= 1
                progressed = True
        if not progressed:  # cannot happen for a graph the lowering walked
            return tuple(0.0 for _ in _MODELS)
    return tuple(_ratio(max(clock, default=0.0), max(work, default=0.0))
                 for clock, work in zip(free, busy))


def _measured_estimate(graph: TaskGraph, task_ms: Mapping[str, float]) -> dict[str, float]:
    """Per task name, its time in `task_ms` (keyed by task label, as
    `collect_task_times_ms` gives them); a task missing there is the sum over its label's
    parts ('F3s1+B1s1'): a part's own time if given, else the mean time of the given
    single-part tasks of its kind (of all given tasks where none is of that kind); a
    segment (no pipeline label) missing there takes 0."""
    by_kind: dict[int, list[float]] = {}
    for label, t in task_ms.items():
        kinds = _label_kinds(label)
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
                    total += sum(mean.get(k, overall) for k in _label_kinds(part))
            out[t.name] = total
    return out


def _makespan(program: Program, latency: Mapping[str, float], sends: str = "blocking") -> float:
    """The makespan of `program` (`_play`), each Run taking its task's time in `latency`."""
    return _play(program, lambda label: (latency.get(label, 0.0),), 1, sends)[0][0]


def _timed_candidates(graph: TaskGraph, estimates: Iterable[Mapping[str, float]]
                      ) -> Iterator[tuple[Program, BufferNames]]:
    """The eager and the lazy timed walk's program under each estimate (per task name,
    its time), each distinct order once (`Note: timed order`)."""
    seen: set[tuple[tuple[Instr, ...], ...]] = set()
    for estimate in estimates:
        for eager in (True, False):
            walk = _TimedLowering(graph, estimate, eager)
            walk.run()
            key = tuple(tuple(gs.instrs) for gs in walk.groups)
            if key not in seen:
                seen.add(key)
                yield _passes(walk)


def _lower_measured(graph: TaskGraph, task_ms: Mapping[str, float],
                    sends: str = "blocking") -> tuple[Program, BufferNames]:
    """The fastest of the round order and the timed orders under measured task times.

    The timed walks run eager and lazy on the measured times and on each estimate of
    `_ESTIMATES`; every candidate is played with the measured times (`_makespan`), and
    the fastest wins, the earlier one (the round order first) on ties. With the times
    known, no hedging over task-time models is needed (`Note: timed order`).
    """
    measured = _measured_estimate(graph, task_ms)
    rounds = _finish(_Lowering(graph))
    best, best_time = rounds, _makespan(rounds[0], measured, sends)
    estimates = (measured, *(_estimate(graph, m) for m in _ESTIMATES))
    for candidate in _timed_candidates(graph, estimates):
        t = _makespan(candidate[0], measured, sends)
        if t < best_time - 1e-9:
            best, best_time = candidate, t
    return best


def _lower_best(graph: TaskGraph, sends: str = "blocking") -> tuple[Program, BufferNames]:
    """The best of the round order and the timed orders (`Note: timed order`).

    The timed walks run eager and lazy under each estimate of `_ESTIMATES`; walks that
    give the same instructions are scored once. Candidates are scored by `_scores`. A
    timed order is eligible only if it is no worse than the round order under every
    model; the eligible one with the best mean wins, the earlier one (the round order
    first) on ties. So no graph gets a program slower under any of `_MODELS` than the
    round order. A round order already at the graph's own timeline under every model
    (`_dataflow_scores`: GPipe, 1F1B) is kept without walking.
    """
    rounds = _finish(_Lowering(graph))
    base = _scores(rounds[0], sends)
    if all(x <= y + 1e-9 for x, y in zip(base, _dataflow_scores(graph))):
        return rounds  # already the graph's own timeline under every model
    best, best_mean = rounds, sum(base) / len(base)
    for candidate in _timed_candidates(graph, (_estimate(graph, m) for m in _ESTIMATES)):
        scores = _scores(candidate[0], sends)
        mean = sum(scores) / len(scores)
        if all(x <= y + 1e-9 for x, y in zip(scores, base)) and mean < best_mean - 1e-9:
            best, best_mean = candidate, mean
    return best


def build_program_with_names(
    graph: TaskGraph, task_ms: Mapping[str, float] | None = None, sends: str = "blocking"
) -> tuple[Program, BufferNames]:
    """Lowers `graph` to a verified Program, and names every buffer.

    The lowering pass: validates the graph, walks it in rounds (see `Note: global
    order`) and in estimated time (`Note: timed order`), each walk's program with its
    exchanges fused into SendRecv (`program_passes.pair_exchanges`) and its tags
    assigned (`program_passes.assign_tags`), keeps the best of them (`_lower_best`),
    adds Frees (`program_passes.add_frees`) and verifies the result
    (`simulate.verify`). This is the one verification of a compiled program: the
    executors take it as verified.

    In the round walk, each round first runs, on every group in turn, its next task if
    all the task's inputs are present on the group (a Run; a donated value is first sent
    to its other consumers, see `Note: donation`), then delivers every message that some
    group's next task waits for and whose value exists. In every walk, a value produced
    on group a (by a task or as a step input) is sent to each other group b that
    consumes it once (the round walk when b first needs it, the timed walks possibly
    earlier) and stays live on b until its last use there. Step outputs stay where they
    were produced. Buffer ids count up per group in order of definition, step inputs
    first (by input index).

    Args:
      graph: the task graph.
      task_ms: measured task times (ms) by task label, or None. Given, the walks also
        run on these times and the fastest program under them is kept
        (`_lower_measured`) instead of the one best across task-time models.
      sends: how the runtime sends ("blocking", or "posted": `Note: posted sends` in
        mpi/posted.py): candidates are timed that way. Every program is verified with
        blocking sends either way.

    Returns:
      The program, and per group a dict from buffer id to the value it holds.

    Raises:
      ValueError: if the graph is invalid (`TaskGraph.validate`), or if a round makes no
        progress (the task order has a cycle across groups), naming each group's stuck
        task and the values it waits for.
      ProgramError: if the result does not verify (a bug in this pass).
    """
    graph.validate()
    program, names = (_lower_best(graph, sends) if not task_ms
                      else _lower_measured(graph, task_ms, sends))
    program = program_passes.add_frees(program)
    simulate.verify(program)
    return program, names


def build_program(graph: TaskGraph) -> Program:
    """Lowers `graph` to a verified Program; see `build_program_with_names`."""
    return build_program_with_names(graph)[0]


def live_buffer_profile(
    group: GroupProgram, names: Mapping[int, Value], predicate: Callable[[Value], bool]
) -> int:
    """The largest number of buffers live at once whose value satisfies `predicate`.

    Args:
      group: one group's program.
      names: buffer id -> value name, as returned by `build_program_with_names`.
      predicate: selects the values counted (e.g. activations).

    Returns:
      The maximum, over the start and after every instruction, of the number of live
      matching buffers. A Run's donated inputs die before its outputs are counted
      (their memory is reused).
    """
    count = peak = sum(predicate(names[b]) for b, _ in group.inputs)
    for instr in group.instrs:
        dead: tuple[int, ...] = ()
        born: tuple[int, ...] = ()
        if isinstance(instr, Run):
            dead, born = instr.donate, instr.outs
        elif isinstance(instr, Free):
            dead = instr.bufs
        elif (r := program_passes.recv_half(instr)) is not None:
            born = (r[0],)
        count += sum(predicate(names[b]) for b in born) - sum(predicate(names[b]) for b in dead)
        peak = max(peak, count)
    return peak
