"""Train a small decoder-only transformer LM with a pipeline, one stage group per rank.

    launch/jpprun -n 4 python examples/train.py --schedule 1f1b --steps 10

Rank r runs group r: its stages' forward and backward tasks, in the order the schedule
gives, exchanging activations and gradients over MPI. Rank 0 prints compilation progress
and, per step, the mean loss, wall time, tokens/s and the bubble (idle share of the step)
the schedule simulator predicts; at the end rank 0 runs the same steps on the same data
in one process under `jax.jit` and prints the largest absolute difference of the losses
and of the final parameters (every rank's, gathered); the run fails (exit status 1)
when either is past its tolerance. Without mpirun (one process) the groups are local
devices.

`--replicas R` runs R copies of a P-group pipeline on R x P ranks (data parallelism
across pipelines; rank replica x P + group):

    launch/jpprun -n 4 python examples/train.py --replicas 2 --microbatches 8

The step is unchanged and still sees the whole batch: replica r runs microbatches
r x n/R ... of the n, and the gradients and losses are combined across replicas right
after their last microbatch, so every replica ends each step with the same parameters,
the ones `jax.jit` computes from the same global batch. R must divide the rank count
and the microbatch count. A checkpoint (`--ckpt-dir`) holds one copy of the state,
written by replica 0, and resumes onto any R.

`--ckpt-dir DIR --save-every K --keep N` saves the state every K steps through a
`jaxpp_mpi.checkpoint.CheckpointManager` over DIR/ckpt (one directory per step,
DIR/ckpt/STEP, the N newest kept), in the background while training goes on, and at the
end; the same command run again resumes from the newest complete step:

    launch/jpprun -n 2 python examples/train.py --steps 100 --ckpt-dir runs/a --save-every 10

`--data-axis D --model-axis M` gives every group D x M devices: the batch's rows are
split over "data" and the blocks' weights Megatron-style over "model" (attention `qkv`
and MLP `up` by columns, attention `proj` and MLP `down` by rows), through the step's
`in_shardings` / `out_shardings`. Under mpirun every rank needs D x M devices (on CPU the
example forces that many unless XLA_FLAGS already sets a device count):

    XLA_FLAGS=--xla_force_host_platform_device_count=4 launch/jpprun -n 2 \
        python examples/train.py --data-axis 2 --model-axis 2

`--trace out.json` records one step after the warm-up (timed task by task, so slower)
and writes every rank's tasks and messages as a Chrome trace: open it in
https://ui.perfetto.dev, or draw it with
`python -m jaxpp_mpi.schedules --from-trace out.json --png out.png`.

The model (`ModelConfig`, `init_params`, `logits_fn` / `loss_fn`, `param_specs`,
`make_train_step`, `synthetic_batch`) sits at module level: bench/compile.py,
bench/spmd.py and tests/models.py import it from here rather than keep copies.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
from functools import partial
from typing import Any, NoReturn

# Importing JAX starts no backend: XLA reads XLA_FLAGS (which `main` may still set) when
# the first device is asked for.
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxpp_mpi
from jaxpp_mpi.schedules import (
    SCHEDULE_NAMES,
    TaskType,
    analyze_schedule,
    schedule_by_name,
)

# -- the model: a decoder-only transformer LM ----------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The transformer's sizes.

    Attributes:
      vocab: tokens in the vocabulary.
      hidden: the model width d.
      heads: attention heads, d / heads wide each.
      seq: tokens per sequence (the length of the learned position embedding).
      layers: transformer blocks, split evenly over the pipeline stages.
      mlp_ratio: the MLP's inner width over d.
      tied: the unembedding is the embedding's transpose (first and last stage share it).
      dtype: weights' and activations' dtype; layer norms, attention scores and logits
        are computed in float32.
      fused_attention: attention by `jax.nn.dot_product_attention` (cuDNN's fused
        kernel on a GPU that has it, which keeps the seq x seq scores out of memory;
        XLA's own elsewhere) instead of the explicit softmax(q k^T) v.
    """

    vocab: int
    hidden: int
    heads: int
    seq: int
    layers: int
    mlp_ratio: int = 4
    tied: bool = False
    dtype: str = "float32"
    fused_attention: bool = False


