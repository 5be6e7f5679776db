"""Random training steps written the way users write them, and their check against `jax.jit`.

A `Program` is a small, printable description of one step: a stack of layers with stage
marks in chosen places (before any work, after the last layer, several at one place),
work before the first mark (the parameter tree cast to bfloat16, an embedding lookup)
and after the last (the loss, a bfloat16 copy of the new parameters), parameters used
by several stages (a tied embedding, a layer sharing another's weights), values made by
one stage and read by several later ones, integer, boolean, bfloat16 and key values
crossing stages through the marks, scalar constants, dropout, `with_sharding_constraint`
on groups of 1 or 2 devices, any library schedule, and residual recomputation on or off
(`Note: recomputed residuals` in compiler/recompute.py). `programs()` is its hypothesis
strategy, simplest values first so that a failure shrinks to a small program; `check`
compiles and runs one in local mode (2 MPMD groups) and compares every result with the
same step under `jax.jit` on one group's devices.

Shapes are tiny (8 features, 4 rows, 2 to 4 microbatches) to keep XLA's compiles short.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

import jaxpp_mpi
from jaxpp_mpi._src.compiler import split as split_pass
from jaxpp_mpi.schedules import SCHEDULE_NAMES, schedule_by_name

GROUPS = 2
WIDTH, ROWS, VOCAB = 8, 4, 8
LAYER_KINDS = ("dense", "norm", "gelu", "softmax")
EXTRA_KINDS = ("int", "bool", "bf16", "key")
# The fewest microbatches each schedule takes on 2 groups (its `tasks(n)` contract).
MIN_MICROBATCHES = {"zerobubble": 2, "dualpipev": 4, "interleaved": 2, "kimik2": 2}


def num_stages(schedule: str) -> int:
    """Stages of the named library schedule on `GROUPS` groups."""
    return schedule_by_name(schedule, GROUPS).num_stages


@dataclasses.dataclass(frozen=True)
class Program:
    """One generated training step (see the module docstring).

    Attributes:
      schedule: a library schedule name (`SCHEDULE_NAMES`), built for 2 groups.
      devices: devices per group (2: the rows are split over "data").
      microbatches: the loop's microbatch count.
      layers: the layer kinds, in order (`LAYER_KINDS`).
      marks: per stage, how many layers run before its `mark_stage_end` (sorted; 0 is
        before any work, `len(layers)` after the last layer, repeats are back to back).
      cast: "loss" casts the parameter tree to bfloat16 at the top of the loss, "step"
        before the loop (gradients then come back in bfloat16), "" never.
      embed: "" (float inputs), "embed" (token inputs looked up in an embedding) or
        "tied" (the embedding also makes the logits: a weight of the first and the last
        stage).
      shared: (layer, source) pairs: the layer uses the source layer's weights.
      skips: (layer, readers): the value after `layer` is added after each reader
        layer, read directly (not through a mark) by every stage that holds one.
      extras: (kind, made after, used after) values carried through the marks between.
      constant: a scalar constant closed over by the loss, and Python scalars.
      dropout: the layers followed by dropout (a key per microbatch in the batch).
      constrain: `with_sharding_constraint(x, P("data"))` after every layer.
      recompute: backward tasks recompute cheap residuals.
      optimizer: "sgd", "momentum" or "adam".
      loss: "mse" against float targets or "xent" against integer labels.
      bf16_copy: the step also returns a bfloat16 copy of the new parameters.
      donate: the parameters and optimizer state are donated.
    """

    schedule: str = "1f1b"
    devices: int = 1
    microbatches: int = 2
    layers: tuple[str, ...] = ("dense", "dense")
    marks: tuple[int, ...] = (1, 2)
    cast: str = ""
    embed: str = ""
    shared: tuple[tuple[int, int], ...] = ()
    skips: tuple[tuple[int, tuple[int, ...]], ...] = ()
    extras: tuple[tuple[str, int, int], ...] = ()
    constant: bool = False
    dropout: tuple[int, ...] = ()
    constrain: bool = False
    recompute: bool = True
    optimizer: str = "sgd"
    loss: str = "mse"
    bf16_copy: bool = False
    donate: bool = False

    def __post_init__(self) -> None:
        n = len(self.layers)
        if len(self.marks) != num_stages(self.schedule) or list(self.marks) != sorted(self.marks):
            raise ValueError(f"marks {self.marks} for {self.schedule}")
        if not all(0 <= m <= n for m in self.marks):
            raise ValueError(f"marks {self.marks} for {n} layers")
        for layer, source in self.shared:
            if not (0 <= source < layer < n):
                raise ValueError(f"shared {(layer, source)}")
        for layer, readers in self.skips:
            if not all(layer < r < n for r in readers):
                raise ValueError(f"skip {(layer, readers)}")
        for kind, made, used in self.extras:
            if kind not in EXTRA_KINDS or not (0 <= made < used < n):
                raise ValueError(f"extra {(kind, made, used)}")

    @property
    def bf16(self) -> bool:
        """Whether the step computes in bfloat16."""
        return bool(self.cast) or any(k == "bf16" for k, _, _ in self.extras)

    def tolerance(self, dtype) -> float:
        """rtol and atol for a result of `dtype`.

        Float32 steps: 1e-5 (the stage executables fuse differently from `jax.jit`'s
        one program). Bfloat16 compute: the executables round intermediate bfloat16
        values at other places than `jax.jit`'s fusions do, and gradients made in
        bfloat16 through several layers and microbatches differ by a few bfloat16 steps
        (measured: up to 1.8% on optimizer moments): 2e-2, atol relative to the
        result's largest magnitude (`scale`) (the mixed-precision step of
        tests/local/test_recompute_placement.py is held to 1e-3). A bfloat16 result may
        round the other way: one bfloat16 step (2**-7 relative). Gradients that come
        back in bfloat16 (`cast="step"`) are summed over microbatches in bfloat16, and
        the pipeline rounds that sum where `jax.jit`'s fused loop need not: a few
        bfloat16 steps, 3e-2.
        """
        if self.cast == "step":
            return 3e-2
        if np.dtype(dtype) == jnp.bfloat16:
            return 2.0 ** -7
        return 2e-2 if self.bf16 else 1e-5

    def scale(self, reference: np.ndarray) -> float:
        """What `tolerance`'s atol is relative to for the result `reference`: 1, or its
        largest magnitude when the step computes in bfloat16.

        A gradient made in bfloat16 is a sum of terms as large as the result's largest
        entries (microbatches summed in bfloat16 under `cast="step"`, an embedding's
        rows scattered together in bfloat16 under `cast="loss"`); an entry where they
        cancel keeps their rounding (bfloat16 steps of the large terms, not of itself):
        the same step run by `jax.jit` and op by op (`jax.disable_jit`) differs by as
        much. Measured: 0.031 on a 0.15 entry of a weight gradient whose largest is 3.4
        (`cast="step"`, the pipeline 0.047 there), and 0.031, one bfloat16 step of the
        terms, on a -0.008 entry of an embedding's gradient (in the momentum) whose
        largest is 3.8 (`cast="loss"`, the pipeline 0.031 there too).
        """
        if not self.bf16 or reference.size == 0:
            return 1.0
        return max(1.0, float(np.max(np.abs(reference.astype(np.float32)))))


@st.composite
def programs(draw: Callable, schedules: tuple[str, ...] = SCHEDULE_NAMES) -> Program:
    """Hypothesis strategy of `Program`s, shrinking towards the default one."""
    schedule = draw(st.sampled_from(schedules))
    n_layers = draw(st.integers(1, 5))
    layers = tuple(draw(st.lists(st.sampled_from(LAYER_KINDS), min_size=n_layers,
                                 max_size=n_layers)))
    marks = tuple(sorted(draw(st.lists(st.integers(0, n_layers), min_size=num_stages(schedule),
                                       max_size=num_stages(schedule)))))
    low = MIN_MICROBATCHES.get(schedule, 1)
    microbatches = draw(st.integers(max(low, 2), max(low, 3)))
    shared = ()
    if n_layers > 1 and draw(st.booleans()):
        layer = draw(st.integers(1, n_layers - 1))
        shared = ((layer, draw(st.integers(0, layer - 1))),)
    skips = ()
    if n_layers > 2 and draw(st.booleans()):
        layer = draw(st.integers(0, n_layers - 3))
        readers = draw(st.lists(st.integers(layer + 1, n_layers - 1), min_size=1, max_size=2,
                                unique=True))
        skips = ((layer, tuple(sorted(readers))),)
    extras = ()
    if n_layers > 1:
        count = draw(st.integers(0, 2))
        picked = []
        for _ in range(count):
            made = draw(st.integers(0, n_layers - 2))
            picked.append((draw(st.sampled_from(EXTRA_KINDS)), made,
                           draw(st.integers(made + 1, n_layers - 1))))
        extras = tuple(picked)
    dropout = tuple(sorted(draw(st.sets(st.integers(0, n_layers - 1), max_size=2))))
    return Program(
        schedule=schedule,
        devices=draw(st.sampled_from((1, 2))),
        microbatches=microbatches,
        layers=layers,
        marks=marks,
        cast=draw(st.sampled_from(("", "loss", "step"))),
        embed=draw(st.sampled_from(("", "embed", "tied"))),
        shared=shared,
        skips=skips,
        extras=extras,
        constant=draw(st.booleans()),
        dropout=dropout,
        constrain=draw(st.booleans()),
        recompute=draw(st.booleans()),
        optimizer=draw(st.sampled_from(("sgd", "momentum", "adam"))),
        loss=draw(st.sampled_from(("mse", "xent"))),
        bf16_copy=draw(st.booleans()),
        donate=draw(st.booleans()),
    )


# ---------------------------------------------------------------------------------------
# The step a Program describes.


def _layer(kind: str, p: dict, x: jax.Array) -> jax.Array:
    w, b = p["w"].astype(x.dtype), p["b"].astype(x.dtype)
    if kind == "dense":
        return jnp.tanh(x @ w + b)
    if kind == "norm":  # a layer norm: its centred values are a cheap residual
        centred = x - jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.mean(centred * centred, axis=-1, keepdims=True)
        return centred * jax.lax.rsqrt(var + 1e-5) * (1.0 + b) + x @ w * 0.1
    if kind == "gelu":
        return jax.nn.gelu(x @ w + b, approximate=True)
    return x + jax.nn.softmax(x @ w, axis=-1) - b  # "softmax": its exp is a residual


def _dropout(key: jax.Array, x: jax.Array, rate: float = 0.25) -> jax.Array:
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def _extra(kind: str, x: jax.Array, key: jax.Array, exact: jax.Array | None) -> Any:
    """The value an extra of `kind` carries, made from the activations `x`; integer and
    key values from `exact` instead when given (a bfloat16 step: an argmax or count of
    activations rounded otherwise than `jax.jit` rounds them could change by a whole
    step)."""
    source = x if exact is None else exact
    if kind == "int":
        return jnp.argmax(source, axis=-1).astype(jnp.int32)
    if kind == "bool":
        return x > 0
    if kind == "bf16":
        return x.astype(jnp.bfloat16)
    return jax.random.fold_in(key, jnp.sum(source > 0))


def _use_extra(kind: str, x: jax.Array, value: Any) -> jax.Array:
    """`x` changed by an extra's value."""
    if kind == "int":
        return x + (value % 3).astype(x.dtype)[:, None] * 0.125
    if kind == "bool":
        return jnp.where(value, x, x * 0.5)
    if kind == "bf16":
        return x + value.astype(x.dtype) * 0.25
    return _dropout(value, x)


