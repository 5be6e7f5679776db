"""Golden program dumps: the compiled Program text for a few schedules, compared exactly.

Each case compiles the training step of `tests/models.py` (the tanh MLP under
`make_step`, one layer per stage) in local mode and compares `str(program)` with
`tests/golden/<name>.txt`, showing a unified diff on a mismatch. A change in lowering
(transfers, frees, tags, instruction order) therefore shows up in review as a change
of these files.

To accept an intended change, rewrite the files and review their diff:

    JAXPP_MPI_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/compiler/test_golden.py
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import jax
import models
import pytest

import jaxpp_mpi as jp
from jaxpp_mpi._src.ir.program import Program
from jaxpp_mpi.schedules import DualPipeV, GPipe, Interleaved1F1B, Std1F1B, ZeroBubble

GOLDEN_DIR = Path(__file__).resolve().parents[2] / "golden"
UPDATE = os.environ.get("JAXPP_MPI_UPDATE_GOLDEN") == "1"

# name -> (schedule, number of MPMD groups, number of microbatches)
CASES = {
    "std1f1b_s2_m4": (Std1F1B(2), 2, 4),
    "gpipe_s2_m4": (GPipe(2), 2, 4),
    "zerobubble_s2_m4": (ZeroBubble(2), 2, 4),
    "interleaved1f1b_s4_g2_m4": (Interleaved1F1B(4, 2), 2, 4),
    "dualpipev_s4_g2_m4": (DualPipeV(4, 2), 2, 4),
}


def program_text(schedule, groups: int, num_microbatches: int) -> str:
    """The whole Program of the MLP training step under `schedule`, as text."""
    params, batch, loss_fn = models.mlp(schedule.num_stages, num_microbatches, width=4,
                                        rows=2)
    step, optimizer = models.make_step(loss_fn, schedule)
    mesh = jp.MpmdMesh(jax.make_mesh((groups, 1), ("stage", "data")), "stage")
    compiled = jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(
        optimizer.init(params), params, batch)
    return str(compiled.program()) + "\n"


@pytest.mark.parametrize("name", sorted(CASES))
def test_program_matches_golden(name: str) -> None:
    text = program_text(*CASES[name])
    path = GOLDEN_DIR / f"{name}.txt"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"no golden {path}; run with JAXPP_MPI_UPDATE_GOLDEN=1"
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(
            expected.splitlines(keepends=True), text.splitlines(keepends=True),
            fromfile=f"golden/{name}.txt", tofile="compiled"))
        pytest.fail(f"program differs from golden/{name}.txt (rerun with "
                    f"JAXPP_MPI_UPDATE_GOLDEN=1 to accept):\n{diff}", pytrace=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_parses_back(name: str) -> None:
    text = (GOLDEN_DIR / f"{name}.txt").read_text()
    program = Program.parse(text)
    assert str(program) + "\n" == text
    assert Program.parse(str(program)) == program
