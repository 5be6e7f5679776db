"""Pipeline schedules: which task each MPMD group runs, and in which order (no JAX, no MPI)."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from jaxpp_mpi._src.schedules.tasks import (
    ScheduleEntry,
    ScheduleTasks,
    Task,
    TaskType,
    entry_tasks,
)

__all__ = [
    "BaseSchedule",
    "DualPipeV",
    "Eager1F1B",
    "GPipe",
    "Interleaved1F1B",
    "InterleavedBaseSchedule",
    "KimiK2",
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "ScheduleEntry",
    "ScheduleTasks",
    "Std1F1B",
    "Task",
    "TaskType",
    "ZeroBubble",
    "check_positive",
    "entry_tasks",
    "schedule_by_name",
]


def check_positive(schedule: str, name: str, value: object, hint: str) -> None:
    """Checks that ``value`` is a positive int (a bool is not).

    Args:
      schedule: Who checks, for the message (a class name or a repr).
      name: What ``value`` is, for the message.
      value: The value to check.
      hint: What to do instead, appended to the message.

    Raises:
      ValueError: if ``value`` is not a positive int.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{schedule}: {name} must be a positive integer, got {value!r}; {hint}")


@dataclass(frozen=True)
class BaseSchedule(metaclass=ABCMeta):
    """A pipeline schedule over ``num_stages`` stages.

    Schedules are frozen dataclasses: immutable, hashable, compared by value, with a
    deterministic ``repr`` (they are stored as JAX primitive params and their repr is
    hashed into the program hash). Subclasses provide ``mpmd_dim`` (a property or a
    field) and ``tasks``.
    """

    num_stages: int

    def __post_init__(self) -> None:
        check_positive(
            type(self).__name__, "num_stages", self.num_stages, "pass the number of stages"
        )

    @property
    def is_partial_bwd(self) -> bool:
        """True when the backward is split into BWD_I and BWD_W tasks."""
        return False

    @property
    def stages_per_group(self) -> int:
        """Number of stages each MPMD group holds."""
        return self.num_stages // self.mpmd_dim  # type: ignore[attr-defined]

    def get_mpmd_idx(self, stage_id: int) -> int:
        """Returns the MPMD index (group) that runs stage ``stage_id``."""
        self._check_stage(stage_id)
        return stage_id % self.mpmd_dim  # type: ignore[attr-defined]

    def _check_stage(self, stage_id: int) -> None:
        if not 0 <= stage_id < self.num_stages:
            raise ValueError(
                f"{self!r}: stage_id {stage_id} is out of range; the stages are "
                f"0..{self.num_stages - 1}"
            )

    def _check_num_microbatches(self, num_microbatches: int) -> None:
        check_positive(
            repr(self),
            "the number of microbatches",
            num_microbatches,
            "run at least one microbatch",
        )

    @abstractmethod
    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        """Returns, for each MPMD index, its ordered list of tasks and fused tasks.

        Args:
          num_microbatches: Number of microbatches (microbatch indexes are 0-based).

        Returns:
          One entry list per MPMD index (`ScheduleTasks`).

        Raises:
          ValueError: if this schedule cannot run ``num_microbatches`` microbatches.
        """


@dataclass(frozen=True)
class _OneStagePerGroup(BaseSchedule):
    """Base of the schedules that run stage ``s`` on group ``s``."""

    @property
    def mpmd_dim(self) -> int:
        """Number of MPMD groups (equal to ``num_stages``)."""
        return self.num_stages


class _Counters:
    """Hands out tasks with, per (stage, kind), microbatches in increasing order."""

    def __init__(self) -> None:
        self._next: defaultdict[tuple[int, TaskType], int] = defaultdict(int)

    def take(self, stage_id: int, kind: TaskType) -> Task:
        microbatch = self._next[stage_id, kind]
        self._next[stage_id, kind] += 1
        return Task(stage_id, microbatch, kind)

    def count(self, stage_id: int, kind: TaskType) -> int:
        return self._next[stage_id, kind]


def _one_f_one_b(stage_id: int, num_microbatches: int, warmup: int) -> list[ScheduleEntry]:
    """``warmup`` forwards, then alternate forward/backward pairs, then the cool-down."""
    warmup = min(warmup, num_microbatches)
    fwd = [Task(stage_id, m, TaskType.FWD) for m in range(num_microbatches)]
    bwd = [Task(stage_id, m, TaskType.BWD) for m in range(num_microbatches)]
    order: list[ScheduleEntry] = list(fwd[:warmup])
    for i in range(num_microbatches - warmup):
        order += [fwd[warmup + i], bwd[i]]
    order += bwd[num_microbatches - warmup :]
    return order