def _owner(prog: Program) -> dict[int, int]:
    shared = dict(prog.shared)
    return {i: shared.get(i, i) for i in range(len(prog.layers))}


def init(prog: Program) -> tuple[dict, dict]:
    """`(params, batch)` of `prog`: float32 master weights, the microbatched batch."""
    rng = np.random.default_rng(len(prog.layers) * 31 + len(prog.marks))
    normal = lambda *shape: (rng.normal(size=shape) * 0.4).astype(np.float32)
    owners = sorted(set(_owner(prog).values()))
    params: dict[str, Any] = {f"l{i}": {"w": normal(WIDTH, WIDTH), "b": normal(WIDTH) * 0.1}
                              for i in owners}
    if prog.embed:
        params["embed"] = normal(VOCAB, WIDTH)
    if prog.loss == "xent" and prog.embed != "tied":
        params["head"] = normal(WIDTH, VOCAB)
    n = prog.microbatches
    batch: dict[str, Any] = {}
    if prog.embed:
        batch["x"] = rng.integers(0, VOCAB, (n, ROWS)).astype(np.int32)
    else:
        batch["x"] = rng.normal(size=(n, ROWS, WIDTH)).astype(np.float32)
    if prog.loss == "xent":
        batch["y"] = rng.integers(0, VOCAB, (n, ROWS)).astype(np.int32)
    else:
        batch["y"] = rng.normal(size=(n, ROWS, WIDTH)).astype(np.float32)
    if prog.dropout or any(k == "key" for k, _, _ in prog.extras):
        batch["key"] = rng.integers(0, 2**32, (n, 2), dtype=np.uint64).astype(np.uint32)
    return params, batch


