"""Lowering: a TaskGraph becomes a deadlock-free, verified Program."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode, Value
from jaxpp_mpi._src.ir import passes as program_passes
from jaxpp_mpi._src.ir import simulate
from jaxpp_mpi._src.ir.program import (
    Free,
    GroupProgram,
    Instr,
    Program,
    Recv,
    Run,
    Send,
)

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


def build_program_with_names(graph: TaskGraph) -> tuple[Program, BufferNames]:
    """Lowers `graph` to a verified Program, and names every buffer.

    The lowering pass: validates the graph, walks it in rounds (see `Note: global
    order`), then fuses exchanges into SendRecv (`program_passes.pair_exchanges`), adds
    Frees (`program_passes.add_frees`), assigns tags (`program_passes.assign_tags`) and
    verifies the result (`simulate.verify`). This is the one verification of a compiled
    program: the executors take it as verified.

    Each round first runs, on every group in turn, its next task if all the task's
    inputs are present on the group (a Run; a donated value is first sent to its other
    consumers, see `Note: donation`), then delivers every message that some group's next
    task waits for and whose value exists: a value produced on group a (by a task or as
    a step input) is sent to each other group b that consumes it once, when b first
    needs it, and stays live on b until its last use there. Step outputs stay where they
    were produced. Buffer ids count up per group in order of definition, step inputs
    first (by input index).

    Args:
      graph: the task graph.

    Returns:
      The program, and per group a dict from buffer id to the value it holds.

    Raises:
      ValueError: if the graph is invalid (`TaskGraph.validate`), or if a round makes no
        progress (the task order has a cycle across groups), naming each group's stuck
        task and the values it waits for.
      ProgramError: if the result does not verify (a bug in this pass).
    """
    graph.validate()
    lowering = _Lowering(graph)
    lowering.run()
    program, names = lowering.program()
    program = program_passes.pair_exchanges(program)
    program = program_passes.assign_tags(program_passes.add_frees(program))
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
