"""Custom schedules read from and written to CSV: one row per group, one cell per task."""

from __future__ import annotations

import codecs
import csv
import hashlib
import io
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from jaxpp_mpi._src.base.files import read_at_most
from jaxpp_mpi._src.schedules.check import ScheduleError, check_tasks, describe
from jaxpp_mpi._src.schedules.library import BaseSchedule, check_positive
from jaxpp_mpi._src.schedules.tasks import (
    KIND_LETTERS,
    ScheduleEntry,
    ScheduleTasks,
    Task,
    TaskType,
    entry_tasks,
    task_label,
)

__all__ = [
    "CustomSchedule",
    "format_entry",
    "groups_needing_stage",
    "parse_cell",
    "schedule_to_csv",
    "schedule_to_rows",
]

MAX_CSV_BYTES = 64 << 20
MAX_CSV_CELLS = 1_000_000
# Commas and line breaks a CSV may hold (its fields and rows, empty ones included):
# counted on the text before the csv module builds a row, so a line of millions of
# commas or blank lines allocates nothing.
MAX_CSV_FIELDS = 2 * MAX_CSV_CELLS
# Note: CSV cells.
#   A cell is a task label (`Note: task labels` in tasks.py): ``F3s5`` is the forward of
#   microbatch 3 at stage 5, ``I3s5``/``W3s5`` the halves of a split backward, and a
#   fused task joins its parts with ``+`` (``F4s1+B1s1``). CSV-only extension: a part may
#   leave out ``s<stage>``, and then its stage is the row's index (``F3``, ``F4+B1``);
#   this is allowed only in a row that holds that one stage alone, and `schedule_to_csv`
#   writes it for such rows. Empty cells are skipped; trailing empty rows are ignored.
_CELL_PART = re.compile(rf"([{KIND_LETTERS}])(\d{{1,9}})(?:s(\d{{1,9}}))?", re.ASCII)

# A cell location: (row, column), both 0-based, and the cell text.
_Cell = tuple[int, int, str]


def format_entry(entry: ScheduleEntry, with_stage: bool = True) -> str:
    """Returns the CSV cell of a task or fused task (`Note: CSV cells`).

    Args:
      entry: A task or fused task.
      with_stage: Whether to write the stage suffix; without it a part is only its kind
        letter and microbatch.

    Returns:
      E.g. ``F3s5`` (its task label), or ``F4+B1`` without the stage.
    """
    if with_stage:
        return task_label(entry)
    return "+".join(f"{t.type.value}{t.microbatch}" for t in entry_tasks(entry))


def parse_cell(text: str, row: int, column: int = 0) -> ScheduleEntry:
    """Parses a CSV cell into a task or fused task (`Note: CSV cells`).

    Args:
      text: The cell's text.
      row: The cell's row, which is the stage of a part without the stage suffix.
      column: The cell's column, for error messages.

    Returns:
      A task, or a tuple of tasks for a fused cell.

    Raises:
      ScheduleError: naming the cell, if the text is not a task.
    """
    tasks = []
    for part in text.split("+"):
        match = _CELL_PART.fullmatch(part.strip())
        if match is None:
            raise ScheduleError(
                f"{_cell_name(row, column, text)}: {part.strip()!r} is not a task; write F, B, "
                "I or W, the microbatch, optionally s and the stage (F3, B3s5), and join fused "
                "tasks with '+'"
            )
        kind, microbatch, stage = match.groups()
        tasks.append(Task(row if stage is None else int(stage), int(microbatch), TaskType(kind)))
    return tasks[0] if len(tasks) == 1 else tuple(tasks)


def _cell_name(row: int, column: int, text: str) -> str:
    return f"row {row + 1} (group {row}), column {column + 1} ({text.strip()!r})"


