"""Per-task wall times: `collect_task_times_ms`, as in JaxPP.

Note: task timing.
  While a `collect_task_times_ms()` block is active, the executors time every Run whose
  task label is not empty: they wait for its inputs, dispatch it, wait for its outputs
  (`block_until_ready`) and append the elapsed wall time in milliseconds to the list of
  its label ('F3s1', 'B0s2', fused labels such as 'F3s1+B1s1' as one entry). This
  serialises the step, so timed steps run slower than untimed ones. Outside such a block
  nothing blocks: an executor looks at `active_task_times()` once per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["TaskTimes", "active_task_times", "collect_task_times_ms"]

TaskTimes = dict[str, list[float]]

_active: list[TaskTimes] = []  # innermost enabled block last


def active_task_times() -> TaskTimes | None:
    """The dict of the innermost enabled `collect_task_times_ms` block, or None."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def collect_task_times_ms(enabled: bool = True) -> Iterator[TaskTimes | None]:
    """Context manager collecting per-task execution times in milliseconds.

    See `Note: task timing`. Blocks nest; times go to the innermost enabled one.

    Example:
      with collect_task_times_ms() as stats:
          step(state, batch)
      for task, times in stats.items():
          print(task, times)

    Args:
      enabled: when False, nothing is collected and the block yields None.

    Yields:
      A dict from task label to the list of its wall times in ms (filled as steps run),
      or None when `enabled` is False.
    """
    if not enabled:
        yield None
        return
    times: TaskTimes = {}
    _active.append(times)
    try:
        yield times
    finally:
        del _active[next(i for i, t in enumerate(_active) if t is times)]
