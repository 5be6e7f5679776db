"""Backward tasks recomputing matrix products (`Note: recomputed residuals`, a GPU's
`dot_intensity`), forced on CPU: the step still matches jax.jit, and an attention's scores
no longer cross from the forward to the backward task."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from models import assert_close_to_reference, make_step, run_steps, schedule, transformer

import jaxpp_mpi as jp
from jaxpp_mpi._src.compiler import split
from jaxpp_mpi._src.ir.program import Run


def _forward_outputs(plan) -> int:
    """Bytes group 0's forward tasks write per step."""
    gp = plan.program.group(0)
    avals = dict(gp.avals)
    return sum(math.prod(avals[b].shape) * np.dtype(avals[b].dtype).itemsize
               for i in gp.instrs if isinstance(i, Run) and i.task.startswith("F")
               for b in i.outs)


@pytest.mark.parametrize("name", ["1f1b", "zerobubble"])
def test_recomputed_products_match_jit(name, monkeypatch):
    sched = schedule(name, 2)
    params, batch, loss_fn = transformer(sched.num_stages, 4, d=32, seq=16)
    step, optimizer = make_step(loss_fn, sched)
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    state = lambda: (optimizer.init(params), params, batch)  # noqa: E731
    kept = jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(*state())
    monkeypatch.setitem(split.DOT_INTENSITY, "cpu", 150.0)
    shrunk = jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(*state())
    assert _forward_outputs(shrunk.plan) < _forward_outputs(kept.plan)
    reference = run_steps(jax.jit(step), *state(), steps=2)
    got = run_steps(shrunk, *state(), steps=2)
    assert assert_close_to_reference(reference, got) == len(jax.tree.leaves(reference))