def _cast(tree):
    return jax.tree.map(lambda a: a.astype(jnp.bfloat16), tree)


def loss_fn(prog: Program) -> Callable:
    """The loss of one microbatch: `loss(params, microbatch) -> scalar`."""
    owner = _owner(prog)
    scale = jnp.asarray(1.25, jnp.float32)  # a constant the loss closes over

    def constrain(x):
        return jax.lax.with_sharding_constraint(x, P("data")) if prog.constrain else x

    def loss(params, mb):
        p = _cast(params) if prog.cast == "loss" else params
        if prog.embed:
            x = jnp.take(p["embed"], mb["x"], axis=0)
        else:
            x = mb["x"].astype(jnp.bfloat16) if prog.cast else mb["x"]
        # bfloat16 steps make their integer and key values from the (exact) input
        exact = None
        if prog.bf16:
            exact = (jax.nn.one_hot(mb["x"], WIDTH) if prog.embed else mb["x"]) + 1e-3 * (
                jnp.arange(WIDTH) - WIDTH / 2)
        x = constrain(x)
        key = jax.random.wrap_key_data(mb["key"]) if "key" in mb else None
        carried: dict[int, Any] = {}  # extra index -> its value, carried through marks
        saved: dict[int, jax.Array] = {}  # skip sources, read directly by later stages

        def boundary(position, x, carried):
            for _ in range(prog.marks.count(position)):
                x, carried = jaxpp_mpi.mark_stage_end((x, carried))
            return x, carried

        x, carried = boundary(0, x, carried)
        for i, kind in enumerate(prog.layers):
            x = _layer(kind, p[f"l{owner[i]}"], x)
            if i in prog.dropout:
                x = _dropout(jax.random.fold_in(key, i), x)
            if prog.constant and i == 0:
                x = x * scale.astype(x.dtype) + 0.5
            for j, (kind_, made, used) in enumerate(prog.extras):
                if used == i:
                    x = _use_extra(kind_, x, carried.pop(j))
                if made == i:
                    carried[j] = _extra(kind_, x, key if key is not None
                                        else jax.random.key(7), exact)
            for source, readers in prog.skips:
                if i in readers:
                    x = x + saved[source] * 0.5
                if i == source:
                    saved[source] = x
            x = constrain(x)
            x, carried = boundary(i + 1, x, carried)
        x = x.astype(jnp.float32)
        if prog.loss == "mse":
            out = jnp.mean((x - mb["y"]) ** 2)
        else:
            head = p["embed"].T if prog.embed == "tied" else p["head"]
            logits = x @ head.astype(jnp.float32)
            logp = jax.nn.log_softmax(logits, axis=-1)
            out = -jnp.mean(jnp.take_along_axis(logp, mb["y"][:, None], axis=-1))
        return out * scale if prog.constant else out

    return loss


