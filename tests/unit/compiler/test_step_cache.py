"""Step entries of the program cache: a relaunch of the same step builds no task graph,
and its plan equals a fresh one (`Note: program cache` in compiler/program_cache.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os

import jax
import models
import numpy as np
import pytest

import jaxpp_mpi as jp
from jaxpp_mpi._src.compiler import build, split, step_entry
from jaxpp_mpi._src.compiler.build import StepPlan, build_step
from jaxpp_mpi._src.compiler.program_cache import ProgramCache
from jaxpp_mpi._src.frontend import api
from jaxpp_mpi.schedules import Interleaved1F1B, Std1F1B

_NOT_COMPARED = ("exes", "consts", "outputs", "step_jaxpr", "program_from_cache",
                 "step_from_cache", "cache_read_s")


def plan_fields(plan: StepPlan) -> dict:
    """Everything a StepPlan carries, in a form that compares by value (an executable by
    its name, donations, family, states and fills; the traced step by its text)."""
    fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)
              if f.name not in _NOT_COMPARED}
    fields["exes"] = [[(name, e.donate_argnums, e.family, e.state_ins, e.state_outs,
                        repr(e.first_fills)) for name, e in group.items()]
                      for group in plan.exes]
    fields["exe_avals"] = [list(group.items()) for group in plan.exe_avals]  # in order
    fields["consts"] = [(np.asarray(c).dtype, np.asarray(c).tobytes()) for c in plan.consts]
    fields["outputs"] = repr(plan.outputs)
    fields["step_jaxpr"] = str(plan.step_jaxpr)
    fields["program_text"] = str(plan.program)
    return fields


def _forbid(monkeypatch, *names: str) -> None:
    """Makes each of `names`, as build.py or step_entry.py calls it, fail when called."""
    for name in names:
        def fail(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} called on a step entry hit")
        homes = [m for m in (build, step_entry) if hasattr(m, name)]
        assert homes, name
        for module in homes:
            monkeypatch.setattr(module, name, fail)


def _problem(schedule, scale: float = 1.0):
    """A fresh step (new closures, as a relaunch traces) and its arguments."""
    params, batch, loss_fn = models.mlp(schedule.num_stages, 4, width=4, rows=2)

    def scaled(params, mb):
        loss, aux = loss_fn(params, mb)
        return loss * scale, aux

    step, optimizer = models.make_step(scaled, schedule)
    return step, (optimizer.init(params), params, batch)


@pytest.mark.parametrize("schedule, shape", [
    (Std1F1B(2), (2, 1)), (Interleaved1F1B(4, 2), (2, 1)), (Std1F1B(2), (2, 2))],
    ids=["1f1b", "interleaved", "1f1b-data2"])
def test_relaunch_builds_no_task_graph_and_equals_a_fresh_plan(tmp_path, monkeypatch,
                                                               schedule, shape):
    mesh = jp.MpmdMesh(jax.make_mesh(shape, ("stage", "data")), "stage")
    cache = ProgramCache(str(tmp_path))
    fresh = build_step(*_problem(schedule), 2, mesh=mesh)
    first = build_step(*_problem(schedule), 2, mesh=mesh, program_cache=cache)
    assert not first.step_from_cache and not first.program_from_cache
    _forbid(monkeypatch, "loop_task_nodes", "TaskGraph", "lower_cached")
    again = build_step(*_problem(schedule), 2, mesh=mesh, program_cache=cache)
    assert again.step_from_cache and again.program_from_cache and again.cache_read_s > 0
    assert plan_fields(again) == plan_fields(fresh) == plan_fields(first)
    assert again.program.hash() == fresh.program.hash()


def test_relaunched_step_matches_jax_jit_and_says_what_it_skipped(tmp_path, monkeypatch,
                                                                  caplog):
    schedule = Std1F1B(2)
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    monkeypatch.setattr(api, "_program_cache", lambda: ProgramCache(str(tmp_path)))
    step, args = _problem(schedule)
    jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).step_plan(*args)  # the first launch
    _forbid(monkeypatch, "loop_task_nodes", "TaskGraph", "lower_cached")
    step, args = _problem(schedule)
    with caplog.at_level(logging.INFO, logger="jaxpp_mpi"):
        pipelined = jp.mpmd_jit_with_loop(step, mpmd_mesh=mesh).compile(*args)
    assert pipelined.plan.step_from_cache
    assert any("program cache hit: loop tasks, task graph, lowering and verification "
               "skipped" in r.getMessage() for r in caplog.records)
    reference = models.run_steps(jax.jit(step), *args)
    result = models.run_steps(pipelined, *args)
    assert models.assert_close_to_reference(reference, result) == len(
        jax.tree.leaves(reference))


def test_key_covers_the_step_and_its_options(tmp_path):
    """Another schedule, microbatch count, donation or way of sending is another step
    entry; another constant's value too, but its task graph is the same, so the
    lowering comes from the program entry."""
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    cache = ProgramCache(str(tmp_path))
    base = build_step(*_problem(Std1F1B(2)), 2, mesh=mesh, program_cache=cache)
    assert not base.program_from_cache
    params, batch, loss_fn = models.mlp(2, 6, width=4, rows=2)
    step, optimizer = models.make_step(loss_fn, Std1F1B(2))
    variants = [
        build_step(*_problem(Interleaved1F1B(4, 2)), 2, mesh=mesh, program_cache=cache),
        build_step(step, (optimizer.init(params), params, batch), 2, mesh=mesh,
                   program_cache=cache),
        build_step(*_problem(Std1F1B(2)), 2, mesh=mesh, program_cache=cache,
                   donate=[True] * len(jax.tree.leaves(_problem(Std1F1B(2))[1]))),
        build_step(*_problem(Std1F1B(2)), 2, mesh=mesh, program_cache=cache, sends="posted"),
    ]
    assert [p.program_from_cache for p in variants] == [False] * 4
    other_constant = build_step(*_problem(Std1F1B(2), scale=2.0), 2, mesh=mesh,
                                program_cache=cache)
    assert other_constant.program_from_cache and not other_constant.step_from_cache
    assert other_constant.program == base.program
    again = build_step(*_problem(Std1F1B(2), scale=2.0), 2, mesh=mesh, program_cache=cache)
    assert again.step_from_cache


def _step_entry_path(directory) -> str:
    """The one step entry in `directory` (a program entry has no plan data)."""
    (path,) = [os.path.join(directory, name) for name in os.listdir(directory)
               if b'"plan":{' in open(os.path.join(directory, name), "rb").read()]
    return path


def _flip(data: bytes) -> bytes:
    i = len(data) - 10
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]


def _foreign(data: bytes) -> bytes:
    """Another step's entry under this key: an executable renamed, checksummed anew."""
    line, _, body = data.partition(b"\n")
    body = body.replace(b'"exe_avals":[[["', b'"exe_avals":[[["x', 1)
    header = json.loads(line)
    header.update(sha256=hashlib.sha256(body).hexdigest(), length=len(body))
    return json.dumps(header, sort_keys=True).encode() + b"\n" + body