def groups_needing_stage(schedule_rows: Sequence[Sequence[ScheduleEntry]]) -> list[bool]:
    """Returns, per group, whether its cells must write the stage (`Note: CSV cells`).

    Args:
      schedule_rows: One entry list per group.

    Returns:
      True for a group that runs a stage other than its own index, or several stages.
    """
    out = []
    for g, row in enumerate(schedule_rows):
        stages = {t.stage_id for e in row for t in entry_tasks(e)}
        out.append(stages != {g})
    return out


def schedule_to_rows(schedule: BaseSchedule, num_microbatches: int) -> list[list[str]]:
    """Returns the CSV cells of a schedule (`Note: CSV cells`).

    Args:
      schedule: Any schedule.
      num_microbatches: Number of microbatches.

    Returns:
      One list of cells per group: ``schedule.tasks(num_microbatches)`` as text.
    """
    rows = schedule.tasks(num_microbatches)
    with_stage = groups_needing_stage(rows)
    return [[format_entry(e, with_stage[g]) for e in row] for g, row in enumerate(rows)]


def schedule_to_csv(
    schedule: BaseSchedule, num_microbatches: int, path: str | os.PathLike
) -> None:
    """Writes ``schedule.tasks(num_microbatches)`` as CSV, one row per group (see CustomSchedule).

    Args:
      schedule: Any schedule.
      num_microbatches: Number of microbatches.
      path: Output file.
    """
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(schedule_to_rows(schedule, num_microbatches))