def _optimizer(prog: Program) -> optax.GradientTransformation:
    """The program's optimizer. Adam divides by the gradient's size, so rounding noise
    in a near-zero component becomes a near-full step of either sign (up to twice the
    learning rate apart, `models.parity_adam`): its eps sits above the compute's noise,
    1e-5 in float32, 1e-3 in bfloat16."""
    if prog.optimizer == "adam":
        return optax.adam(1e-3, eps=1e-3 if prog.bf16 else 1e-5)
    return optax.sgd(0.1, momentum=0.9 if prog.optimizer == "momentum" else None)


def make_step(prog: Program) -> tuple[Callable, optax.GradientTransformation]:
    """`(step, optimizer)`: `step(params, opt_state, batch)` trains one step."""
    sched = schedule_by_name(prog.schedule, GROUPS)
    opt = _optimizer(prog)
    loss = loss_fn(prog)

    def step(params, opt_state, batch):
        inner = _cast(params) if prog.cast == "step" else params
        value, grads = jaxpp_mpi.treduce(partial(jax.value_and_grad(loss), inner), batch,
                                         schedule=sched)
        grads = jax.tree.map(lambda g, w: g.astype(w.dtype), grads, params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        out = (params, opt_state, value)
        return (*out, _cast(params)) if prog.bf16_copy else out

    return step, opt


# ---------------------------------------------------------------------------------------
# Running one against jax.jit.


@contextlib.contextmanager
def recomputation(on: bool) -> Iterator[None]:
    """Residual recomputation on or off while compiling (`split_body`'s switch)."""
    if on:
        yield
        return
    before = split_pass.recompute_residuals
    split_pass.recompute_residuals = lambda eqns, where: [set() for _ in eqns]
    try:
        yield
    finally:
        split_pass.recompute_residuals = before


_MESHES: dict[int, tuple[jaxpp_mpi.MpmdMesh, Mesh]] = {}


def meshes(devices: int) -> tuple[jaxpp_mpi.MpmdMesh, Mesh]:
    """The local-mode mesh of 2 groups of `devices`, and group 0's mesh for `jax.jit`."""
    if devices not in _MESHES:
        flat = jax.devices()[:GROUPS * devices]
        mesh = jax.make_mesh((GROUPS, devices), ("stage", "data"),
                             axis_types=(AxisType.Auto,) * 2, devices=flat)
        group0 = Mesh(np.asarray(flat[:devices]), ("data",), axis_types=(AxisType.Auto,))
        _MESHES[devices] = (jaxpp_mpi.MpmdMesh(mesh, "stage"), group0)
    return _MESHES[devices]


def _values(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def check(prog: Program) -> None:
    """Compiles and runs `prog` pipelined and under `jax.jit`; asserts equal results of
    the same dtypes and shapes (within `Program.tolerance`, atol times `Program.scale`).

    A step computing in bfloat16 with a result further from `jax.jit`'s than that is
    run once more op by op (`jax.disable_jit`): `jax.jit`'s fusions round bfloat16
    values elsewhere than single ops do, and so do the pipeline's executables, so an
    entry may differ from `jax.jit`'s by that much more, as much as the op-by-op run's
    does. (Measured: a momentum entry 0.028 from `jax.jit`'s pipelined, where the
    op-by-op run is 0.026 from it and 0.008 from the pipeline's.)

    Raises:
      AssertionError: a result differs.
      CompileError: the pipeline refuses a step `jax.jit` runs (a finding too).
    """
    step, opt = make_step(prog)
    params, batch = init(prog)
    mpmd_mesh, group0 = meshes(prog.devices)
    opt_state = jax.jit(opt.init)(params)
    with jax.set_mesh(group0):
        reference = _values(jax.jit(step)(params, opt_state, batch))
    donate = (0, 1) if prog.donate else ()
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh, donate_argnums=donate)
    with recomputation(prog.recompute):
        compiled = pipelined.compile(params, opt_state, batch)
    args = (jax.tree.map(jnp.array, params), jax.tree.map(jnp.array, opt_state), batch)
    got = _values(compiled(*args))
    assert len(got) == len(reference), (len(got), len(reference))
    eager: list[np.ndarray] = []

    def op_by_op() -> list[np.ndarray]:
        if not eager:
            with jax.set_mesh(group0), jax.disable_jit():
                eager.extend(_values(step(params, opt_state, batch)))
        return eager

    for k, (a, b) in enumerate(zip(reference, got)):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), (k, a.dtype, a.shape, b.dtype, b.shape)
        compare(b, a, prog, lambda k=k: op_by_op()[k], f"result leaf {k} of {prog}")


