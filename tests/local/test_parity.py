"""Pipelined training steps against plain `jax.jit`, for every schedule, in local mode.

Each test trains a small model for a few `optax.adam` steps twice, feeding the outputs of
step k back as the inputs of step k + 1:

* the pipelined step: `mpmd_jit_with_loop` over an `(S, 1)` mesh, `treduce` with the
  schedule under test, and `mark_stage_end` at the end of every stage;
* the reference: the same step under `jax.jit`, with a hand-written sequential loop over
  the microbatches (losses and aux stacked, gradients summed in microbatch order) and no
  stage marks, so that it shares no code with the library.

After every step the optimizer state, the updated params, the per-microbatch losses and
aux, and the summed gradients of the two must agree to float32 tolerance.

Compiles repeat a lot here (the stage tasks of schedules sharing a model, and the second
compile when a step's own MpmdArray outputs come back as inputs); tests/conftest.py's on-disk
XLA compilation cache turns those repeats into loads.

Models: a tanh MLP (one or two layers per stage, changing widths across stage boundaries)
and a small decoder-only transformer (token + learned position embedding on the first stage,
one pre-LN causal multi-head attention + MLP block per stage, final layernorm, unembedding
and softmax cross-entropy after the last stage mark).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpp_mpi

RTOL, ATOL = 1e-5, 1e-6
NUM_STEPS = 3
OPTIMIZER = optax.adam(1e-2)

# ------------------------------------------------------------------------------- schedules

# name -> schedule for S MPMD groups; the last three hold two stages per group.
SCHEDULES: dict[str, Callable[[int], jaxpp_mpi.BaseSchedule]] = {
    "GPipe": lambda s: jaxpp_mpi.GPipe(s),
    "Std1F1B": lambda s: jaxpp_mpi.Std1F1B(s),
    "Eager1F1B": lambda s: jaxpp_mpi.Eager1F1B(s),
    "ZeroBubble": lambda s: jaxpp_mpi.ZeroBubble(s),
    "Interleaved1F1B": lambda s: jaxpp_mpi.Interleaved1F1B(2 * s, s),
    "KimiK2": lambda s: jaxpp_mpi.KimiK2(2 * s, s),
    "DualPipeV": lambda s: jaxpp_mpi.DualPipeV(2 * s, s),
}


def rejects(schedule: str, groups: int, microbatches: int) -> bool:
    """DualPipeV needs at least num_stages microbatches: with S=4 (8 stages), 4 is too few."""
    return schedule == "DualPipeV" and microbatches < 2 * groups


@functools.cache
def local_mesh(groups: int) -> jaxpp_mpi.MpmdMesh:
    return jaxpp_mpi.MpmdMesh(jax.make_mesh((groups, 1), ("stage", "data")), "stage")


def identity(x):
    return x


# ---------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class Model:
    """A model for a given number of stages: `loss(params, microbatch, mark)`."""

    init: Callable[[np.random.Generator, int], Any]  # (rng, num_stages) -> params
    data: Callable[[np.random.Generator, int], Any]  # (rng, num_microbatches) -> batch
    loss: Callable[[Any, Any, Callable], tuple[jax.Array, dict]]


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> jax.Array:
    # NumPy draws: eager jax.random would compile one tiny kernel per shape.
    return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32))


# MLP: stage i has 1 + i % 2 tanh layers; widths change at stage boundaries.
MLP_IN, MLP_OUT, MLP_MICROBATCH = 8, 6, 4


def _mlp_widths(num_stages: int) -> list[list[int]]:
    """Per stage, the widths of its layers' outputs (the last stage ends at MLP_OUT)."""
    widths = [[12 + 4 * (i % 2)] * (1 + i % 2) for i in range(num_stages)]
    widths[-1][-1] = MLP_OUT
    return widths


def mlp_init(rng: np.random.Generator, num_stages: int) -> list[list[dict]]:
    params, fan_in = [], MLP_IN
    for stage_widths in _mlp_widths(num_stages):
        stage = []
        for width in stage_widths:
            stage.append(
                {"w": _normal(rng, (fan_in, width), fan_in**-0.5), "b": _normal(rng, (width,), 0.1)}
            )
            fan_in = width
        params.append(stage)
    return params


def mlp_data(rng: np.random.Generator, num_microbatches: int) -> tuple[jax.Array, jax.Array]:
    return (
        _normal(rng, (num_microbatches, MLP_MICROBATCH, MLP_IN), 1.0),
        _normal(rng, (num_microbatches, MLP_MICROBATCH, MLP_OUT), 0.5),
    )


def mlp_loss(params, microbatch, mark):
    x, y = microbatch
    for stage in params:
        for layer in stage:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        x = mark(x)
    err = (x - y) ** 2
    return jnp.mean(err), {"max_out": jnp.max(x), "err_per_feature": jnp.mean(err, axis=0)}


