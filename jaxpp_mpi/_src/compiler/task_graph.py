"""The task graph: per-group ordered tasks and the values they exchange (lowering's input)."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import NoReturn

from jaxpp_mpi._src.ir.program import Aval

__all__ = ["NamedBuffers", "TaskGraph", "TaskNode", "Value", "ValueNames"]

# One value instance: an int of the graph's `ValueNames` (a built step's graph), or its
# name itself (a graph written by hand), e.g. 'v12' or 'v12@3' (value v12 of microbatch
# 3). Opaque to the lowering: only compared for equality and sorted for determinism.
Value = int | str

_NO_SPACE = re.compile(r"\S+")


@dataclasses.dataclass(frozen=True, slots=True)
class TaskNode:
    """One executable call placed on one group.

    Attributes:
      name: task label stored in `Run.task` ('F3s1', 'B3s1', 'pre0'); no whitespace,
        unique in the graph.
      group: the MPMD index that runs it.
      exe: the executable name.
      ins: the values passed, in the executable's argument order.
      outs: the values defined, in the executable's result order.
      donate: a subset of `ins` whose buffers the executable may reuse; see
        `Note: donation` in `TaskGraph`.
    """

    name: str
    group: int
    exe: str
    ins: tuple[Value, ...]
    outs: tuple[Value, ...]
    donate: tuple[Value, ...] = ()

    def __post_init__(self):
        # Field by field, in field order; each read and set once (a graph holds tens of
        # thousands of nodes).
        name, exe = self.name, self.exe
        if not isinstance(name, str) or not _NO_SPACE.fullmatch(name):
            raise ValueError(f"task {name!r}: bad name {name!r}")
        if not isinstance(exe, str) or not _NO_SPACE.fullmatch(exe):
            raise ValueError(f"task {name!r}: bad exe {exe!r}")
        set_field = object.__setattr__
        set_field(self, "group", int(self.group))
        ins = tuple(self.ins)
        set_field(self, "ins", ins)
        outs = tuple(self.outs)
        set_field(self, "outs", outs)
        donate = tuple(self.donate)
        set_field(self, "donate", donate)
        if len(set(outs)) != len(outs):
            raise ValueError(f"task {name}: an output value is repeated in {outs}")
        if donate and not _once_each(ins, donate):
            for v in donate:
                if ins.count(v) != 1 or donate.count(v) != 1:
                    raise ValueError(
                        f"task {name}: donated value {v!r} must appear exactly once in "
                        f"ins {ins} and once in donate {donate}"
                    )


def _once_each(ins: tuple[Value, ...], donate: tuple[Value, ...]) -> bool:
    """Whether, plainly, each value of `donate` is once in `ins` and once in `donate`
    (False may be wrong: then the caller checks value by value)."""
    in_set = set(ins)
    return (len(in_set) == len(ins) and len(set(donate)) == len(donate)
            and in_set.issuperset(donate))


class ValueNames:
    """The values of a built step's task graph as dense ints, and their names.

    Note: dense values
      A built graph's values are the ints 0, 1, 2, ... handed out here, in the order
      the graph's builder makes them, each with a name ('v12@3', 'x4g1', 'in0') made
      only when asked for (an error message, a buffer's name). The lowering looks
      values up in dicts and sets once per use, millions of times for a deep
      pipeline: an int hashes to itself, so values made together sit together in a
      table, while names hash to random slots and, past the caches, miss on nearly
      every look-up (`Note: the memory floor` in bench/startup.py measures both).
      The lowering sorts values only to break ties (which message goes first), and an
      int sorts by the order it was made; on every schedule measured the programs are
      the ones the names would give, hash for hash (tests/unit/compiler/
      test_dense_values.py keeps three of them so).

    A *block* is the values of one body value over the microbatches, `head@0` to
    `head@{n-1}`; a single value has a name of its own.
    """

    def __init__(self) -> None:
        self._starts: list[int] = []  # each block's or single's first value, ascending
        self._heads: list[str] = []  # its name, or its head ('v12' of 'v12@3')
        self._blocks: list[bool] = []  # whether it is a block
        self._interned: dict[str, int] = {}  # single name -> its value
        self.size = 0  # the values handed out

    def block(self, head: str, n: int) -> range:
        """`n` new values, named `head@0` to `head@{n-1}`."""
        start = self.size
        self._starts.append(start)
        self._heads.append(head)
        self._blocks.append(True)
        self.size = start + n
        return range(start, start + n)

    def intern(self, name: str) -> int:
        """The single value named `name`, made on first use (one name, one value: the
        caller gives no single the name of a block's value)."""
        v = self._interned.get(name)
        if v is None:
            v = self._interned[name] = self.size
            self._starts.append(v)
            self._heads.append(name)
            self._blocks.append(False)
            self.size = v + 1
        return v

    def name(self, v: Value) -> str:
        """The name of value `v` (a name is its own)."""
        if isinstance(v, str):
            return v
        if not 0 <= v < self.size:
            raise KeyError(f"no value {v!r} (made: {self.size})")
        i = bisect.bisect_right(self._starts, v) - 1
        return f"{self._heads[i]}@{v - self._starts[i]}" if self._blocks[i] else self._heads[i]

    def digest(self) -> str:
        """Everything the names depend on, as text (a program entry's key)."""
        return repr((self.size, self._starts, self._heads, self._blocks))


class NamedBuffers(Mapping):
    """A group's buffer id -> value name, read-only, each name made when read (`Note:
    dense values`): the lowering's buffer names of a built step's graph."""

    def __init__(self, values: Mapping[int, Value], names: ValueNames):
        self._values, self._names = values, names

    def __getitem__(self, b: int) -> str:
        return self._names.name(self._values[b])

    def __iter__(self) -> Iterator[int]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return repr(dict(self.items()))


@dataclasses.dataclass(frozen=True)
class TaskGraph:
    """What each group runs, in which order, and where step inputs and outputs live.

    Note: donation
      A task donates a value on its own group: the local buffer of that value (the
      produced one, an input binding, or the received copy) dies inside the task. No
      later task of that group may use the value, it may not be a step output of that
      group, and the lowering sends it to other groups before the donating task runs.

    Note: what a task waits for
      In a valid graph (`validate`) a value made or bound on a task's own group is
      there whenever the task is next: an earlier task of the group made it or it was
      bound at the start, and a donated one is read by no later task. So a task waits
      only for its inputs made or bound on other groups (`waits`), a few of them: a
      stage's tasks read its weights every microbatch (at 1F1B 32 x 1024, 64k of 1.1M
      task inputs come from other groups). The lowering's walks test only those, and a
      group's `have` there holds only what it received. The dataflow timeline
      (`task_models.dataflow_scores`) and the tails read them too: there a value of the
      task's own group is done by its group's clock already, and a reader on the same
      group is reached through the group's next task, whose tail is at least as long
      (times are never negative).

    Attributes:
      num_groups: the number of MPMD groups.
      tasks: per group, its tasks in the order the group must run them.
      inputs: (value, owner group, flat step input index); the value is live on its owner
        at the start of the step.
      outputs: (value, flat step output index); the value stays on the group that
        produced it.
      avals: the aval of every value (extra entries are ignored).
      names: the names of the values, if they are ints (`Note: dense values`).
    """

    num_groups: int
    tasks: tuple[tuple[TaskNode, ...], ...]
    inputs: tuple[tuple[Value, int, int], ...]
    outputs: tuple[tuple[Value, int], ...]
    avals: Mapping[Value, Aval]
    names: ValueNames | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "num_groups", int(self.num_groups))
        object.__setattr__(self, "tasks", tuple(tuple(ts) for ts in self.tasks))
        object.__setattr__(self, "inputs", tuple((v, int(g), int(k)) for v, g, k in self.inputs))
        object.__setattr__(self, "outputs", tuple((v, int(k)) for v, k in self.outputs))
        object.__setattr__(self, "avals", MappingProxyType(dict(self.avals)))

    def value_name(self, v: Value) -> str:
        """The name of value `v` (`Note: dense values`)."""
        return self.names.name(v) if self.names is not None else v

    def show(self, v: Value) -> str:
        """Value `v` as an error message names it: its name, quoted."""
        return repr(self.value_name(v))

    @property
    def producer_map(self) -> Mapping[Value, tuple[int, str]]:
        """`producers`' map, read-only and not copied (one value's producer, a few
        values' where a copy of them all would cost more)."""
        return MappingProxyType(self._producers)

    def producers(self) -> dict[Value, tuple[int, str]]:
        """Maps each value to (group, task name) of its producer; task name '' = an input.

        Found once per graph (a graph never changes: its fields are tuples, frozen nodes
        and a read-only mapping); each call returns a new dict.

        Raises:
          ValueError: if a value is produced twice.
        """
        return dict(self._producers)

    @functools.cached_property
    def _producers(self) -> dict[Value, tuple[int, str]]:
        """`producers`' map, made once (cached_property writes the instance dict, which
        a frozen dataclass allows; a call that raises caches nothing)."""
        out: dict[Value, tuple[int, str]] = {}
        for v, g, _ in self.inputs:
            if v in out:
                _produced_twice(self.show(v), out[v], (g, ""))
            out[v] = (g, "")
        for ts in self.tasks:
            for t in ts:
                made = (t.group, t.name)
                for v in t.outs:
                    if v in out:
                        _produced_twice(self.show(v), out[v], made)
                    out[v] = made
        return out

    def validate(self) -> None:
        """Checks the graph's invariants (once: the result is `waits`).

        Raises:
          ValueError: naming the first problem: a bad group count or index, a task listed
            on another group, a duplicated task name or input/output binding, a value
            produced twice or never, a value without aval, a same-group use that does not
            follow its production, or a donation broken as `Note: donation` says.
        """
        self.waits  # noqa: B018 - checked when first made

    @functools.cached_property
    def waits(self) -> tuple[tuple[tuple[Value, ...], ...], ...]:
        """Per group, per task: what it waits for, its inputs made or bound on other
        groups, each once, in argument order (`Note: what a task waits for`).

        Found while the graph is checked, made once (a graph never changes).

        Raises:
          ValueError: as `validate`, for an invalid graph (nothing is kept then).
        """
        n = self.num_groups
        if n < 1 or len(self.tasks) != n:
            raise ValueError(f"num_groups={n} but tasks has {len(self.tasks)} group lists")
        names: set[str] = set()
        for g, ts in enumerate(self.tasks):
            for t in ts:
                if t.group != g:
                    raise ValueError(f"task {t.name} has group {t.group} but is listed on {g}")
                if t.name in names:
                    raise ValueError(f"task name {t.name!r} is used twice")
                names.add(t.name)
        bindings: set[tuple[int, int]] = set()
        for v, g, k in self.inputs:
            if not 0 <= g < n or k < 0:
                raise ValueError(f"input {self.show(v)}: bad owner group {g} or index {k}")
            if (g, k) in bindings:
                raise ValueError(f"input index {k} is bound twice on group {g}")
            bindings.add((g, k))
        prod = self._producers  # read only here: no copy
        if not prod.keys() <= self.avals.keys():  # name the first value without one
            v = next(v for v in prod if v not in self.avals)
            raise ValueError(f"value {self.show(v)} has no aval")
        out_idx: set[int] = set()
        for v, k in self.outputs:
            if v not in prod:
                raise ValueError(f"output {k} ({self.show(v)}) is never produced")
            if k < 0 or k in out_idx:
                raise ValueError(f"output index {k} ({self.show(v)}) is negative or repeated")
            out_idx.add(k)
        outputs = {v for v, _ in self.outputs}
        bound: list[set[Value]] = [set() for _ in range(n)]  # per group: its input values
        for v, g, _ in self.inputs:
            bound[g].add(v)
        return tuple(_check_group_order(g, ts, prod, outputs, bound[g], self.show)
                     for g, ts in enumerate(self.tasks))


def _produced_twice(v: str, old: tuple[int, str], new: tuple[int, str]) -> NoReturn:
    """Raises `producers`' error: value `v` (as `TaskGraph.show` names it) is produced
    by `old` and by `new` (group, task name; task name '' = an input)."""

    def by(group: int, task: str) -> str:
        return f"task {task} on group {group}" if task else f"an input of group {group}"

    raise ValueError(f"value {v} is produced twice: by {by(*old)} and by {by(*new)}")


def _check_group_order(
    g: int, tasks: tuple[TaskNode, ...], prod: Mapping[Value, tuple[int, str]],
    outputs: set[Value], inputs: set[Value], show: Callable[[Value], str],
) -> tuple[tuple[Value, ...], ...]:
    """Checks one group's list: uses after same-group production, and `Note: donation`;
    returns what each task waits for (`TaskGraph.waits`; `show`: `TaskGraph.show`)."""
    done: set[Value] = set(inputs)  # the values bound or made on g, and not donated
    donated: dict[Value, str] = {}
    waits: list[tuple[Value, ...]] = []
    for t in tasks:
        # A value in `done` is produced (`prod` has every input and every output),
        # ready and not donated; another one must come from another group and not be
        # a donated copy. A task that reads a value otherwise has its inputs checked
        # one by one.
        away = [v for v in t.ins if v not in done]
        for v in away:
            made = prod.get(v)
            if made is None or made[0] == g or v in donated:
                _check_uses(g, t, prod, done, donated, show)
        if len(away) > 1 and len(set(away)) < len(away):
            away = list(dict.fromkeys(away))
        waits.append(tuple(away))
        for v in t.donate:
            if prod[v][0] == g and v in outputs:
                raise ValueError(f"task {t.name} on group {g} donates step output {show(v)}")
            donated[v] = t.name
            done.discard(v)
        done.update(t.outs)
    return tuple(waits)


def _check_uses(g: int, t: TaskNode, prod: Mapping[Value, tuple[int, str]],
                done: set[Value], donated: Mapping[Value, str],
                show: Callable[[Value], str]) -> None:
    """Raises on the first input of `t` (on group `g`) that is never produced, donated,
    or produced on `g` but not yet (`done`: the values bound or made on `g` so far, less
    the donated ones; `show`: `TaskGraph.show`)."""
    for v in t.ins:
        if v not in prod:
            raise ValueError(f"task {t.name} on group {g}: input {show(v)} is never produced")
        if v in donated:
            raise ValueError(
                f"task {t.name} on group {g} uses {show(v)}, which task {donated[v]} donated"
            )
        h, p = prod[v]
        if h == g and v not in done:
            raise ValueError(
                f"task {t.name} on group {g} uses {show(v)} before task {p} produces it there"
            )
