"""What a step computes, as text that is the same in every process.

Note: step fingerprints.
  The program hash (ir/program.py) covers instructions, buffers and shapes, not the
  arithmetic inside an executable: two ranks whose step differs only in an operation
  (`sin` for `cos`, another constant) would build the same program and train silently
  apart. `step_text(plan)` prints the traced step the plan was built from (its jaxpr:
  the loop body, the code around the loop, every constant as a digest of its value);
  `agree.agree_on_program` compares the digests of these texts across ranks. The
  compiler is deterministic, so ranks with the same program and the same traced step
  build the same executables: printing the one jaxpr every rank already has costs a
  fraction of tracing each group's executables anew and printing those (0.06 s against
  0.40 s on the 4-stage example, where that was a tenth of a rank's compile CPU), and a
  difference is reported at the line of the user's own step where it is. The text must
  not depend on the process: memory addresses in reprs (a host callback's function,
  `<function f at 0x7f...>`) are removed; variable names come from JAX's printer, which
  numbers them in order; nothing uses `id()`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jaxpp_mpi._src.compiler.build import StepPlan

__all__ = ["STEP", "jaxpr_text", "step_text", "step_texts"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

STEP = "the traced step"
"""The name of `step_text`'s text where the ranks' texts are compared (`step_texts`)."""


def _const_text(c: Any) -> str:
    """A constant's dtype, shape and content digest (or its repr, addresses removed)."""
    try:
        value = np.asarray(c)
    except Exception:  # noqa: BLE001 - not an array: its repr will do
        return _ADDRESS.sub("", repr(c))
    if value.dtype == object:
        return _ADDRESS.sub("", repr(c))
    digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
    return f"{value.dtype.name}{list(value.shape)} sha256:{digest}"


def jaxpr_text(jaxpr: Any, consts: Sequence[Any]) -> str:
    """A traced step as process-independent text (`Note: step fingerprints`): `jaxpr`
    printed without addresses, then one line per constant (the jaxpr's first inputs)."""
    body = _ADDRESS.sub("", str(jaxpr))
    return body + "".join(f"\nconst {k}: {_const_text(c)}" for k, c in enumerate(consts))


def step_text(plan: StepPlan) -> str:
    """The traced step of `plan` as process-independent text (`jaxpr_text` of its jaxpr
    and constants).

    Args:
      plan: the step plan (`build_step`'s).
    """
    return jaxpr_text(plan.step_jaxpr, plan.consts)


def step_texts(plan: StepPlan) -> dict[str, str]:
    """`{STEP: step_text(plan)}`: what `agree.agree_on_program` compares."""
    return {STEP: step_text(plan)}
