"""Tests for the stage-boundary mark `mark_stage_end` / `stage_end_p`."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpp_mpi._src.primitives import stage_marks as primitives
from jaxpp_mpi._src.primitives.stage_marks import mark_stage_end, pipeline_enter_stage, stage_end_p


def _marks(jaxpr) -> list:
    """All stage marks of a jaxpr in eqn order, descending into sub-jaxprs."""
    out = []

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive is stage_end_p:
                out.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub.jaxpr if isinstance(sub, jax.extend.core.ClosedJaxpr) else sub)

    walk(jaxpr.jaxpr if isinstance(jaxpr, jax.extend.core.ClosedJaxpr) else jaxpr)
    return out


def _params():
    k0, k1, k2 = jax.random.split(jax.random.key(0), 3)
    return {
        "w0": jax.random.normal(k0, (4, 6)) * 0.5,
        "w1": jax.random.normal(k1, (6, 6)) * 0.5,
        "w2": jax.random.normal(k2, (6, 3)) * 0.5,
    }


def _loss(params, x, mark=True):
    m = mark_stage_end if mark else (lambda v, name=None: v)
    h = m(jnp.tanh(x @ params["w0"]), name="s0")
    h, count = m((jnp.tanh(h @ params["w1"]), jnp.sum(x > 0)), name="s1")
    loss = m(jnp.mean(h @ params["w2"]) ** 2, name="s2")
    return loss, {"count": count, "loss2": loss * 2.0}


X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


def test_identity_on_pytrees():
    tree = {"a": jnp.arange(3.0), "b": (jnp.int32(4), jnp.ones((2, 2), jnp.bfloat16))}
    out = mark_stage_end(tree, name="x")
    assert jax.tree.structure(out) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert mark_stage_end({}) == {}


def test_jit_lowering_is_identity():
    f = jax.jit(lambda x: mark_stage_end(x * 2.0) + 1.0)
    np.testing.assert_array_equal(f(jnp.arange(4.0)), jnp.arange(4.0) * 2.0 + 1.0)
    hlo = f.lower(jnp.arange(4.0)).as_text()
    assert "stage_end" not in hlo and "custom_call" not in hlo


def test_vmap():
    f = lambda x, y: mark_stage_end((x * 2.0, y))
    xs = jnp.arange(6.0).reshape(3, 2)
    a, b = jax.vmap(f, in_axes=(0, None), out_axes=(0, None))(xs, jnp.float32(1.0))
    np.testing.assert_array_equal(a, xs * 2.0)
    assert b.shape == ()
    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=(1, None)))(xs, jnp.float32(1.0))
    assert len(_marks(jaxpr)) == 1


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit, jax.checkpoint])
def test_grad_matches_unmarked(wrap):
    p = _params()
    vg = jax.value_and_grad(wrap(lambda p, x: _loss(p, x)), has_aux=True)
    ref = jax.value_and_grad(wrap(lambda p, x: _loss(p, x, mark=False)), has_aux=True)
    got, want = vg(p, X), ref(p, X)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    g = jax.grad(lambda p: wrap(lambda p, x: _loss(p, x))(p, X)[0])(p)
    jax.tree.map(np.testing.assert_array_equal, g, want[1])


def test_jvp_linearize_vjp():
    f = lambda x: mark_stage_end(jnp.sin(x)) * 3.0
    x, t = jnp.arange(3.0), jnp.ones(3)
    y, ty = jax.jvp(f, (x,), (t,))
    np.testing.assert_allclose(ty, 3.0 * jnp.cos(x))
    y2, lin = jax.linearize(f, x)
    np.testing.assert_allclose(lin(t), ty)
    _, vjp = jax.vjp(f, x)
    (ct,) = vjp(jnp.ones(3))
    np.testing.assert_allclose(ct, 3.0 * jnp.cos(x))
    np.testing.assert_array_equal(y, y2)


def test_integer_leaves_and_symbolic_zero_cotangents():
    def f(w, n):
        a, b, k = mark_stage_end((w * 2.0, w * 3.0, n))
        return jnp.sum(a) * k  # b unused: symbolic-zero cotangent

    g = jax.grad(f)(jnp.ones(3), jnp.int32(5))
    np.testing.assert_array_equal(g, jnp.full(3, 10.0))
    bwd = [e for e in _marks(jax.make_jaxpr(jax.grad(f))(jnp.ones(3), jnp.int32(5)))
           if e.params["direction"] == "bwd"]
    assert len(bwd) == 1
    # Int leaf 2 has no tangent; leaf 1's zero cotangent is instantiated.
    assert bwd[0].params["leaves"] == (0, 1)
    assert len(bwd[0].invars) == 2


def test_forward_then_reversed_backward_marks_with_has_aux():
    p = _params()
    jaxpr = jax.make_jaxpr(jax.value_and_grad(_loss, has_aux=True))(p, X)
    marks = _marks(jaxpr)
    got = [(e.params["direction"], e.params["name"]) for e in marks]
    assert got == [
        ("fwd", "s0"), ("fwd", "s1"), ("fwd", "s2"),
        ("bwd", "s2"), ("bwd", "s1"), ("bwd", "s0"),
    ]
    assert marks[1].params["leaves"] == (0, 1)  # fwd mark holds the int leaf too
    assert marks[4].params["leaves"] == (0,)  # bwd mark only the float one


def test_remat_does_not_duplicate_forward_marks():
    p = _params()
    f = jax.checkpoint(lambda p, x: _loss(p, x), policy=jax.checkpoint_policies.nothing_saveable)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(f, has_aux=True))(p, X)
    dirs = [e.params["direction"] for e in _marks(jaxpr)]
    assert dirs == ["fwd"] * 3 + ["bwd"] * 3


def test_marks_survive_dce():
    from jax.interpreters import partial_eval as pe

    jaxpr = jax.make_jaxpr(lambda x: (mark_stage_end(x * 2.0), x)[1])(jnp.ones(2)).jaxpr
    dced, _ = pe.dce_jaxpr(jaxpr, [True])
    assert len(_marks(dced)) == 1


def test_transpose_flips_direction():
    f = lambda x: mark_stage_end(x, name="m")
    (ct,) = jax.linear_transpose(f, jnp.ones(2))(jnp.arange(2.0))
    np.testing.assert_array_equal(ct, jnp.arange(2.0))
    jaxpr = jax.make_jaxpr(jax.linear_transpose(f, jnp.ones(2)))(jnp.arange(2.0))
    assert [e.params["direction"] for e in _marks(jaxpr)] == ["bwd"]
    once = jax.linear_transpose(f, jnp.ones(2))
    twice = jax.linear_transpose(lambda ct: once(ct)[0], jnp.ones(2))
    jaxpr = jax.make_jaxpr(twice)(jnp.arange(2.0))
    assert [e.params["direction"] for e in _marks(jaxpr)] == ["fwd"]


def test_pipeline_enter_stage_warns_once(monkeypatch):
    monkeypatch.setattr(primitives, "_warned_enter_stage", False)
    with pytest.warns(DeprecationWarning, match="mark_stage_end"):
        out = pipeline_enter_stage(jnp.ones(2))
    np.testing.assert_array_equal(out, jnp.ones(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeline_enter_stage(jnp.ones(2))


def test_bad_direction_rejected():
    with pytest.raises(ValueError, match="direction"):
        jax.make_jaxpr(lambda x: stage_end_p.bind(x, name=None, direction="up", leaves=(0,)))(
            jnp.ones(1)
        )