@dataclass(frozen=True)
class GPipe(_OneStagePerGroup):
    """Every group runs all forwards, then all backwards (ascending microbatch order)."""

    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        self._check_num_microbatches(num_microbatches)
        return [
            [Task(s, m, TaskType.FWD) for m in range(num_microbatches)]
            + [Task(s, m, TaskType.BWD) for m in range(num_microbatches)]
            for s in range(self.num_stages)
        ]


@dataclass(frozen=True)
class Std1F1B(_OneStagePerGroup):
    """1F1B (PipeDream-flush): ``num_stages - 1 - rank`` warm-up forwards, then F/B pairs."""

    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        self._check_num_microbatches(num_microbatches)
        p = self.num_stages
        return [_one_f_one_b(s, num_microbatches, p - 1 - s) for s in range(p)]


@dataclass(frozen=True)
class Eager1F1B(_OneStagePerGroup):
    """1F1B with ``2 * (num_stages - 1 - rank)`` warm-up forwards (as JaxPP's Eager1F1B).

    Each group runs ahead by twice its distance to the last stage, so a forward's output
    is sent well before the receiver needs it and sends overlap with compute, at the cost
    of up to ``2 * num_stages - 1`` live activations on the first group.
    """

    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        self._check_num_microbatches(num_microbatches)
        p = self.num_stages
        return [_one_f_one_b(s, num_microbatches, 2 * (p - 1 - s)) for s in range(p)]


@dataclass(frozen=True)
class ZeroBubble(_OneStagePerGroup):
    """ZB-H1 (Qi et al., 2023): 1F1B with BWD split in BWD_I + BWD_W, W deferred to fill bubbles.

    Group ``s`` runs ``num_stages - s`` forwards, then ``s`` (BWD_I, FWD) pairs, then cycles
    BWD_I, BWD_W, FWD, skipping a kind once all its microbatches are done; so stage ``s``
    keeps ``s`` weight gradients pending and runs them in the bubbles of the cool-down.
    """

    @property
    def is_partial_bwd(self) -> bool:
        return True

    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        self._check_num_microbatches(num_microbatches)
        p = self.num_stages
        if num_microbatches < p:
            raise ValueError(
                f"{self!r} needs at least num_stages={p} microbatches (its warm-up runs "
                f"{p} forwards on the first group), got {num_microbatches}; use "
                f"num_microbatches >= {p} or Std1F1B"
            )
        return [self._group_tasks(s, num_microbatches) for s in range(p)]

    def _group_tasks(self, s: int, n: int) -> list[ScheduleEntry]:
        it = _Counters()
        kinds = (TaskType.FWD, TaskType.BWD_I, TaskType.BWD_W)
        order: list[ScheduleEntry] = [it.take(s, TaskType.FWD) for _ in range(self.num_stages - s)]
        for _ in range(s):
            order += [it.take(s, TaskType.BWD_I), it.take(s, TaskType.FWD)]
        cycle = (TaskType.BWD_I, TaskType.BWD_W, TaskType.FWD)
        pos = 0
        while any(it.count(s, k) < n for k in kinds):
            kind = cycle[pos % 3]
            pos += 1
            if it.count(s, kind) < n:
                order.append(it.take(s, kind))
        return order


@dataclass(frozen=True)
class InterleavedBaseSchedule(BaseSchedule):
    """Base of schedules where each of ``mpmd_dim`` groups holds several stages (JaxPP's
    name): stage ``s`` runs on group ``s % mpmd_dim`` unless a subclass says otherwise.

    Subclass it, as JaxPP users do, for a schedule with more stages than groups: give
    ``tasks`` (and ``get_mpmd_idx`` for another placement).

    Raises:
      ValueError: ``mpmd_dim`` is not a positive int, or does not divide ``num_stages``.
    """

    mpmd_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        check_positive(name, "mpmd_dim", self.mpmd_dim, "pass the number of MPMD groups")
        if self.num_stages % self.mpmd_dim:
            raise ValueError(
                f"{name}: num_stages={self.num_stages} is not divisible by "
                f"mpmd_dim={self.mpmd_dim}; every group must hold the same number of "
                f"stages, so use a num_stages that is a multiple of {self.mpmd_dim}"
            )


