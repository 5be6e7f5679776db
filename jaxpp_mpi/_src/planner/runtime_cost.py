"""What the runtime adds to a step for each instruction of its program: `RuntimeCost`, its
fit to measured steps, and its charge on a program's Runs (no JAX).

Note: runtime costs.
  A step takes its tasks' work and its messages' transfers, and besides them something
  for every instruction its program holds: a Run's dispatch and the part of its run
  that does not grow with its work (`run_ms`: handing over its buffers, allocating its
  outputs, waiting for them), a message half's on its group's thread (`message_ms`:
  posting a send, waiting on and placing a received value, on top of the link's
  `MessageCost`) and a Free's (`free_ms`). Schedules differ in these counts: per
  microbatch DualPipeV and Interleaved1F1B run twice the Runs of ZeroBubble, and more
  messages and frees (`ir/counts.py`), so a cost per instruction changes the ranking
  where FLOPs alone call them even.

  The planner charges them on the group's own clock (`run_charges`): each Run takes
  `run_ms` more, and each other instruction's cost is added to the Run before it in its
  group (to the group's first Run where none is before it), as the group's one
  dispatching thread spends it there. A SendRecv is two message halves; an AllReduce
  costs one message half.

  On the 2-core CPU VM the cost of a Run is not its dispatch (7 us a Run with no work:
  bench/results/dispatch.json) nor in its executable (run alone, a stage split in two
  runs no slower than whole: bench/results/stages.json), but in the step of two ranks:
  there each Run more costs about 1 ms with tasks of 10 to 60 ms (bench/results/
  schedules.json), 0.3 to 0.7 ms with tasks of 1 to 7 ms (bench/planner.py), 0.03 to
  0.09 ms with sub-millisecond ones: a schedule of two stages per group measures slower
  than FLOPs and bubbles say, by an amount that grows with the model. Fit it.

  The costs are plain data given to `plan_schedules`: `RuntimeCost()` holds the figures
  fitted on that VM (`DEFAULT_RUNTIME_COST`); `fit_runtime_cost` fits them to measured
  steps of the same work under programs with different counts (least squares of the
  steps' times over their counts, the shared work as the intercept),
  `RuntimeCost.fit_to_traced_steps` fits `run_ms` to traced steps, and
  `RuntimeCost.from_dispatch` reads bench/dispatch.py's figures (the lower bound).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpp_mpi._src.ir.program import AllReduce, Free, Program, Recv, Run, Send, SendRecv

__all__ = ["COUNTED", "DEFAULT_RUNTIME_COST", "RuntimeCost", "RuntimeSample",
           "fit_runtime_cost", "runtime_counts", "run_charges"]

COUNTED = ("run", "message", "free")
"""The instruction classes a `RuntimeCost` prices, as `runtime_counts` names them."""


@dataclasses.dataclass(frozen=True)
class RuntimeCost:
    """What the runtime adds per instruction, in ms (`Note: runtime costs`).

    The default `run_ms` is `fit_runtime_cost` of the traced steps of bench/schedules.py
    (residual MLP blocks, width 1024, 8 microbatches, each of the 7 schedules on 2 ranks
    of the 2-core CPU VM: bench/results/schedules.json, each step's `compute` + `other`
    of its `breakdown`, both ranks, over its Runs, message halves and Frees): 1.05 ms a
    Run (0.92 of it inside the Runs' own times, 0.13 in dispatch between them), the
    message halves and Frees fitted at 0. A message half's default is its dispatch in
    bench/results/dispatch.json (`from_dispatch`: 11 us); a Free's is 0, as fitted.
    The cost of a Run grows with the model (`Note: runtime costs`): on other machines
    and for models far from that one, fit it (`fit_to_traced_steps`, `fit_runtime_cost`).

    Attributes:
      run_ms: one Run, beyond its work.
      message_ms: one message half (a Send, a Recv, either half of a SendRecv), beyond
        its transfer.
      free_ms: one Free.
    """

    run_ms: float = 1.05
    message_ms: float = 0.011
    free_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in ("run_ms", "message_ms", "free_ms"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"RuntimeCost.{name} must be a finite number of ms >= 0, "
                                 f"got {value!r}")

    def of(self, counts: Mapping[str, float]) -> float:
        """The cost of `counts` instructions ({'run': n, 'message': n, 'free': n})."""
        return sum(counts.get(k, 0) * getattr(self, f"{k}_ms") for k in COUNTED)

    @classmethod
    def fit_to_traced_steps(cls, task_times: Sequence[Mapping[str, float]],
                            fixed: RuntimeCost | None = None) -> RuntimeCost:
        """`run_ms` fitted to traced steps of the same work under programs with different
        Run counts (one stage per group and two, say): each step's task times
        (`collect_task_times_ms`, one time per label, every rank's merged) are as many
        Runs as labels (`RuntimeSample.from_task_times`); the other costs are `fixed`'s
        (default: `RuntimeCost()`'s).

        Raises:
          ValueError: fewer than two steps, or steps with the same number of Runs.
        """
        samples = [RuntimeSample.from_task_times(t) for t in task_times]
        return fit_runtime_cost(samples, fit=("run",),
                                fixed=cls() if fixed is None else fixed)[0]

    @classmethod
    def from_dispatch(cls, result: Mapping[str, Any], where: str = "mpi",
                      paths: Sequence[str] = ("posted", "chained")) -> RuntimeCost:
        """The host costs bench/dispatch.py measured with no work (its JSON, `result`): a
        Run's and a message half's mean `runtime_us` over its rows of section `where`
        (message rows of the message `paths` only: 'posted', 'chained', 'staged'); the
        Free's is the default's. A lower bound: a Run of real work costs more.

        Raises:
          ValueError: the section has no Run row or no Send/Recv row of `paths`.
        """
        rows = (result.get(where) or {}).get("rows") or []
        runs = [r["runtime_us"] for r in rows if r.get("instr") == "Run"]
        messages = []
        for r in rows:
            instr, _, path = str(r.get("instr", "")).partition(" (")
            if instr in ("Send", "Recv") and path.rstrip(")") in paths:
                messages.append(r["runtime_us"])
        if not runs or not messages:
            raise ValueError(f"no Run rows and Send/Recv rows of paths {list(paths)} in the "
                             f"{where!r} section of the dispatch result: pass "
                             "bench/results/dispatch.json as loaded")
        return cls(run_ms=sum(runs) / len(runs) * 1e-3,
                   message_ms=sum(messages) / len(messages) * 1e-3)


DEFAULT_RUNTIME_COST = RuntimeCost()


def _kind(instr: Any) -> tuple[str, int] | None:
    """(class, how many) of one instruction, as `RuntimeCost` prices it."""
    if isinstance(instr, Run):
        return "run", 1
    if isinstance(instr, SendRecv):
        return "message", 2
    if isinstance(instr, (Send, Recv, AllReduce)):
        return "message", 1
    if isinstance(instr, Free):
        return "free", 1
    return None


def runtime_counts(program: Program) -> list[dict[str, int]]:
    """Per group, its instructions as `RuntimeCost` prices them: {'run', 'message',
    'free'} (a SendRecv two message halves)."""
    out = []
    for g in program.groups:
        counts = dict.fromkeys(COUNTED, 0)
        for instr in g.instrs:
            kind = _kind(instr)
            if kind is not None:
                counts[kind[0]] += kind[1]
        out.append(counts)
    return out


def run_charges(program: Program, cost: RuntimeCost) -> dict[int, float]:
    """Per Run (by `id`), the runtime cost charged to it (`Note: runtime costs`): its
    own `run_ms` and the cost of the other instructions after it up to the next Run
    (before the group's first Run: to that Run). A group without Runs is charged
    nothing."""
    charges: dict[int, float] = {}
    for g in program.groups:
        last, pending = None, 0.0
        for instr in g.instrs:
            kind = _kind(instr)
            if kind is None:
                continue
            ms = kind[1] * getattr(cost, f"{kind[0]}_ms")
            if isinstance(instr, Run):
                charges[id(instr)] = ms + pending
                last, pending = instr, 0.0
            elif last is None:
                pending += ms
            else:
                charges[id(last)] += ms
    return charges


@dataclasses.dataclass(frozen=True)
class RuntimeSample:
    """One measured step for `fit_runtime_cost`.

    Attributes:
      counts: its instructions: {'run': n, 'message': n, 'free': n}, summed over the
        groups whose time `ms` is (`runtime_counts`).
      ms: its time: the same work in every sample, plus what the runtime adds.
    """

    counts: Mapping[str, float]
    ms: float

    @classmethod
    def from_task_times(cls, task_ms: Mapping[str, float]) -> RuntimeSample:
        """One traced step's Runs (`collect_task_times_ms`, every rank's merged, one
        time per label): as many Runs as labels, their times summed. Traced steps of
        one step's work under programs with different Run counts (one stage per group
        and two, say) fit `run_ms` (`fit_runtime_cost(..., fit=('run',))`).

        Raises:
          ValueError: no times.
        """
        if not task_ms:
            raise ValueError("no task times: pass the times of one traced step "
                             "(collect_task_times_ms, every rank's merged)")
        return cls({"run": len(task_ms)}, float(sum(task_ms.values())))


def fit_runtime_cost(samples: Sequence[RuntimeSample],
                     fit: Sequence[str] = COUNTED,
                     fixed: RuntimeCost = DEFAULT_RUNTIME_COST) -> tuple[RuntimeCost, float]:
    """The per-instruction costs that explain measured steps of the same work.

    Least squares of `ms = work + sum_k counts[k] * cost_k` over the samples, `work` (the
    work every sample shares) free, each cost of `fit` >= 0 (the best fit over the
    subsets of costs left free, the others at 0); the costs not in `fit` are `fixed`'s,
    taken off the times first.

    Args:
      samples: steps of the same work (the same model, batch and microbatches) under
        programs with different instruction counts, e.g. every schedule of
        bench/schedules.py, each the sum of its groups' task and dispatch time.
      fit: which of 'run', 'message', 'free' to fit.
      fixed: where the others come from.

    Returns:
      (the costs, the fitted shared work in ms).

    Raises:
      ValueError: an unknown class in `fit`, or fewer samples than unknowns, or counts
        that do not vary (nothing to fit from).
    """
    import numpy as np  # here: the module is imported by the command line, without numpy

    fit = tuple(fit)
    bad = [k for k in fit if k not in COUNTED]
    if bad or not fit:
        raise ValueError(f"fit names {bad or 'nothing'}: choose among {', '.join(COUNTED)}")
    if len(samples) < len(fit) + 1:
        raise ValueError(f"fitting {len(fit)} costs and the shared work needs at least "
                         f"{len(fit) + 1} samples, got {len(samples)}")
    kept = {k: getattr(fixed, f"{k}_ms") for k in COUNTED if k not in fit}
    x = np.array([[float(s.counts.get(k, 0)) for k in fit] for s in samples])
    y = np.array([float(s.ms) - sum(float(s.counts.get(k, 0)) * c for k, c in kept.items())
                  for s in samples])
    if np.allclose(x, x[0]):
        raise ValueError("every sample has the same instruction counts: time programs "
                         "with different counts (other schedules or stage counts)")
    best = None
    for free in itertools.chain.from_iterable(
            itertools.combinations(range(len(fit)), r) for r in range(len(fit) + 1)):
        a = np.column_stack([np.ones(len(samples)), x[:, list(free)]])
        coef, *_ = np.linalg.lstsq(a, y, rcond=None)
        if np.any(coef[1:] < 0):
            continue
        residual = float(np.sum((a @ coef - y) ** 2))
        if best is None or residual < best[0] - 1e-12:
            best = (residual, free, coef)
    _, free, coef = best
    costs = dict(kept)
    for i, k in enumerate(fit):
        costs[k] = float(coef[1 + free.index(i)]) if i in free else 0.0
    return RuntimeCost(**{f"{k}_ms": v for k, v in costs.items()}), float(coef[0])
