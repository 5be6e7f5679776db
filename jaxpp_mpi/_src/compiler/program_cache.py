"""Lowered programs kept on disk, so a relaunched job does not build its step's program again.

Note: program cache.
  A relaunch of the same step reads back what only lowering needs instead of building
  it. A *step entry* is keyed by what the program depends on that is known before any
  per-microbatch task exists: the traced step's text (its jaxpr, every constant as a
  digest of its value: `Note: step fingerprints` in compiler/fingerprint.py), the
  schedule (its repr and the order it gives every group's tasks, fused pairs
  included), the group count, the in/out specs and donations, the replicas, the
  group's mesh shape, the measured task times, how the runtime sends, JAX's version,
  the library's version and a digest of the source of the packages that trace and plan
  (`compiler/`, `ir/`, `schedules/`, `primitives/`) (`step_key`). It carries the
  verified program, its buffer names, and what the step plan takes from the task graph:
  each executable's avals and the step's input bindings (`StepEntry`). On a hit the
  compiler builds no loop task node, no task graph, and neither lowers nor verifies;
  it still traces and splits, which make the executables' functions (JAX's own cache
  then serves their compiles).

  On a miss the lowering itself goes through a *program entry*, keyed by a sha256 of
  the task graph's canonical text (every task's name, executable, values in and out
  and donations; the step's inputs and outputs; the aval of every value the program
  holds), the task times, the sends, the version and the source digest (`graph_key`):
  a step whose text changed but whose graph did not (another constant's value) skips
  the lowering still. Neither entry is ever looked up by anything coarser.

  An entry is one file, `<key>.program`: a header line (format, key, version, the
  sha256 and length of the body) and the body, one JSON document: the program in a
  compact form (string tables of avals, executables and task labels; each instruction
  a short list), the buffer names, and a step entry's plan data. Reading checks all of
  it, and every instruction is rebuilt through its own checks; an entry that fails any
  check (cut short, flipped bytes, another format or version, another key, a malformed
  body; for a step entry, executables or step inputs other than those the plan has
  just made) is ignored and rebuilt, never trusted, and the rebuilt one replaces it. A
  stored entry was verified before it was written, so a hit skips the verification
  too: the checksum proves it is the program that verified. Writes go to a unique
  temporary file in the same directory, flushed, then renamed over the entry
  (`os.replace`, atomic on POSIX), so several ranks of one host writing the same entry
  at once each leave a whole file, and a reader sees a whole entry or none. Every rank
  builds every group's program, so on a first launch a rank slower to reach its
  lowering may already read the entry a faster rank of its host wrote: the same
  program either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxpp_mpi._src.base.files import read_at_most
from jaxpp_mpi._src.compiler.lower import build_program_with_names
from jaxpp_mpi._src.compiler.task_graph import TaskGraph
from jaxpp_mpi._src.compiler.walks import BufferNames
from jaxpp_mpi._src.ir.program import (
    AllReduce,
    Aval,
    Free,
    GroupProgram,
    Instr,
    Program,
    Recv,
    Run,
    Send,
    SendRecv,
)

__all__ = ["FORMAT", "ProgramCache", "StepEntry", "graph_key", "lower_cached", "step_key"]

logger = logging.getLogger("jaxpp_mpi")

FORMAT = "jaxpp_mpi-program-2"
_MAX_ENTRY_BYTES = 1 << 30  # an entry larger than this is not read
_SOURCE_PACKAGES = ("compiler", "ir", "schedules", "primitives")

ExeAvals = tuple[tuple[Aval, ...], tuple[Aval, ...]]  # an executable's (input, output) avals


def _version() -> str:
    try:
        return importlib.metadata.version("jaxpp_mpi")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_SOURCE_DIGEST: str | None = None


def source_digest() -> str:
    """A sha256 over the source files of the packages that trace, plan and lower a step
    (read once)."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        root = pathlib.Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for package in _SOURCE_PACKAGES:
            for path in sorted((root / package).glob("*.py")):
                h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def _head(kind: str, task_ms: Mapping[str, float] | None, sends: str) -> bytes:
    """What every key of `kind` covers besides its own parts."""
    return repr((FORMAT, kind, _version(), source_digest(), sends,
                 sorted((task_ms or {}).items()))).encode()


