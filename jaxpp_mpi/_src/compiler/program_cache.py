"""Lowered programs kept on disk, so a relaunched job does not lower its step again.

Note: program cache.
  Lowering (`lower.build_program_with_names`: the walks, their scoring, the frees and
  the verification) is a pure function of the task graph, the measured task times, how
  the runtime sends, and the compiler's own code. An entry is keyed by a sha256 over
  all of them: the graph's canonical text (every task's name, executable, values in
  and out and donations; the step's inputs and outputs; the aval of every value the
  program holds), the task times, the sends, the library's version and a digest of
  the source of the packages that lower (`compiler/`, `ir/`, `schedules/`). The
  graph already carries what the traced step, the schedule, the microbatch count and
  the mesh's MPMD dimension decide, so a step that differs in any of them has another
  key; an entry is never looked up by anything coarser.

  An entry is one file, `<key>.program`: a header line (format, key, version, the
  sha256 and length of the body) and the body (the verified program's text form, then
  each group's buffer names as JSON). Reading checks all of it; an entry that fails
  any check (cut short, flipped bytes, another format or version, another key) is
  ignored and rebuilt, never trusted, and the rebuilt one replaces it. A stored entry
  was verified before it was written, so a hit skips the verification too: the
  checksum proves it is the text that verified. Writes go to a unique temporary file
  in the same directory, flushed, then renamed over the entry (`os.replace`, atomic
  on POSIX), so several ranks of one host writing the same entry at once each leave a
  whole file, and a reader sees a whole entry or none. Every rank builds every group's
  program, so on a first launch a rank slower to reach its lowering may already read
  the entry a faster rank of its host wrote: the same program either way.
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
from collections.abc import Mapping

from jaxpp_mpi._src.base.files import read_at_most
from jaxpp_mpi._src.compiler.lower import build_program_with_names
from jaxpp_mpi._src.compiler.task_graph import TaskGraph
from jaxpp_mpi._src.compiler.walks import BufferNames
from jaxpp_mpi._src.ir.program import Program

__all__ = ["FORMAT", "ProgramCache", "graph_key", "lower_cached"]

logger = logging.getLogger("jaxpp_mpi")

FORMAT = "jaxpp_mpi-program-1"
_MAX_ENTRY_BYTES = 1 << 30  # an entry larger than this is not read
_SOURCE_PACKAGES = ("compiler", "ir", "schedules")


def _version() -> str:
    try:
        return importlib.metadata.version("jaxpp_mpi")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


_SOURCE_DIGEST: str | None = None


def source_digest() -> str:
    """A sha256 over the source files of the packages that lower a step (read once)."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        root = pathlib.Path(__file__).resolve().parent.parent
        h = hashlib.sha256()
        for package in _SOURCE_PACKAGES:
            for path in sorted((root / package).glob("*.py")):
                h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def graph_key(graph: TaskGraph, task_ms: Mapping[str, float] | None, sends: str) -> str:
    """The entry key of lowering `graph` (`Note: program cache`).

    Args:
      graph: the task graph.
      task_ms: the measured task times the lowering is given, or None.
      sends: how the runtime sends ("blocking" or "posted").

    Returns:
      A sha256 hex digest.
    """
    h = hashlib.sha256()
    head = (FORMAT, _version(), source_digest(), graph.num_groups, sends,
            sorted((task_ms or {}).items()))
    h.update(repr(head).encode())
    avals = graph.avals
    for ts in graph.tasks:
        h.update(repr([(t.name, t.group, t.exe, t.ins, t.outs, t.donate) for t in ts]).encode())
        h.update(repr([(v, str(avals[v])) for t in ts for v in t.outs]).encode())
    h.update(repr(graph.inputs).encode())
    h.update(repr([str(avals[v]) for v, _, _ in graph.inputs]).encode())
    h.update(repr(graph.outputs).encode())
    return h.hexdigest()


def _names_json(names: BufferNames) -> str:
    return json.dumps([sorted(group.items()) for group in names], separators=(",", ":"))


def _names_from_json(text: str) -> BufferNames:
    groups = json.loads(text)
    if not isinstance(groups, list):
        raise ValueError("buffer names are not a list")
    return tuple({int(b): str(v) for b, v in group} for group in groups)


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

    def load(self, key: str) -> tuple[Program, BufferNames] | None:
        """The verified program and buffer names stored under `key`, or None when there
        is no such entry or it fails a check (then it is logged and left to be
        replaced)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = read_at_most(f, _MAX_ENTRY_BYTES)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            logger.warning("program cache: cannot read %s (%s); lowering again", path, e)
            return None
        try:
            return _decode(data, key)
        except (ValueError, TypeError, KeyError) as e:
            logger.warning("program cache: ignoring %s (%s); lowering again", path, e)
            return None

    def store(self, key: str, program: Program, names: BufferNames) -> None:
        """Writes the entry `key` atomically (a unique temporary file, then a rename).

        A failure to write (a read-only or full disk) is logged, not raised: the step
        runs without its entry.
        """
        data = _encode(key, program, names)
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


def _encode(key: str, program: Program, names: BufferNames) -> bytes:
    body = (str(program) + "\0" + _names_json(names)).encode()
    header = {"format": FORMAT, "key": key, "version": _version(),
              "sha256": hashlib.sha256(body).hexdigest(), "length": len(body)}
    return json.dumps(header, sort_keys=True).encode() + b"\n" + body


def _decode(data: bytes, key: str) -> tuple[Program, BufferNames]:
    """An entry's program and names; ValueError for any failed check."""
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
    text, sep, names = body.decode().partition("\0")
    if not sep:
        raise ValueError("no buffer names")
    program = Program.parse(text)
    buffer_names = _names_from_json(names)
    if len(buffer_names) != program.num_groups:
        raise ValueError("buffer names of another group count")
    return program, buffer_names


def lower_cached(graph: TaskGraph, task_ms: Mapping[str, float] | None, sends: str,
                 cache: ProgramCache | None) -> tuple[Program, BufferNames, bool]:
    """`lower.build_program_with_names(graph, task_ms, sends)`, through `cache`.

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