def compare(got: np.ndarray, reference: np.ndarray, prog: Program,
            op_by_op: Callable[[], np.ndarray], what: str) -> None:
    """Asserts `got` equals `reference` (`jax.jit`'s) within `prog.tolerance`, atol times
    `prog.scale`; for a step computing in bfloat16, or as far from it as `op_by_op()`
    (the step's result run op by op, asked for only then) is, entry by entry (`check`).

    Raises:
      AssertionError: naming `what`, and for a bfloat16 step the worst entry.
    """
    tol = prog.tolerance(reference.dtype)
    ref, out = reference.astype(np.float32), got.astype(np.float32)
    atol = tol * prog.scale(reference)
    if prog.bf16 and not np.allclose(out, ref, rtol=tol, atol=atol, equal_nan=True):
        eager = np.asarray(op_by_op(), np.float32)
        ok = np.isclose(out, ref, rtol=tol, atol=atol + np.abs(eager - ref), equal_nan=True)
        i = tuple(int(j) for j in np.unravel_index(np.argmin(ok), ok.shape))
        assert ok.all(), (f"{what}: entry {i} is {out[i]} pipelined, {ref[i]} under "
                          f"jax.jit, {eager[i]} op by op (rtol {tol}, atol {atol} plus "
                          "jax.jit's distance from op by op)")
        return
    np.testing.assert_allclose(out, ref, rtol=tol, atol=atol, err_msg=what)
