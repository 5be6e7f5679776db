"""An internal error of the compiler names the step, the task's stage and the source line
of the operation involved, and says how to report it (compiler/internal_errors.py)."""

from __future__ import annotations

import inspect
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpp_mpi
from jaxpp_mpi._src.base.errors import CompileError
from jaxpp_mpi._src.compiler import build, step_entry


def _loss(params, mb):
    x, y = mb
    x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ params[0]))
    x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ params[1]))
    return jnp.mean((x - y) ** 2)  # the line the error must name


LOSS_LINE = inspect.getsourcelines(_loss)[1] + 3


def _step(params, batch):
    loss, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(_loss), params), batch,
                                    schedule=jaxpp_mpi.Std1F1B(2))
    return [p - 0.1 * g for p, g in zip(params, grads)], loss


ARGS = ([np.ones((4, 4), np.float32)] * 2, (np.ones((2, 2, 4), np.float32),) * 2)


def _value_made_by_sub(monkeypatch) -> str:
    """The name the split pass gives the loss's `x - y` (recorded by spying on it)."""
    seen = {}
    original = build.split_body

    def spy(*args, **kwargs):
        seen["split"] = original(*args, **kwargs)
        return seen["split"]

    monkeypatch.setattr(build, "split_body", spy)
    build.build_step(_step, ARGS, 2, what="train_step")
    split = seen["split"]
    return next(name for name, eqn in split.value_eqns.items()
                if eqn.primitive.name == "sub" and split.value_task[name][1] == 1)


def test_an_internal_error_names_step_stage_line_and_how_to_report(monkeypatch):
    value = _value_made_by_sub(monkeypatch)

    def broken_lowering(graph, *args, **kwargs):
        raise ValueError(f"task B0s1 on group 1: input '{value}@0' is never produced")

    monkeypatch.setattr(step_entry, "lower_cached", broken_lowering)
    with pytest.raises(CompileError) as info:
        build.build_step(_step, ARGS, 2, what="train_step")
    text = str(info.value)
    assert text.startswith("train_step: internal error while building the program: task "
                           f"B0s1 on group 1: input '{value}@0' is never produced")
    assert "task B0s1 runs stage 1" in text
    assert re.search(rf"value {value} is made by `sub` in stage 1's BWD task, at "
                     rf"\S*test_internal_errors\.py:{LOSS_LINE} \(_loss\)", text), text
    assert "bug in jaxpp_mpi" in text and "please report it" in text
    assert "jax.make_jaxpr(step)(*args)" in text


def test_an_error_naming_no_value_still_says_how_to_report(monkeypatch):
    def broken_lowering(graph, *args, **kwargs):
        raise ValueError("group 0 deadlocks at instruction 3")

    monkeypatch.setattr(step_entry, "lower_cached", broken_lowering)
    with pytest.raises(CompileError, match=r"^train_step: internal error while building the "
                       r"program: group 0 deadlocks at instruction 3\. This is a bug in "
                       r"jaxpp_mpi.*please report it"):
        build.build_step(_step, ARGS, 2, what="train_step")
