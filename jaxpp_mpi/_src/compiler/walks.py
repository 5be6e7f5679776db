"""The walks of a task graph that emit each group's instructions: what every walk
keeps (`Walk`), what they share (`WalkIndex`) and the walk in rounds (`RoundWalk`,
`Note: global order`); the walk in estimated time is timed_walk.py's (`Note: timed
order`). lower.py runs them, chooses among their programs and verifies the winner.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping
from typing import NamedTuple

from jaxpp_mpi._src.compiler.task_graph import NamedBuffers, TaskGraph, TaskNode, Value
from jaxpp_mpi._src.ir.program import GroupProgram, Instr, Program
from jaxpp_mpi._src.ir.trusted import new_recv, new_run, new_send

__all__ = ["BufferNames", "Event", "RoundWalk", "Walk", "WalkIndex", "dataflow_order"]

BufferNames = tuple[Mapping[int, str], ...]  # per group: buffer id -> value name
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
    """The lowering's mutable state for one group: what a walk reads and changes (`have`,
    `pos`), and the instructions and buffers made from its events (`Note: emitted
    once`)."""

    tasks: tuple[TaskNode, ...]
    waits: tuple[tuple[Value, ...], ...]  # per task, what it waits for (`TaskGraph.waits`)
    # the values received from other groups (`Note: what a task waits for`)
    have: set[Value] = dataclasses.field(default_factory=set)
    pos: int = 0  # index of the next task
    # the instructions, made only for the kept walk's program
    instrs: list[Instr] = dataclasses.field(default_factory=list)
    bufs: dict[Value, int] = dataclasses.field(default_factory=dict)  # value -> live buffer
    names: list[Value] = dataclasses.field(default_factory=list)  # buffer id -> value

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
        if self.pos >= len(self.tasks):
            return ()
        return tuple(v for v in self.waits[self.pos] if v not in self.have)

    def ready(self) -> bool:
        """Whether there is a next task and all its inputs are present on this group."""
        return self.pos < len(self.tasks) and all(map(self.have.__contains__,
                                                      self.waits[self.pos]))


def dataflow_order(graph: TaskGraph, sent: Mapping[str, tuple[Value, ...]]
                   ) -> tuple[list[tuple[int, int]], bool]:
    """Every task as (group, its index there), each after the task before it on its
    group and after the tasks making its inputs, and whether that order exists.

    The groups are swept in turn, each running its tasks while the values they wait
    for exist (`TaskGraph.waits`; `sent`: per task, its outputs that other groups
    read, `WalkIndex.sent`). That is the dataflow's own order; `WalkIndex.tails`
    and `task_models.dataflow_scores` read it. A task order with a cycle across groups
    has none: the tasks left when the sweep stops follow in their groups' order, and
    the flag is False (the walks then stop, naming the stuck tasks).
    """
    have = {v for v, _, _ in graph.inputs}
    pos = [0] * graph.num_groups
    order: list[tuple[int, int]] = []
    left = sum(map(len, graph.tasks))
    while left:
        before = left
        for g, ts in enumerate(graph.tasks):
            i, end, wait = pos[g], len(ts), graph.waits[g]
            while i < end and all(map(have.__contains__, wait[i])):
                order.append((g, i))
                have.update(sent[ts[i].name])
                i += 1
            left -= i - pos[g]
            pos[g] = i
        if left == before:
            for g, ts in enumerate(graph.tasks):
                order.extend((g, i) for i in range(pos[g], len(ts)))
            return order, False
    return order, True


class WalkIndex:
    """What every walk of one task graph reads and none changes, computed once.

    The lowering walks one graph once in rounds and twice per estimate in time
    (lower.py); these facts depend on the graph alone (`tails`: on the graph and one
    estimate), so the walks share them instead of each deriving them again.

    Attributes:
      graph: the task graph.
      prod: value -> the group producing it (or binding it, for a step input), for
        the values that move (`remote`) and the step's inputs and outputs.
      waits: the graph's `waits` (`Note: what a task waits for` in task_graph.py).
      remote: value -> the groups other than its producer that read it.
      first_use: per group, value -> index of the first of its tasks waiting for it
        (`TaskGraph.waits`: the values of `remote` it reads).
      sent: per task name, its outputs that other groups read (in output order).
      readers: value -> the groups of `remote`, ascending (computed on first use).
    """

    def __init__(self, graph: TaskGraph):
        self.graph = graph
        self.remote: dict[Value, set[int]] = {}
        self.first_use: list[dict[Value, int]] = []
        self.waits = graph.waits
        for g, waits in enumerate(self.waits):
            first: dict[Value, int] = {}
            for i, w in enumerate(waits):
                for v in w:
                    if v not in first:
                        first[v] = i
            for v in first:
                self.remote.setdefault(v, set()).add(g)
            self.first_use.append(first)
        made = graph.producer_map
        self.prod = {v: made[v][0] for v in itertools.chain(
            self.remote, (v for v, _, _ in graph.inputs), (v for v, _ in graph.outputs))}
        remote = self.remote
        self.sent = {t.name: tuple(v for v in t.outs if v in remote)
                     for ts in graph.tasks for t in ts}
        self._tails: list[tuple[Mapping[str, float], dict[str, float]]] = []

    @functools.cached_property
    def readers(self) -> dict[Value, tuple[int, ...]]:
        return {v: tuple(sorted(gs)) for v, gs in self.remote.items()}

    @functools.cached_property
    def _dataflow(self) -> tuple[list[tuple[int, int]], bool]:
        return dataflow_order(self.graph, self.sent)

    @functools.cached_property
    def order(self) -> list[TaskNode]:
        """Every task in `dataflow_order`'s order, computed once."""
        tasks = self.graph.tasks
        return [tasks[g][i] for g, i in self._dataflow[0]]

    @functools.cached_property
    def order_waits(self) -> list[tuple[Value, ...]]:
        """Per task of `order`, what it waits for (`waits`)."""
        waits = self.waits
        return [waits[g][i] for g, i in self._dataflow[0]]

    @property
    def complete(self) -> bool:
        """Whether `order` exists (`dataflow_order`'s flag): False for a task order
        with a cycle across groups."""
        return self._dataflow[1]

    @functools.cached_property
    def _tail_steps(self) -> tuple[list[str], list[list[int]]]:
        """For `tails`: the task names of `order` reversed, and per task the positions
        in that list of its successors (the next task on its group, the readers on other
        groups of its outputs: `Note: what a task waits for`) that come before it, which
        are all of them when `order` exists."""
        names: list[str] = []
        succs: list[list[int]] = []
        readers: dict[Value, list[int]] = {}  # value -> positions of its readers so far
        after: list[int | None] = [None] * self.graph.num_groups  # the group's next task
        for i, (t, waits) in enumerate(zip(reversed(self.order),
                                           reversed(self.order_waits))):
            succ = []
            for v in self.sent[t.name]:
                if v in readers:
                    succ += readers[v]
            if after[t.group] is not None:
                succ.append(after[t.group])
            names.append(t.name)
            succs.append(succ)
            after[t.group] = i
            for v in waits:
                if v in readers:
                    readers[v].append(i)
                else:
                    readers[v] = [i]
        return names, succs

    def known_tails(self, latency: Mapping[str, float]) -> dict[str, float] | None:
        """`tails(latency)` if made already (for `latency` or times equal to it), else
        None."""
        for seen, tail in self._tails:
            if seen is latency or seen == latency:
                return tail
        return None

    def tails(self, latency: Mapping[str, float]) -> dict[str, float]:
        """Per task: the longest path from its start to the end of the step, each task
        taking its time in `latency` (along group order and data).

        Tasks are visited in `order` reversed, so every successor of a task is done
        before it (`_tail_steps`, found once for every estimate).
        """
        known = self.known_tails(latency)  # equal models' times: one tail
        if known is not None:
            return known
        names, succs = self._tail_steps
        done: list[float] = []
        for name, succ in zip(names, succs):
            done.append(latency[name] + (max(map(done.__getitem__, succ)) if succ else 0.0))
        tail = dict(zip(names, done))
        self._tails.append((latency, tail))
        return tail


