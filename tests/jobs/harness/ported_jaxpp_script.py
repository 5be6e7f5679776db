"""Not a test: a JaxPP training script ported to jaxpp_mpi (the porting check's script).

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
        python tests/jobs/harness/ported_jaxpp_script.py --pp 2    # one process
    launch/jpprun -n 4 python tests/jobs/harness/ported_jaxpp_script.py --pp 4

Written the way JaxPP's own scripts are (its flax dropout test, examples/basic.py and
tutorial): a flax-style model with dropout in every stage, a `TrainState` carrying a
typed PRNG key, a `treduce` over microbatches, `in_specs`, the batch passed by keyword,
an optax optimizer and `f"{loss:.3f}"` logging. The two lines marked `PORT:`, the import
and the mesh line, are the only jaxpp_mpi-specific ones. (One call is jaxpp_mpi's only:
like `jax.jit`, JaxPP refuses keyword arguments when `in_specs` is given; jaxpp_mpi
accepts them, see docs/porting-from-jaxpp.md.)

Flax itself is not installed for the tests (it brings orbax, tensorstore, protobuf and a
dozen more packages); the model and `TrainState` below are their minimal look-alikes:
`init`/`apply` with `{"params": ...}` and `rngs={"dropout": key}`, dropout as
`flax.linen.Dropout` draws it (`bernoulli(key, 1 - rate)`, one key folded per layer), and
a frozen dataclass registered as a pytree with `apply_fn` and `tx` as static fields, as
`flax.struct.PyTreeNode` registers flax's `TrainState`.

After training, the script runs the same steps under single-process `jax.jit` (a Python
loop over the microbatches, no stage marks, the same keys, so the same dropout masks)
and compares every value this process holds: parameters, optimizer state, step and
losses at rtol 1e-5, keys bit for bit. It exits with status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxpp_mpi as jaxpp  # PORT: was `import jaxpp.api as jaxpp`

RTOL, ATOL = 1e-5, 1e-6
FEATURES, ROWS = 8, 4


# ------------------------------------------------------------------ model (flax-style)


@dataclasses.dataclass(frozen=True)
class DropoutMLP:
    """`num_layers` Dense layers (tanh, then dropout, after each) with a stage mark every
    `num_layers // num_stages` layers; the last layer's outputs are the logits."""

    num_layers: int
    num_stages: int
    rate: float = 0.5
    mark_stages: bool = True

    def init(self, rng: jax.Array, x: jax.Array) -> dict[str, Any]:
        params = {}
        fan_in = x.shape[-1]
        for i, key in enumerate(jax.random.split(rng, self.num_layers)):
            params[f"Dense_{i}"] = {
                "kernel": jax.random.normal(key, (fan_in, FEATURES)) / np.sqrt(fan_in),
                "bias": jnp.zeros((FEATURES,)),
            }
            fan_in = FEATURES
        return {"params": params}

    def apply(
        self,
        variables: dict[str, Any],
        x: jax.Array,
        training: bool,
        rngs: dict[str, jax.Array] | None = None,
    ) -> jax.Array:
        params = variables["params"]
        per_stage = self.num_layers // self.num_stages
        for i in range(self.num_layers):
            layer = params[f"Dense_{i}"]
            x = x @ layer["kernel"] + layer["bias"]
            if i + 1 < self.num_layers:
                x = jnp.tanh(x)
            if training and self.rate > 0:
                keep = jax.random.bernoulli(
                    jax.random.fold_in(rngs["dropout"], i), 1.0 - self.rate, x.shape
                )
                x = jnp.where(keep, x / (1.0 - self.rate), 0.0)
            if self.mark_stages and (i + 1) % per_stage == 0:
                x = jaxpp.mark_stage_end(x)
        return x


@partial(
    jax.tree_util.register_dataclass,
    data_fields=["step", "params", "opt_state", "key"],
    meta_fields=["apply_fn", "tx"],
)
@dataclasses.dataclass(frozen=True)
class TrainState:
    """flax.training.train_state.TrainState, plus the dropout key (JaxPP's
    `DropoutEnabledTrainState`)."""

    step: Any
    apply_fn: Callable = dataclasses.field(repr=False)
    params: Any
    tx: optax.GradientTransformation = dataclasses.field(repr=False)
    opt_state: Any
    key: jax.Array

    @classmethod
    def create(
        cls, *, apply_fn: Callable, params: Any, tx: optax.GradientTransformation, key: jax.Array
    ) -> TrainState:
        return cls(
            step=0, apply_fn=apply_fn, params=params, tx=tx, opt_state=tx.init(params), key=key
        )

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)

    def apply_gradients(self, *, grads: Any) -> TrainState:
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        return self.replace(
            step=self.step + 1,
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
        )


# ------------------------------------------------------------------ training step


def loss_fn(state: TrainState, params: Any, microbatch: Any, dropout_rng: jax.Array):
    inputs, targets = microbatch
    logits = state.apply_fn(
        {"params": params}, inputs, training=True, rngs={"dropout": dropout_rng}
    )
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(state: TrainState, batch: Any, schedule: jaxpp.BaseSchedule):
    dropout_rng = jax.random.fold_in(key=state.key, data=state.step)
    grad_fn = jax.value_and_grad(partial(loss_fn, state, dropout_rng=dropout_rng))
    losses, grads = jaxpp.treduce(partial(grad_fn, state.params), batch, schedule=schedule)
    return state.apply_gradients(grads=grads), losses.mean()