def graph_key(graph: TaskGraph, task_ms: Mapping[str, float] | None, sends: str) -> str:
    """The program entry key of lowering `graph` (`Note: program cache`).

    Args:
      graph: the task graph.
      task_ms: the measured task times the lowering is given, or None.
      sends: how the runtime sends ("blocking" or "posted").

    Returns:
      A sha256 hex digest.
    """
    h = hashlib.sha256(_head("graph", task_ms, sends))
    h.update(repr(graph.num_groups).encode())
    avals = graph.avals
    for ts in graph.tasks:
        h.update(repr([(t.name, t.group, t.exe, t.ins, t.outs, t.donate) for t in ts]).encode())
        h.update(repr([(v, str(avals[v])) for t in ts for v in t.outs]).encode())
    h.update(repr(graph.inputs).encode())
    h.update(repr([str(avals[v]) for v, _, _ in graph.inputs]).encode())
    h.update(repr(graph.outputs).encode())
    if graph.names is not None:  # the buffer names an entry keeps
        h.update(graph.names.digest().encode())
    return h.hexdigest()


def step_key(parts: Sequence[str], task_ms: Mapping[str, float] | None, sends: str) -> str:
    """The step entry key of a step described by `parts` (`Note: program cache`).

    Args:
      parts: texts that together decide the step's program and plan (the caller's:
        the traced step, the schedule's order, the options, ...); each is hashed with
        its length, so no two lists of parts hash alike by concatenation.
      task_ms: the measured task times the lowering is given, or None.
      sends: how the runtime sends ("blocking" or "posted").

    Returns:
      A sha256 hex digest.
    """
    h = hashlib.sha256(_head("step", task_ms, sends))
    for part in parts:
        data = part.encode()
        h.update(b"%d:" % len(data) + data)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class StepEntry:
    """What a step entry carries (`Note: program cache`).

    Attributes:
      program: the verified program (before any replica reduction is added).
      buffer_names: per group, buffer id -> value name.
      exe_avals: per group, executable name -> (input avals, output avals), in the
        order the plan lists them.
      input_avals: per flat step input, its aval.
      input_owner: per flat step input, the group it is bound on (None: unused).
      mb_inputs: (flat step input index, group, microbatch) of each microbatch index.
    """

    program: Program
    buffer_names: BufferNames
    exe_avals: tuple[dict[str, ExeAvals], ...]
    input_avals: tuple[Aval, ...]
    input_owner: tuple[int | None, ...]
    mb_inputs: tuple[tuple[int, int, int], ...]


# -- the body's compact form -----------------------------------------------------------


class _Table:
    """Distinct strings or avals numbered in order of first use (an aval is written as
    its text, once)."""

    def __init__(self):
        self.index: dict[str | Aval, int] = {}

    def __call__(self, item: str | Aval) -> int:
        return self.index.setdefault(item, len(self.index))

    def strings(self) -> list[str]:
        return [str(item) for item in self.index]


def _instr_json(instr: Instr, avals: _Table, words: _Table) -> list:
    """One instruction as a short list: a type code, then its fields."""
    if type(instr) is Run:
        return [0, words(instr.exe), instr.ins, instr.outs, words(instr.task), instr.donate]
    if type(instr) is Send:
        return [1, instr.buf, instr.dst, instr.tag]
    if type(instr) is Recv:
        return [2, instr.buf, instr.src, instr.tag, avals(instr.aval)]
    if type(instr) is SendRecv:
        return [3, instr.send_buf, instr.dst, instr.send_tag, instr.recv_buf, instr.src,
                instr.recv_tag, avals(instr.aval)]
    if type(instr) is Free:
        return [4, instr.bufs]
    if type(instr) is AllReduce:
        return [5, instr.bufs, instr.op]
    raise TypeError(f"not an instruction: {instr!r}")


# Per type code: (the number of fields, the instruction from its fields, the avals and the
# words). Each instruction's own checks run on what it is given.
_INSTR_DECODERS: tuple[tuple[int, Callable[[list, list, list], Instr]], ...] = (
    (6, lambda e, a, w: Run(w[e[1]], e[2], e[3], w[e[4]], e[5])),
    (4, lambda e, a, w: Send(e[1], e[2], e[3])),
    (5, lambda e, a, w: Recv(e[1], e[2], e[3], a[e[4]])),
    (8, lambda e, a, w: SendRecv(*e[1:7], a[e[7]])),
    (2, lambda e, a, w: Free(e[1])),
    (3, lambda e, a, w: AllReduce(e[1], e[2])),
)


