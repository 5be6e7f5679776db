"""An internal error of the compiler, as the user reads it: which step, stage and line.

A step that `jax.jit` compiles must compile here too; when building its program fails a
check of the compiler's own (`Note: program invariants`), that is a bug of jaxpp_mpi,
not of the step. The error then says so, names the step, the task and stage, and the
operation of the user's code that made the value involved (its source line), and says
what to send with a report.
"""

from __future__ import annotations

import os
import re

from jaxpp_mpi._src.base.compat import eqn_source_line
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler.split import SplitBody

__all__ = ["internal_error"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_REPORT = ("This is a bug in jaxpp_mpi, not in your step: please report it with this "
           "message and a program that shows it (your step, or the output of "
           "`jax.make_jaxpr(step)(*args)`, and the schedule and mesh you compiled it for).")


def internal_error(what: str, error: Exception, split: SplitBody) -> CompileError:
    """The CompileError reporting `error`, a failed internal check while building
    `what`'s program, with the stage and source line of the value it names.

    Args:
      what: the step's name.
      error: the check's error; its text names task labels (`B0s1`) and values
        (`'v11@0'`) as the program does.
      split: the step's split loop body (where each value is made).

    Returns:
      The error to raise (from `error`).
    """
    text = str(error)
    where = []
    task = re.search(r"\btask ([A-Z][A-Za-z0-9+]*?s(\d+))\b", text)
    value = next((m for m in re.findall(r"'(v\d+)@\d+'", text) if m in split.value_eqns),
                 None)
    if value is not None:
        eqn = split.value_eqns[value]
        key = split.value_task.get(value)
        home = (f"in stage {key[1]}'s {key[0].name} task" if key is not None else
                "by each task that reads it (it reads loop operands only)")
        line = eqn_source_line(eqn, skip=(_PACKAGE,))
        where.append(f"value {value} is made by `{eqn.primitive.name}` {home}"
                     + (f", at {line}" if line else ""))
    if task is not None:
        where.insert(0, f"task {task.group(1)} runs stage {task.group(2)}")
    detail = f" ({'; '.join(where)})" if where else ""
    return CompileError(f"{what}: internal error while building the program: {text}"
                        f"{detail}. {_REPORT}")