@dataclass(frozen=True, repr=False)
class CustomSchedule(BaseSchedule):
    """A schedule given as explicit task lists, usually read from a hand-edited CSV.

    It is checked on construction. Its stage-to-group map comes from where stages appear;
    ``is_partial_bwd`` is true when it holds BWD_I/BWD_W tasks; ``tasks`` only accepts the
    number of microbatches it was written for.

    Attributes:
      num_stages: Number of stages (every stage must appear in the lists).
      groups: One tuple of entries per MPMD group.
      num_microbatches: Number of microbatches the lists are written for.
      cells: Optional CSV location (row, column, text) of each entry, for error messages.
    """

    groups: tuple[tuple[ScheduleEntry, ...], ...]
    num_microbatches: int
    cells: tuple[tuple[_Cell, ...], ...] | None = field(
        default=None, compare=False, hash=False, repr=False
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(
            "CustomSchedule",
            "num_microbatches",
            self.num_microbatches,
            "pass how many microbatches the task lists are written for",
        )
        object.__setattr__(self, "groups", tuple(tuple(row) for row in self.groups))
        if not self.groups:
            raise ScheduleError("CustomSchedule: no groups (the CSV has no rows)")
        where = self._where
        stage_to_group: dict[int, tuple[int, int]] = {}
        for g, row in enumerate(self.groups):
            if not row:
                raise ScheduleError(
                    f"CustomSchedule: row {g + 1} (group {g}) is empty; every group needs tasks"
                )
            for i, entry in enumerate(row):
                for t in entry_tasks(entry):
                    if not isinstance(t, Task):
                        raise ScheduleError(f"CustomSchedule: {where(g, i)}: {t!r} is not a Task")
                    first = stage_to_group.setdefault(t.stage_id, (g, i))
                    if first[0] != g:
                        raise ScheduleError(
                            f"CustomSchedule: {where(g, i)}: {describe(t)} is on group {g} but "
                            f"stage {t.stage_id} already runs on group {first[0]} "
                            f"({where(*first)}); a stage lives on one group"
                        )
        missing = [s for s in range(self.num_stages) if s not in stage_to_group]
        if missing:
            raise ScheduleError(
                f"CustomSchedule: stage {missing[0]} appears in no group, but num_stages="
                f"{self.num_stages}; stages must be numbered 0..num_stages-1"
            )
        s_map = tuple(stage_to_group[s][0] for s in range(self.num_stages))
        object.__setattr__(self, "_stage_to_group", s_map)
        check_tasks(
            self.groups,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            stage_to_group=s_map,
            partial_bwd=self.is_partial_bwd,
            name="CustomSchedule",
            where=where,
        )
        text = "\n".join(",".join(format_entry(e) for e in row) for row in self.groups)
        object.__setattr__(self, "_digest", hashlib.sha256(text.encode()).hexdigest()[:16])

    def _where(self, g: int, i: int) -> str:
        if self.cells is not None and g < len(self.cells) and i < len(self.cells[g]):
            return _cell_name(*self.cells[g][i])
        return f"group {g}, position {i}"

    def __repr__(self) -> str:
        return (
            f"CustomSchedule(num_stages={self.num_stages}, mpmd_dim={self.mpmd_dim}, "
            f"num_microbatches={self.num_microbatches}, tasks_sha256={self._digest})"
        )

    @property
    def mpmd_dim(self) -> int:
        """Number of MPMD groups (rows)."""
        return len(self.groups)

    @property
    def is_partial_bwd(self) -> bool:
        return any(
            t.type in (TaskType.BWD_I, TaskType.BWD_W)
            for row in self.groups
            for e in row
            for t in entry_tasks(e)
        )

    def get_mpmd_idx(self, stage_id: int) -> int:
        self._check_stage(stage_id)
        return self._stage_to_group[stage_id]

    def tasks(self, num_microbatches: int) -> ScheduleTasks:
        if num_microbatches != self.num_microbatches:
            raise ValueError(
                f"{self!r} is written for {self.num_microbatches} microbatches, got "
                f"num_microbatches={num_microbatches}; run it with {self.num_microbatches} "
                f"microbatches or write a CSV for {num_microbatches}"
            )
        return [list(row) for row in self.groups]

    @classmethod
    def from_tasks(
        cls,
        tasks: Sequence[Sequence[ScheduleEntry]],
        num_microbatches: int | None = None,
        cells: Sequence[Sequence[_Cell]] | None = None,
    ) -> CustomSchedule:
        """Builds a checked schedule from per-group entry lists.

        Args:
          tasks: One ordered entry list per group.
          num_microbatches: Defaults to the largest microbatch index plus one.
          cells: Optional CSV location of each entry, for error messages.

        Returns:
          The schedule; ``num_stages`` is the largest stage index plus one.

        Raises:
          ScheduleError: if the lists are not a complete, runnable schedule.
        """
        all_tasks = [t for row in tasks for e in row for t in entry_tasks(e) if isinstance(t, Task)]
        num_stages = 1 + max((t.stage_id for t in all_tasks), default=0)
        if num_microbatches is None:
            num_microbatches = 1 + max((t.microbatch for t in all_tasks), default=0)
        return cls(
            num_stages,
            tuple(tuple(r) for r in tasks),
            num_microbatches,
            None if cells is None else tuple(tuple(r) for r in cells),
        )

    @classmethod
    def from_csv(cls, path: str | os.PathLike) -> CustomSchedule:
        """Reads and checks a schedule written by ``schedule_to_csv`` or by hand.

        Args:
          path: The CSV file (`Note: CSV cells`), UTF-8 (a byte-order mark is allowed), at
            most ``MAX_CSV_BYTES``.

        Returns:
          The checked schedule.

        Raises:
          ScheduleError: naming the file, and the offending cell (row, column, text) or
            line: a file that cannot be read, is too large or is not UTF-8 text, or any
            error of ``from_csv_text``.
        """
        try:
            with open(path, "rb") as f:
                data = read_at_most(f, MAX_CSV_BYTES)
        except OSError as e:
            raise ScheduleError(
                f"{path}: cannot read the schedule CSV: {e.strerror or e}"
            ) from None
        if len(data) > MAX_CSV_BYTES:
            raise ScheduleError(
                f"{path}: larger than {MAX_CSV_BYTES} bytes, too large for a schedule CSV"
            )
        return cls.from_csv_text(_decode_csv(data, str(path)), source=str(path))

    @classmethod
    def from_csv_text(cls, text: str, source: str = "<csv>") -> CustomSchedule:
        """Like ``from_csv``, from the CSV text itself.

        Args:
          text: The CSV text.
          source: Its name in error messages.

        Returns:
          The checked schedule.

        Raises:
          ScheduleError: naming ``source`` and the offending cell (row, column, text) or
            line.
        """
        separators = text.count(",") + text.count("\n")
        if separators > MAX_CSV_FIELDS:
            raise ScheduleError(
                f"{source}: {separators} commas and line breaks is too many for a schedule "
                f"CSV (limit {MAX_CSV_FIELDS})"
            )
        groups: list[list[ScheduleEntry]] = []
        cells: list[list[_Cell]] = []
        count = 0
        empty_row = None  # the first empty row: only trailing empty rows may follow
        reader = csv.reader(io.StringIO(text))
        try:
            for r, row in enumerate(reader):
                entries: list[ScheduleEntry] = []
                located: list[_Cell] = []
                for c, cell in enumerate(row):
                    if not cell.strip():
                        continue
                    count += 1 + cell.count("+")
                    if count > MAX_CSV_CELLS:
                        raise ScheduleError(
                            f"{_cell_name(r, c, cell)}: more than {MAX_CSV_CELLS} tasks"
                        )
                    entries.append(parse_cell(cell, r, c))
                    located.append((r, c, cell))
                if not entries:
                    empty_row = r if empty_row is None else empty_row
                    continue
                if empty_row is not None:
                    raise ScheduleError(
                        f"row {empty_row + 1} (group {empty_row}) is empty but row {r + 1} "
                        "holds tasks; every group needs tasks (remove the empty row)"
                    )
                groups.append(entries)
                cells.append(located)
        except csv.Error as e:
            raise ScheduleError(
                f"{source}: line {reader.line_num}: not a valid CSV file: {e}"
            ) from None
        except ScheduleError as e:
            raise ScheduleError(f"{source}: {e}") from None
        _check_indexes(groups, cells, count, source)
        try:
            return cls.from_tasks(groups, cells=cells)
        except ScheduleError as e:
            raise ScheduleError(f"{source}: {e}") from None


def _decode_csv(data: bytes, source: str) -> str:
    """A schedule CSV's bytes as text: UTF-8, a leading byte-order mark dropped.

    Raises:
      ScheduleError: naming ``source``, the line and the byte, if it is not UTF-8.
    """
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ScheduleError(
            f"{source}: line {line}: byte 0x{data[e.start]:02x} is not UTF-8 text; save the "
            "schedule as UTF-8 (cells are ASCII, e.g. F3s5)"
        ) from None


def _check_indexes(
    groups: list[list[ScheduleEntry]], cells: list[list[_Cell]], count: int, source: str
) -> None:
    """Rejects indexes no complete schedule of this size could reach, and misused bare cells."""
    for g, row in enumerate(groups):
        bare = None  # first cell of the row with a part lacking the stage suffix
        for i, entry in enumerate(row):
            for t in entry_tasks(entry):
                if t.microbatch >= count or t.stage_id >= count:
                    raise ScheduleError(
                        f"{source}: {_cell_name(*cells[g][i])}: index too large for a file "
                        f"holding {count} tasks"
                    )
            if bare is None and any(
                _CELL_PART.fullmatch(p.strip()).group(3) is None  # type: ignore[union-attr]
                for p in cells[g][i][2].split("+")
            ):
                bare = i
        other = next(
            (i for i, e in enumerate(row) if any(t.stage_id != g for t in entry_tasks(e))), None
        )
        if bare is not None and other is not None:
            raise ScheduleError(
                f"{source}: {_cell_name(*cells[g][bare])}: a cell without a stage suffix means "
                f"stage {g} (the row's index), which is only allowed when the row holds that "
                f"stage alone, but column {cells[g][other][1] + 1} "
                f"({cells[g][other][2].strip()!r}) holds another stage; write the stage on "
                "every cell of this row (e.g. F3s5)"
            )
