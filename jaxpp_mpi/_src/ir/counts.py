"""How many executables and instructions a program runs, per stage, group and microbatch.

On a GPU every executable call carries a fixed host cost, so the number of executables
a microbatch passes through on each stage is a figure of its own, next to FLOPs and
bytes; these counts are read off the program's `Run` task labels (`Note: task labels`
in schedules/tasks.py), without JAX.

Note: executable counts.
  A `Run` is a loop task when its label has a part with a microbatch (`F3s1`, the fused
  `F3s1+B3s1`); segments outside the loop (`preg0`, `post0g1`) and unlabelled Runs are
  not counted. A Run counts once for each stage its parts belong to, however many
  parts it fuses: a microbatch passing through that stage calls it once. Its kind on a
  stage is the kind letters of that stage's parts in label order (`FB`, `FI`). Counts
  are divided by the program's number of microbatches: the distinct microbatch indexes
  of its loop tasks (a replica's own microbatches under pipeline replicas).
"""

from __future__ import annotations

from collections.abc import Iterator

from jaxpp_mpi._src.ir.program import Program, Run
from jaxpp_mpi._src.schedules.tasks import parse_label

__all__ = [
    "executables_per_microbatch",
    "executables_per_microbatch_by_kind",
    "group_executables_per_microbatch",
    "instruction_counts",
    "num_microbatches",
]


def _loop_runs(program: Program) -> Iterator[tuple[int, dict[int, str], set[int]]]:
    """Per loop-task Run (`Note: executable counts`): its group, {stage: kind} and the
    microbatches its parts name."""
    for g in program.groups:
        for instr in g.instrs:
            if not isinstance(instr, Run) or not instr.task:
                continue
            kinds: dict[int, str] = {}
            microbatches: set[int] = set()
            for part in parse_label(instr.task):
                if part.microbatch is None or part.stage is None:
                    continue
                kinds[part.stage] = kinds.get(part.stage, "") + part.kind
                microbatches.add(part.microbatch)
            if kinds:
                yield g.mpmd_idx, kinds, microbatches


def num_microbatches(program: Program) -> int:
    """The number of distinct microbatch indexes of the program's loop tasks.

    Args:
      program: any program; its Runs' task labels are read (`Note: task labels`).

    Returns:
      The count, 0 for a program without loop tasks.
    """
    seen: set[int] = set()
    for _, _, microbatches in _loop_runs(program):
        seen |= microbatches
    return len(seen)


def executables_per_microbatch_by_kind(program: Program) -> dict[int, dict[str, float]]:
    """Per stage and kind, the executables one microbatch passes through
    (`Note: executable counts`).

    Args:
      program: any program.

    Returns:
      {stage: {kind: Runs per microbatch}}, e.g. `{0: {'F': 1.0, 'B': 1.0}, 1: {'FB':
      1.0}}` for 1F1B on two stages; stages and kinds sorted; empty without loop tasks.
    """
    n = num_microbatches(program)
    counts: dict[int, dict[str, int]] = {}
    for _, kinds, _ in _loop_runs(program):
        for stage, kind in kinds.items():
            per_kind = counts.setdefault(stage, {})
            per_kind[kind] = per_kind.get(kind, 0) + 1
    return {stage: {kind: counts[stage][kind] / n for kind in sorted(counts[stage])}
            for stage in sorted(counts)}


def executables_per_microbatch(program: Program) -> dict[int, float]:
    """Per stage, the executables one microbatch passes through (`Note: executable
    counts`): loop-task Runs of the stage, summed over groups, over the microbatches.

    Args:
      program: any program.

    Returns:
      {stage: Runs per microbatch}, stages sorted, e.g. `{0: 2.0, 1: 1.0}` for 1F1B on
      two stages (the last stage's forward and backward fused); empty without loop
      tasks.
    """
    return {stage: sum(by_kind.values())
            for stage, by_kind in executables_per_microbatch_by_kind(program).items()}


def group_executables_per_microbatch(program: Program) -> dict[int, float]:
    """Per group, its loop-task Runs over the microbatches: the executable calls its
    process dispatches per microbatch (a Run fusing two stages counts once here).

    Args:
      program: any program.

    Returns:
      {mpmd_idx: Runs per microbatch} for every group, 0.0 for a group without loop
      tasks; empty when the program has none.
    """
    n = num_microbatches(program)
    if not n:
        return {}
    counts = dict.fromkeys(range(program.num_groups), 0)
    for g, _, _ in _loop_runs(program):
        counts[g] += 1
    return {g: c / n for g, c in counts.items()}


def instruction_counts(program: Program) -> dict[int, dict[str, int]]:
    """Per group, its instructions by type name (`Run`, `Send`, `Recv`, `SendRecv`,
    `Free`, `AllReduce`): what each process dispatches in one step.

    Args:
      program: any program.

    Returns:
      {mpmd_idx: {type name: count}}, names sorted; only types the group uses.
    """
    out: dict[int, dict[str, int]] = {}
    for g in program.groups:
        counts: dict[str, int] = {}
        for instr in g.instrs:
            name = type(instr).__name__
            counts[name] = counts.get(name, 0) + 1
        out[g.mpmd_idx] = dict(sorted(counts.items()))
    return out