# Transformer: vocab 32, d_model 16, 2 heads, sequence 8, microbatch 2.
VOCAB, D_MODEL, HEADS, SEQ, TF_MICROBATCH = 32, 16, 2, 8, 2


def _layernorm(p: dict, h: jax.Array) -> jax.Array:
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean((h - mean) ** 2, axis=-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]


def _ln_init() -> dict:
    return {"g": jnp.ones(D_MODEL), "b": jnp.zeros(D_MODEL)}


def _attention(p: dict, h: jax.Array) -> jax.Array:
    batch, seq, _ = h.shape
    split = lambda t: t.reshape(batch, seq, HEADS, D_MODEL // HEADS)
    q, k, v = (split(h @ p[name]) for name in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D_MODEL // HEADS)
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, D_MODEL)
    return out @ p["wo"]


def _block(p: dict, h: jax.Array) -> jax.Array:
    h = h + _attention(p, _layernorm(p["ln1"], h))
    hidden = jax.nn.gelu(_layernorm(p["ln2"], h) @ p["w1"] + p["b1"])
    return h + hidden @ p["w2"] + p["b2"]


def _block_init(rng: np.random.Generator) -> dict:
    scale = D_MODEL**-0.5
    proj = {name: _normal(rng, (D_MODEL, D_MODEL), scale) for name in ("wq", "wk", "wv", "wo")}
    return {
        **proj,
        "ln1": _ln_init(),
        "ln2": _ln_init(),
        "w1": _normal(rng, (D_MODEL, 4 * D_MODEL), scale),
        "b1": jnp.zeros(4 * D_MODEL),
        "w2": _normal(rng, (4 * D_MODEL, D_MODEL), (4 * D_MODEL) ** -0.5),
        "b2": jnp.zeros(D_MODEL),
    }


def transformer_init(rng: np.random.Generator, num_stages: int) -> dict:
    return {
        "embed": _normal(rng, (VOCAB, D_MODEL), 1.0),
        "pos": _normal(rng, (SEQ, D_MODEL), 0.1),
        "blocks": [_block_init(rng) for _ in range(num_stages)],
        "head": {"ln": _ln_init(), "unembed": _normal(rng, (D_MODEL, VOCAB), D_MODEL**-0.5)},
    }


def transformer_data(rng: np.random.Generator, num_microbatches: int) -> tuple[jax.Array, ...]:
    tokens = rng.integers(0, VOCAB, (num_microbatches, TF_MICROBATCH, SEQ + 1), dtype=np.int32)
    return jnp.asarray(tokens[..., :-1]), jnp.asarray(tokens[..., 1:])  # next-token targets


def transformer_loss(params, microbatch, mark):
    tokens, targets = microbatch
    h = params["embed"][tokens] + params["pos"]
    for block in params["blocks"]:
        h = mark(_block(block, h))
    logits = _layernorm(params["head"]["ln"], h) @ params["head"]["unembed"]
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll), {
        "nll_per_position": jnp.mean(nll, axis=0),
        "logit_rms": jnp.sqrt(jnp.mean(logits**2)),
    }


MODELS = {
    "mlp": Model(mlp_init, mlp_data, mlp_loss),
    "transformer": Model(transformer_init, transformer_data, transformer_loss),
}

# ------------------------------------------------------------------------------ the steps


def sequential_reduce(fun: Callable, xs: Any) -> tuple[Any, Any]:
    """treduce's default semantics, by hand: stack the first outputs, sum the second ones
    in microbatch order (a scan rather than an unrolled loop: quicker to compile)."""
    _, second = jax.eval_shape(fun, jax.tree.map(lambda a: a[0], xs))
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), second)

    def body(total, x):
        out, summand = fun(x)
        return jax.tree.map(jnp.add, total, summand), out

    summed, stacked = jax.lax.scan(body, zeros, xs)
    return stacked, summed


def make_step(loss: Callable, reduce: Callable, mark: Callable) -> Callable:
    """A training step; returns (opt_state, params, losses, aux, grads)."""

    def step(opt_state, params, batch):
        grad_fn = jax.value_and_grad(partial(loss, mark=mark), has_aux=True)
        (losses, aux), grads = reduce(partial(grad_fn, params), batch)
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), losses, aux, grads

    return step


def pipelined_step(loss: Callable, schedule, mesh: jaxpp_mpi.MpmdMesh):
    reduce = lambda fun, xs: jaxpp_mpi.treduce(fun, xs, schedule=schedule)
    step = make_step(loss, reduce, jaxpp_mpi.mark_stage_end)
    return jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)


def train(step: Callable, params: Any, batch: Any) -> list[Any]:
    """NUM_STEPS steps from `params`, each fed the previous one's state; per-step outputs."""
    opt_state, history = OPTIMIZER.init(params), []
    for _ in range(NUM_STEPS):
        out = step(opt_state, params, batch)
        opt_state, params = out[0], out[1]
        history.append(out)
    return history