def init_params(key: jax.Array, cfg: ModelConfig, std: float | None = None) -> dict[str, Any]:
    """Token and position embeddings, `cfg.layers` pre-norm blocks, final norm and (untied)
    head.

    Args:
      key: the random key.
      cfg: the sizes.
      std: one standard deviation for every embedding and weight matrix. By default:
        small embeddings, weights of std 1/sqrt(fan-in), the two that write to the
        residual stream (proj, down) scaled down by sqrt(2 x layers) more.
    """
    ks = iter(jax.random.split(key, 6 * cfg.layers + 4))
    dtype = jnp.dtype(cfg.dtype)

    def normal(shape: tuple[int, ...], scale: float) -> jax.Array:
        scale = scale if std is None else std
        return (jax.random.normal(next(ks), shape) * scale).astype(dtype)

    d, ffn, layers = cfg.hidden, cfg.mlp_ratio * cfg.hidden, cfg.layers
    params = {
        "embed": normal((cfg.vocab, d), 0.02),
        "pos": normal((cfg.seq, d), 0.01),
        "blocks": [{
            "ln1": jnp.ones(d, dtype), "qkv": normal((d, 3 * d), d ** -0.5),
            "proj": normal((d, d), (2 * layers * d) ** -0.5), "ln2": jnp.ones(d, dtype),
            "up": normal((d, ffn), d ** -0.5),
            "down": normal((ffn, d), (2 * layers * ffn) ** -0.5),
        } for _ in range(layers)],
        "ln_f": jnp.ones(d, dtype),
    }
    if not cfg.tied:
        params["head"] = normal((d, cfg.vocab), d ** -0.5)
    return params


def layernorm(x: jax.Array, g: jax.Array) -> jax.Array:
    """Layer norm without offset, computed in float32 and returned in `x`'s dtype."""
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype) * g