def reference_step(state: TrainState, batch: Any):
    """The same step without pipelining: a Python loop over the microbatches."""
    dropout_rng = jax.random.fold_in(key=state.key, data=state.step)
    grad_fn = jax.value_and_grad(partial(loss_fn, state, dropout_rng=dropout_rng))
    losses, grads = [], None
    for i in range(batch[0].shape[0]):
        loss, g = grad_fn(state.params, jax.tree.map(operator.itemgetter(i), batch))
        losses.append(loss)
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    return state.apply_gradients(grads=grads), jnp.stack(losses).mean()


# ------------------------------------------------------------------ checking


def is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def replicas(x: Any) -> list[jax.Array]:
    """The copies of a result this process holds (JaxPP's `to_mpmd_local_array`)."""
    if not x.is_partially_addressable:
        return []
    local = x.to_mpmd_local_array
    return local if isinstance(local, list) else [local]


def compare(name: str, got: Any, want: Any) -> tuple[int, list[str]]:
    """(values compared, mismatches) of every leaf of `got` this process holds."""
    checked, errors = 0, []
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    want_leaves = jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        return 0, [f"{name}: {len(got_leaves)} leaves, jax.jit has {len(want_leaves)}"]
    for (path, g), w in zip(got_leaves, want_leaves):
        where = f"{name}{jax.tree_util.keystr(path)}"
        if is_key(g) != is_key(w):
            errors.append(f"{where}: key {is_key(g)}, jax.jit: key {is_key(w)}")
            continue
        for r in replicas(g):
            checked += 1
            try:
                if is_key(w):
                    np.testing.assert_array_equal(
                        jax.random.key_data(r), jax.random.key_data(w), err_msg=where
                    )
                else:
                    np.testing.assert_allclose(
                        np.asarray(r), np.asarray(w), rtol=RTOL, atol=ATOL, err_msg=where
                    )
            except AssertionError as e:
                errors.append(str(e))
    return checked, errors


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, required=True, help="pipeline groups")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    # PORT: was jaxpp.MpmdMesh(jax.sharding.Mesh(np.array(jax.devices()).reshape(args.pp,
    #     1, 1), ("stage", "data", "model")), "stage"): under MPI a rank sees only its devices
    mpmd_mesh = jaxpp.make_mpmd_mesh((args.pp, 1, 1), ("stage", "data", "model"), "stage")

    data_key, params_key, dropout_key = jax.random.split(jax.random.key(0), 3)
    x_key, y_key = jax.random.split(data_key)
    batch = (
        jax.random.normal(x_key, (args.microbatches, ROWS, FEATURES)),
        jax.random.randint(y_key, (args.microbatches, ROWS), 0, FEATURES),
    )
    model = DropoutMLP(num_layers=args.pp, num_stages=args.pp)
    state = TrainState.create(
        apply_fn=model.apply,
        params=model.init(params_key, batch[0][0])["params"],
        tx=optax.adam(1e-2),
        key=dropout_key,
    )

    state_specs = jax.tree.map(lambda x: P("data") if np.ndim(x) else P(), state)
    pp_train_step = jaxpp.mpmd_jit_with_loop(
        partial(train_step, schedule=jaxpp.Std1F1B(mpmd_mesh.mpmd_dim)),
        mpmd_mesh=mpmd_mesh,
        in_specs=(state_specs,),
        out_specs=(state_specs, P()),
    )

    pp_state, pp_losses = state, []
    for step_id in range(args.steps):
        pp_state, loss = pp_train_step(pp_state, batch=batch)
        pp_losses.append(loss)
        print(f"[Step {step_id + 1:02d}] Train Loss: {loss:.3f}", flush=True)

    # The reference: the same steps under jax.jit, from the same state and keys.
    reference_model = dataclasses.replace(model, mark_stages=False)
    jit_step = jax.jit(reference_step)
    jit_state = state.replace(apply_fn=reference_model.apply)
    jit_losses = []
    for _ in range(args.steps):
        jit_state, loss = jit_step(jit_state, batch)
        jit_losses.append(loss)
    # Dropout is live: without it the first step's loss differs.
    no_dropout = state.replace(apply_fn=dataclasses.replace(reference_model, rate=0.0).apply)
    if np.isclose(
        float(jax.jit(reference_step)(no_dropout, batch)[1]), float(jit_losses[0]), rtol=1e-3
    ):
        print("dropout had no effect on the jax.jit loss", file=sys.stderr)
        return 1

    checked, errors = compare("state", pp_state, jit_state)
    n, e = compare("losses", pp_losses, jit_losses)
    checked, errors = checked + n, errors + e
    if not checked:
        print("this process holds none of the results: nothing compared", file=sys.stderr)
        return 1
    if errors:
        print(
            f"MISMATCH with jax.jit: {len(errors)} of the {checked} values held here differ",
            *errors,
            sep="\n",
            file=sys.stderr,
        )
        return 1
    print(f"parity with jax.jit: {checked} values held here match", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
