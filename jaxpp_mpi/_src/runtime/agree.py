"""Raising on every rank: the collective decisions that keep MPI ranks in step.

Note: raise on every rank.
  In MPI mode an error that only some ranks see would leave the others waiting for
  messages that never come. So every decision that may fail is taken collectively: each
  rank reports its own outcome (an error's one-line description, a digest, a hash) with
  one object allgather (or rank 0 decides and broadcasts), and every rank raises when
  any rank failed or the ranks disagree. On an MPI communicator the allgather is the
  watched one (`Note: watched allgather` in mpi/gather.py): the same list, from
  point-to-point messages, so that past its deadline each waiting rank names the peers
  it waits for and their hosts. `comm=None` means this process alone (local
  mode, a single-process job): nothing is communicated and a rank's own error is
  raised as it is.

  Whose error a failing rank raises is the caller's choice (`own`):
  - "always": a rank raises its own error; the others raise the caller's error naming
    the failed ranks (checkpoints);
  - "if_all": a rank raises its own error only when every rank failed, else every rank
    raises the caller's error, chained from its own (compilation);
  - "never": every rank raises the caller's error, the same text everywhere (reshard).

Every collective here waits under a deadline named by its `label` (`Note: deadlines` in
runtime/failure.py): a rank that never arrives ends the job, each waiting rank naming the
label. `run` measures its own work (tracing, compiling) and records it under its label,
so that collective's deadline grows with it.

Note: idle waits.
  After long local work (tracing, compiling) ranks reach the next collective seconds
  apart, and a rank waiting in a blocking MPI collective polls, using a whole core.
  Where ranks share cores (more ranks than cores, as in CI), that core is taken from a
  peer that is still compiling. So `run` and the compile barrier first wait in
  `wait_idle`: a non-blocking barrier tested every `IDLE_POLL_S`, sleeping between
  tests, which costs a rank at most that much latency once every rank has arrived.
  Collectives on a step's path (the step call agreement) do not: there the ranks arrive
  together, and the watched allgather sleeps between its own tests once it has waited
  200 us (from 50 us up to 1 ms), so a rank waiting in it takes no core either.

Only mpi4py's object collectives of a communicator handed in, and the MPI layer's
watched allgather, are used here; nothing here imports MPI. Modules outside `mpi/` that
need the MPI layer itself reach it through `collectives()`, imported on first use:
mpi4py initialises MPI on import, and local mode must not need it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from jaxpp_mpi._src.base.types import Comm
from jaxpp_mpi._src.runtime.failure import deadline, is_mpi, record_work

if TYPE_CHECKING:
    from jaxpp_mpi._src.ir.program import Program

__all__ = [
    "Failure",
    "Own",
    "agree_on_program",
    "allgather",
    "allgather_or_raise",
    "bcast",
    "check_same",
    "collectives",
    "describe",
    "differing_ranks",
    "raise_gathered",
    "raise_if_any",
    "run",
    "wait_idle",
]

T = TypeVar("T")

LABEL = "a collective decision of the ranks"
"""The deadline label of a collective whose caller names none."""

Own = Literal["always", "if_all", "never"]
"""Whose error a failing rank raises (see Note: raise on every rank)."""

Failure = Callable[[list[int], Sequence[str | None]], Exception]
"""(failed ranks, every rank's message) -> the error the ranks raise."""


def collectives() -> ModuleType:
    """The MPI layer's collectives module, imported on first use (it imports mpi4py).

    Returns:
      `jaxpp_mpi._src.mpi.collectives`.
    """
    from jaxpp_mpi._src.mpi import collectives as module

    return module


def _gather() -> ModuleType:
    """The MPI layer's watched allgather (`jaxpp_mpi._src.mpi.gather`), imported on
    first use (it imports mpi4py)."""
    from jaxpp_mpi._src.mpi import gather as module

    return module


def describe(error: BaseException | None) -> str | None:
    """One line naming `error`'s type and text, as ranks exchange it; None for None."""
    return None if error is None else f"{type(error).__name__}: {error}"


def allgather(obj: Any, comm: Comm, label: str = LABEL, *, seconds: float | None = None,
              how: str | None = None) -> list[Any]:
    """Every rank's `obj`, element `r` from rank `r` (`[obj]` when `comm` is None).

    On an MPI communicator, the watched allgather (`Note: watched allgather` in
    mpi/gather.py): past the deadline this rank names the peers it still waits for. A
    stand-in communicator's own `allgather` otherwise.

    Args:
      obj: a small picklable value (metadata, never array data).
      comm: the communicator, or None for this process alone.
      label: where the ranks wait, for the deadline's report.
      seconds: the deadline (None: the label's, `Note: deadlines`).
      how: where `seconds` comes from, for the deadline's report.

    Returns:
      The list of every rank's `obj`, in rank order.
    """
    if comm is None:
        return [obj]
    if not is_mpi(comm):
        with deadline(label, comm, seconds=seconds, how=how):
            return comm.allgather(obj)
    gather = _gather()
    progress = gather.Progress()
    with deadline(label, comm, seconds=seconds, how=how,
                  waiting_on=lambda: progress.waiting):
        return gather.allgather(obj, comm, progress)


def bcast(obj: Any, comm: Comm, root: int = 0, label: str = LABEL) -> Any:
    """`obj` of rank `root`, on every rank (`obj` itself when `comm` is None); waits
    under the deadline `label`."""
    if comm is None:
        return obj
    with deadline(label, comm):
        return comm.bcast(obj, root=root)


def differing_ranks(values: Sequence[Any]) -> list[int]:
    """The ranks whose value differs from rank 0's."""
    return [r for r, v in enumerate(values) if v != values[0]]


def raise_gathered(messages: Sequence[str | None], error: BaseException | None,
                   failure: Failure, *, own: Own = "always") -> None:
    """Raises on every rank if any rank's message is set (Note: raise on every rank).

    Args:
      messages: every rank's message (None where the rank did not fail), already
        gathered or broadcast.
      error: this rank's own error (None if it had none).
      failure: builds the error to raise from (failed ranks, `messages`).
      own: whose error a failing rank raises.

    Raises:
      `error` or `failure(...)` (chained from `error`), when any message is set.
    """
    failed = [r for r, m in enumerate(messages) if m is not None]
    if not failed and error is None:
        return
    if error is not None and (own == "always"
                              or (own == "if_all" and len(failed) == len(messages))):
        raise error
    raise failure(failed, messages) from error


def allgather_or_raise(value: Any, error: BaseException | None, comm: Comm,
                       failure: Failure, *, own: Own = "always",
                       message: Callable[[BaseException | None], str | None] = describe,
                       label: str = LABEL, seconds: float | None = None,
                       how: str | None = None) -> list[Any]:
    """Allgathers (this rank's error, `value`); raises on every rank if any rank failed.

    One allgather carries both a rank's outcome and what the ranks compare next (a
    digest, a byte count), so a failure costs no extra round.

    Args:
      value: a small picklable value to gather (ignored where some rank failed).
      error: this rank's error, or None.
      comm: the communicator, or None for this process alone (then `error` is raised
        as it is, if set).
      failure: as for `raise_gathered`.
      own: as for `raise_gathered`.
      message: what a rank tells the others of its error (`describe` by default).
      label: where the ranks wait, for the deadline's report.
      seconds, how: the deadline and its origin, as for `allgather`.

    Returns:
      Every rank's `value`, in rank order, when no rank failed.

    Raises:
      `error` or `failure(...)`, on every rank, when any rank has an error.
    """
    if comm is None:
        if error is not None:
            raise error
        return [value]
    reports = allgather((message(error), value), comm, label, seconds=seconds, how=how)
    raise_gathered([m for m, _ in reports], error, failure, own=own)
    return [v for _, v in reports]


def raise_if_any(error: BaseException | None, comm: Comm, failure: Failure, *,
                 own: Own = "always",
                 message: Callable[[BaseException | None], str | None] = describe,
                 label: str = LABEL) -> None:
    """Raises on every rank if any rank has an error (`allgather_or_raise` of nothing).

    Raises:
      `error` or `failure(...)`, on every rank, when any rank has an error.
    """
    allgather_or_raise(None, error, comm, failure, own=own, message=message, label=label)


IDLE_POLL_S = 0.002
"""How often `wait_idle` tests whether every rank has arrived (`Note: idle waits`)."""


def wait_idle(comm: Comm, label: str = LABEL) -> None:
    """Returns once every rank of `comm` has called it, sleeping while it waits (see
    `Note: idle waits`); under the deadline `label`. Nothing for `comm=None` or a
    stand-in communicator without `Ibarrier`.
    """
    ibarrier = getattr(comm, "Ibarrier", None)
    if ibarrier is None:
        return
    with deadline(label, comm):
        request = ibarrier()
        while not request.Test():
            time.sleep(IDLE_POLL_S)


def run(fn: Callable[[], T], comm: Comm, failure: Failure, *, own: Own = "always",
        label: str = LABEL) -> T:
    """`fn()` on every rank; if it raises on any rank, every rank raises.

    Args:
      fn: the work; any `Exception` it raises is caught and reported to every rank.
      comm: the communicator, or None for this process alone (then `fn` simply runs).
      failure: as for `raise_gathered`.
      own: as for `raise_gathered`.
      label: where the ranks wait once `fn` is done (e.g. "compile barrier"); `fn`'s
        time is recorded under it, so this collective's deadline is at least
        `work_factor` x the slowest `fn` seen (`Note: deadlines`).

    Returns:
      `fn()`'s result, when no rank failed.
    """
    if comm is None:
        return fn()
    start = time.monotonic()
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 - raised on every rank just below
        result, error = None, e
    record_work(label, time.monotonic() - start)
    wait_idle(comm, label)
    raise_if_any(error, comm, failure, own=own, label=label)
    return result


def check_same(text: str, comm: Comm, failure: Callable[[list[int]], Exception],
               label: str = LABEL) -> None:
    """Raises `failure(ranks differing from rank 0)` on every rank unless `text` is the
    same on every rank (one allgather of its sha256 digest, under the deadline
    `label`)."""
    digest = hashlib.sha256(text.encode()).hexdigest()
    differ = differing_ranks(allgather(digest, comm, label))
    if differ:
        raise failure(differ)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _first_difference(a: str, b: str) -> tuple[int, str, str]:
    """(1-based line number, line of `a`, line of `b`) of the first differing line."""
    la, lb = a.splitlines(), b.splitlines()
    k = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
    return (k + 1, la[k].strip() if k < len(la) else "<end>",
            lb[k].strip() if k < len(lb) else "<end>")


def agree_on_program(program: Program, comm: Comm,
                     computations: Callable[[], Mapping[str, str]] | None = None) -> None:
    """Allgathers the program hash (in MPI mode, the barrier before the first message).

    Args:
      program: this rank's whole program.
      comm: the communicator, or None for this process alone (nothing to agree on).
      computations: returns named, deterministic texts of what the ranks compute (the
        traced step's jaxpr: `compiler/fingerprint.py`); their digest joins the program
        hash, so ranks running different arithmetic with the same shapes are refused
        too. Called only in MPI mode.

    Raises:
      ValueError: on every rank, when the ranks built different programs or traced
        different computations, naming the ranks that differ from rank 0 and the first
        differing line (of the program, or of the first differing text) of each.
    """
    if comm is None:
        return
    label = "program agreement"
    texts = dict(computations()) if computations is not None else {}
    digests = {name: _digest(text) for name, text in texts.items()}
    mine = (program.hash(), _digest(repr(sorted(digests.items()))))
    hashes = allgather(mine, comm, label)
    differ = differing_ranks([h for h, _ in hashes])
    if differ:
        programs = allgather(str(program), comm, label)
        details = []
        for r in differ:
            k, a, b = _first_difference(programs[0], programs[r])
            details.append(f"  rank {r} (hash {hashes[r][0][:12]}) differs from rank 0 (hash "
                           f"{hashes[0][0][:12]}) at program line {k}:\n"
                           f"    rank 0:  {a}\n    rank {r}:  {b}")
        raise ValueError(
            "the ranks compiled different programs for this step, so their messages would "
            "not match; every rank must call the step with the same shapes, dtypes, "
            "shardings and schedule:\n" + "\n".join(details)
        )
    differ = differing_ranks([e for _, e in hashes])
    if not differ:
        return
    every = allgather(digests, comm, label)
    details = []
    for r in differ:
        name = next((n for n in every[0] if every[r].get(n) != every[0][n]),
                    next(iter(set(every[r]) - set(every[0])), "?"))
        details.append((r, name))
    wanted = sorted({name for _, name in details})
    shown = allgather({n: texts.get(n, "<none>") for n in wanted}, comm, label)
    lines = []
    for r, name in details:
        k, a, b = _first_difference(shown[0][name], shown[r][name])
        lines.append(f"  rank {r} differs from rank 0 first in {name}, at jaxpr line {k}:\n"
                     f"    rank 0:  {a}\n    rank {r}:  {b}")
    raise ValueError(
        "the ranks traced different code for this step (same program, different "
        "computations), so they would not train the same model; every rank must run the "
        "same step function:\n" + "\n".join(lines)
    )