def block(p: dict[str, jax.Array], h: jax.Array, heads: int,
          fused_attention: bool = False) -> jax.Array:
    """One pre-norm block on `h` (batch, seq, d): causal self-attention, then a GELU
    MLP (`ModelConfig.fused_attention`: attention by `jax.nn.dot_product_attention`)."""
    seq, d = h.shape[-2:]
    x = layernorm(h, p["ln1"])
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    if fused_attention:  # (batch, seq, heads, d / heads), as dot_product_attention takes
        q, k, v = (t.reshape(*t.shape[:-1], heads, d // heads) for t in (q, k, v))
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        h = h + att.reshape(h.shape) @ p["proj"]
        return h + jax.nn.gelu(layernorm(h, p["ln2"]) @ p["up"]) @ p["down"]
    split = lambda t: t.reshape(*t.shape[:-1], heads, d // heads).swapaxes(-2, -3)
    q, k, v = split(q), split(k), split(v)
    scores = (q @ k.swapaxes(-1, -2)).astype(jnp.float32) / np.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    att = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1).astype(h.dtype) @ v
    h = h + att.swapaxes(-2, -3).reshape(h.shape) @ p["proj"]
    return h + jax.nn.gelu(layernorm(h, p["ln2"]) @ p["up"]) @ p["down"]


def logits_fn(params: dict[str, Any], inputs: jax.Array, cfg: ModelConfig,
              num_stages: int) -> jax.Array:
    """float32 next-token logits for `inputs` (..., seq): the blocks split evenly over
    `num_stages` stages, each stage ended by `jaxpp_mpi.mark_stage_end` (the embedding
    runs on the first stage, the head on the last)."""
    h = params["embed"][inputs] + params["pos"]
    per_stage = cfg.layers // num_stages
    for s in range(num_stages):
        for p in params["blocks"][s * per_stage:(s + 1) * per_stage]:
            h = block(p, h, cfg.heads, cfg.fused_attention)
        h = jaxpp_mpi.mark_stage_end(h)
    head = params["embed"].T if cfg.tied else params["head"]
    return (layernorm(h, params["ln_f"]) @ head).astype(jnp.float32)


def next_token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean negative log-likelihood of `targets` under `logits`."""
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def loss_fn(params: dict[str, Any], mb: dict[str, jax.Array], cfg: ModelConfig,
            num_stages: int) -> jax.Array:
    """One microbatch's loss: `mb["inputs"]`'s next-token NLL against `mb["targets"]`."""
    return next_token_nll(logits_fn(params, mb["inputs"], cfg, num_stages), mb["targets"])


def param_specs(params: dict[str, Any]) -> dict[str, Any]:
    """Megatron-style layouts: column-split the first linear of attention and MLP over
    "model", row-split the second; everything else replicated."""
    column, row = P(None, "model"), P("model", None)
    split = {"qkv": column, "proj": row, "up": column, "down": row}
    specs = jax.tree.map(lambda _: P(), params)
    specs["blocks"] = [{k: split.get(k, P()) for k in b} for b in params["blocks"]]
    return specs


def make_train_step(loss, sched, optimizer: optax.GradientTransformation):
    """The training step: `loss`'s value and gradient per microbatch under `treduce` (the
    pipelined loop, in `sched`'s order), then one `optimizer` update.

    Returns:
      `train_step(opt_state, params, batch) -> (opt_state, params, mean loss)`, for
      `jaxpp_mpi.mpmd_jit_with_loop` and, unchanged, for `jax.jit`.
    """

    def train_step(opt_state, params, batch):
        loss_and_grad = partial(jax.value_and_grad(loss), params)
        losses, grads = jaxpp_mpi.treduce(loss_and_grad, batch, schedule=sched)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), losses.mean()

    return train_step


def synthetic_batch(cfg: ModelConfig, num_microbatches: int,
                    microbatch_size: int) -> dict[str, jax.Array]:
    """Data with structure to learn: each token is the previous plus one (mod the vocab),
    from random starts (numpy seed 0); int32 `inputs` and `targets` of shape
    (num_microbatches, microbatch_size, cfg.seq)."""
    rng = np.random.default_rng(0)
    starts = rng.integers(0, cfg.vocab, (num_microbatches, microbatch_size, 1))
    tokens = (starts + np.arange(cfg.seq + 1)) % cfg.vocab
    return {"inputs": jnp.asarray(tokens[..., :-1], jnp.int32),
            "targets": jnp.asarray(tokens[..., 1:], jnp.int32)}


def plan_inputs(mpmd_mesh: jaxpp_mpi.MpmdMesh, layers: int = 8, num_microbatches: int = 8,
                microbatch_size: int = 4) -> dict[str, Any]:
    """This model for the planner (`python -m jaxpp_mpi.schedules plan
    examples/train.py:plan_inputs`): the default sizes with `layers` blocks, a stage mark
    after every block (the planner keeps those that end its stages), adam; the step,
    its abstract arguments, the batch argument and the donated ones."""
    cfg = ModelConfig(vocab=256, hidden=64, heads=4, seq=32, layers=layers)
    optimizer = optax.adam(3e-3)
    # One stage per mark, so the step also runs as written (to measure its task times).
    sched = jaxpp_mpi.Interleaved1F1B(layers, mpmd_mesh.mpmd_dim)
    step = make_train_step(partial(loss_fn, cfg=cfg, num_stages=layers), sched, optimizer)
    params = jax.eval_shape(partial(init_params, cfg=cfg), jax.random.key(0))
    batch = jax.eval_shape(lambda: synthetic_batch(cfg, num_microbatches, microbatch_size))
    return {"step": step, "args": (jax.eval_shape(optimizer.init, params), params, batch),
            "batch_argnums": 2, "donate_argnums": (0, 1)}


# -- the script ----------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b")
    p.add_argument("--microbatches", dest="num_microbatches", type=int, default=8,
                   help="microbatches per step")
    p.add_argument("--microbatch-size", type=int, default=4, help="sequences per microbatch")
    # Deprecated spellings of the two flags above, kept working but hidden from --help.
    p.add_argument("--mubatches", dest="num_microbatches", type=int, help=argparse.SUPPRESS)
    p.add_argument("--mubatch-size", dest="microbatch_size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=0,
                   help="transformer blocks (default: one per stage)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--tied", action="store_true", help="tie the unembedding to the embedding")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-axis", type=int, default=1,
                   help="devices per group on 'data' (the batch's rows split over them)")
    p.add_argument("--model-axis", type=int, default=1,
                   help="devices per group on 'model' (the blocks' weights split over them)")
    p.add_argument("--replicas", type=int, default=1,
                   help="copies of the pipeline (MPI mode: R x P ranks for P groups); the "
                        "microbatches of a step are shared out among them")
    p.add_argument("--groups", type=int, default=0,
                   help="MPMD groups in a single process (default: the MPI world size)")
    p.add_argument("--matmul-precision", choices=("auto", "default", "high", "highest"),
                   default="auto",
                   help="float32 matrix products (jax_default_matmul_precision). auto: "
                        "highest on GPUs/TPUs, whose default (TF32/bf16 passes) rounds "
                        "by how XLA fuses, so the pipelined stages and one jax.jit of "
                        "the step differ past the float32 check's tolerance; JAX's "
                        "default on CPU")
    p.add_argument("--no-check", action="store_true", help="skip the jax.jit comparison")
    p.add_argument("--trace", metavar="OUT.json",
                   help="record the step after the warm-up step as a Chrome trace")
    p.add_argument("--ckpt-dir", metavar="DIR",
                   help="checkpoints go to DIR/ckpt/STEP (a CheckpointManager): resume from "
                        "the newest complete step there, save at the end; on "
                        "SIGTERM/SIGUSR1 (e.g. SLURM preemption) every rank stops after the "
                        "same step, saves it and exits 0, so re-running the same command "
                        "resumes")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="with --ckpt-dir: also save every K steps, written in the background "
                        "while training goes on (0: only at the end and on preemption)")
    p.add_argument("--keep", type=int, default=2, metavar="N",
                   help="with --ckpt-dir: keep the N newest steps (default 2)")
    p.add_argument("--quiet", action="store_true",
                   help="print only the check against jax.jit (and errors)")
    return p.parse_args(argv)


def _world_size() -> int:
    """The MPI job's size from the launcher's environment, before JAX or MPI start."""
    from jaxpp_mpi.launch import launcher_world_size

    return launcher_world_size(os.environ)


def pipeline_layout(world: int, replicas: int, num_microbatches: int) -> int:
    """The number of groups per pipeline for `replicas` copies on `world` ranks.

    It depends only on the arguments and the job size, so every rank decides alike,
    before JAX starts.

    Raises:
      ValueError: `replicas` is not positive, needs MPI mode (`world` == 1), does not
        divide `world` or does not divide `num_microbatches`.
    """
    if replicas < 1:
        raise ValueError(f"--replicas={replicas} must be at least 1")
    if replicas == 1:
        return world
    if world == 1:
        raise ValueError(f"--replicas={replicas} needs one rank per (replica, group): run "
                         f"launch/jpprun -n {replicas}*P for {replicas} replicas of a "
                         "P-group pipeline")
    if world % replicas:
        raise ValueError(f"--replicas={replicas} must divide the job's {world} ranks "
                         f"(launch/jpprun -n {replicas}*P for {replicas} replicas of a "
                         "P-group pipeline)")
    if num_microbatches % replicas:
        raise ValueError(f"--replicas={replicas} must divide --microbatches="
                         f"{num_microbatches}: each replica runs the same number of the "
                         "step's microbatches")
    return world // replicas


def refuse(message: str, world: int) -> NoReturn:
    """Exits with `message`, which every rank reached alike: under MPI each rank prints
    it and waits for the others first, so the launcher, which ends the job when the
    first rank exits, cuts no rank's message short."""
    print(f"examples/train.py: {message}", file=sys.stderr, flush=True)
    if world > 1:
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
    raise SystemExit(2)


def predicted_bubble(sched, num_microbatches: int, trace=None) -> float:
    """The schedule simulator's mean bubble fraction: with unit task times (F=1, B=2,
    I=W=1), or with the mean task times of a trace from `jaxpp_mpi.trace.export`."""
    latencies = None
    if trace is not None:
        from jaxpp_mpi.trace import parse_label

        times: dict[TaskType, list[float]] = {}
        for ev in trace["traceEvents"]:
            parts = parse_label(ev["name"]) if ev.get("cat") == "task" else ()
            if len(parts) == 1 and parts[0].kind in "FBIW":
                times.setdefault(TaskType(parts[0].kind), []).append(ev["dur"])
        unit = {TaskType.FWD: 1.0, TaskType.BWD: 2.0, TaskType.BWD_I: 1.0, TaskType.BWD_W: 1.0}
        mean = {k: sum(v) / len(v) for k, v in times.items()}
        scale = sum(mean[k] / unit[k] for k in mean) / max(1, len(mean))  # for kinds unseen
        latencies = {k: mean.get(k, unit[k] * scale) for k in unit} if mean else None
    bubble = analyze_schedule(sched, num_microbatches, latencies).bubble_fraction
    return sum(bubble) / len(bubble)


def main(argv=None) -> int:
    args = parse_args(argv)
    world = _world_size()
    replicas = args.replicas
    try:
        pipeline = pipeline_layout(world, replicas, args.num_microbatches)
    except ValueError as e:
        refuse(str(e), world)
    per_group = args.data_axis * args.model_axis
    if world == 1:  # local mode: every group's devices in this process
        groups = args.groups or 2
        flag = f"--xla_force_host_platform_device_count={groups * per_group}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    elif per_group > 1 and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        flag = f"--xla_force_host_platform_device_count={per_group}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

    import jaxpp_mpi.checkpoint
    import jaxpp_mpi.launch
    import jaxpp_mpi.trace

    if world == 1:
        groups = args.groups or 2
        mesh = jaxpp_mpi.MpmdMesh(
            jax.make_mesh((groups, args.data_axis, args.model_axis),
                          ("stage", "data", "model")), "stage")
    else:
        groups = pipeline
        mesh = jaxpp_mpi.make_mpmd_mesh(
            (replicas, groups, args.data_axis, args.model_axis),
            ("replica", "stage", "data", "model"), "stage", replica_axis_name="replica")
    rank = 0 if mesh.is_local else mesh.job_comm.Get_rank()  # the job's, every replica's
    precision = args.matmul_precision
    if precision == "auto":
        precision = "default" if jax.local_devices()[0].platform == "cpu" else "highest"
    if precision != "default":  # the pipelined run and the jax.jit check alike
        jax.config.update("jax_default_matmul_precision", precision)
    verbose = rank == 0 and not args.quiet
    if verbose:  # compilation progress (the jaxpp_mpi logger, INFO, rank 0 only)
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("  %(message)s"))
        logging.getLogger("jaxpp_mpi").addHandler(handler)
        logging.getLogger("jaxpp_mpi").setLevel(logging.INFO)
    sched = schedule_by_name(args.schedule, groups)
    stages = sched.num_stages
    layers = args.layers or stages
    if layers % stages:
        raise SystemExit(f"--layers={layers} must be a multiple of the {stages} stages")
    if args.microbatch_size % args.data_axis or args.hidden % args.model_axis:
        raise SystemExit(f"--microbatch-size={args.microbatch_size} must be a multiple of "
                         f"--data-axis={args.data_axis}, --hidden={args.hidden} of "
                         f"--model-axis={args.model_axis}")
    cfg = ModelConfig(vocab=args.vocab, hidden=args.hidden, heads=args.heads, seq=args.seq,
                      layers=layers, tied=args.tied, dtype=args.dtype)
    optimizer = optax.adam(args.lr)
    train_step = make_train_step(partial(loss_fn, cfg=cfg, num_stages=stages), sched,
                                 optimizer)
    batch = synthetic_batch(cfg, args.num_microbatches, args.microbatch_size)
    params = init_params(jax.random.PRNGKey(0), cfg)
    opt_state = optimizer.init(params)

    in_shardings = out_shardings = None  # one device per group: nothing to split
    if per_group > 1:
        specs = param_specs(params)
        opt_specs = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, specs,
                                          transform_non_params=lambda _: P())
        rows = {k: P(None, "data") for k in batch}  # (microbatch, row, position)
        in_shardings, out_shardings = (opt_specs, specs, rows), (opt_specs, specs, P())
    step = jaxpp_mpi.mpmd_jit_with_loop(train_step, mpmd_mesh=mesh, donate_argnums=(0, 1),
                                        in_shardings=in_shardings,
                                        out_shardings=out_shardings)
    if verbose:
        layout = f" (data={args.data_axis}, model={args.model_axis})" if per_group > 1 else ""
        copies = (f" x {replicas} replicas ({args.num_microbatches // replicas} "
                  "microbatches each)") if replicas > 1 else ""
        print(f"{args.schedule}: {stages} stages on {groups} groups of {per_group} device(s)"
              f"{layout}{copies}, {args.num_microbatches} microbatches", flush=True)
    # The guard covers the whole run, compiling and the final save included: a SIGTERM
    # (or SIGUSR1: what launch/jpprun makes of a SIGTERM to it) anywhere only sets a
    # flag, and every rank stops after the same step with its checkpoint saved. Without
    # --ckpt-dir there is nothing to save: signals keep their default action.
    guarded = jaxpp_mpi.PreemptionGuard(mesh) if args.ckpt_dir else contextlib.nullcontext()
    with guarded as guard:
        t0 = time.perf_counter()
        compiled = step.compile(opt_state, params, batch)
        local_microbatches = args.num_microbatches // replicas  # each replica's share
        bubble = predicted_bubble(sched, local_microbatches)
        if verbose:
            print(f"compiled in {time.perf_counter() - t0:.1f} s; bubble: the simulated idle "
                  "share (unit task times; after a --trace step, its task times)", flush=True)
            print(f"{'step':>5}  {'loss':>8}  {'time ms':>9}  {'tokens/s':>10}  {'bubble':>6}",
                  flush=True)
        tokens = args.num_microbatches * args.microbatch_size * args.seq
        traced = min(1, args.steps - 1) if args.trace else -1  # after one warm-up step
        losses: list = []
        state = (opt_state, params)
        first = 0
        ckpt = os.path.join(args.ckpt_dir, "ckpt") if args.ckpt_dir else None
        # Steps DIR/ckpt/STEP; saving every --save-every steps, the --keep newest kept. A
        # save returns once this rank holds a host copy of its part of the state (the
        # step may then donate it) and is written in the background; the next save, or
        # manager.wait(), raises on every rank if it failed.
        manager = jaxpp_mpi.checkpoint.CheckpointManager(
            ckpt, mesh=mesh, save_interval_steps=max(1, args.save_every),
            max_to_keep=max(1, args.keep)) if ckpt else None
        latest = manager.latest_step() if manager else None
        if latest is not None:  # the newest complete step, an interrupted save's included
            first = latest
            like = {"opt_state": opt_state, "params": params, "losses": np.zeros(first)}
            restored = manager.restore(like, shardings={
                "opt_state": compiled.in_shardings[0][0],
                "params": compiled.in_shardings[0][1],
                "losses": None})
            state = (restored["opt_state"], restored["params"])
            losses = [float(v) for v in np.asarray(restored["losses"])]
            if verbose:
                print(f"resumed from {ckpt} at step {first}", flush=True)

        def save(step_count: int, force: bool = False) -> None:
            tree = {"opt_state": state[0], "params": state[1], "losses": np.array(losses)}
            manager.save(step_count, tree, force=force)

        for i in range(first, args.steps):
            with jaxpp_mpi.trace.record() if i == traced else contextlib.nullcontext() as events:
                start = time.perf_counter()
                opt_state_out, params_out, loss = compiled(*state, batch)
                state = (opt_state_out, params_out)
                value = (float(np.asarray(loss.first_mpmd_replica))
                         if loss.is_partially_addressable else None)
                if not mesh.is_local:  # the loss lives on the last stage's rank
                    with jaxpp_mpi.launch.deadline("loss broadcast", mesh.comm):
                        value = mesh.comm.bcast(value, root=min(loss.mpmd_idxs))
                elapsed = time.perf_counter() - start
            losses.append(value)
            if verbose:
                mark = " *traced (timed task by task: slower)" if i == traced else ""
                print(f"{i:>5}  {value:>8.4f}  {elapsed * 1e3:>9.1f}  {tokens / elapsed:>10,.0f}  "
                      f"{100 * bubble:>5.1f}%{mark}", flush=True)
            if i == traced:
                info = {"schedule": args.schedule, "num_microbatches": args.num_microbatches,
                        "step": i}
                trace = jaxpp_mpi.trace.export(args.trace, events, mesh, other_data=info)
                if trace is not None:
                    bubble = predicted_bubble(sched, local_microbatches, trace)
                    if verbose:
                        print(f"wrote {args.trace}", flush=True)
            if manager and args.save_every:
                save(i + 1)  # every --save-every steps, in the background
            if ckpt and guard.should_stop():
                save(i + 1, force=True)  # after the save in flight, if any
                manager.close()  # every rank: committed, or raised
                if verbose:
                    why = guard.received.name if guard.received else "a peer's signal"
                    print(f"stopping after step {i} on {why}; saved {ckpt}; run the same "
                          "command to resume", flush=True)
                return 0
        if ckpt:
            save(args.steps, force=True)
            manager.close()
    if args.no_check:
        return 0
    # Every rank's final parameters (each group's, in every replica) go to rank 0.
    held = {jax.tree_util.keystr(path): np.asarray(x.first_mpmd_replica)
            for path, x in jax.tree_util.tree_leaves_with_path(state[1])
            if x.is_partially_addressable}
    if mesh.is_local:
        gathered = [held]
    else:
        with jaxpp_mpi.launch.deadline("parameter check", mesh.job_comm):
            gathered = mesh.job_comm.gather(held, root=0)
    if rank != 0:
        return 0
    # The reference: the same step in this one process, with no pipeline.
    ref_params = init_params(jax.random.PRNGKey(0), cfg)
    ref_state = (optimizer.init(ref_params), ref_params)
    ref_step = jax.jit(train_step)
    ref_losses = []
    for _ in range(args.steps):
        o, p, loss = ref_step(*ref_state, batch)
        ref_state = (o, p)
        ref_losses.append(float(loss))
    reference = {jax.tree_util.keystr(path): np.asarray(x, np.float32)
                 for path, x in jax.tree_util.tree_leaves_with_path(ref_state[1])}
    ranks_per_replica = 1 if mesh.is_local else groups  # local: one process holds all
    return check_against_jit(losses, ref_losses, gathered, reference, ranks_per_replica,
                             float32=args.dtype == "float32")


