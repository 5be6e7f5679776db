"""The program IR: per-group instruction lists, their text form and their hash.

The instructions themselves (and buffer avals) live in ir/instructions.py; they are
re-exported here, so `from jaxpp_mpi._src.ir.program import Run` keeps working.
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
import re
from collections.abc import Iterable, Mapping
from functools import cached_property

from jaxpp_mpi._src.ir.instructions import (
    INSTR_TYPES,
    REDUCE_OPS,
    AllReduce,
    Aval,
    Free,
    Instr,
    Recv,
    Run,
    Send,
    SendRecv,
    SpecEntry,
    parse_instr,
)

__all__ = [
    "INSTR_TYPES",
    "REDUCE_OPS",
    "AllReduce",
    "Aval",
    "Free",
    "GroupProgram",
    "Instr",
    "Program",
    "ProgramError",
    "Recv",
    "Run",
    "Send",
    "SendRecv",
    "SpecEntry",
    "parse_instr",
]


class ProgramError(ValueError):
    """A program that breaks an invariant of the IR (see `Note: program invariants`).

    Attributes:
      kind: one of `ProgramError.KINDS`.
      groups: the MPMD indexes of the groups involved.
      index: the instruction index involved in the first group, or None.
    """

    KINDS = frozenset(
        {
            "deadlock",
            "unmatched",
            "aval_mismatch",
            "use_after_free",
            "undefined",
            "redefined",
            "leak",
            "bad_peer",
            "bad_tag",
        }
    )

    def __init__(
        self, kind: str, message: str, groups: Iterable[int] = (), index: int | None = None
    ):
        if kind not in self.KINDS:
            raise ValueError(f"unknown ProgramError kind {kind!r}")
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.groups = tuple(groups)
        self.index = index


# ----------------------------------------------------------------------------- programs

_INSTR_TYPE_SET = frozenset(INSTR_TYPES)


def _first(pair: tuple) -> object:
    return pair[0]


_PAIR_TYPES = frozenset({tuple})
_PAIR_LENS = frozenset({2})
_INTS = frozenset({int})
_KEY, _VALUE = operator.itemgetter(0), operator.itemgetter(1)


def _sorted_pairs(items: tuple, value_type: type) -> bool:
    """Whether `items` is a tuple of (int, `value_type`) 2-tuples, increasing in the int:
    its own canonical form, then kept as it is (no new tuple per buffer)."""
    if not (_PAIR_TYPES.issuperset(map(type, items)) and _PAIR_LENS.issuperset(map(len, items))):
        return False
    keys = list(map(_KEY, items))
    return (
        _INTS.issuperset(map(type, keys))
        and all(map(operator.lt, keys, keys[1:]))
        and {value_type}.issuperset(map(type, map(_VALUE, items)))
    )


def _sorted_dict(mapping: dict, value_type: type) -> bool:
    """`_sorted_pairs(tuple(mapping.items()), value_type)` for a dict, cheaper: its items
    are 2-tuples, and its keys distinct, so increasing is the same as sorted (and
    `sorted` on a sorted list of ints only compares neighbours)."""
    keys = list(mapping)
    return (
        _INTS.issuperset(map(type, keys))
        and keys == sorted(keys)
        and {value_type}.issuperset(map(type, mapping.values()))
    )


def _pairs(pairs: Mapping[int, int] | Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    items = pairs.items() if isinstance(pairs, Mapping) else pairs
    return tuple(sorted((int(b), int(k)) for b, k in items))


def _instrs(mpmd_idx: int, instrs: Iterable[Instr]) -> tuple[Instr, ...]:
    """`instrs` as a tuple, checked to be instructions."""
    instrs = tuple(instrs)
    if not set(map(type, instrs)) <= _INSTR_TYPE_SET:
        for i, instr in enumerate(instrs):
            if not isinstance(instr, INSTR_TYPES):
                raise TypeError(f"group {mpmd_idx} #{i}: not an instruction: {instr!r}")
    return instrs


_PAIR = re.compile(r"%(\d+)=(\d+)")
_BUF = re.compile(r"%\d+")


def _parse_pairs(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for tok in text.split():
        m = _PAIR.fullmatch(tok)
        if m is None:
            raise ValueError(f"bad input/output binding {tok!r}")
        out.append((int(m[1]), int(m[2])))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class GroupProgram:
    """The ordered instructions one MPMD group runs for one step.

    Note: program invariants
      - Buffers are symbolic int ids local to a group (`%3` in text). A buffer is live
        from the instruction that defines it (an input binding, a Run output, a Recv or
        the receive half of a SendRecv) until a Free names it or a Run donates it; it may
        be used only while live, and defined again only after it is dead.
      - Every buffer that is not a group output is freed or donated exactly once; the
        outputs are live at the end.
      - Messages match as in MPI: same (src, dst) and tag, in program order among equal
        tags. `assign_tags` numbers the messages of each channel 0, 1, ...
      - Send and Recv block with rendezvous semantics; a program must complete without
        relying on eager buffering (`verify` proves it).

    Attributes:
      mpmd_idx: the group (== MPI rank in MPI mode).
      inputs: (buffer, flat step input index) pairs; those buffers are live at start.
      instrs: the instructions, in execution order.
      outputs: (buffer, flat step output index) pairs; live at the end.
      avals: (buffer, Aval) pairs for every buffer, sorted by buffer; a mapping is
        accepted. `aval_map` is the dict view.
    """

    mpmd_idx: int
    inputs: tuple[tuple[int, int], ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[tuple[int, int], ...]
    avals: tuple[tuple[int, Aval], ...]

    def __post_init__(self):
        object.__setattr__(self, "mpmd_idx", int(self.mpmd_idx))
        object.__setattr__(self, "inputs", _pairs(self.inputs))
        object.__setattr__(self, "outputs", _pairs(self.outputs))
        object.__setattr__(self, "instrs", _instrs(self.mpmd_idx, self.instrs))
        avals = self.avals
        if type(avals) is dict and _sorted_dict(avals, Aval):
            object.__setattr__(self, "avals", tuple(avals.items()))  # as below
            if type(self) is GroupProgram:
                # `aval_map` now, as a copy of the dict given: a dict copies a dict
                # much faster than `aval_map` builds one from the pairs
                self.__dict__["aval_map"] = avals.copy()
            return
        items = tuple(avals.items() if isinstance(avals, Mapping) else avals)
        if _sorted_pairs(items, Aval):
            object.__setattr__(self, "avals", items)  # what the general path below makes
            return
        bufs, avals = zip(*items) if items else ((), ())
        if not (set(map(type, bufs)) <= {int} and all(map(operator.lt, bufs, bufs[1:]))):
            pairs = sorted(zip(map(int, bufs), avals), key=_first)
            bufs, avals = zip(*pairs) if pairs else ((), ())
            if not all(map(operator.lt, bufs, bufs[1:])):
                b = next(b for k, b in enumerate(bufs) if k and bufs[k - 1] == b)
                raise ValueError(f"two avals for buffer %{b}")
        if not set(map(type, avals)) <= {Aval}:
            for b, a in zip(bufs, avals):
                if not isinstance(a, Aval):
                    raise TypeError(f"aval of %{b} is not an Aval: {a!r}")
        object.__setattr__(self, "avals", tuple(zip(bufs, avals)))

    def with_instrs(self, instrs: Iterable[Instr], *, checked: bool = False) -> GroupProgram:
        """`dataclasses.replace(self, instrs=tuple(instrs))`, without checking again the
        fields that stay (a pass's rewrite of a large group).

        Args:
          instrs: the new instructions.
          checked: the caller vouches that each is an instruction (one of a group's, or
            one just made: `Note: trusted instructions` in ir/trusted.py), so they are
            not checked again.
        """
        if type(self) is not GroupProgram:
            return dataclasses.replace(self, instrs=tuple(instrs))
        new = object.__new__(GroupProgram)
        for name in ("mpmd_idx", "inputs", "outputs", "avals"):
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(
            new, "instrs", tuple(instrs) if checked else _instrs(self.mpmd_idx, instrs)
        )
        if "aval_map" in self.__dict__:  # the same avals: the same dict (never changed)
            new.__dict__["aval_map"] = self.__dict__["aval_map"]
        return new

    @cached_property
    def aval_map(self) -> dict[int, Aval]:
        """The avals as a dict from buffer id to Aval."""
        return dict(self.avals)

    def aval(self, buf: int) -> Aval:
        """Returns the aval of `buf`."""
        return self.aval_map[buf]

    def format(self, numbered: bool = False) -> str:
        """The text form; `numbered` prefixes instructions with `#index` (parses back)."""
        lines = [f"group {self.mpmd_idx}"]
        lines.append("  inputs" + "".join(f" %{b}={k}" for b, k in self.inputs))
        if numbered:
            lines.extend(f"  #{i} {instr}" for i, instr in enumerate(self.instrs))
        else:
            lines.extend(f"  {instr}" for instr in self.instrs)
        lines.append("  outputs" + "".join(f" %{b}={k}" for b, k in self.outputs))
        lines.extend(f"  aval %{b} {a}" for b, a in self.avals)
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.format()

    def hash(self) -> str:
        """sha256 hex digest of the canonical text form."""
        return hashlib.sha256(str(self).encode()).hexdigest()

    @classmethod
    def parse(cls, text: str) -> GroupProgram:
        """Parses the text form of one group.

        Raises:
          ValueError: naming the offending line.
        """
        groups = _parse_groups(text)
        if len(groups) != 1:
            raise ValueError(f"expected one group, found {len(groups)}")
        return groups[0]


@dataclasses.dataclass(frozen=True)
class Program:
    """The whole step: one GroupProgram per MPMD group, `groups[i].mpmd_idx == i`."""

    groups: tuple[GroupProgram, ...]

    def __post_init__(self):
        groups = tuple(self.groups)
        for i, g in enumerate(groups):
            if g.mpmd_idx != i:
                raise ValueError(f"groups[{i}] has mpmd_idx {g.mpmd_idx}")
        object.__setattr__(self, "groups", groups)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def group(self, mpmd_idx: int) -> GroupProgram:
        """Returns the program of group `mpmd_idx`."""
        return self.groups[mpmd_idx]

    def format(self, numbered: bool = False) -> str:
        """The text form; see `GroupProgram.format`."""
        return "\n".join(g.format(numbered) for g in self.groups)

    def __str__(self) -> str:
        return self.format()

    def hash(self) -> str:
        """sha256 hex digest of the canonical text form (equal programs, equal hashes)."""
        return hashlib.sha256(str(self).encode()).hexdigest()

    @classmethod
    def parse(cls, text: str) -> Program:
        """Parses the text form written by `str(program)` (numbered or not).

        Raises:
          ValueError: naming the offending line.
        """
        return cls(_parse_groups(text))


def _parse_groups(text: str) -> tuple[GroupProgram, ...]:
    """Parses the text form of any number of groups."""
    groups: list[GroupProgram] = []
    cur: dict | None = None

    def close():
        if cur is not None:
            groups.append(GroupProgram(**cur))

    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        head, _, rest = line.partition(" ")
        try:
            if head == "group":
                close()
                cur = dict(mpmd_idx=int(rest), inputs=(), instrs=[], outputs=(), avals=[])
            elif cur is None:
                raise ValueError("expected 'group N' first")
            elif head == "inputs":
                cur["inputs"] = _parse_pairs(rest)
            elif head == "outputs":
                cur["outputs"] = _parse_pairs(rest)
            elif head == "aval":
                buf, _, aval = rest.partition(" ")
                if not _BUF.fullmatch(buf):
                    raise ValueError(f"bad buffer {buf!r}")
                cur["avals"].append((int(buf[1:]), Aval.parse(aval)))
            else:
                cur["instrs"].append(parse_instr(line))
        except (ValueError, TypeError) as e:
            raise ValueError(f"line {lineno}: {raw!r}: {e}") from None
    close()
    return tuple(groups)
