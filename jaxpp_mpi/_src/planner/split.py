"""Stage boundaries: which of a step's stage marks end the stages of a split.

Pure Python. A step with M stage marks has M segments (segment j ends at mark j; the
code after the last mark belongs to the last segment). A split into S stages keeps S
marks, the last one always: `even_marks` the same number of segments per stage;
`balanced_marks` those that make the slowest stage as fast as it can be (the linear
partition problem, solved exactly by dynamic programming). Where a group holds several
stages (Interleaved1F1B, DualPipeV), what a step waits for is the busiest group:
`group_balanced_marks` keeps the marks that make it least busy. `splits_to_try` gathers
them for the planner, which simulates each.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = ["balanced_marks", "even_marks", "group_balanced_marks", "splits_to_try",
           "stage_segments"]

EXHAUSTIVE = 20_000
"""`group_balanced_marks` tries every split when there are at most this many."""


def even_marks(num_marks: int, num_stages: int) -> tuple[int, ...] | None:
    """The marks that split `num_marks` segments into `num_stages` stages of as many
    segments each, or None when `num_stages` does not divide `num_marks`."""
    if num_marks % num_stages:
        return None
    per = num_marks // num_stages
    return tuple(per * (s + 1) - 1 for s in range(num_stages))


def stage_segments(stage_marks: Sequence[int]) -> list[tuple[int, ...]]:
    """Per stage, the segments it is made of, for a split keeping `stage_marks`."""
    out, start = [], 0
    for mark in stage_marks:
        out.append(tuple(range(start, mark + 1)))
        start = mark + 1
    return out


def balanced_marks(segment_cost: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """The marks to keep so that the costliest of `num_stages` stages costs least.

    Args:
      segment_cost: per segment, its cost (e.g. one microbatch's forward and backward).
      num_stages: S, at most the number of segments.

    Returns:
      S marks in increasing order, the last segment's among them; among splits of equal
      bottleneck, the one whose stages come earliest.

    Raises:
      ValueError: more stages than segments.
    """
    m = len(segment_cost)
    if not 1 <= num_stages <= m:
        raise ValueError(f"cannot split {m} segments into {num_stages} stages")
    prefix = [0.0]
    for c in segment_cost:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][j]: the least bottleneck of splitting segments 0..j-1 into s stages
    best = [[inf] * (m + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (m + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, m + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], prefix[j] - prefix[i])
                if value < best[s][j] - 1e-12 * max(1.0, abs(value)):
                    best[s][j], cut[s][j] = value, i
    marks, j = [], m
    for s in range(num_stages, 0, -1):
        marks.append(j - 1)
        j = cut[s][j]
    return tuple(reversed(marks))


def _group_key(cost: Sequence[float], marks: Sequence[int], groups: Sequence[int]) -> tuple:
    """(busiest group's cost, costliest stage's cost) of a split."""
    stages = [sum(cost[j] for j in seg) for seg in stage_segments(marks)]
    load: dict[int, float] = {}
    for g, c in zip(groups, stages):
        load[g] = load.get(g, 0.0) + c
    return (round(max(load.values()), 9), round(max(stages), 9))


def group_balanced_marks(segment_cost: Sequence[float], group_of_stage: Sequence[int]
                         ) -> tuple[int, ...]:
    """The marks whose busiest group (its stages' costs summed) costs least; among those,
    the one whose costliest stage costs least, then the earliest.

    Every split is tried when there are at most `EXHAUSTIVE`; else single marks are
    moved one segment at a time from `balanced_marks`' split while that helps.

    Args:
      segment_cost: per segment, its cost.
      group_of_stage: per stage, the group that runs it (its length is the stage count).

    Returns:
      The marks, in increasing order, the last segment's among them.
    """
    m, stages = len(segment_cost), len(group_of_stage)
    if math.comb(m - 1, stages - 1) <= EXHAUSTIVE:
        return min(((*inner, m - 1) for inner in itertools.combinations(range(m - 1),
                                                                       stages - 1)),
                   key=lambda marks: (_group_key(segment_cost, marks, group_of_stage), marks))
    marks = list(balanced_marks(segment_cost, stages))
    best = _group_key(segment_cost, marks, group_of_stage)
    improved = True
    while improved:
        improved = False
        for k in range(stages - 1):
            for step in (-1, 1):
                moved = marks[:k] + [marks[k] + step] + marks[k + 1:]
                low = moved[k - 1] if k else -1
                if not low < moved[k] < moved[k + 1]:
                    continue
                key = _group_key(segment_cost, moved, group_of_stage)
                if key < best:
                    marks, best, improved = moved, key, True
    return tuple(marks)


def splits_to_try(segment_cost: Sequence[float], group_of_stage: Sequence[int],
                  balance: bool = True) -> list[tuple[int, ...]]:
    """The distinct splits worth simulating for a schedule whose stage s runs on group
    `group_of_stage[s]`: the even split (where there is one) and, with `balance`, the
    balanced one and, where a group holds several stages, the group-balanced one."""
    m, stages = len(segment_cost), len(group_of_stage)
    splits = [even_marks(m, stages)]
    if balance:
        splits.append(balanced_marks(segment_cost, stages))
        if len(set(group_of_stage)) < stages:
            splits.append(group_balanced_marks(segment_cost, group_of_stage))
    return list(dict.fromkeys(s for s in splits if s is not None))