class Walk:
    """What every walk keeps: each group's state (`_Group`), the step inputs' buffers
    (defined first, by group and input index), the events (`Note: walk events`) and the
    values the messages move; a walk's `run` appends events, then `program` makes its
    instructions and its Program.

    Note: emitted once
      A walk records only its events and the values its messages move (`moved`: per
      message its value, per exchange the lower group's then the higher's): that is
      all of its order, as every group runs its tasks in its own order. The lowering
      walks several candidates and keeps one, so the instructions and buffers are made
      once, for the program asked of a walk (`_emit`, playing the events in order:
      each group's buffers are defined in the order the walk made the values present
      there, inputs first). Two walks with the same events and values make the same
      program, which is how lower.py tells distinct walks apart.

    Attributes:
      graph: the task graph.
      index: the facts the graph's walks share (`WalkIndex`).
      groups: per group, its state: tasks, values received, next task (and, once made,
        instructions and buffers).
      events: the walk's events in order (`Note: walk events`).
      moved: per message event, its value; per exchange (a, b, True), a's and b's.
    """

    def __init__(self, graph: TaskGraph, index: WalkIndex | None = None):
        self.graph = graph
        self.index = index if index is not None else WalkIndex(graph)
        self.prod = self.index.prod
        self.groups = [_Group(ts, ws) for ts, ws in zip(graph.tasks, self.index.waits)]
        self.input_bufs: dict[Value, int] = {}
        self.events: list[Event] = []  # `Note: walk events`
        self.moved: list[Value | tuple[Value, Value]] = []
        self._emitted = False
        for v, g, _ in sorted(graph.inputs, key=lambda x: (x[1], x[2], x[0])):
            self.input_bufs[v] = self.groups[g].define(v)

    def _stuck_message(self) -> str:
        lines = []
        name = self.graph.value_name
        for g, gs in enumerate(self.groups):
            t = gs.next_task
            if t is None:
                continue
            waits = ", ".join(
                f"{name(v)} (from group {self.prod[v]})" if self.prod[v] != g else name(v)
                for v in gs.missing()
            )
            lines.append(f"  group {g}: task {t.name} waits for {waits}")
        return "lowering made no progress (a cycle in the task order?):\n" + "\n".join(lines)

    def program(self) -> tuple[Program, BufferNames]:
        """The Program (exchanges unpaired, tags unassigned, no Frees) and buffer names
        of the walk `run` took (`Note: emitted once`)."""
        self._emit()
        groups = []
        for g, gs in enumerate(self.groups):
            inputs = [(self.input_bufs[v], k) for v, h, k in self.graph.inputs if h == g]
            outputs = [(gs.bufs[v], k) for v, k in self.graph.outputs if self.prod[v] == g]
            avals = dict(enumerate(map(self.graph.avals.__getitem__, gs.names)))
            groups.append(GroupProgram(g, inputs, tuple(gs.instrs), outputs, avals))
        names = self.graph.names  # `Note: dense values` in task_graph.py
        return Program(tuple(groups)), tuple(
            dict(enumerate(gs.names)) if names is None
            else NamedBuffers(dict(enumerate(gs.names)), names) for gs in self.groups)

    def _emit(self) -> None:
        """Appends each group's instructions and defines its buffers, playing the
        events in order (`Note: emitted once`); once."""
        if self._emitted:
            return
        self._emitted = True
        groups, avals = self.groups, self.graph.avals
        pos = [0] * len(groups)
        moved = iter(self.moved)
        # Trusted constructors (`Note: trusted instructions` in ir/trusted.py): the
        # names are the task nodes' (checked when made), the buffer ids counted here,
        # each aval the one `program`'s GroupProgram checks for the buffer received.
        for e in self.events:
            if len(e) == 2:
                gs = groups[e[0]]
                task = gs.tasks[pos[e[0]]]
                pos[e[0]] += 1
                bufs = gs.bufs
                ins = tuple(map(bufs.__getitem__, task.ins))
                gone = tuple(sorted(map(bufs.pop, task.donate))) if task.donate else ()
                gs.instrs.append(new_run(task.exe, ins, gs.define_all(task.outs), task.name,
                                         gone))
            elif e[2]:
                a, b = groups[e[0]], groups[e[1]]
                v, w = next(moved)
                v_send, w_send = a.bufs[v], b.bufs[w]
                v_recv, w_recv = b.define(v), a.define(w)
                a.instrs += [new_send(v_send, e[1], -1), new_recv(w_recv, e[1], -1, avals[w])]
                b.instrs += [new_send(w_send, e[0], -1), new_recv(v_recv, e[0], -1, avals[v])]
            else:
                src, dst = groups[e[0]], groups[e[1]]
                v = next(moved)
                src.instrs.append(new_send(src.bufs[v], e[1], -1))
                dst.instrs.append(new_recv(dst.define(v), e[0], -1, avals[v]))