@dataclass(frozen=True)
class Interleaved1F1B(InterleavedBaseSchedule):
    """Megatron-LM interleaved 1F1B: group ``r`` holds stages ``r, r + mpmd_dim, ...``.

    Microbatches go in rounds of ``g`` (``g = mpmd_dim`` when ``n`` is a multiple of it).
    A group runs the forwards of one round on its first chunk (virtual stage), then the same
    round on its next chunk, and so on; backwards visit the chunks in reverse. Group ``r``
    warms up with ``(chunks - 1) * g + 2 * (mpmd_dim - 1 - r)`` forwards (capped by the
    number of forwards), then alternates forward/backward, then cools down. With
    ``fuse_steady_state`` each steady-state (forward, backward) pair is one fused task.
    """

    fuse_steady_state: bool = False

    def _round_size(self, n: int) -> int:
        """Microbatches per round; all rounds have the same size."""
        chunks = self.num_stages // self.mpmd_dim
        if chunks == 1:
            return n
        rounds = max(1, n // self.mpmd_dim)
        if n % rounds:
            raise ValueError(
                f"{self!r} cannot run {n} microbatches: like Megatron-LM's interleaving, each "
                f"group cycles through its {chunks} stages one round of microbatches at a "
                f"time, and rounds must all have the same size, at least mpmd_dim="
                f"{self.mpmd_dim} (a single round when n < {2 * self.mpmd_dim}), so that "
                f"every group agrees on which stage runs when; n must be divisible by "
                f"n // mpmd_dim = {rounds}: use a multiple of {self.mpmd_dim} such as "
                f"{self.mpmd_dim * rounds} or {self.mpmd_dim * (rounds + 1)}"
            )
        return n // rounds

    def _warmup(self, mpmd_idx: int, round_size: int) -> int:
        chunks = self.num_stages // self.mpmd_dim
        return (chunks - 1) * round_size + 2 * (self.mpmd_dim - 1 - mpmd_idx)

    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        self._check_num_microbatches(num_microbatches)
        g = self._round_size(num_microbatches)
        return [self._group_tasks(r, num_microbatches, g) for r in range(self.mpmd_dim)]

    def _group_tasks(self, r: int, n: int, g: int) -> list[ScheduleEntry]:
        d, chunks = self.mpmd_dim, self.num_stages // self.mpmd_dim
        total = n * chunks
        warmup = min(self._warmup(r, g), total)
        it = _Counters()

        def fwd(step: int) -> Task:
            return it.take((step // g) % chunks * d + r, TaskType.FWD)

        def bwd(step: int) -> Task:
            return it.take((chunks - 1 - (step // g) % chunks) * d + r, TaskType.BWD)

        order: list[ScheduleEntry] = [fwd(i) for i in range(warmup)]
        for i in range(total - warmup):
            pair = (fwd(warmup + i), bwd(i))
            order += [pair] if self.fuse_steady_state else list(pair)
        order += [bwd(i) for i in range(total - warmup, total)]
        return order


@dataclass(frozen=True)
class KimiK2(Interleaved1F1B):
    """Interleaved1F1B with one more warm-up forward on every group (as JaxPP's KimiK2)."""

    def _warmup(self, mpmd_idx: int, round_size: int) -> int:
        return super()._warmup(mpmd_idx, round_size) + 1


@dataclass(frozen=True)
class DualPipeV(InterleavedBaseSchedule):
    """DeepSeek's DualPipeV: a V-shaped pipeline with ``num_stages == 2 * mpmd_dim``.

    Group ``r`` holds stage ``r`` (the way down) and stage ``2 * mpmd_dim - 1 - r`` (the way
    back), so the first and the last stage share group 0. The task order is DeepSeek's eight
    phases (forward warm-up, forward/backward overlap as fused tasks, zero-bubble cool-down
    where BWD_W is deferred to a FIFO and run later). A backward that is not split appears as
    the fused task ``(BWD_I, BWD_W)``.
    """

    def __post_init__(self) -> None:
        BaseSchedule.__post_init__(self)  # the V-shape rule below implies divisibility
        check_positive("DualPipeV", "mpmd_dim", self.mpmd_dim, "pass the number of MPMD groups")
        if self.num_stages != 2 * self.mpmd_dim:
            raise ValueError(
                f"DualPipeV needs exactly 2 * mpmd_dim stages (two per group, in a V), got "
                f"num_stages={self.num_stages} with mpmd_dim={self.mpmd_dim}; use "
                f"DualPipeV(num_stages={2 * self.mpmd_dim}, mpmd_dim={self.mpmd_dim})"
            )

    @property
    def is_partial_bwd(self) -> bool:
        return True

    def get_mpmd_idx(self, stage_id: int) -> int:
        self._check_stage(stage_id)
        return min(stage_id, self.num_stages - 1 - stage_id)

    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        self._check_num_microbatches(num_microbatches)
        if num_microbatches < self.num_stages:
            raise ValueError(
                f"{self!r} needs at least num_stages={self.num_stages} microbatches (its "
                f"warm-up fills both arms of the V), got {num_microbatches}; use "
                f"num_microbatches >= {self.num_stages}"
            )
        return [self._group_tasks(r, num_microbatches) for r in range(self.mpmd_dim)]

    def _group_tasks(self, r: int, n: int) -> list[ScheduleEntry]:
        d = self.mpmd_dim
        down, up = r, 2 * d - 1 - r
        it = _Counters()
        deferred: deque[int] = deque()  # stages whose BWD_W waits, oldest first
        F, I, W = TaskType.FWD, TaskType.BWD_I, TaskType.BWD_W  # noqa: E741

        def bwd(stage: int, zero_bubble: bool = False) -> Sequence[Task]:
            if zero_bubble:
                deferred.append(stage)
                return (it.take(stage, I),)
            return (it.take(stage, I), it.take(stage, W))

        def weight() -> Task:
            return it.take(deferred.popleft(), W)

        out: list[ScheduleEntry] = []
        out += [it.take(down, F) for _ in range(2 * (d - r - 1))]  # 1: forwards, way down
        for _ in range(r + 1):  # 2: forwards on both arms
            out += [it.take(down, F), it.take(up, F)]
        for _ in range(d - r - 1):  # 3: backward, its weight pass, forward (way back)
            out += [*bwd(up, zero_bubble=True), weight(), it.take(up, F)]
        for i in range(n - 2 * d + r + 1):  # 4: main phase, forward+backward overlapped
            if i == 0 and r == d - 1:
                out += [it.take(down, F), tuple(bwd(up))]
            else:
                out.append((it.take(down, F), *bwd(up)))
            out.append((it.take(up, F), *bwd(down)))
        for _ in range(d - r - 1):  # 5: backward way back, overlapped pair
            out += [tuple(bwd(up)), (it.take(up, F), *bwd(down))]
        switch = 2 * ((r + 1) // 2) + (1 if r % 2 == 0 else 0)
        for i in range(2 * (r + 1)):  # 6: backwards on both arms, second half zero-bubble
            stage = up if i % 2 == 0 else down
            out.append(_single(bwd(stage, zero_bubble=i >= switch)))
        for _ in range(d - r - 1):  # 7: pending weight pass, then a zero-bubble backward
            out += [weight(), *bwd(down, zero_bubble=True)]
        out += [weight() for _ in range(len(deferred))]  # 8: remaining weight passes
        return out


def _single(tasks: Sequence[Task]) -> ScheduleEntry:
    return tasks[0] if len(tasks) == 1 else tuple(tasks)


# Note: schedule registry.
#   `SCHEDULES` is the one table of named schedules: short name -> class, in the order
#   flags list them. `schedule_by_name` and the ``--schedule`` flags of examples/train.py
#   and bench/pipeline.py take the short names; ``python -m jaxpp_mpi.schedules`` takes
#   the class names (any case) of the same classes.
SCHEDULES: Mapping[str, type[BaseSchedule]] = MappingProxyType({
    "gpipe": GPipe,
    "1f1b": Std1F1B,
    "eager1f1b": Eager1F1B,
    "interleaved": Interleaved1F1B,
    "zerobubble": ZeroBubble,
    "dualpipev": DualPipeV,
    "kimik2": KimiK2,
})
SCHEDULE_NAMES = tuple(SCHEDULES)


def schedule_by_name(name: str, mpmd_dim: int) -> BaseSchedule:
    """Returns the schedule called ``name`` (`Note: schedule registry`) for ``mpmd_dim`` groups.

    One stage per group for gpipe, 1f1b, eager1f1b and zerobubble; two per group for
    interleaved, dualpipev and kimik2.

    Args:
      name: One of `SCHEDULE_NAMES`.
      mpmd_dim: Number of MPMD groups.

    Returns:
      The schedule, with ``num_stages`` equal to ``mpmd_dim`` or ``2 * mpmd_dim``.

    Raises:
      ValueError: for an unknown name.
    """
    cls = SCHEDULES.get(name)
    if cls is None:
        raise ValueError(f"unknown schedule {name!r}; the names are {', '.join(SCHEDULE_NAMES)}")
    if issubclass(cls, InterleavedBaseSchedule):
        return cls(2 * mpmd_dim, mpmd_dim)
    return cls(mpmd_dim)
