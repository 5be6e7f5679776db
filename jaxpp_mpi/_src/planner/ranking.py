"""Plans ranked: the fastest that fits first, one sentence on why, a table (no JAX)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

from jaxpp_mpi._src.schedules.library import BaseSchedule

__all__ = ["Plan", "format_bytes", "format_plans", "parse_bytes", "rank"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
SAME_MEMORY = 0.005
"""Peak memories within this fraction of each other are called the same."""


def parse_bytes(text: str | int | float) -> int:
    """A byte count from `80GiB`, `512 MiB`, `1.5GB`, `4e9` or a number.

    Raises:
      ValueError: not a size.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return int(text)
    m = _SIZE.fullmatch(str(text))
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (write e.g. 80GiB, 512MiB or 4e9)")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def format_bytes(n: float) -> str:
    """`n` bytes in binary units: '1.5 GiB', '740 KiB', '12 B'."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


@dataclasses.dataclass(frozen=True)
class Plan:
    """One schedule, microbatch count and stage split, as the planner predicts it runs.

    Attributes:
      schedule: the schedule.
      num_microbatches: microbatches per step.
      stage_marks: which of the step's `mark_stage_end` calls (in forward order) end a
        stage; the others are dropped (`Note: restaging`).
      step_ms: the predicted step time.
      bubble: the groups' mean idle share of the step.
      peak_bytes: per group, the predicted peak device bytes (per device).
      fits: whether every group's peak is within the memory limit (None: no limit).
      reason: for the first plan, why it ranks first; for the others, how they compare
        with it.
      busy_ms: per group, its Runs' predicted time (what the runtime adds per
        instruction included: `Note: runtime costs`).
      stage_ms: per stage, the predicted work of one microbatch's forward and backward
        (the stage costs the split was chosen from).
    """

    schedule: BaseSchedule
    num_microbatches: int
    stage_marks: tuple[int, ...]
    step_ms: float
    bubble: float
    peak_bytes: tuple[int, ...]
    fits: bool | None = None
    reason: str = ""
    busy_ms: tuple[float, ...] = ()
    stage_ms: tuple[float, ...] = ()

    @property
    def label(self) -> str:
        """e.g. 'ZeroBubble(2 stages), 8 microbatches'."""
        return f"{type(self.schedule).__name__}({self.schedule.num_stages} stages), " \
               f"{self.num_microbatches} microbatches"

    @property
    def peak(self) -> int:
        """The largest group's peak bytes."""
        return max(self.peak_bytes, default=0)

    def apply(self, step: Callable) -> Callable:
        """`step` running this plan's schedule and stage split, for `mpmd_jit_with_loop`;
        feed it `batch(...)` of the batch (`Note: restaging`)."""
        from jaxpp_mpi._src.planner.restage import restage

        return restage(step, self.schedule, self.stage_marks)

    def batch(self, batch: Any) -> Any:
        """`batch` (leaves (microbatches, rows, ...)) as this plan's microbatches."""
        from jaxpp_mpi._src.planner.restage import microbatched

        return microbatched(batch, self.num_microbatches)


def _key(p: Plan) -> tuple:
    return (p.fits is False, p.step_ms, p.peak, type(p.schedule).__name__,
            p.schedule.num_stages, p.num_microbatches)


def _percent(a: float, b: float) -> str:
    """|a - b| / b as a percentage: '12%', '5.6%', '0.43%'."""
    x = abs(a - b) / b * 100 if b > 0 else 0.0
    return f"{x:.0f}%" if x >= 10 else f"{x:.2g}%"


def _memory_words(a: Plan, b: Plan) -> str:
    if b.peak and abs(a.peak - b.peak) <= SAME_MEMORY * b.peak:
        return f"at the same peak memory ({format_bytes(a.peak)})"
    more = "more" if a.peak > b.peak else "less"
    return (f"with {_percent(a.peak, b.peak)} {more} peak memory ({format_bytes(a.peak)} "
            f"against {format_bytes(b.peak)})")


def _why_first(first: Plan, others: Sequence[Plan], limit: int | None) -> str:
    fitting = [p for p in others if p.fits is not False]
    if first.fits is False:
        return (f"no plan fits {format_bytes(limit or 0)}: {first.label} is the fastest "
                f"and needs {format_bytes(first.peak)}")
    rival = next((p for p in fitting if type(p.schedule) is not type(first.schedule)
                  or p.schedule.num_stages != first.schedule.num_stages), None)
    if rival is None:
        if not fitting:
            return f"{first.label}: the only plan that fits {format_bytes(limit or 0)}"
        rival = fitting[0]
    speed = ("as fast as" if rival.step_ms <= first.step_ms
             else f"{_percent(first.step_ms, rival.step_ms)} faster than")
    text = (f"{first.label}: predicted {speed} the best other schedule, {rival.label} "
            f"(bubble {first.bubble:.0%} against {rival.bubble:.0%}), "
            f"{_memory_words(first, rival)}")
    faster_unfit = sum(p.fits is False and p.step_ms < first.step_ms for p in others)
    if faster_unfit:
        text += f"; {faster_unfit} faster plans do not fit {format_bytes(limit or 0)}"
    return text


def _versus_first(p: Plan, first: Plan, limit: int | None) -> str:
    if p.fits is False:
        g = max(range(len(p.peak_bytes)), key=p.peak_bytes.__getitem__)
        return f"does not fit: group {g} needs {format_bytes(p.peak)} > {format_bytes(limit or 0)}"
    slower = "slower" if p.step_ms > first.step_ms else "faster"
    return f"{_percent(p.step_ms, first.step_ms)} {slower} than the first"


def rank(plans: Sequence[Plan], memory_limit: int | None = None) -> list[Plan]:
    """`plans` with their fit against `memory_limit` (bytes, None: no limit), fitting ones
    first, then by predicted step time and peak memory; each with its `reason`."""
    fitted = [dataclasses.replace(p, fits=None if memory_limit is None
                                  else p.peak <= memory_limit) for p in plans]
    ordered = sorted(fitted, key=_key)
    if not ordered:
        return []
    first = ordered[0]
    out = [dataclasses.replace(first, reason=_why_first(first, ordered[1:], memory_limit))]
    out += [dataclasses.replace(p, reason=_versus_first(p, first, memory_limit))
            for p in ordered[1:]]
    return out


def format_plans(plans: Sequence[Plan], limit: int | None = None) -> str:
    """The ranked plans as a text table, with the first plan's reason under it."""
    head = ("#", "schedule", "stages", "microbatches", "step ms", "bubble",
            "peak memory per group", "fits", "stage marks")
    rows = [head]
    for k, p in enumerate(plans, 1):
        fits = "-" if p.fits is None else ("yes" if p.fits else "NO")
        rows.append((str(k), type(p.schedule).__name__, str(p.schedule.num_stages),
                     str(p.num_microbatches), f"{p.step_ms:.4g}", f"{p.bubble:.1%}",
                     ", ".join(format_bytes(b) for b in p.peak_bytes), fits,
                     ",".join(str(m) for m in p.stage_marks)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    if limit is not None:
        lines.append(f"memory limit {format_bytes(limit)} per device")
    if plans:
        lines.append(f"why first: {plans[0].reason}")
    return "\n".join(lines)
