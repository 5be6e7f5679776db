"""A stage's forward and backward that the schedule runs back to back are one task
(`Note: back-to-back tasks` in compiler/loop_order.py).

Checked: which pairs fuse (the last stage under 1F1B-like schedules and ZeroBubble's
F + I; nothing under GPipe), that the fused programs compute bit for bit what the same
programs with every task apart compute, and that both match plain `jax.jit`, and that
the last group's executables write fewer bytes (the residuals stay inside).
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pytest
from models import (
    assert_close_to_reference,
    bits,
    held_values,
    make_step,
    mlp,
    run_steps,
    schedule,
    transformer,
)

import jaxpp_mpi as jp
from jaxpp_mpi._src.compiler import loop_order, split
from jaxpp_mpi._src.compiler.build import build_step
from jaxpp_mpi._src.ir.program import Run
from jaxpp_mpi.trace import parse_label


def _plan(name: str, n: int = 4):
    sched = schedule(name, 2)
    params, batch, loss_fn = mlp(sched.num_stages, n, width=4, rows=2)
    step, optimizer = make_step(loss_fn, sched)
    return sched, build_step(step, (optimizer.init(params), params, batch), 2)


def _runs(plan, g: int) -> list[str]:
    return [i.task for i in plan.program.group(g).instrs if isinstance(i, Run) and i.task
            and parse_label(i.task)[0].kind in "FBIW"]


@pytest.mark.parametrize(
    "name, fused",
    [
        ("1f1b", {1: "FB1"}),  # 2 stages: the last one's F and B
        ("eager1f1b", {1: "FB1"}),
        ("interleaved", {1: "FB3"}),  # 4 stages on 2 groups: stage 3 only
        ("zerobubble", {1: "FI1"}),  # W stays apart, run later
        ("gpipe", {}),  # F and B back to back at the turn only: left apart
        ("dualpipev", {}),
    ],
)
def test_which_pairs_fuse(name, fused):
    sched, plan = _plan(name)
    for g in range(2):
        families = {e.family for e in plan.exes[g].values() if e.family}
        labels = _runs(plan, g)
        if g in fused:
            family = fused[g]
            kinds, stage = family[:2], int(family[2:])
            assert family in families
            # the fused pair's own families are gone; every microbatch runs the pair
            assert not families & {f"{kinds[0]}{stage}", f"{kinds[1]}{stage}"}
            pairs = [t for t in labels if "+" in t]
            assert pairs == [f"{kinds[0]}{m}s{stage}+{kinds[1]}{m}s{stage}"
                             for m in range(4)], labels
        else:
            assert all("+" not in t for t in labels), labels
            assert all(len(f.rstrip("0123456789")) == 1 for f in families), families


def _apart(monkeypatch):
    monkeypatch.setattr(loop_order, "_back_to_back", lambda *a, **k: {})


def _written(group) -> int:
    """Bytes the executables of `group` write to the program's buffers in one step."""
    avals = dict(group.avals)
    return sum(math.prod(avals[b].shape) * np.dtype(avals[b].dtype).itemsize
               for i in group.instrs if isinstance(i, Run) for b in i.outs)


def test_fused_last_group_holds_no_residuals_between_tasks(monkeypatch):
    sched = schedule("1f1b", 2)
    params, batch, loss_fn = transformer(sched.num_stages, 4)
    step, optimizer = make_step(loss_fn, sched)
    args = (optimizer.init(params), params, batch)
    fused = build_step(step, args, 2).program
    _apart(monkeypatch)
    apart = build_step(step, args, 2).program
    assert _written(fused.group(0)) == _written(apart.group(0))
    # apart, F writes the residuals B reads; fused, they never leave the executable
    assert _written(fused.group(1)) < _written(apart.group(1))


@pytest.mark.parametrize("name", ["1f1b", "zerobubble", "interleaved"])
def test_fused_matches_apart_bit_for_bit_and_jit(name, monkeypatch):
    sched = schedule(name, 2)
    params, batch, loss_fn = transformer(sched.num_stages, 4)
    step, optimizer = make_step(loss_fn, sched)
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    state = lambda: (optimizer.init(params), params, batch)  # noqa: E731
    # Bit for bit under XLA's default CPU code generation: the tests' elemental emitter
    # (tests/conftest.py) rounds a fused module's arithmetic otherwise than the apart ones'.
    pipelined = functools.partial(jp.mpmd_jit_with_loop, mpmd_mesh=mesh,
                                  compiler_options={"xla_cpu_use_fusion_emitters": True})

    fused = pipelined(step).compile(*state())
    assert any("+" in t for t in _runs(fused.plan, 1))
    reference = run_steps(jax.jit(step), *state(), steps=2)
    got = run_steps(fused, *state(), steps=2)
    assert assert_close_to_reference(reference, got) == len(jax.tree.leaves(reference))
    # Bit for bit, the backward tasks read every residual as the forward task made it: a
    # recomputed one (Note: recomputed residuals in compiler/recompute.py) may differ from
    # the fused executable's in the last bit, as XLA fuses it differently.
    monkeypatch.setattr(split, "recompute_residuals", lambda eqns, where: [set() for _ in eqns])
    fused = pipelined(step).compile(*state())
    got = run_steps(fused, *state(), steps=2)
    with monkeypatch.context() as m:
        _apart(m)
        apart = pipelined(step).compile(*state())
        assert all("+" not in t for g in range(2) for t in _runs(apart.plan, g))
        want = run_steps(apart, *state(), steps=2)
    for a, b in zip(held_values(want), held_values(got)):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(bits(b), bits(a))
