"""Task times and scratch bytes per stage segment, and a lowered program's Run times.

Note: planner task costs.
  The planner prices every task of every candidate program from one table, per stage
  segment (the code between two consecutive stage marks of the step; segment j ends at
  mark j) and task kind (F, B, I, W): the *work* of one microbatch in ms at the traced
  microbatch size, and XLA's scratch bytes of the task compiled alone. A stage of a
  candidate is a run of segments, so its task's work is the sum over its segments, and
  its scratch the largest of theirs. A Run takes `overhead_ms` (what the runtime adds
  to a Run, `RuntimeCost.run_ms`; the planner charges it, and what other instructions
  cost, on the group's clock: `Note: runtime costs` in runtime_cost.py) plus the work
  of its label's parts, scaled by the candidate's rows per
  microbatch over the traced ones (the work of a row is taken to be the same at any
  microbatch size). A W part whose I task the program lacks does both (the first stage:
  `label_times` in compiler/task_models.py).

  The work comes from XLA's cost analysis (FLOPs times `ms_per_flop`, the time a FLOP
  of the step's costliest segment takes: families.measured_ms_per_flop), or from measured
  task times (`collect_task_times_ms` of one traced step of the step as written, whose
  stages are the segments): a measured label's time less the overhead is the work of
  its parts, shared out by their FLOPs when fused ('F3s1+B3s1'); a kind not measured
  follows from one that is (B = I + W; I and W share a measured B by their FLOPs),
  else from FLOPs at the measured time per FLOP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jaxpp_mpi._src.planner.runtime_cost import DEFAULT_RUNTIME_COST
from jaxpp_mpi._src.schedules.tasks import parse_label

__all__ = ["KINDS", "SegmentCosts", "from_flops", "from_measured", "run_ms", "run_temp_bytes"]

KINDS = "FBIW"
DEFAULT_OVERHEAD_MS = DEFAULT_RUNTIME_COST.run_ms
"""What the runtime adds to a Run beyond its work, in ms (`RuntimeCost.run_ms`)."""


@dataclasses.dataclass(frozen=True)
class SegmentCosts:
    """Per task kind, per stage segment: one microbatch's work and scratch bytes
    (`Note: planner task costs`).

    Attributes:
      work_ms: kind letter -> per segment, the work in ms at `rows` rows per microbatch.
      temp_bytes: kind letter -> per segment, XLA's scratch bytes of the task alone.
      rows: the rows per microbatch these are for.
      overhead_ms: what the runtime adds to a Run (`RuntimeCost.run_ms`).
    """

    work_ms: Mapping[str, tuple[float, ...]]
    temp_bytes: Mapping[str, tuple[int, ...]]
    rows: int
    overhead_ms: float = DEFAULT_OVERHEAD_MS

    @property
    def num_segments(self) -> int:
        return len(self.work_ms["F"])

    def stage_work(self, kind: str, segments: Sequence[int]) -> float:
        """The work of one `kind` task of a stage made of `segments` (ms)."""
        return sum(self.work_ms[kind][j] for j in segments)

    def stage_temp(self, kind: str, segments: Sequence[int]) -> int:
        """The scratch bytes of one `kind` task of a stage made of `segments`."""
        return max((self.temp_bytes[kind][j] for j in segments), default=0)


def from_flops(flops: Mapping[str, Sequence[float]], temp_bytes: Mapping[str, Sequence[int]],
               rows: int, ms_per_flop: float,
               overhead_ms: float = DEFAULT_OVERHEAD_MS) -> SegmentCosts:
    """The table from XLA's FLOPs per (kind, segment) at `ms_per_flop`."""
    work = {k: tuple(float(f) * ms_per_flop for f in flops[k]) for k in KINDS}
    return SegmentCosts(work, {k: tuple(temp_bytes[k]) for k in KINDS}, rows, overhead_ms)


def _pieces(parts: Sequence[tuple[str, int]], stages: Sequence[Sequence[int]],
            measured: set[tuple[str, int]], flops: Mapping[str, Sequence[float]]
            ) -> list[tuple[str, int, float]]:
    """The (kind, segment, FLOPs) a measured label's work is shared among: each part's
    stage's segments, a W part whose stage has no measured I doing that I too."""
    out = []
    for kind, stage in parts:
        for j in stages[stage]:
            out.append((kind, j, float(flops[kind][j])))
            if kind == "W" and ("I", stage) not in measured:
                out.append(("I", j, float(flops["I"][j])))
    return out


