"""`mpmd_jit_by_yield` (a function with stage marks and no loop, run once through its
stages) and `cross_mpmd_all_reduce` in local mode, against `jax.jit` of the same function
(`Note: by_yield as a one-microbatch loop`, `Note: cross-group sums`).
"""

from __future__ import annotations

import functools
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from models import assert_tree_close, mlp

import jaxpp_mpi as jp
from jaxpp_mpi._src.frontend.by_yield import StagesInOrder, mpmd_jit_by_yield
from jaxpp_mpi._src.ir.program import Run
from jaxpp_mpi._src.primitives.cross_mpmd import cross_mpmd_all_reduce

RTOL = 1e-6
TASK_RE = re.compile(r"([FBIW])(\d+)s(\d+)")


@functools.cache
def mpmd_mesh(groups: int = 2) -> jp.MpmdMesh:
    return jp.MpmdMesh(jax.make_mesh((groups, 1), ("stage", "data")), "stage")


def one_batch(num_stages: int):
    """tests/models.py's mlp with one (inputs, targets) batch, no microbatch axis."""
    params, batch, loss_fn = mlp(num_stages, 1)
    return params, jax.tree.map(lambda a: a[0], batch), loss_fn


def assert_matches(ref, out) -> None:
    assert_tree_close(ref, out, RTOL, 0)

def stage_tasks(compiled: jp.MpmdCompiled, group: int) -> list[tuple[str, int]]:
    """(kind, stage) of each loop task group `group` runs, in order."""
    out = []
    for instr in compiled.program(group).instrs:
        if isinstance(instr, Run) and (m := TASK_RE.fullmatch(instr.task)):
            out.append((m.group(1), int(m.group(3))))
    return out


# ------------------------------------------------------------------- mpmd_jit_by_yield


@pytest.mark.parametrize("num_stages", [2, 4], ids=["1_stage_per_group", "2_stages_per_group"])
def test_by_yield_mlp_forward_matches_jit(num_stages):
    """The MLP's forward (loss and max activation) pipelined over 2 groups equals
    jax.jit's; stage s runs on group s % 2, forwards only, and the results live on the
    last stage's group."""
    params, batch, loss_fn = one_batch(num_stages)
    fun = mpmd_jit_by_yield(loss_fn, mpmd_mesh(), target_num_stages=num_stages)
    out = fun(params, batch)
    assert_matches(jax.jit(loss_fn)(params, batch), out)
    compiled = fun.compile(params, batch)
    for g in range(2):
        assert stage_tasks(compiled, g) == [("F", s) for s in range(g, num_stages, 2)]
    assert all(x.mpmd_idxs == {1} for x in jax.tree.leaves(out))


def test_by_yield_with_gradients_inside_runs_the_backward():
    """A function that takes value_and_grad inside (no loop) runs its backward stages
    too; loss and gradients equal jax.jit's, each gradient on its stage's group."""
    params, batch, loss_fn = one_batch(2)
    fun = partial(jax.value_and_grad(loss_fn, has_aux=True))
    out = mpmd_jit_by_yield(fun, mpmd_mesh())(params, batch)
    assert_matches(jax.jit(fun)(params, batch), out)
    grads = out[1]
    assert [w.mpmd_idxs for w, _ in grads] == [{0}, {1}]


def test_by_yield_as_decorator():
    """Used as a decorator, with mpmd_mesh by keyword; the wrapper keeps `fun`'s name."""

    def forward(params, x):
        for w, b in params:
            x = jp.mark_stage_end(jnp.tanh(x @ w + b))
        return x

    pipelined = mpmd_jit_by_yield(mpmd_mesh=mpmd_mesh())(forward)
    params, (x, _), _ = one_batch(2)
    assert pipelined.__name__ == "forward"
    assert_matches(jax.jit(forward)(params, x), pipelined(params, x))


def test_by_yield_keyword_and_static_arguments():
    """Keyword arguments reach `fun`, and a static one (static_argnames, passed on to
    mpmd_jit_with_loop) picks the function traced: equal to jax.jit with the same."""

    def forward(params, x, *, act, scale):
        for w, b in params:
            x = jp.mark_stage_end(getattr(jnp, act)(x @ w + b) * scale)
        return x

    pipelined = mpmd_jit_by_yield(forward, mpmd_mesh(), static_argnames="act")
    reference = jax.jit(forward, static_argnames="act")
    params, (x, _), _ = one_batch(2)
    for act in ("tanh", "sin"):
        kwargs = {"act": act, "scale": jnp.float32(0.5)}
        assert_matches(reference(params, x, **kwargs), pipelined(params, x, **kwargs))


def _no_marks(w, x):
    return x @ w


def _two_marks(w, x):
    return jp.mark_stage_end(jp.mark_stage_end(x @ w) @ w)


def _one_mark(w, x):
    return jp.mark_stage_end(x @ w)


