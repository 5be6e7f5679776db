"""Small models and training steps shared by the local and MPI parity tests.

Each builder returns `(params, batch, loss_fn)` for `num_stages` pipeline stages, with
`mark_stage_end` at the end of every stage; `make_step` wraps a loss into the training
step of the user-facing example (value_and_grad in a treduce, then optax adam). The
transformer is examples/train.py's, imported from it.
"""

from __future__ import annotations

import math
import re
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpp_mpi
from jaxpp_mpi.schedules import SCHEDULE_NAMES, schedule_by_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train  # noqa: E402 - examples/train.py: the transformer

SCHEDULES = SCHEDULE_NAMES


def schedule(name: str, groups: int):
    """The named schedule for `groups` MPMD groups (see `schedule_by_name`)."""
    return schedule_by_name(name, groups)


def _keys(seed: int, n: int):
    return jax.random.split(jax.random.PRNGKey(seed), n)


def mlp(num_stages: int, num_microbatches: int, width: int = 16, rows: int = 4):
    """A tanh MLP, one layer per stage, squared-error loss; aux = max activation."""
    ks = _keys(0, num_stages + 2)
    params = [(jax.random.normal(ks[i], (width, width)) * 0.4, jnp.full((width,), 0.01 * i))
              for i in range(num_stages)]
    batch = (jax.random.normal(ks[-2], (num_microbatches, rows, width)),
             jax.random.normal(ks[-1], (num_microbatches, rows, width)))

    def loss_fn(params, mb):
        x, y = mb
        for w, b in params:
            x = jaxpp_mpi.mark_stage_end(jnp.tanh(x @ w + b))
        return jnp.mean((x - y) ** 2), {"max": jnp.max(x)}

    return params, batch, loss_fn


def transformer(num_stages: int, num_microbatches: int, *, vocab: int = 32, d: int = 16,
                seq: int = 8, rows: int = 2, heads: int = 2, tied: bool = False,
                fused_attention: bool = False):
    """examples/train.py's decoder-only LM, small: embedding on stage 0, one block per
    stage (MLP 2d wide), head + loss last; aux = next-token accuracy.

    With `tied`, the output projection is the embedding's transpose, so the first and
    the last stage share a weight; `fused_attention`: attention by
    `jax.nn.dot_product_attention` (`ModelConfig.fused_attention`).
    """
    cfg = train.ModelConfig(vocab=vocab, hidden=d, heads=heads, seq=seq, layers=num_stages,
                            mlp_ratio=2, tied=tied, fused_attention=fused_attention)
    # Weights of std 0.2, not the example's smaller ones: gradients stay far above float32
    # rounding, whose noise adam would otherwise magnify past the parity tolerance
    # (measured on 8 interleaved stages: 7x the tolerance with the default, 0.3x with 0.2).
    params = train.init_params(jax.random.PRNGKey(1), cfg, std=0.2)
    batch = train.synthetic_batch(cfg, num_microbatches, rows)

    def loss_fn(params, mb):
        logits = train.logits_fn(params, mb["inputs"], cfg, num_stages)
        nll = train.next_token_nll(logits, mb["targets"])
        return nll, {"acc": (logits.argmax(-1) == mb["targets"]).mean()}

    return params, batch, loss_fn


def parity_adam() -> optax.GradientTransformation:
    """Adam for parity tests: learning rate 1e-3 and eps=1e-5 instead of 1e-8.

    The stage executables fuse differently from the one-program `jax.jit` reference, so
    gradients differ in the last bits. Adam's update g / (sqrt(v) + eps) turns a gradient
    component that is pure rounding noise (~1e-9) into a near full-size step when eps is
    1e-8: measured, the small transformer's params then differ from the reference by 8x
    the rtol 1e-5 tolerance after 3 steps (GPipe and 1F1B alike), by 0.5x with eps=1e-5
    at learning rate 1e-2, and still by 1.7e-6 (atol 1e-6) on 8 interleaved stages; the
    smaller rate scales that noise down tenfold.
    """
    return optax.adam(1e-3, eps=1e-5)


def make_step(loss_fn, sched, optimizer=None):
    """The training step of the user-facing example, for `jax.jit` or mpmd_jit."""
    optimizer = optimizer or parity_adam()

    def train_step(opt_state, params, batch):
        grad_fn = partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, aux), grads = jaxpp_mpi.treduce(grad_fn, batch, schedule=sched)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), losses, aux

    return train_step, optimizer


