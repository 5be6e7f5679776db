"""The program's vocabulary: buffer avals and instructions, each with a text form."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable
from typing import Union

__all__ = [
    "INSTR_TYPES",
    "REDUCE_OPS",
    "AllReduce",
    "Aval",
    "Free",
    "Instr",
    "Recv",
    "Run",
    "Send",
    "SendRecv",
    "SpecEntry",
    "instr_kind",
    "parse_instr",
    "program_spec",
]

SpecEntry = Union[None, str, tuple[str, ...]]  # noqa: UP007 (a runtime alias)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NO_SPACE = re.compile(r"\S+")


_set = object.__setattr__  # sets a field of a frozen instance (in __post_init__)
_INT = frozenset({int})


def _buf_ids(bufs: Iterable[int]) -> tuple[int, ...]:
    if type(bufs) is tuple and _INT.issuperset(map(type, bufs)):
        out = bufs  # already what `tuple(map(int, bufs))` would give (built once)
    else:
        out = tuple(map(int, bufs))
    if out and min(out) < 0:
        raise ValueError(f"buffer ids must be >= 0, got {out}")
    return out


def _buf_id(buf: int) -> int:
    out = int(buf)
    if out < 0:
        raise ValueError(f"buffer ids must be >= 0, got {out}")
    return out


# ----------------------------------------------------------------------------- avals


def _spec_entry(entry: object) -> SpecEntry:
    if entry is None:
        return None
    names = (entry,) if isinstance(entry, str) else tuple(entry)  # type: ignore[arg-type]
    for name in names:
        if not isinstance(name, str) or not _NAME.fullmatch(name) or name == "_":
            raise ValueError(f"bad mesh axis name {name!r} in spec entry {entry!r}")
    return entry if isinstance(entry, str) else names


def program_spec(entries: Iterable[object]) -> tuple[SpecEntry, ...]:
    """Spec entries as the program writes them (`Aval.spec`), from entries as JAX's
    `PartitionSpec` may spell them: a tuple of one axis name as that name, an empty
    tuple as None."""
    out = []
    for e in entries:
        if isinstance(e, tuple):
            e = e[0] if len(e) == 1 else (e or None)
        out.append(e)
    return tuple(out)


def _spec_entry_str(entry: SpecEntry) -> str:
    if entry is None:
        return "_"
    if isinstance(entry, str):
        return entry
    return "(" + ",".join(entry) + ")"


def _split_top(text: str) -> list[str]:
    """Splits `text` at commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _parse_spec_entry(text: str) -> SpecEntry:
    if text == "_":
        return None
    if text.startswith("(") and text.endswith(")"):
        inner = text[1:-1]
        return tuple(inner.split(",")) if inner else ()
    return text


_AVAL_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\[([0-9,]*)\](?:\{(.*)\})?")


@dataclasses.dataclass(frozen=True, slots=True)
class Aval:
    """Shape, dtype and in-group PartitionSpec of a buffer.

    Text form: `float32[8,16]`, `bfloat16[8,16]{data,_}`, `float32[8,16]{(data,model)}`.

    Attributes:
      shape: the global shape of the value inside its group.
      dtype: a numpy dtype name ('float32', 'bfloat16', 'int32', ...).
      spec: the PartitionSpec inside the group: entries are None, an axis name, or a
        tuple of axis names. Trailing None entries are dropped, so `(None, None)` and
        `()` are the same spec.
    """

    shape: tuple[int, ...]
    dtype: str
    spec: tuple[SpecEntry, ...] = ()

    def __post_init__(self):
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        if not isinstance(self.dtype, str) or not _NAME.fullmatch(self.dtype):
            raise ValueError(f"bad dtype name {self.dtype!r}")
        spec = [_spec_entry(e) for e in self.spec]
        while spec and spec[-1] is None:
            spec.pop()
        if len(spec) > len(shape):
            raise ValueError(f"spec {tuple(spec)} is longer than shape {shape}")
        _set(self, "shape", shape)
        _set(self, "spec", tuple(spec))

    def __str__(self) -> str:
        text = f"{self.dtype}[{','.join(map(str, self.shape))}]"
        if self.spec:
            text += "{" + ",".join(_spec_entry_str(e) for e in self.spec) + "}"
        return text

    @classmethod
    def parse(cls, text: str) -> Aval:
        """Parses the text form written by `str(aval)`."""
        if cls is Aval:
            return _parse_aval(text)
        return cls._parse(text)

    @classmethod
    def _parse(cls, text: str) -> Aval:
        m = _AVAL_RE.fullmatch(text)
        if m is None:
            raise ValueError(f"cannot parse aval {text!r}")
        dtype, dims, spec = m.groups()
        shape = tuple(int(d) for d in dims.split(",")) if dims else ()
        entries = tuple(_parse_spec_entry(e) for e in _split_top(spec)) if spec else ()
        return cls(shape, dtype, entries)


@functools.lru_cache(maxsize=4096)
def _parse_aval(text: str) -> Aval:
    """`Aval.parse`, once per distinct text (avals are immutable; a program repeats few)."""
    return Aval._parse(text)


