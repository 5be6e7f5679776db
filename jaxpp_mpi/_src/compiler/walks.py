"""The walks of a task graph that emit each group's instructions: in rounds
(`RoundWalk`, `Note: global order`) and in estimated time (`TimedWalk`, `Note: timed
order`). lower.py runs them, chooses among their programs and verifies the winner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import NamedTuple

from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode, Value
from jaxpp_mpi._src.ir.program import (
    GroupProgram,
    Instr,
    Program,
    Recv,
    Run,
    Send,
)

__all__ = ["BufferNames", "Event", "RoundWalk", "TimedWalk", "WalkIndex", "dataflow_order"]

BufferNames = tuple[dict[int, Value], ...]  # per group: buffer id -> value name
# One event of a walk (`Note: walk events`): (group, task name) for a Run, (sender,
# receiver, whether it is an exchange) for a message.
Event = tuple[int, str] | tuple[int, int, bool]


class _Message(NamedTuple):
    """One transfer of `value` from group `src` to group `dst`."""

    value: Value
    src: int
    dst: int


@dataclasses.dataclass
class _Group:
    """The lowering's mutable state for one group."""

    tasks: tuple[TaskNode, ...]
    # the instructions as (class, arguments), made only for the kept walk's program
    instrs: list[tuple[type[Instr], tuple]] = dataclasses.field(default_factory=list)
    bufs: dict[Value, int] = dataclasses.field(default_factory=dict)  # value -> live buffer
    names: list[Value] = dataclasses.field(default_factory=list)  # buffer id -> value
    pos: int = 0  # index of the next task

    def define(self, v: Value) -> int:
        """A fresh buffer for `v`; ids count up in order of definition."""
        b = len(self.names)
        self.bufs[v] = b
        self.names.append(v)
        return b

    def define_all(self, vs: tuple[Value, ...]) -> tuple[int, ...]:
        """Fresh buffers for `vs`, in order (`define` for each in turn)."""
        first = len(self.names)
        ids = tuple(range(first, first + len(vs)))
        self.bufs.update(zip(vs, ids))
        self.names.extend(vs)
        return ids

    @property
    def next_task(self) -> TaskNode | None:
        return self.tasks[self.pos] if self.pos < len(self.tasks) else None

    def missing(self) -> tuple[Value, ...]:
        """The inputs of the next task not present on this group, in argument order."""
        t = self.next_task
        return () if t is None else tuple(dict.fromkeys(v for v in t.ins if v not in self.bufs))

    def ready(self) -> bool:
        """Whether there is a next task and all its inputs are present on this group."""
        return self.pos < len(self.tasks) and all(map(self.bufs.__contains__,
                                                      self.tasks[self.pos].ins))


def dataflow_order(graph: TaskGraph) -> tuple[list[TaskNode], bool]:
    """Every task, each after the task before it on its group and after the tasks making
    its inputs, and whether that order exists.

    The groups are swept in turn, each running its tasks while their inputs exist (the
    dataflow's own order; `WalkIndex.tails` and `task_models.dataflow_scores` read it).
    A task order with a cycle across groups has none: the tasks left when the sweep
    stops follow in their groups' order, and the flag is False (the walks then stop,
    naming the stuck tasks).
    """
    have = {v for v, _, _ in graph.inputs}
    pos = [0] * graph.num_groups
    order: list[TaskNode] = []
    left = sum(map(len, graph.tasks))
    while left:
        before = left
        for g, ts in enumerate(graph.tasks):
            i, end = pos[g], len(ts)
            while i < end and all(map(have.__contains__, ts[i].ins)):
                order.append(ts[i])
                have.update(ts[i].outs)
                i += 1
            left -= i - pos[g]
            pos[g] = i
        if left == before:
            for g, ts in enumerate(graph.tasks):
                order.extend(ts[pos[g]:])
            return order, False
    return order, True


