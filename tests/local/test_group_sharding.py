"""Every device of a group does its share: layouts through the pipeline (`Note: layouts`).

Local mode, 2 groups of 2 or 4 CPU devices each (axes "data" and "model"). The references
are independent of the pipeline: the per-device FLOPs of plain `jax.jit` of the same step
on one group's mesh (XLA's cost analysis; one microbatch, so the reference has no loop,
whose body XLA would count once), and the values of the step under plain `jax.jit` on one
device.
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from models import (
    SCHEDULES,
    all_reduced,
    assert_close_to_reference,
    make_step,
    megatron_specs,
    mlp,
    run_steps,
    schedule,
    transformer,
)

import jaxpp_mpi as jp

MODELS = {"mlp": mlp, "transformer": transformer}
LAYOUTS = {"data": (2, 1), "model": (1, 2), "data_model": (2, 2)}


@functools.cache
def mpmd_mesh(data: int, model: int) -> jp.MpmdMesh:
    mesh = jax.make_mesh((2, data, model), ("stage", "data", "model"),
                         axis_types=(AxisType.Auto,) * 3)
    return jp.MpmdMesh(mesh, "stage")


def problem(model: str, sched: str, num_microbatches: int):
    s = schedule(sched, 2)
    params, batch, loss_fn = MODELS[model](s.num_stages, num_microbatches)
    # Strongly typed, as results are: a weak-typed leaf would recompile (as in jax.jit).
    params = jax.tree.map(lambda x: jax.numpy.asarray(np.asarray(x)), params)
    step, optimizer = make_step(loss_fn, s)
    pspecs, bspecs = megatron_specs(model, params, batch)
    return step, optimizer, params, batch, (pspecs, bspecs)


def flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost["flops"])


@functools.cache
def compiled_pair(model: str, layout: str):
    """(pipelined compiled step, jax.jit of the same step on one group's mesh), one
    microbatch, Megatron layouts."""
    data, model_axis = LAYOUTS[layout]
    step, optimizer, params, batch, (pspecs, bspecs) = problem(model, "gpipe", 1)
    state = optimizer.init(params)
    pipelined = jp.mpmd_jit_with_loop(
        step, mpmd_mesh=mpmd_mesh(data, model_axis), in_shardings=(None, pspecs, bspecs)
    ).compile(state, params, batch)
    group = jax.make_mesh((data, model_axis), ("data", "model"),
                          axis_types=(AxisType.Auto,) * 2,
                          devices=jax.devices()[: data * model_axis])
    named = lambda t: jax.tree.map(lambda s: NamedSharding(group, s), t,
                                   is_leaf=lambda x: isinstance(x, P))
    reference = jax.jit(step, in_shardings=(named(jax.tree.map(lambda _: P(), state)),
                                            named(pspecs), named(bspecs)))
    return pipelined, reference.lower(state, params, batch).compile()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_per_device_flops_match_jax_jit_on_the_group_mesh(model, layout):
    pipelined, reference = compiled_pair(model, layout)
    per_group = [g["flops"] for g in pipelined.cost_analysis()]
    assert sum(per_group) == pytest.approx(flops(reference), rel=0.10)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_values_between_tasks_carry_layouts(model):
    pipelined, _ = compiled_pair(model, "data_model")
    text = str(pipelined.program())
    assert "{_,data" in text or "{data" in text  # activations split over the batch rows
    # Both ends of every message agree (the program verifies with the layouts in it).
    from jaxpp_mpi._src.ir.simulate import verify

    verify(pipelined.program())


def test_data_parallel_forward_tasks_gather_nothing():
    pipelined, _ = compiled_pair("mlp", "data")
    for g in range(2):
        names = [n for n in pipelined.cost_analysis()[g]["per_executable"] if n.startswith("F")]
        assert names
        for name in names:
            assert "all-gather" not in pipelined.as_text(g, name)


@functools.cache
def trained(model: str, sched: str):
    """Three donated adam steps on 2 groups of data=2 x model=2 and, as the reference,
    under plain jax.jit on one device."""
    step, optimizer, params, batch, (pspecs, bspecs) = problem(model, sched, 4)
    reference = run_steps(jax.jit(step), optimizer.init(params), params, batch)
    f = jp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2, 2),
                              in_shardings=(None, pspecs, bspecs), donate_argnums=(0, 1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run_steps(f, optimizer.init(params), params, batch)
    return reference, got, f, [str(w.message) for w in caught]


@pytest.mark.parametrize("sched", SCHEDULES)
def test_mlp_matches_jax_jit_for_every_schedule(sched):
    reference, got, f, caught = trained("mlp", sched)
    assert assert_close_to_reference(reference, got) > 0
    assert not [m for m in caught if "donat" in m]
    assert len(f._cache) == 1  # one compile across the training loop


def test_transformer_matches_jax_jit():
    reference, got, _, caught = trained("transformer", "1f1b")
    assert assert_close_to_reference(reference, got) > 0
    assert not [m for m in caught if "donat" in m]


def test_model_split_weights_stay_split_after_three_steps():
    _, got, _, _ = trained("mlp", "1f1b")
    params = got[1]
    w0, w1 = params[0][0], params[1][0]
    assert isinstance(w0, jp.MpmdArray)
    for w, shard in ((w0, (16, 8)), (w1, (8, 16))):
        local = w.first_mpmd_replica
        assert {s.data.shape for s in local.addressable_shards} == {shard}
    np.testing.assert_array_equal(np.asarray(w0.first_mpmd_replica).shape, (16, 16))


def all_reduced_per_step(compiled, group: int) -> dict[str, int]:
    """Per executable kind of `group`'s program (F, B, FB for a fused pair: `Note:
    back-to-back tasks`; '' outside the loop), the elements all-reduced in one step:
    each executable's `all_reduced` times the runs of it in the program."""
    from jaxpp_mpi._src.ir.program import Run

    counts: dict[str, int] = {}
    for instr in compiled.program(group).instrs:
        if isinstance(instr, Run):
            n = all_reduced(compiled.as_text(group, instr.exe))
            kind = compiled.plan.exes[group][instr.exe].family.rstrip("0123456789")
            counts[kind] = counts.get(kind, 0) + n
    return counts


@functools.cache
def data_parallel(num_microbatches: int):
    step, optimizer, params, batch, (pspecs, bspecs) = problem("mlp", "1f1b", num_microbatches)
    return jp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2, 1),
                                 in_shardings=(None, pspecs, bspecs)).compile(
        optimizer.init(params), params, batch)


def test_data_parallel_gradients_are_reduced_once_per_step():
    """`Note: deferred reduction`: the weight gradients of a data=2 group are summed
    per device over the microbatches and all-reduced once, after the stage's last
    backward; so a step's backward all-reduces do not grow with the microbatch count
    (per microbatch they would: 2 -> 4 microbatches doubles them). Group 1 runs its F
    and B as one task (`Note: back-to-back tasks`): there every variant also holds the
    forward's own all-reduces of the loss and its aux (rows split over "data"), which
    do run once per microbatch; only `_last` adds the gradients'."""
    compiled = data_parallel(4)
    weights = 16 * 16 + 16  # one stage's w and b (the MLP of `problem`)
    for g, kind in enumerate(("B", "FB")):
        family = f"{kind}{g}"
        count = lambda name: all_reduced(compiled.as_text(g, name))  # noqa: B023
        forward = count(family)  # the plain variant: no gradient all-reduce
        assert forward == (0 if kind == "B" else 2), g  # the loss's sum, the aux's max
        assert count(f"{family}_first") == forward, g
        assert count(f"{family}_last") == forward + weights, g
        two = all_reduced_per_step(data_parallel(2), g)
        four = all_reduced_per_step(data_parallel(4), g)
        assert four[kind] - two[kind] == 2 * forward, (g, two, four)


def test_only_add_states_take_their_values_layout(monkeypatch):
    """A deferred family's tasks give each `Add` state's new value the state's Explicit
    type (`deferred.like`); a `Concat` state (here the per-microbatch losses) takes its
    microbatch's row as it is. JAX 0.11 refused a scalar laid out as the whole row, which
    silently sent the family back to per-microbatch reduction."""
    from jaxpp_mpi._src.compiler import deferred

    like = deferred.like
    calls = []

    def checked(v, state):
        calls.append((jax.typeof(v).shape, jax.typeof(state).shape))
        return like(v, state)

    monkeypatch.setattr(deferred, "like", checked)
    compiled = data_parallel.__wrapped__(4)  # compiled afresh, not an earlier test's
    assert calls and all(v == s for v, s in calls), calls
    families = {(g, name.split("_")[0]) for g, name in compiled._compiler.unreduced}
    assert families == {(0, "B0"), (1, "FB1")}, sorted(compiled._compiler.unreduced)


def test_each_executable_is_compiled_once(monkeypatch):
    """The layout pass compiles every executable of a multi-device group, those of the
    families whose gradient sums are deferred the deferred way (`Note: deferred
    reduction`): none is compiled again afterwards."""
    from collections import Counter

    from jaxpp_mpi._src.compiler import deferred
    from jaxpp_mpi._src.driver import group_compiler

    counts: Counter = Counter()

    def counting(fn):
        def wrapped(exe, *args, **kwargs):
            counts[id(exe)] += 1
            return fn(exe, *args, **kwargs)
        return wrapped

    monkeypatch.setattr(group_compiler, "compile_exe", counting(group_compiler.compile_exe))
    monkeypatch.setattr(deferred, "compile_deferred", counting(deferred.compile_deferred))
    step, optimizer, params, batch, (pspecs, bspecs) = problem("mlp", "1f1b", 4)
    compiled = jp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2, 1),
                                     in_shardings=(None, pspecs, bspecs)).compile(
        optimizer.init(params), params, batch)
    exes = {id(e): (g, n) for g, group in enumerate(compiled.plan.exes) for n, e in group.items()}
    assert compiled._compiler.unreduced  # some families are deferred
    assert set(counts) == set(exes), sorted(exes[k] for k in set(exes) - set(counts))
    assert max(counts.values()) == 1, sorted(exes[k] for k, c in counts.items() if c > 1)


def test_a_family_refused_after_its_first_variant_is_reduced_per_microbatch(monkeypatch):
    """A deferred family one of whose later variants Explicit mode refuses falls back
    whole to per-microbatch reduction: its variants compiled so far are dropped and
    compiled as usual, and the step still matches jax.jit."""
    from jaxpp_mpi._src.compiler import deferred

    compile_variant = deferred.compile_variant

    def refusing(exe, *args, **kwargs):
        if exe.family == "FB1" and not deferred.first_variant(exe):
            raise TypeError("refused (test)")
        return compile_variant(exe, *args, **kwargs)

    monkeypatch.setattr(deferred, "compile_variant", refusing)
    step, optimizer, params, batch, (pspecs, bspecs) = problem("mlp", "1f1b", 4)
    f = jp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(2, 1),
                              in_shardings=(None, pspecs, bspecs), donate_argnums=(0, 1))
    reference = run_steps(jax.jit(step), optimizer.init(params), params, batch)
    got = run_steps(f, optimizer.init(params), params, batch)
    assert assert_close_to_reference(reference, got) > 0
    compiled = next(iter(f._cache.values()))
    families = {name.split("_")[0] for _, name in compiled._compiler.unreduced}
    assert families == {"B0"}, sorted(compiled._compiler.unreduced)
    # FB1 fell back: every variant all-reduces its microbatch's gradients (one stage's
    # w and b) besides the loss's sum and the aux's max
    b1 = [n for n in compiled.cost_analysis()[1]["per_executable"] if n.startswith("FB1")]
    assert b1 and all(all_reduced(compiled.as_text(1, n)) == 16 * 16 + 16 + 2 for n in b1), b1