class RoundWalk(Walk):
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
        super().__init__(graph, index)
        # values made so far that other groups read (`Note: what a task waits for`)
        self.available: set[Value] = set(self.input_bufs)
        # value -> consumer groups other than its producer, not yet delivered to
        self.undelivered = {v: set(gs) for v, gs in self.index.remote.items()}

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
        self.available.update(self.index.sent[self._run(g, gs)])
        return True

    def _run(self, g: int, gs: _Group) -> str:
        """Runs group g's next task, whose inputs are all present; returns its name."""
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
        if t.donate:
            gs.have.difference_update(t.donate)
        self.events.append((g, t.name))
        gs.pos += 1
        return t.name

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

    def _take(self, m: _Message) -> None:
        """Marks `m` delivered: its value is present on its receiver."""
        self.undelivered[m.value].discard(m.dst)
        self.groups[m.dst].have.add(m.value)

    def _send(self, m: _Message) -> None:
        """`m` as a Send on its sender and a Recv on its receiver."""
        self._take(m)
        self.events.append((m.src, m.dst, False))
        self.moved.append(m.value)

    def _exchange(self, m: _Message, r: _Message) -> None:
        """`m` (a->b, a < b) and `r` (b->a) as Send then Recv on each side.

        The crossing pattern becomes one SendRecv per side in `pair_exchanges` (see
        `Note: global order`).
        """
        self._take(m)
        self._take(r)
        self.events.append((m.src, m.dst, True))
        self.moved.append((m.value, r.value))