@pytest.mark.parametrize("damage", [_flip, lambda data: data[: len(data) // 2], _foreign],
                         ids=["flipped", "cut", "foreign"])
def test_damaged_or_foreign_step_entry_is_rebuilt(tmp_path, damage):
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    schedule = Std1F1B(2)
    cache = ProgramCache(str(tmp_path))
    first = build_step(*_problem(schedule), 2, mesh=mesh, program_cache=cache)
    path = _step_entry_path(tmp_path)
    with open(path, "rb") as f:
        good = f.read()
    with open(path, "wb") as f:
        f.write(damage(good))
    rebuilt = build_step(*_problem(schedule), 2, mesh=mesh, program_cache=cache)
    assert not rebuilt.step_from_cache and plan_fields(rebuilt) == plan_fields(first)
    with open(path, "rb") as f:
        assert f.read() == good  # the rebuilt entry replaced the damaged one
    assert build_step(*_problem(schedule), 2, mesh=mesh, program_cache=cache).step_from_cache


def test_another_split_of_the_same_step_is_another_entry(tmp_path, monkeypatch):
    """The key covers what the split decided: with its residuals recomputed or not
    (`Note: recomputed residuals` in compiler/recompute.py), one step has two task graphs
    of other executables, and neither reads the other's entry."""
    mesh = jp.MpmdMesh(jax.make_mesh((2, 1), ("stage", "data")), "stage")
    schedule = Std1F1B(2)
    cache = ProgramCache(str(tmp_path))
    params, batch, loss_fn = models.transformer(schedule.num_stages, 4)
    step, optimizer = models.make_step(loss_fn, schedule)
    args = (optimizer.init(params), params, batch)
    recomputed = build_step(step, args, 2, mesh=mesh, program_cache=cache)
    monkeypatch.setattr(split, "recompute_residuals",
                        lambda eqns, where: [set() for _ in eqns])
    fresh = build_step(step, args, 2, mesh=mesh)
    kept = build_step(step, args, 2, mesh=mesh, program_cache=cache)
    assert not kept.step_from_cache
    assert plan_fields(kept) == plan_fields(fresh) != plan_fields(recomputed)
    assert build_step(step, args, 2, mesh=mesh, program_cache=cache).step_from_cache
