"""What each executable of a step computes, as text that is the same in every process.

Note: executable fingerprints.
  The program hash (ir/program.py) covers instructions, buffers and shapes, not the
  arithmetic inside an executable: two ranks whose step differs only in an operation
  (`sin` for `cos`, another constant) would build the same program and train silently
  apart. `executable_texts(plan)` traces every group's executables (the plan holds all
  of them on every rank) to jaxprs and prints them, with the values of their constants
  as digests; `agree.agree_on_program` compares the digests of these texts across
  ranks. The text must not depend on the process: memory addresses in reprs (a host
  callback's function, `<function f at 0x7f...>`) are removed; variable names come from
  JAX's printer, which numbers them in order; nothing uses `id()`.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

if TYPE_CHECKING:
    from jaxpp_mpi._src.compiler.build import StepPlan

__all__ = ["executable_texts", "jaxpr_text"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


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


def jaxpr_text(closed: jax.extend.core.ClosedJaxpr) -> str:
    """`closed` as process-independent text: its jaxpr, then one line per constant."""
    body = _ADDRESS.sub("", str(closed.jaxpr))
    consts = "".join(f"\nconst {k}: {_const_text(c)}" for k, c in enumerate(closed.consts))
    return body + consts


def executable_texts(plan: StepPlan) -> dict[str, str]:
    """Per executable of every group, named "group g executable NAME", the text of what
    it computes (see `Note: executable fingerprints`).

    Args:
      plan: the step plan (`build_step`'s), before compilation.

    Returns:
      The texts, in group order, then the plan's executable order.
    """
    out = {}
    with jax.set_mesh(None):
        for g, exes in enumerate(plan.exes):
            for name, exe in exes.items():
                ins, _ = plan.exe_avals[g][name]
                structs = [jax.ShapeDtypeStruct(a.shape, np.dtype(a.dtype)) for a in ins]
                closed = jax.make_jaxpr(exe.fn)(*structs)
                out[f"group {g} executable {name}"] = jaxpr_text(closed)
    return out