def check_against_jit(losses: list[float], ref_losses: list[float],
                      gathered: list[dict], reference: dict, ranks_per_replica: int,
                      float32: bool) -> int:
    """Prints the largest differences from the `jax.jit` run; 1 when one is too large.

    Args:
      losses: the pipelined run's loss per step.
      ref_losses: `jax.jit`'s loss per step.
      gathered: per job rank, the parameters it holds by key path.
      reference: `jax.jit`'s final parameters by key path.
      ranks_per_replica: ranks per pipeline replica, in job rank order.
      float32: the run's dtype is float32 (tighter tolerances than bfloat16).
    """
    tol, param_tol = (1e-4, 1e-3) if float32 else (5e-2, 5e-2)
    diff = float(np.max(np.abs(np.array(losses) - np.array(ref_losses))))
    print(f"max |loss - jax.jit loss| over {len(losses)} steps: {diff:.3g} "
          f"(tolerance {tol:g})", flush=True)
    missing: list[str] = []
    param_diff = 0.0
    for replica in range(len(gathered) // ranks_per_replica):
        seen: set[str] = set()
        first = replica * ranks_per_replica
        for held in gathered[first:first + ranks_per_replica]:
            for key, value in held.items():
                seen.add(key)
                error = np.abs(value.astype(np.float32) - reference[key])
                param_diff = max(param_diff, float(error.max(initial=0.0)))
        missing += [f"replica {replica}: {key}" for key in sorted(set(reference) - seen)]
    print(f"max |param - jax.jit param| on {len(gathered)} rank(s): {param_diff:.3g} "
          f"(tolerance {param_tol:g})", flush=True)
    if missing or not (diff <= tol and param_diff <= param_tol):
        print("MISMATCH against jax.jit" + (f"; no rank holds {missing}" if missing else ""),
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