class WalkIndex:
    """What every walk of one task graph reads and none changes, computed once.

    The lowering walks one graph once in rounds and twice per estimate in time
    (lower.py); these facts depend on the graph alone (`tails`: on the graph and one
    estimate), so the walks share them instead of each deriving them again.

    Attributes:
      graph: the task graph.
      prod: value -> the group producing it (or binding it, for a step input).
      remote: value -> the groups other than its producer that read it.
      first_use: per group, value -> index of the first of its tasks reading it.
      sent: per task name, its outputs that other groups read (in output order).
    """

    def __init__(self, graph: TaskGraph):
        self.graph = graph
        self.prod = {v: g for v, (g, _) in graph.producers().items()}
        self.remote: dict[Value, set[int]] = {}
        self.first_use: list[dict[Value, int]] = []
        for g, ts in enumerate(graph.tasks):
            first: dict[Value, int] = {}
            for i, t in enumerate(ts):
                for v in t.ins:
                    first.setdefault(v, i)
            for v in first:
                if self.prod[v] != g:
                    self.remote.setdefault(v, set()).add(g)
            self.first_use.append(first)
        remote = self.remote
        self.sent = {t.name: tuple(v for v in t.outs if v in remote)
                     for ts in graph.tasks for t in ts}
        self._order: list[TaskNode] | None = None
        self._tails: list[tuple[Mapping[str, float], dict[str, float]]] = []

    @property
    def order(self) -> list[TaskNode]:
        """Every task in `dataflow_order`'s order, computed once."""
        if self._order is None:
            self._order, _ = dataflow_order(self.graph)
        return self._order

    def tails(self, latency: Mapping[str, float]) -> dict[str, float]:
        """Per task: the longest path from its start to the end of the step, each task
        taking its time in `latency` (along group order and data).

        Tasks are visited in `order` reversed, so every successor of a task (the next
        task on its group, the readers of its outputs) is done before it; `longest`
        keeps, per value, the longest tail of its readers so far.
        """
        for seen, tail in self._tails:
            if seen is latency:
                return tail
        tail: dict[str, float] = {}
        longest: dict[Value, float] = {}
        after: list[float | None] = [None] * self.graph.num_groups  # the group's next task's
        for t in reversed(self.order):
            succ = [longest[v] for v in t.outs if v in longest]
            if after[t.group] is not None:
                succ.append(after[t.group])
            x = tail[t.name] = after[t.group] = latency[t.name] + max(succ, default=0.0)
            for v in t.ins:
                if v not in longest or longest[v] < x:
                    longest[v] = x
        self._tails.append((latency, tail))
        return tail


