"""The program hash covers what the step computes (`Note: step fingerprints` in
compiler/fingerprint.py): the text is the same for separate traces of the same step, and
ranks tracing different arithmetic are refused on every rank, naming the first differing
line of the traced step. Two ranks are two threads over a stand-in communicator."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from models import make_step, mlp
from thread_comm import on_thread_ranks

import jaxpp_mpi
from jaxpp_mpi._src.compiler.build import build_step
from jaxpp_mpi._src.compiler.fingerprint import STEP, step_texts
from jaxpp_mpi._src.runtime import agree

ROOT = Path(__file__).resolve().parents[3]


def _plan(sign: float = 1.0, scale: float = 1.0):
    params, batch, _ = mlp(2, 4)

    def loss_fn(params, mb):
        x, y = mb
        for w, b in params:
            x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ w + b if sign > 0 else x @ w - b))
        return jnp.mean((x - y) ** 2) * scale, {"max": jnp.max(x)}

    step_fn, opt = make_step(loss_fn, jaxpp_mpi.Std1F1B(2))
    return build_step(step_fn, (opt.init(params), params, batch), 2)


def _agree_on_two_ranks(plans) -> list[BaseException | None]:
    def rank(r: int, comm) -> None:
        agree.agree_on_program(plans[r].program, comm,
                               computations=lambda: step_texts(plans[r]))

    return [error for _, error in on_thread_ranks(2, rank)]


def test_two_traces_of_one_step_give_the_same_texts_without_addresses():
    a, b = step_texts(_plan()), step_texts(_plan())
    assert a == b and list(a) == [STEP]
    assert "treduce" in a[STEP] and " at 0x" not in a[STEP]


def test_the_texts_do_not_depend_on_the_process():
    code = ("import hashlib, sys; sys.path[:0] = ['tests', 'tests/unit/runtime'];"
            "from test_fingerprint import _plan;"
            "from jaxpp_mpi._src.compiler.fingerprint import step_texts;"
            "t = step_texts(_plan());"
            "print(hashlib.sha256(repr(sorted(t.items())).encode()).hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="random")
    theirs = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                            capture_output=True, text=True).stdout.strip()
    mine = step_texts(_plan())
    assert theirs == hashlib.sha256(repr(sorted(mine.items())).encode()).hexdigest()


def test_same_code_on_every_rank_agrees():
    assert _agree_on_two_ranks([_plan(), _plan()]) == [None, None]


@pytest.mark.parametrize("other", [
    {"sign": -1.0},  # another operation, the same shapes
    {"scale": 2.0},  # another constant
], ids=["operation", "constant"])
def test_different_arithmetic_on_one_rank_is_refused_on_every_rank(other):
    plans = [_plan(), _plan(**other)]
    assert plans[0].program.hash() == plans[1].program.hash()  # invisible to the program
    errors = _agree_on_two_ranks(plans)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert str(errors[0]) == str(errors[1])
    message = str(errors[0])
    assert "the ranks traced different code" in message
    assert f"rank 1 differs from rank 0 first in {STEP}, at jaxpr line " in message
    # The line shown is the step's own: rank 1's text has it, rank 0's does not.
    shown = message.split("rank 1:  ")[1].strip()
    assert shown in step_texts(plans[1])[STEP] and shown not in step_texts(plans[0])[STEP]


def test_local_mode_computes_no_fingerprint():
    def never():
        raise AssertionError("fingerprints computed without a communicator")

    agree.agree_on_program(_plan().program, None, computations=never)
