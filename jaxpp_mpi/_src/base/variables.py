"""Every `JAXPP_MPI_*` environment variable, defined once: who reads it, its default, the
values it takes, what it means, and the one parser of its value.

Standard library only: `launch/jpprun.py` reads it (through launch/env.py) before any JAX
or MPI exists, and `import jaxpp_mpi` reads it through its settings at import.
`config.parse_options` parses every variable that jaxpp_mpi's Python reads, so a bad
value raises on every rank alike when the options are first asked for (an MPI-mode
mesh, or the first compile), before any step. docs/reliability.md's table of variables
is generated from `VARIABLES`: `python -m jaxpp_mpi._src.base.cli --table` prints it,
`--update` rewrites the doc's table in place (tests/unit/test_variables.py fails while
the two differ).

Note: variable values.
  A value is read without its surrounding blanks, and words in any case. Set but empty
  is refused (unset the variable for its default). A switch takes 1/true/yes/on or
  0/false/no/off. A number must be finite and within the variable's range, so that a
  typo, `nan` or `inf` cannot leave a deadline that never comes, an absurd bucket or
  thread count. A refused value raises `VariableError` (a ValueError) naming the
  variable, the value as given and what it takes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["AUTO", "OFF", "VARIABLES", "Variable", "VariableError", "markdown_table",
           "parse_all", "table_span", "update_table", "variable"]

AUTO = "auto"
OFF = "off"

# Who reads a variable (the table's "read by" column).
RANKS = "every rank"
LAUNCH = "launchers, every rank"
SHELL = "launch/jpprun (shell)"
INSTALL = "make install (shell)"
TESTS = "tests"
# The readers whose variables `config.parse_options` checks on every rank.
PYTHON_READERS = (RANKS, LAUNCH)

_SWITCH = {"1": True, "true": True, "yes": True, "on": True,
           "0": False, "false": False, "no": False, "off": False}
_TIMEOUT = {AUTO: AUTO, OFF: OFF, "0": OFF, "none": OFF}
_MAX_SECONDS = 30 * 24 * 3600.0  # deadlines: 30 days
PROGRAM = "a program"


class VariableError(ValueError):
    """A `JAXPP_MPI_*` variable's value is malformed or out of range."""

    # The ranks of a job read the same environment, so each raises this alike: the abort
    # hook lets the peers print theirs before it ends the job (`raised_on_every_rank` in
    # launch/abort.py, `Note: abort before the mesh`).
    _jaxpp_mpi_raised_on_every_rank = True


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable (see `Note: variable values`).

    Attributes:
      name: the variable.
      read_by: who reads it (RANKS, LAUNCH, SHELL, INSTALL or TESTS).
      default: the value, or the behaviour, when it is unset (for the docs).
      meaning: one line for the docs.
      words: the words it takes (lower case) and the value each parses to; the first
        word of each value is the one that messages and the docs show.
      number: `float` or `int` when it takes a number too, else None.
      low: the smallest number it takes.
      high: the largest number it takes.
      unit: the number's unit, for messages ("seconds", "MiB").
      path: what else it takes, in words: `PROGRAM` (a program on PATH, or a path to
        one), or another text for a path (one with a `/`, or an existing directory);
        empty: nothing else.
      unset: what `parse` returns when it is unset.
    """

    name: str
    read_by: str
    default: str
    meaning: str
    words: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    number: type | None = None
    low: float = 0.0
    high: float = 0.0
    unit: str = ""
    path: str = ""
    unset: Any = None

    @property
    def takes(self) -> str:
        """What it takes, e.g. `a number of seconds from 0 to 600, auto or off`."""
        return self.describe_values()

    def describe_values(self, code: bool = False) -> str:
        """What it takes, its words in backticks when `code` (the docs)."""
        parts = []
        if self.number is float:
            parts.append(f"a number of {self.unit} from {_fmt(self.low)} to "
                         f"{_fmt(self.high, self.unit)}")
        elif self.number is int:
            parts.append(f"an integer from {_fmt(self.low)} to {_fmt(self.high)}")
        shown: dict[Any, str] = {}
        for word, value in self.words.items():
            shown.setdefault(value, f"`{word}`" if code else word)
        parts += list(shown.values())
        if self.path:
            parts.append(self.path)
        return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]

    def parse(self, env: Mapping[str, str]) -> Any:
        """This variable's value in `env`.

        Args:
          env: the environment (normally `os.environ`).

        Returns:
          `unset` when it is absent, else the value of its word, its number (a float or
          an int) or its path.

        Raises:
          VariableError: naming the variable, the value and what it takes.
        """
        if self.name not in env:
            return self.unset
        raw = env[self.name]
        text = raw.strip()
        if not text:
            raise self._error(raw, "empty; unset it for the default, or ")
        if text.lower() in self.words:
            return self.words[text.lower()]
        if self.number is not None:
            return self._number(raw, text)
        if self.path == PROGRAM and shutil.which(text):
            return text
        if self.path not in ("", PROGRAM) and (os.sep in text or os.path.isdir(text)):
            return text
        raise self._error(raw)

    def _number(self, raw: str, text: str) -> float | int:
        if self.number is int:
            try:
                value: float = int(text)
            except ValueError:
                raise self._error(raw, "not an integer; ") from None
        else:
            try:
                value = float(text)
            except ValueError:
                raise self._error(raw) from None
        if not (self.low <= value <= self.high):  # also refuses nan and inf
            raise self._error(raw)
        return value

    def _error(self, raw: str, why: str = "") -> VariableError:
        return VariableError(f"{self.name}={raw!r}: {why}use {self.takes}")


def _fmt(x: float, unit: str = "") -> str:
    text = f"{int(x)}" if float(x).is_integer() else f"{x:g}"
    days = x / 86400
    if unit == "seconds" and days >= 1 and days.is_integer():
        text += f" ({int(days)} days)"
    return text


def _switch(name: str, read_by: str, default: bool, meaning: str) -> Variable:
    return Variable(name, read_by, "`1`" if default else "unset", meaning, _SWITCH,
                    unset=default)


def _seconds(name: str, default: str, meaning: str, *, high: float = _MAX_SECONDS,
             words: Mapping[str, Any] | None = None, unset: Any = None) -> Variable:
    return Variable(name, RANKS, default, meaning, words or {}, number=float, high=high,
                    unit="seconds", unset=unset)


def _count(name: str, default: str, meaning: str, low: int, high: int) -> Variable:
    return Variable(name, LAUNCH, default, meaning, number=int, low=low, high=high)


VARIABLES: tuple[Variable, ...] = (
    _seconds("JAXPP_MPI_STEP_TIMEOUT", "`auto`", "watchdog deadline per step in seconds "
             "(`auto`: 300 s for the first 3 steps, then max(60 s, 20 x the slowest); "
             "`0`/`off`: no watchdog)", words=_TIMEOUT, unset=AUTO),
    _seconds("JAXPP_MPI_WATCHDOG_FLOOR", "`60`", "the automatic step deadline's floor once "
             "learnt, in seconds", unset=60.0),
    _seconds("JAXPP_MPI_WATCHDOG_GRACE", "`5`", "seconds between the watchdog's (or a "
             "deadline's) report and the abort", high=600.0, unset=5.0),
    _seconds("JAXPP_MPI_DEADLINE", "follows `JAXPP_MPI_STEP_TIMEOUT`", "deadline of every "
             "collective outside the step, in seconds (`auto`: 300 s; after tracing/compiling "
             "at least 5 x the slowest such work; `0`/`off`: none)", words=_TIMEOUT),
    Variable("JAXPP_MPI_ABORT_WAIT", LAUNCH, "`10`", "seconds a rank ending the job waits "
             "for `MPI_Abort` before it exits by itself, and jpprun for mpirun once a rank "
             "aborted (mpirun waits for a lost host's daemon; `Note: bounded abort`)",
             number=float, high=600.0, unit="seconds", unset=10.0),
    _switch("JAXPP_MPI_ABORT_ON_EXCEPTION", RANKS, True, "MPI mode: an uncaught exception "
            "prints a rank-prefixed traceback and aborts the job"),
    _switch("JAXPP_MPI_HEAP_TUNING", RANKS, True, "the MPI executor keeps large host buffers "
            "in the C heap (glibc `mallopt`), so received messages do not page-fault fresh "
            "memory (`bench/p2p.py`)"),
    _switch("JAXPP_MPI_POSTED_SENDS", RANKS, True, "on CPU, MPI mode posts its sends "
            "(non-blocking `MPI_Isend` from the array's own memory, so a rank computes on "
            "while its message waits for the receiver) and lowers the step for them; `0`: "
            "blocking sends, as on other platforms"),
    Variable("JAXPP_MPI_STAGED_MESSAGES", RANKS, "`auto`", "`auto`: a non-CPU group's "
             "messages are staged through host memory by a sender and a receiver thread, off "
             "the dispatching thread, unless `MPI4JAX_USE_CUDA_MPI` is true (MPI then takes "
             "device buffers); CPU groups keep posted sends. `1`: staged on every platform, "
             "CPU included; `0`: never. Staging needs `MPI_THREAD_MULTIPLE`; with less it "
             "falls back to `0`'s path with a warning",
             {AUTO: AUTO, **{word: "1" if on else "0" for word, on in _SWITCH.items()}},
             unset=AUTO),
    _switch("JAXPP_MPI_SHARED_COMPILES", RANKS, True, "MPI mode: ranks that need the same "
            "executable compile it once between them and pass it on serialized (off by itself "
            "while JAX's persistent compilation cache is in use)"),
    Variable("JAXPP_MPI_PROGRAM_CACHE", RANKS, "`auto`", "where lowered programs are kept "
             "for the next launch of the same step (`Note: program cache`): `auto`: in "
             "`jaxpp_mpi_programs/` inside JAX's persistent compilation cache directory when "
             "that cache is on, else nowhere; `0`: never; or a directory",
             {AUTO: AUTO, **{word: OFF for word, on in _SWITCH.items() if not on}},
             path="a directory", unset=AUTO),
    Variable("JAXPP_MPI_REPLICA_BUCKET_MB", RANKS, "`64`", "pipeline replicas: the most MiB "
             "one all-reduce across replicas carries (`0`: one per task's results)",
             number=float, high=float(1 << 20), unit="MiB", unset=64.0),
    _count("JAXPP_MPI_THREADS_PER_RANK", "`SLURM_CPUS_PER_TASK`, else `1`", "compute "
           "threads per CPU rank; jpprun exports it "
           "([running.md](running.md#workstations-launchjpprun))", 1, 4096),
    _count("JAXPP_MPI_GPUS_PER_RANK", "the visible GPUs shared evenly", "GPUs per rank for "
           "`bind_local_devices`; jpprun exports it", 0, 256),
    _switch("JAXPP_MPI_AUTO_SETTINGS", LAUNCH, True, "`import jaxpp_mpi` gives a CPU rank "
            "that shares its node jpprun's thread settings and a core of its own, however it "
            "was launched; `0`: off"),
    _count("JAXPP_MPI_LOCAL_RANK", "the launcher's", "this process's rank on its node, "
           "overriding the launcher's variables (`Note: Local rank detection`; set with "
           "`JAXPP_MPI_LOCAL_SIZE`)", 0, 4095),
    _count("JAXPP_MPI_LOCAL_SIZE", "the launcher's", "the node's rank count, overriding the "
           "launcher's variables (set with `JAXPP_MPI_LOCAL_RANK`)", 1, 4096),
    Variable("JAXPP_MPI_PYTHON", SHELL, "`./.venv/bin/python`", "the interpreter "
             "`launch/jpprun` runs with (`make` sets it to its venv's); the ranks run the "
             "same one", path=PROGRAM),
    Variable("JAXPP_MPI_MPI", INSTALL, "`wheel`", "`wheel` or `system` MPI "
             "([getting-started.md](getting-started.md#install)); tools/install.sh refuses "
             "other words", {"wheel": "wheel", "system": "system"}),
    Variable("JAXPP_MPI_CUDA", INSTALL, "`auto`", "mpi4jax's CUDA part: built when a toolkit "
             "is found (`auto`), never, always, or from the toolkit at a path; "
             "tools/install.sh refuses other values", {AUTO: AUTO, OFF: OFF, "on": "on"},
             path="a toolkit's path"),
    _switch("JAXPP_MPI_UPDATE_GOLDEN", TESTS, False, "`1` rewrites the golden program "
            "dumps in `tests/golden/`"),
    Variable("JAXPP_MPI_FUZZ_EXAMPLES", TESTS, "`2`", "tests/local/test_fuzz_programs.py: "
             "generated programs checked against `jax.jit` per schedule (`make fuzz`: 300)",
             number=int, low=1, high=100_000, unset=2),
    Variable("JAXPP_MPI_FUZZ_SEED", TESTS, "unset", "tests/local/test_fuzz_programs.py: "
             "draw the programs from this seed instead of the fixed derandomized sequence",
             number=int, low=0, high=2**32 - 1),
    Variable("JAXPP_MPI_FAULT_STAMP", TESTS, "unset", "tests/jobs/harness/faults.py (and "
             "`bench/faults.py`): print the moment of each injected fault",
             {"1": True}, unset=False),
    Variable("JAXPP_MPI_CHECKPOINT_PAUSE_AT", RANKS, "unset", "tests only: a rank "
             "reaching this point of a checkpoint save prints `jaxpp_mpi checkpoint paused "
             "at POINT (rank R, pid P)` and sleeps until killed (`write`: mid-way through "
             "its leaf files; `rename`: rank 0, manifest written, before the rename; "
             "`delete`: rank 0, while removing an old step), so that a test kills it there "
             "(tests/jobs/test_checkpoint_crash.py)",
             {"write": "write", "rename": "rename", "delete": "delete"}),
)

_BY_NAME = {v.name: v for v in VARIABLES}


def variable(name: str) -> Variable:
    """The definition of variable `name` (KeyError for a name not in `VARIABLES`)."""
    return _BY_NAME[name]


def parse_all(env: Mapping[str, str], readers: Iterable[str] = PYTHON_READERS
              ) -> dict[str, Any]:
    """The values of the variables read by `readers`, each checked (`Variable.parse`).

    Args:
      env: the environment.
      readers: whose variables to parse (default: those jaxpp_mpi's Python reads).

    Returns:
      {name: value}.

    Raises:
      VariableError: for the first variable, in `VARIABLES`' order, that is malformed.
    """
    readers = tuple(readers)
    return {v.name: v.parse(env) for v in VARIABLES if v.read_by in readers}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table() -> str:
    """docs/reliability.md's table of every variable, one row each, from `VARIABLES`."""
    rows = ["| variable | read by | default | takes | what |", "|---|---|---|---|---|"]
    for v in VARIABLES:
        rows.append(f"| `{v.name}` | {v.read_by} | {_cell(v.default)} "
                    f"| {_cell(v.describe_values(code=True))} "
                    f"| {_cell(v.meaning)} |")
    return "\n".join(rows) + "\n"


def table_span(text: str) -> tuple[int, int]:
    """Where the variable table sits in docs/reliability.md's `text`: [start, end).

    Raises:
      ValueError: when the doc has no such table.
    """
    section = text.index("## Environment variables")
    start = text.index("| variable |", section)
    end = start
    while text.startswith("|", end):
        newline = text.find("\n", end)
        end = len(text) if newline < 0 else newline + 1
    return start, end


def update_table(text: str) -> str:
    """docs/reliability.md's `text` with its variable table generated anew."""
    start, end = table_span(text)
    return text[:start] + markdown_table() + text[end:]