@functools.cache
def reference_history(model_name: str, num_stages: int, microbatches: int):
    """The jax.jit reference; it depends on the schedule only through num_stages."""
    model = MODELS[model_name]
    params, batch = problem(model, num_stages, microbatches)
    step = jax.jit(make_step(model.loss, sequential_reduce, identity))
    return [jax.tree.map(np.asarray, out) for out in train(step, params, batch)]


def problem(model: Model, num_stages: int, microbatches: int) -> tuple[Any, Any]:
    rng = np.random.default_rng(num_stages)
    return model.init(rng, num_stages), model.data(rng, microbatches)


def assert_same_history(got: list[Any], want: list[Any]) -> None:
    names = ("opt_state", "params", "losses", "aux", "grads")
    for step, (got_out, want_out) in enumerate(zip(got, want, strict=True)):
        for name, g, w in zip(names, got_out, want_out, strict=True):
            want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(w)
            got_leaves, got_tree = jax.tree.flatten(g)
            assert got_tree == want_tree, f"step {step}: {name} structure differs"
            for (path, w_leaf), g_leaf in zip(want_leaves, got_leaves):
                np.testing.assert_allclose(
                    np.asarray(g_leaf),
                    w_leaf,
                    rtol=RTOL,
                    atol=ATOL,
                    err_msg=f"step {step}: {name}{jax.tree_util.keystr(path)}",
                )


# ------------------------------------------------------------------------------ the tests

def repeats_steady_state(schedule: str, groups: int, microbatches: int) -> bool:
    """8 microbatches on 2 groups of one stage each: the 4-microbatch case already runs
    past warm-up into the steady state (2x the stages), with the same executables."""
    one_stage = SCHEDULES[schedule](groups).num_stages == groups
    return one_stage and groups == 2 and microbatches == 8


MATRIX = [
    pytest.param(model, name, groups, mbs, id=f"{model}-{name}-S{groups}-mb{mbs}")
    for model in MODELS
    for name in SCHEDULES
    for groups in (2, 4)
    for mbs in (4, 8)
    if not rejects(name, groups, mbs) and not repeats_steady_state(name, groups, mbs)
]


@pytest.mark.parametrize(("model_name", "schedule_name", "groups", "microbatches"), MATRIX)
def test_matches_jax_jit(model_name, schedule_name, groups, microbatches):
    model, schedule = MODELS[model_name], SCHEDULES[schedule_name](groups)
    params, batch = problem(model, schedule.num_stages, microbatches)
    step = pipelined_step(model.loss, schedule, local_mesh(groups))
    got = train(step, params, batch)
    assert_same_history(got, reference_history(model_name, schedule.num_stages, microbatches))


@pytest.mark.parametrize("model_name", list(MODELS))
def test_dualpipev_rejects_fewer_microbatches_than_stages(model_name):
    model, schedule = MODELS[model_name], SCHEDULES["DualPipeV"](4)
    params, batch = problem(model, schedule.num_stages, 4)
    step = pipelined_step(model.loss, schedule, local_mesh(4))
    with pytest.raises(jaxpp_mpi.CompileError, match="microbatches"):
        step(OPTIMIZER.init(params), params, batch)


def test_user_example_on_4x2_mesh():
    """The user-facing example's shape: a (4, 2) mesh with default axis types (4 groups of 2
    devices), Std1F1B(4), a weights-only tanh MLP, the step written with the decorator."""
    mesh = jaxpp_mpi.MpmdMesh(jax.make_mesh((4, 2), ("stage", "data")), "stage")

    def loss_fn(params, mb, mark=jaxpp_mpi.mark_stage_end):
        x, y = mb
        for w in params:
            x = mark(jnp.tanh(x @ w))
        return jnp.mean((x - y) ** 2), {"max": jnp.max(x)}

    @partial(jaxpp_mpi.mpmd_jit_with_loop, mpmd_mesh=mesh)
    def train_step(opt_state, params, batch):
        grad_fn = partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, aux), grads = jaxpp_mpi.treduce(grad_fn, batch, schedule=jaxpp_mpi.Std1F1B(4))
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), losses, aux, grads

    rng = np.random.default_rng(7)
    params = [_normal(rng, (16, 16), 0.3) for _ in range(4)]
    batch = (_normal(rng, (8, 4, 16), 1.0), _normal(rng, (8, 4, 16), 0.5))
    reference = jax.jit(make_step(loss_fn, sequential_reduce, identity))
    want = [jax.tree.map(np.asarray, out) for out in train(reference, params, batch)]
    got = train(train_step, params, batch)
    assert all(isinstance(x, jaxpp_mpi.MpmdArray) for x in jax.tree.leaves(got))
    assert_same_history(got, want)