# ----------------------------------------------------------------------------- instructions


def _b(buf: int) -> str:
    return f"%{buf}"


def _bl(bufs: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(_b, bufs)) + ")"


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """Runs the group's executable `exe` on `ins`, defining `outs`.

    Attributes:
      exe: executable name, no whitespace (e.g. 'fwd_s1').
      ins: input buffers, in the executable's argument order.
      outs: output buffers, in the executable's result order; defined here.
      task: opaque label without whitespace used for timing and latency lookup
        ('F3s1' = forward of microbatch 3 on stage 1; kinds F, B, I, W; fused tasks
        joined with '+'); '' for code outside the microbatch loop.
      donate: a subset of `ins` whose memory the executable may reuse; they are dead
        after this instruction (implicitly freed, see `Note: program invariants`).
    """

    exe: str
    ins: tuple[int, ...]
    outs: tuple[int, ...]
    task: str = ""
    donate: tuple[int, ...] = ()

    def __post_init__(self):
        exe, task = self.exe, self.task
        if not isinstance(exe, str) or not _NO_SPACE.fullmatch(exe):
            raise ValueError(f"bad executable name {exe!r}")
        if not isinstance(task, str) or (task and not _NO_SPACE.fullmatch(task)):
            raise ValueError(f"bad task label {task!r}")
        ins = _buf_ids(self.ins)
        _set(self, "ins", ins)
        _set(self, "outs", _buf_ids(self.outs))
        if self.donate:
            donate = set(_buf_ids(self.donate))
            if not donate.issubset(ins):
                raise ValueError(
                    f"donated buffers {tuple(sorted(donate))} are not all inputs of {exe}"
                )
            _set(self, "donate", tuple(sorted(donate)))
        else:
            _set(self, "donate", ())

    def __str__(self) -> str:
        text = f"run {self.exe} {_bl(self.ins)} -> {_bl(self.outs)}"
        if self.task:
            text += f"  task={self.task}"
        if self.donate:
            text += f"  donate={_bl(self.donate)}"
        return text


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """Blocking send of `buf` to group `dst` with MPI tag `tag` (-1: not yet assigned)."""

    buf: int
    dst: int
    tag: int

    def __post_init__(self):
        # Fields that are ints already (a buffer: >= 0) are kept: `_buf_id` and `int`
        # would return them as they are.
        buf = self.buf
        if type(buf) is not int or buf < 0:
            _set(self, "buf", _buf_id(buf))
        if not type(self.dst) is type(self.tag) is int:
            _set(self, "dst", int(self.dst))
            _set(self, "tag", int(self.tag))

    def __str__(self) -> str:
        return f"send {_b(self.buf)} -> {self.dst} tag={self.tag}"


@dataclasses.dataclass(frozen=True, slots=True)
class Recv:
    """Blocking receive from group `src` with tag `tag`, defining `buf` with `aval`."""

    buf: int
    src: int
    tag: int
    aval: Aval

    def __post_init__(self):
        buf = self.buf  # as in `Send.__post_init__`
        if type(buf) is not int or buf < 0:
            _set(self, "buf", _buf_id(buf))
        if not type(self.src) is type(self.tag) is int:
            _set(self, "src", int(self.src))
            _set(self, "tag", int(self.tag))
        if not isinstance(self.aval, Aval):
            raise TypeError(f"Recv.aval must be an Aval, got {self.aval!r}")

    def __str__(self) -> str:
        return f"recv {_b(self.buf)} <- {self.src} tag={self.tag} {self.aval}"