def _instr_from_json(entry: list, avals: list[Aval], words: list[str]) -> Instr:
    code = entry[0]
    if type(code) is not int or not 0 <= code < len(_INSTR_DECODERS):
        raise ValueError(f"bad instruction code {code!r}")
    size, decode = _INSTR_DECODERS[code]
    if len(entry) != size:
        raise ValueError(f"instruction {entry!r} has {len(entry)} fields, expected {size}")
    return decode(entry, avals, words)


def _program_json(program: Program, avals: _Table) -> dict:
    """The program in its compact form (avals numbered in `avals`)."""
    words = _Table()
    groups = [[g.inputs, g.outputs, [(b, avals(a)) for b, a in g.avals],
               [_instr_json(instr, avals, words) for instr in g.instrs]]
              for g in program.groups]
    return {"words": words.strings(), "groups": groups}


def _program_from_json(data: dict, avals: list[Aval]) -> Program:
    words = data["words"]
    if not all(isinstance(w, str) for w in words):
        raise ValueError("executable names and task labels are not strings")
    groups = []
    for k, (inputs, outputs, buffers, instrs) in enumerate(data["groups"]):
        groups.append(GroupProgram(
            k, [tuple(p) for p in inputs],
            tuple(_instr_from_json(e, avals, words) for e in instrs),
            [tuple(p) for p in outputs], [(b, avals[a]) for b, a in buffers]))
    return Program(tuple(groups))


def _names_json(names: BufferNames) -> list:
    return [sorted(group.items()) for group in names]


def _names_from_json(groups: Any) -> BufferNames:
    if not isinstance(groups, list):
        raise ValueError("buffer names are not a list")
    return tuple({int(b): str(v) for b, v in group} for group in groups)


def _avals_of(texts: list[int], avals: list[Aval]) -> tuple[Aval, ...]:
    return tuple(avals[k] for k in texts)


def _plan_json(entry: StepEntry, avals: _Table) -> dict:
    """A step entry's plan data (everything but the program and the names)."""
    return {
        "exe_avals": [[(name, [avals(a) for a in ins], [avals(a) for a in outs])
                       for name, (ins, outs) in group.items()] for group in entry.exe_avals],
        "input_avals": [avals(a) for a in entry.input_avals],
        "input_owner": list(entry.input_owner),
        "mb_inputs": [list(x) for x in entry.mb_inputs],
    }


def _step_entry(program: Program, names: BufferNames, plan: dict,
                avals: list[Aval]) -> StepEntry:
    exe_avals = tuple({str(name): (_avals_of(ins, avals), _avals_of(outs, avals))
                       for name, ins, outs in group} for group in plan["exe_avals"])
    owner = tuple(None if g is None else int(g) for g in plan["input_owner"])
    mb_inputs = tuple((int(k), int(g), int(m)) for k, g, m in plan["mb_inputs"])
    entry = StepEntry(program, names, exe_avals, _avals_of(plan["input_avals"], avals),
                      owner, mb_inputs)
    if len(exe_avals) != program.num_groups or len(owner) != len(entry.input_avals):
        raise ValueError("plan data of another step")
    return entry


def _encode(key: str, program: Program, names: BufferNames,
            step: StepEntry | None = None) -> bytes:
    avals = _Table()
    doc = {"program": _program_json(program, avals), "names": _names_json(names),
           "plan": None if step is None else _plan_json(step, avals)}
    doc["avals"] = avals.strings()
    body = json.dumps(doc, separators=(",", ":")).encode()
    header = {"format": FORMAT, "key": key, "version": _version(),
              "sha256": hashlib.sha256(body).hexdigest(), "length": len(body)}
    return json.dumps(header, sort_keys=True).encode() + b"\n" + body