def run_steps(step, opt_state, params, batch, steps: int = 3):
    """`steps` training steps feeding each step's state into the next; all outputs."""
    outs = None
    for _ in range(steps):
        outs = step(opt_state, params, batch)
        opt_state, params = outs[0], outs[1]
    return outs


def held_values(tree) -> list:
    """Numpy values of the leaves this process holds (None for leaves held elsewhere)."""
    out = []
    for x in jax.tree.leaves(tree):
        if isinstance(x, jaxpp_mpi.MpmdArray):
            held = list(x.local_arrays.values())  # any group's replica held here
            out.append(np.asarray(held[0]) if held else None)
        else:
            out.append(np.asarray(x))
    return out


def assert_close_to_reference(reference, pipelined, rtol=1e-5, atol=1e-6) -> int:
    """Asserts every held leaf of `pipelined` matches `reference`; returns how many
    leaves were compared."""
    ref = held_values(reference)
    got = held_values(pipelined)
    assert len(ref) == len(got)
    compared = 0
    for i, (a, b) in enumerate(zip(ref, got)):
        if b is None:
            continue
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol, err_msg=f"leaf {i}")
        compared += 1
    return compared


def assert_tree_close(ref, out, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same pytree structure, every leaf of the same shape and dtype as the reference's
    and equal to it within `rtol`/`atol`."""
    ref_leaves, ref_tree = jax.tree.flatten(ref)
    out_leaves, out_tree = jax.tree.flatten(out)
    assert out_tree == ref_tree
    for k, (r, o) in enumerate(zip(ref_leaves, out_leaves)):
        r, o = np.asarray(r), np.asarray(o)
        assert o.shape == r.shape and o.dtype == r.dtype, f"leaf {k}"
        np.testing.assert_allclose(o, r, rtol=rtol, atol=atol, err_msg=f"leaf {k}")


def random_array(seed: int, shape, dtype) -> np.ndarray:
    """Random bit patterns of `dtype` (NaN payloads and -0.0 included for floats), the
    same on every rank for the same seed."""
    width = np.dtype(jnp.dtype(dtype)).itemsize
    raw = np.random.default_rng(seed).integers(0, 2 ** (8 * width), shape, dtype=np.uint64)
    return raw.astype(f"u{width}").view(jnp.dtype(dtype))


def all_reduced(hlo: str) -> int:
    """Elements all-reduced by one run of an optimized HLO text (XLA combines several
    all-reduces into one of a tuple, so the ops alone do not count the values)."""
    total = 0
    for line in hlo.splitlines():
        if " all-reduce(" in line:
            result = line.split(" all-reduce(")[0].split("=", 1)[1]
            for dims in re.findall(r"\[([\d,]*)\]", result):
                total += math.prod(int(d) for d in dims.split(",") if d)
    return total


def bits(x) -> np.ndarray:
    """The raw bits of `x` as unsigned integers (compare NaN payloads and -0.0 too)."""
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def megatron_specs(model: str, params, batch):
    """`(param specs, batch specs)` splitting weights Megatron-style over "model"
    (column-split first linear, row-split second) and the batch rows over "data".

    For `mlp`, even layers are column-split and odd ones row-split; for `transformer`,
    each block's qkv and up projections are column-split and proj and down row-split.
    """
    from jax.sharding import PartitionSpec as P

    column, row = P(None, "model"), P("model", None)
    if model == "mlp":
        pspecs = [(column, P("model")) if i % 2 == 0 else (row, P())
                  for i in range(len(params))]
        return pspecs, (P(None, "data"), P(None, "data"))
    return train.param_specs(params), jax.tree.map(lambda _: P(None, "data"), batch)


def constrained_mlp_loss(constrain):
    """`mlp`'s loss with every stage's activation passed through `constrain`."""

    def loss_fn(params, mb):
        x, y = mb
        for w, b in params:
            x = jaxpp_mpi.mark_stage_end(constrain(jnp.tanh(x @ w + b)))
        return jnp.mean((x - y) ** 2), {"max": jnp.max(x)}

    return loss_fn


def data_constraint(kind: str, mesh):
    """`with_sharding_constraint` splitting rows over "data": with a NamedSharding on
    `mesh` ("named") or a bare PartitionSpec ("bare")."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if kind == "named":
        return lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
    return lambda x: jax.lax.with_sharding_constraint(x, P("data"))