@dataclasses.dataclass(frozen=True, slots=True)
class SendRecv:
    """A send and a receive that proceed together, as MPI_Sendrecv.

    The send half sends `send_buf` to `dst` with `send_tag`; the receive half defines
    `recv_buf` (with `aval`) from `src` with `recv_tag`. The instruction completes when
    both halves have been matched.
    """

    send_buf: int
    dst: int
    send_tag: int
    recv_buf: int
    src: int
    recv_tag: int
    aval: Aval

    def __post_init__(self):
        send_buf, recv_buf = self.send_buf, self.recv_buf  # as in `Send.__post_init__`
        if type(send_buf) is not int or send_buf < 0:
            _set(self, "send_buf", _buf_id(send_buf))
        if type(recv_buf) is not int or recv_buf < 0:
            _set(self, "recv_buf", _buf_id(recv_buf))
        ints = (self.dst, self.send_tag, self.src, self.recv_tag)
        if not _INT.issuperset(map(type, ints)):
            for name, value in zip(("dst", "send_tag", "src", "recv_tag"), ints, strict=True):
                _set(self, name, int(value))
        if not isinstance(self.aval, Aval):
            raise TypeError(f"SendRecv.aval must be an Aval, got {self.aval!r}")

    def __str__(self) -> str:
        return (
            f"sendrecv {_b(self.send_buf)} -> {self.dst} tag={self.send_tag}, "
            f"{_b(self.recv_buf)} <- {self.src} tag={self.recv_tag} {self.aval}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Free:
    """Releases `bufs`; they may not be used afterwards."""

    bufs: tuple[int, ...]

    def __post_init__(self):
        bufs = _buf_ids(self.bufs)
        if not bufs:
            raise ValueError("Free needs at least one buffer")
        _set(self, "bufs", bufs)

    def __str__(self) -> str:
        return "free " + " ".join(map(_b, self.bufs))


REDUCE_OPS = ("sum", "max", "bor")
"""How `AllReduce` combines: `sum` and `max` elementwise; `bor` the bitwise OR of the
values' bit patterns (exact for buffers of which at most one replica holds non-zero bits
at each position, such as a `Concat` state: `Note: replicas` in compiler/replicas.py)."""


@dataclasses.dataclass(frozen=True, slots=True)
class AllReduce:
    """Combines `bufs` across the pipeline replicas of this group, in place.

    Every replica of the pipeline runs the same group program; this instruction is a
    collective of the ranks that run group g's program (one per replica). After it,
    each buffer holds the combination (`op`, see `REDUCE_OPS`) of that buffer over all
    replicas, on every replica. The buffers stay defined with the same avals. With one
    replica it changes nothing. Messages never cross replicas, so it cannot deadlock
    against Send/Recv (`Note: replicas` in compiler/replicas.py).

    Attributes:
      bufs: the buffers (defined before, not freed), reduced together (one bucket).
      op: one of `REDUCE_OPS`.
    """

    bufs: tuple[int, ...]
    op: str = "sum"

    def __post_init__(self):
        bufs = _buf_ids(self.bufs)
        if not bufs or len(set(bufs)) != len(bufs):
            raise ValueError(f"AllReduce needs distinct buffers, got {bufs}")
        if self.op not in REDUCE_OPS:
            raise ValueError(f"AllReduce op must be one of {REDUCE_OPS}, got {self.op!r}")
        _set(self, "bufs", bufs)

    def __str__(self) -> str:
        return f"allreduce {_bl(self.bufs)} op={self.op}"


Instr = Union[Run, Send, Recv, SendRecv, Free, AllReduce]  # noqa: UP007 (a runtime alias)
INSTR_TYPES = (Run, Send, Recv, SendRecv, Free, AllReduce)


def instr_kind(cls: type) -> type | None:
    """The one of `INSTR_TYPES` that `cls` is or derives from, else None. (No class
    derives from two: their slots conflict.) `isinstance(instr, T)` for T in
    `INSTR_TYPES` is `instr_kind(type(instr)) is T`."""
    return next((t for t in INSTR_TYPES if issubclass(cls, t)), None)


_BUF_LIST = re.compile(r"%[0-9]+(?:, %[0-9]+)*")


def _parse_bufs(text: str) -> tuple[int, ...]:
    if not text:
        return ()
    if _BUF_LIST.fullmatch(text):
        return tuple(map(int, text[1:].split(", %")))
    for tok in text.split(", "):
        digits = tok[1:]
        if tok[:1] != "%" or not (digits.isascii() and digits.isdigit()):
            raise ValueError(f"bad buffer {tok!r}")
    raise ValueError(f"bad buffer list {text!r}")


_I = r"(-?\d+)"
_INSTR_PARSERS = {
    "run": (
        re.compile(
            r"run (\S+) \(([^)]*)\) -> \(([^)]*)\)(?:  task=(\S+))?(?:  donate=\(([^)]*)\))?"
        ),
        lambda m: Run(
            m[1], _parse_bufs(m[2]), _parse_bufs(m[3]), m[4] or "", _parse_bufs(m[5] or "")
        ),
    ),
    "send": (
        re.compile(rf"send %(\d+) -> {_I} tag={_I}"),
        lambda m: Send(int(m[1]), int(m[2]), int(m[3])),
    ),
    "recv": (
        re.compile(rf"recv %(\d+) <- {_I} tag={_I} (\S+)"),
        lambda m: Recv(int(m[1]), int(m[2]), int(m[3]), Aval.parse(m[4])),
    ),
    "sendrecv": (
        re.compile(rf"sendrecv %(\d+) -> {_I} tag={_I}, %(\d+) <- {_I} tag={_I} (\S+)"),
        lambda m: SendRecv(*(int(m[k]) for k in range(1, 7)), Aval.parse(m[7])),
    ),
    "free": (
        re.compile(r"free((?: %\d+)+)"),
        lambda m: Free(tuple(int(t[1:]) for t in m[1].split())),
    ),
    "allreduce": (
        re.compile(r"allreduce \(([^)]*)\) op=(\w+)"),
        lambda m: AllReduce(_parse_bufs(m[1]), m[2]),
    ),
}


_NUMBERED = re.compile(r"^#\d+\s+")


def parse_instr(text: str) -> Instr:
    """Parses one instruction from the text form written by `str(instr)`.

    Raises:
      ValueError: if `text` is not an instruction.
    """
    text = text.strip()
    if text[:1] == "#":
        text = _NUMBERED.sub("", text)
    entry = _INSTR_PARSERS.get(text.split(" ", 1)[0])
    m = entry[0].fullmatch(text) if entry else None
    if m is None:
        raise ValueError(f"cannot parse instruction {text!r}")
    return entry[1](m)