def from_measured(task_ms: Mapping[str, float], flops: Mapping[str, Sequence[float]],
                  temp_bytes: Mapping[str, Sequence[int]], rows: int,
                  overhead_ms: float = DEFAULT_OVERHEAD_MS,
                  stages: Sequence[Sequence[int]] | None = None
                  ) -> tuple[SegmentCosts, float]:
    """The table from measured task times (`Note: planner task costs`).

    Args:
      task_ms: task label -> measured ms; segment labels ('post0g1') are ignored here.
      flops: kind -> per segment, XLA's FLOPs of the task alone.
      temp_bytes: kind -> per segment, its scratch bytes.
      rows: rows per microbatch of the measured step.
      overhead_ms: what the runtime adds to a Run, taken off each measured time.
      stages: per stage of the measured step, its segments (default: one each).

    Returns:
      The table, and the measured ms per FLOP (the measured work over its FLOPs).

    Raises:
      ValueError: no label of `task_ms` is a task of a stage.
    """
    segments = len(flops["F"])
    stages = [(j,) for j in range(segments)] if stages is None else stages
    labelled = {}
    for label, t in task_ms.items():
        parts = [(p.kind, p.stage) for p in parse_label(label)]
        if all(k in KINDS and s is not None and s < len(stages) for k, s in parts):
            labelled[label] = (parts, float(t))
    if not labelled:
        raise ValueError("task_times_ms names no task of the step's stages (labels such as "
                         f"'F0s0'; got {', '.join(sorted(task_ms)[:4])}): pass the times of "
                         "one traced step of this step as written (collect_task_times_ms)")
    measured = {part for parts, _ in labelled.values() for part in parts}
    samples: dict[tuple[str, int], list[float]] = {}
    for parts, t in labelled.values():
        pieces = _pieces(parts, stages, measured, flops)
        whole = sum(f for _, _, f in pieces)
        work = max(0.0, t - overhead_ms)
        for kind, j, f in pieces:
            share = work * f / whole if whole > 0 else work / len(pieces)
            samples.setdefault((kind, j), []).append(share)
    known = {part: sum(ts) / len(ts) for part, ts in samples.items()}
    measured_flops = sum(float(flops[k][j]) for k, j in known)
    ms_per_flop = sum(known.values()) / measured_flops if measured_flops > 0 else 0.0
    work: dict[str, list[float]] = {k: [0.0] * segments for k in KINDS}
    for j in range(segments):
        got = {k: known.get((k, j)) for k in KINDS}
        if got["B"] is None and got["W"] is not None:
            got["B"] = got["W"] + (got["I"] or 0.0)
        if got["B"] is not None and (got["I"] is None or got["W"] is None):
            i_flops, w_flops = float(flops["I"][j]), float(flops["W"][j])
            both = i_flops + w_flops
            i_share = i_flops / both if both > 0 else 0.5
            got["I"] = got["B"] * i_share if got["I"] is None else got["I"]
            got["W"] = got["B"] - got["I"] if got["W"] is None else got["W"]
        for k in KINDS:
            work[k][j] = got[k] if got[k] is not None else float(flops[k][j]) * ms_per_flop
    table = SegmentCosts({k: tuple(v) for k, v in work.items()},
                         {k: tuple(temp_bytes[k]) for k in KINDS}, rows, overhead_ms)
    return table, ms_per_flop


def _parts(label: str) -> list[tuple[str, int]]:
    return [(p.kind, p.stage) for p in parse_label(label)
            if p.kind in KINDS and p.stage is not None]


def run_ms(labels: set[str], costs: SegmentCosts, stages: Sequence[Sequence[int]],
           rows: int, segment_ms: Mapping[str, float]) -> dict[str, float]:
    """Per Run label of a candidate program, its predicted time (`Note: planner task
    costs`).

    Args:
      labels: the program's Run labels.
      costs: the segment table.
      stages: per stage of the candidate, the segments it is made of.
      rows: the candidate's rows per microbatch.
      segment_ms: the time of each code segment outside the loop ('post0g1'), by label.

    Returns:
      label -> ms.
    """
    scale = rows / costs.rows
    present = {part for label in labels for part in _parts(label)}
    out = {}
    for label in labels:
        parts = _parts(label)
        if not parts:
            out[label] = segment_ms.get(label, 0.0)
            continue
        work = 0.0
        for kind, stage in parts:
            work += costs.stage_work(kind, stages[stage])
            if kind == "W" and ("I", stage) not in present:
                work += costs.stage_work("I", stages[stage])
        out[label] = costs.overhead_ms + scale * work
    return out


def run_temp_bytes(label: str, costs: SegmentCosts, stages: Sequence[Sequence[int]],
                   rows: int) -> int:
    """A loop task's estimated scratch bytes: the sum over its label's parts of the
    largest scratch of the stage's segments, scaled by the rows per microbatch."""
    scale = rows / costs.rows
    return int(scale * sum(costs.stage_temp(kind, stages[stage])
                           for kind, stage in _parts(label)))