class RoundWalk:
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

    Note: walk events
      Beside the instructions, a walk keeps its events in that single order (`events`):
      `(g, task)` for a Run, `(src, dst, False)` for a message, `(a, b, True)` for an
      exchange. Each group's events are its instructions in order, and the order is a
      rendezvous execution of the paired program, so playing the events (each Run
      adding its time to its group's clock, a message or exchange setting both clocks
      to their maximum; with posted sends a message only its receiver's) times the
      program as playing it would (`rendezvous.play`, `simulate.posted_order`), bit
      for bit: the same additions and maxima per group, and a clock depends only on
      its group's sequence and the clocks it meets. So the lowering scores candidates
      from their events (`task_models.play_walk`) and makes only the winner's program.
    """

    def __init__(self, graph: TaskGraph, index: WalkIndex | None = None):
        self.graph = graph
        self.index = index if index is not None else WalkIndex(graph)
        self.prod = self.index.prod
        self.groups = [_Group(ts) for ts in graph.tasks]
        self.available: set[Value] = set()  # values produced somewhere so far
        # value -> consumer groups other than its producer, not yet delivered to
        self.undelivered = {v: set(gs) for v, gs in self.index.remote.items()}
        self.input_bufs: dict[Value, int] = {}
        self.events: list[Event] = []  # `Note: walk events`
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
        if not gs.ready():
            return False
        self.available.update(self._run(g, gs))
        return True

    def _run(self, g: int, gs: _Group) -> tuple[Value, ...]:
        """Runs group g's next task, whose inputs are all present; returns its outputs."""
        t = gs.tasks[gs.pos]
        undelivered = self.undelivered
        if t.donate and any(map(undelivered.get, t.donate)):
            # a donated buffer dies in the task: send it to its other consumers first
            early = [
                _Message(v, g, dst)
                for v in t.donate
                if undelivered.get(v) and self.prod[v] == g
                for dst in sorted(undelivered[v])
            ]
            if early:
                self._deliver(early)
        bufs = gs.bufs
        ins = tuple(map(bufs.__getitem__, t.ins))
        donate = tuple(map(bufs.pop, t.donate)) if t.donate else ()
        gs.instrs.append((Run, (t.exe, ins, gs.define_all(t.outs), t.name, donate)))
        self.events.append((g, t.name))
        gs.pos += 1
        return t.outs

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
        messages keep their order (`_deliver_pair`).
        """
        by_pair: dict[tuple[int, int], list[_Message]] = {}
        for m in messages:
            key = (m.src, m.dst) if m.src < m.dst else (m.dst, m.src)
            by_pair.setdefault(key, []).append(m)
        for key in sorted(by_pair):
            self._deliver_pair(key[0], by_pair[key])
        return bool(messages)

    def _deliver_pair(self, lo: int, messages: list[_Message]) -> None:
        """Appends `messages`, all between group `lo` and one other group, in order: the
        k-th message from `lo` is paired with the k-th towards it into an exchange
        (`_exchange`); the rest become Send/Recv."""
        up = [m for m in messages if m.src == lo]
        if len(up) == len(messages) or not up:
            for m in messages:
                self._send(m)
            return
        down = [m for m in messages if m.src != lo]
        for k in range(max(len(up), len(down))):
            if k < len(up) and k < len(down):
                self._exchange(up[k], down[k])
            else:
                self._send((up if k < len(up) else down)[k])

    def _take(self, m: _Message) -> tuple[int, int]:
        """(sender's buffer, receiver's fresh buffer) of `m`; marks `m` delivered."""
        self.undelivered[m.value].discard(m.dst)
        return self.groups[m.src].bufs[m.value], self.groups[m.dst].define(m.value)

    def _send(self, m: _Message) -> None:
        sbuf, rbuf = self._take(m)
        self.groups[m.src].instrs.append((Send, (sbuf, m.dst, -1)))
        self.groups[m.dst].instrs.append((Recv, (rbuf, m.src, -1, self.graph.avals[m.value])))
        self.events.append((m.src, m.dst, False))

    def _exchange(self, m: _Message, r: _Message) -> None:
        """`m` (a->b) and `r` (b->a) as Send then Recv on each side.

        The crossing pattern becomes one SendRecv per side in `pair_exchanges` (see
        `Note: global order`).
        """
        a, b = m.src, m.dst
        m_send, m_recv = self._take(m)
        r_send, r_recv = self._take(r)
        avals = self.graph.avals
        self.groups[a].instrs += [(Send, (m_send, b, -1)), (Recv, (r_recv, b, -1, avals[r.value]))]
        self.groups[b].instrs += [(Send, (r_send, a, -1)), (Recv, (m_recv, a, -1, avals[m.value]))]
        self.events.append((a, b, True))

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
            avals = dict(enumerate(map(self.graph.avals.__getitem__, gs.names)))
            instrs = tuple(make(*args) for make, args in gs.instrs)
            groups.append(GroupProgram(g, inputs, instrs, outputs, avals))
        return Program(tuple(groups)), tuple(dict(enumerate(gs.names)) for gs in self.groups)


class TimedWalk(RoundWalk):
    """Walks the graph in estimated time and appends each group's instructions.

    Note: timed order
      The round walk (`RoundWalk.run`) gives every task one round, so with tasks of
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
      a wrong estimate can wait where the round walk does not. So the lowering
      (`_lower_best` in lower.py) builds the round order and the eager and lazy timed
      orders under each of four estimates (`ESTIMATES` in task_models.py, the
      task-time models of `MODELS`: no single estimate wins everywhere: on 4 groups
      Interleaved and KimiK2 reach their own timeline under every model when walked
      with B four times F, ZeroBubble and DualPipeV gain only from the lazy walk on the
      defaults) and simulates each under every model, each task at its time under the
      model as the walks estimated it (`label_times`: the first stage's W, which has no
      I task, does both), and with the runtime's sends (`sends`: blocking, or posted
      where the MPI executor posts them, `Note: posted sends` in mpi/posted.py; every
      candidate is deadlock-free with blocking sends either way); a timed order
      replaces the round order only if it is no slower under any model, and the one
      with the best mean wins. bench/lowering.py measures the result against each
      schedule's own dataflow timeline. When the user gives measured task times
      (`task_times_ms`), there is nothing to hedge: the walks also run on those times
      and the program fastest under them wins (`_lower_measured` in lower.py).

      With `eager`, two idle groups exchange every value one owes the other; without,
      only what the receiver's next task needs or what a receiver with nothing ready
      takes (a receive before an independent Run could make that Run wait on the
      sender, if the estimate is wrong). Each event is still appended at one point of a
      single global order, both sides of a message at once, so `Note: global order`'s
      argument (rendezvous play, no deadlock) holds unchanged.
    """

    def __init__(self, graph: TaskGraph, latency: Mapping[str, float], eager: bool,
                 index: WalkIndex | None = None):
        super().__init__(graph, index)
        self.latency = latency
        self.eager = eager
        n = len(self.groups)
        self.time = [0.0] * n
        self.first_use = self.index.first_use  # per group: value -> first task reading it
        self.pending: list[dict[tuple[Value, int], _Message]] = [{} for _ in range(n)]
        for v in self.input_bufs:
            self._owe(v)
        self.tail = self.index.tails(latency)
        self._ended = True  # whether a group may have ended since `run` last looked

    def _owe(self, v: Value) -> None:
        """Records the messages of the new value `v` with the groups waiting for it."""
        waiting = self.undelivered.get(v)
        if not waiting:
            return
        src = self.prod[v]
        for dst in sorted(waiting):
            m = _Message(v, src, dst)
            self.pending[src][(v, dst)] = self.pending[dst][(v, dst)] = m

    def _deliver_timed(self, messages: list[_Message]) -> None:
        """Delivers `messages` pair by pair (sorted), in the order receivers need them."""
        by_pair: dict[tuple[int, int], list[_Message]] = {}
        for m in messages:
            key = (m.src, m.dst) if m.src < m.dst else (m.dst, m.src)
            by_pair.setdefault(key, []).append(m)
        pending, time, first_use = self.pending, self.time, self.first_use
        for a, b in sorted(by_pair):
            ms = by_pair[a, b]
            if len(ms) > 1:
                ms.sort(key=lambda m: (first_use[m.dst][m.value], m.value, m.dst))
            self._deliver_pair(a, ms)
            owed_a, owed_b = pending[a], pending[b]
            for m in ms:
                del owed_a[m.value, m.dst], owed_b[m.value, m.dst]
            if not (owed_a and owed_b):
                self._ended = True
            time[a] = time[b] = max(time[a], time[b])

    def _takes_now(self, m: _Message) -> bool:
        """Whether m's receiver, idle, should take m now (see `Note: timed order`)."""
        if self.eager:
            return True
        r = self.groups[m.dst]
        if r.pos >= len(r.tasks):
            return True
        ins = r.tasks[r.pos].ins
        return m.value in ins or not all(map(r.bufs.__contains__, ins))  # or r waits

    def run(self) -> None:
        """Plays the groups in estimated time until all tasks ran and all values arrived.

        Raises:
          ValueError: if no group can act (the task order has a cycle across groups).
        """
        groups, pending, time = self.groups, self.pending, self.time
        live = list(range(len(groups)))
        while True:
            # A group with no task left and nothing owed to or by it never acts again;
            # only a group's last task or a delivery can end one (`_ended`).
            if self._ended:
                self._ended = False
                live = [g for g in live if groups[g].pos < len(groups[g].tasks) or pending[g]]
                if not live:
                    return
            # The earliest group almost always acts; `_act` changes nothing when it does
            # not, so trying it first and then every group in order is the same walk.
            # `live` ascends, and min and sorted keep the first of equals: ties by index.
            first = min(live, key=time.__getitem__)
            if self._act(first, live):
                continue
            if not any(self._act(g, live) for g in sorted(live, key=time.__getitem__)):
                raise ValueError(self._stuck_message())

    def _act(self, g: int, live: list[int]) -> bool:
        """One step of group g at its time; returns whether anything changed."""
        time = self.time
        t, gs = time[g], self.groups[g]
        owes = self.pending[g]  # keyed by (value, receiver): sorted by value, then receiver
        pending = [owes[k] for k in sorted(owes)] if owes else []
        if pending:
            if self.eager:
                here = [m for m in pending if time[m.src if m.dst == g else m.dst] <= t]
            else:
                here = [m for m in pending
                        if time[m.src if m.dst == g else m.dst] <= t and self._takes_now(m)]
            if here:
                self._deliver_timed(here)
                return True
        pos = gs.pos
        if pos < len(gs.tasks) and all(map(gs.bufs.__contains__, gs.tasks[pos].ins)):
            task = gs.tasks[pos]
            if pending:
                owed = [m for m in pending if m.src == g and time[m.dst] > t]
                forced = [m.dst for m in owed if m.value in task.donate]
                wait = [time[h] for h in forced] or [
                    time[m.dst] for m in owed if self._worth_waiting(m, task, t)
                ]
                if wait:
                    time[g] = min(wait)
                    return True
                # A donated value owed to an idle peer that did not take it yet
                # (`_takes_now`) goes now, before its task consumes it.
                donated = [m for m in pending if m.src == g and m.value in task.donate]
                if donated:
                    self._deliver_timed(donated)
                    return True
            self._run(g, gs)  # the timed walk keeps no `available`: `pending` serves
            if gs.pos == len(gs.tasks):
                self._ended = True
            for v in self.index.sent[task.name]:  # the outputs some other group reads
                self._owe(v)
            time[g] = t + self.latency[task.name]
            return True
        later = [time[h] for h in live if time[h] > t]
        if later:
            time[g] = min(later)
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