def _decode(data: bytes, key: str) -> tuple[Program, BufferNames, dict | None, list[Aval]]:
    """An entry's program, names, plan data (None in a program entry) and aval table;
    ValueError for any failed check."""
    line, newline, body = data.partition(b"\n")
    if not newline:
        raise ValueError("no header")
    header = json.loads(line)
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    for field, want in (("format", FORMAT), ("key", key), ("version", _version())):
        if header.get(field) != want:
            raise ValueError(f"{field} {header.get(field)!r}, expected {want!r}")
    if header.get("length") != len(body):
        raise ValueError(f"{len(body)} bytes, the header says {header.get('length')}")
    if header.get("sha256") != hashlib.sha256(body).hexdigest():
        raise ValueError("checksum mismatch")
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError("the body is not an object")
    avals = [Aval.parse(text) for text in doc["avals"]]
    program = _program_from_json(doc["program"], avals)
    buffer_names = _names_from_json(doc["names"])
    if len(buffer_names) != program.num_groups:
        raise ValueError("buffer names of another group count")
    return program, buffer_names, doc["plan"], avals


# An entry with a valid checksum but a malformed body (a bug, or another writer's hand)
# fails with one of these; it is rebuilt like any other failed check.
_BAD_ENTRY = (ValueError, TypeError, KeyError, IndexError, AttributeError)


@dataclasses.dataclass(frozen=True)
class ProgramCache:
    """A directory of lowered programs (`Note: program cache`).

    Attributes:
      directory: where the entries live (made on the first store).
    """

    directory: str

    def path(self, key: str) -> str:
        """The file of entry `key`."""
        return os.path.join(self.directory, f"{key}.program")

    def _read(self, key: str) -> tuple[Program, BufferNames, dict | None, list[Aval]] | None:
        """The decoded entry `key`, or None when there is none or it fails a check
        (then it is logged and left to be replaced)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = read_at_most(f, _MAX_ENTRY_BYTES)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("program cache: cannot read %s (%s); building again", path, e)
            return None
        try:
            return _decode(data, key)
        except _BAD_ENTRY as e:
            logger.warning("program cache: ignoring %s (%s); building again", path, e)
            return None

    def load(self, key: str) -> tuple[Program, BufferNames] | None:
        """The verified program and buffer names stored under `key`, or None when there
        is no such entry or it fails a check (then it is logged and left to be
        replaced)."""
        entry = self._read(key)
        return None if entry is None else entry[:2]

    def load_step(self, key: str) -> StepEntry | None:
        """The step entry stored under `key`, or None as `load`."""
        entry = self._read(key)
        if entry is None:
            return None
        program, names, plan, avals = entry
        try:
            if plan is None:
                raise ValueError("a program entry, not a step entry")
            return _step_entry(program, names, plan, avals)
        except _BAD_ENTRY as e:
            logger.warning("program cache: ignoring %s (%s); building again",
                           self.path(key), e)
            return None

    def store(self, key: str, program: Program, names: BufferNames) -> None:
        """Writes the program entry `key` (see `_write`)."""
        self._write(key, _encode(key, program, names))

    def store_step(self, key: str, entry: StepEntry) -> None:
        """Writes the step entry `key` (see `_write`)."""
        self._write(key, _encode(key, entry.program, entry.buffer_names, entry))

    def _write(self, key: str, data: bytes) -> None:
        """Writes the entry `key` atomically (a unique temporary file, then a rename).

        A failure to write (a read-only or full disk) is logged, not raised: the step
        runs without its entry.
        """
        try:
            os.makedirs(self.directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp",
                                       dir=self.directory)
            try:
                os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide it from other users' jobs
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("program cache: cannot write %s (%s)", self.path(key), e)


def lower_cached(graph: TaskGraph, task_ms: Mapping[str, float] | None, sends: str,
                 cache: ProgramCache | None) -> tuple[Program, BufferNames, bool]:
    """`lower.build_program_with_names(graph, task_ms, sends)`, through `cache`'s
    program entries.

    Returns:
      The verified program, its buffer names, and whether they came from the cache.

    Raises:
      As `build_program_with_names` on a miss.
    """
    if cache is None:
        return (*build_program_with_names(graph, task_ms, sends), False)
    key = graph_key(graph, task_ms, sends)
    hit = cache.load(key)
    if hit is not None:
        return (*hit, True)
    program, names = build_program_with_names(graph, task_ms, sends)
    cache.store(key, program, names)
    return program, names, False