def _with_treduce(w, x):
    body = lambda row: jp.mark_stage_end(jp.mark_stage_end(row @ w))
    return jp.treduce(body, x, jp.GPipe(2), operation=jp.Concat())


@pytest.mark.parametrize(
    ("fun", "kwargs", "match"),
    [
        (_no_marks, {}, "has no stage marks.*mark_stage_end"),
        (_two_marks, {"target_num_stages": 4}, "has 2 stage marks .* but target_num_stages=4"),
        (_one_mark, {}, "has 1 stage.*fewer than the mesh's 2 MPMD groups"),
        (_with_treduce, {}, "calls treduce.*no microbatch loop.*mpmd_jit_with_loop"),
    ],
    ids=["no_marks", "target_mismatch", "fewer_stages_than_groups", "treduce_inside"],
)
def test_by_yield_rejects_bad_functions(fun, kwargs, match):
    """Each bad function raises a CompileError naming it, what is wrong and the fix."""
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    with pytest.raises(jp.CompileError, match=match) as info:
        mpmd_jit_by_yield(fun, mpmd_mesh(), **kwargs)(w, x)
    assert fun.__name__ in str(info.value)


def test_by_yield_rejects_bad_options():
    with pytest.raises(TypeError, match="needs mpmd_mesh, an MpmdMesh"):
        mpmd_jit_by_yield(_two_marks, None)
    with pytest.raises(ValueError, match="target_num_stages must be a positive integer"):
        mpmd_jit_by_yield(_two_marks, mpmd_mesh(), target_num_stages=0)


def test_stages_in_order_schedule():
    """Group r runs its stages r, r + d, ... forward in order, backward in reverse."""
    sched = StagesInOrder(4, mpmd_dim=2)
    labels = [[f"{t.type.value}{t.stage_id}" for t in group] for group in sched.tasks(1)]
    assert labels == [["F0", "F2", "B2", "B0"], ["F1", "F3", "B3", "B1"]]
    assert [sched.get_mpmd_idx(s) for s in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="every group must run at least one stage"):
        StagesInOrder(1, mpmd_dim=2)


# ---------------------------------------------------------------- cross_mpmd_all_reduce


def test_cross_mpmd_all_reduce_of_stage_partials_by_yield():
    """Per-stage partial sums (one per group, stage s on group s % 2) add up to jax.jit's
    sum on the last stage's group."""

    def forward(params, x):
        partials = []
        for w, b in params:
            x = jnp.tanh(x @ w + b)
            partials.append(jnp.sum(x * x))
            x = jp.mark_stage_end(x)
        return x, cross_mpmd_all_reduce(*partials)

    params, (x, _), _ = one_batch(4)
    out = mpmd_jit_by_yield(forward, mpmd_mesh())(params, x)
    assert_matches(jax.jit(forward)(params, x), out)
    assert out[1].mpmd_idxs == {1}


def test_cross_mpmd_all_reduce_after_the_loop():
    """A global gradient-norm clip: each stage's squared gradient norm (on its group) is
    summed after the loop; every group's update reads the sum. Equal to jax.jit's; the
    norm is held by the lowest group."""
    params, batch, loss_fn = mlp(2, 4)
    sched = jp.Std1F1B(2)

    def step(params, batch):
        grad_fn = partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, _), grads = jp.treduce(grad_fn, batch, schedule=sched)
        norms = [sum(jnp.sum(g * g) for g in layer) for layer in grads]
        norm = jnp.sqrt(cross_mpmd_all_reduce(*norms))
        scale = jnp.minimum(1.0, 0.5 / norm)
        new = jax.tree.map(lambda p, g: p - 0.1 * scale * g, params, grads)
        return new, losses, norm

    ref = jax.jit(step)(params, batch)
    out = jp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh())(params, batch)
    # The stage executables fuse differently from jax.jit's one program: gradients (and
    # so the norm) differ in the last bits, as in the other training-step parity tests.
    for r, o in zip(jax.tree.leaves(ref), jax.tree.leaves(out)):
        np.testing.assert_allclose(np.asarray(o), np.asarray(r), rtol=1e-5, atol=1e-7)
    assert out[2].mpmd_idxs == {0}
    assert [w.mpmd_idxs for w, _ in out[0]] == [{0}, {1}]


def test_cross_mpmd_all_reduce_checks_and_eager():
    """Eagerly the sum in argument order; JaxPP's dtype check, and a shape check."""
    a, b, c = jnp.float32(1.5), jnp.float32(2.25), jnp.float32(-0.5)
    assert float(cross_mpmd_all_reduce(a, b, c)) == (1.5 + 2.25) - 0.5
    with pytest.raises(TypeError, match="same dtype.*float32.*int32"):
        cross_mpmd_all_reduce(jnp.ones(2), jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match=r"same shape.*\(2,\).*\(3,\)"):
        cross_mpmd_all_reduce(jnp.ones(2), jnp.ones(3))
    with pytest.raises(TypeError, match="at least one value"):
        cross_mpmd_all_reduce()
