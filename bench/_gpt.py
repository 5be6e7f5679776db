"""bench/gpu.py's workload: examples/train.py's decoder in bf16 over float32 weights.

The model, its initialisation, the synthetic batch and the pipelined training step are
examples/train.py's (imported from it); what is added here is what the benchmark
compares them with: the bf16 loss (weights cast inside it), `jax.jit`'s step as a
`lax.scan` over the microbatches, each stage's share of one microbatch as a function of
its own, and the small helpers of a timed run (a clock, readiness, peak memory, the
result file's header, the program's executable counts).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))  # train.py: the model

# GPT-2 small's shape (untied head, vocab padded to a multiple of 128), and a smoke size.
FULL = {"layers": 12, "hidden": 768, "heads": 12, "seq": 1024, "vocab": 50304,
        "num_microbatches": 8, "microbatch_size": 8}
QUICK = {"layers": 4, "hidden": 64, "heads": 4, "seq": 32, "vocab": 256,
         "num_microbatches": 4, "microbatch_size": 8}
LOSS_TOLERANCE = 5e-2  # |loss - jax.jit's loss|: bf16 products, XLA fusing them its own way


def add_model_options(p: argparse.ArgumentParser) -> None:
    """--layers ... --microbatch-size (default: FULL) and --quick (QUICK, where not given)."""
    for name in FULL:
        flag = "--" + name.replace("_", "-").replace("num-", "")
        p.add_argument(flag, dest=name, type=int, default=None,
                       help=f"default {FULL[name]} ({QUICK[name]} with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="a tiny model (" + ", ".join(f"{k} {v}" for k, v in QUICK.items())
                   + ") that runs on a CPU in a minute or two; every code path")
    p.add_argument("--fused-attention", action="store_true",
                   help="attention by jax.nn.dot_product_attention (cuDNN's fused kernel "
                   "on a GPU: no seq x seq scores kept for the backward), in jax.jit's "
                   "step and the pipeline's alike")


def model_options(args: argparse.Namespace) -> dict[str, int]:
    """The sizes the run uses: the options given, else FULL's or QUICK's."""
    base = QUICK if args.quick else FULL
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v
             for k, v in base.items()}
    for k in sizes:
        setattr(args, k, sizes[k])
    return sizes


def config(sizes: dict[str, int], fused_attention: bool = False):
    """The model's `ModelConfig`: float32 weights (the master copy)."""
    import train

    return train.ModelConfig(vocab=sizes["vocab"], hidden=sizes["hidden"],
                             heads=sizes["heads"], seq=sizes["seq"], layers=sizes["layers"],
                             fused_attention=fused_attention)


def cast(tree: Any) -> Any:
    """Every float32 leaf of `tree` in bfloat16."""
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x,
                        tree)


def bf16_loss(cfg, num_stages: int):
    """One microbatch's loss with the weights cast to bf16 inside it (the stages split
    by `mark_stage_end` as examples/train.py's `logits_fn` does)."""
    import train

    def loss(params, mb):
        return train.loss_fn(cast(params), mb, cfg, num_stages)

    return loss


def initial_state(cfg, optimizer):
    """(opt_state, params) from examples/train.py's init (key 0)."""
    import jax
    import train

    params = train.init_params(jax.random.PRNGKey(0), cfg)
    return optimizer.init(params), params


def scan_train_step(loss, optimizer, num_microbatches: int):
    """`jax.jit`'s step: `lax.scan` of the loss's value and gradient over the
    microbatches, summing the gradients (as `treduce` does), then one update.

    Returns:
      `step(opt_state, params, batch) -> (opt_state, params, mean loss)`, as
      examples/train.py's `make_train_step`.
    """
    import jax
    import jax.numpy as jnp
    import optax

    grad = jax.value_and_grad(loss)

    def step(opt_state, params, batch):
        def body(acc, mb):
            value, g = grad(params, mb)
            return jax.tree.map(jnp.add, acc, g), value

        zero = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(body, zero, batch, length=num_microbatches)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), losses.mean()

    return step


def grad_step(loss, sched):
    """The pipelined step without the optimizer (what bench/stages.py plans):
    `step(params, batch) -> (losses, summed gradients)`."""
    import jax

    import jaxpp_mpi

    def step(params, batch):
        return jaxpp_mpi.treduce(partial(jax.value_and_grad(loss), params), batch,
                                 schedule=sched)

    return step


def stage_params(params: dict[str, Any], stage: int, num_stages: int) -> dict[str, Any]:
    """The weights stage `stage` uses: its blocks, the embeddings on the first stage,
    the final norm and head on the last."""
    per = len(params["blocks"]) // num_stages
    out: dict[str, Any] = {"blocks": params["blocks"][stage * per:(stage + 1) * per]}
    if stage == 0:
        out.update(embed=params["embed"], pos=params["pos"])
    if stage == num_stages - 1:
        out.update(ln_f=params["ln_f"], head=params["head"])
    return out


def stage_reference(cfg, stage: int, num_stages: int):
    """One microbatch of stage `stage`'s share of the step, for `jax.jit` alone.

    `fn(acc, params, x, t)` with `stage_params`' weights: `x` is the token ids on the
    first stage, else the previous stage's bf16 output; `t` the targets on the last
    stage, else the output's cotangent. Returns the weight gradients added into `acc`,
    then the input gradient (not on the first stage), then the output (not on the last)
    or the loss (on the last), as bench/stages.py's reference does.
    """
    import jax
    import train

    first, last = stage == 0, stage == num_stages - 1
    argnums = (0,) if first else (0, 1)

    def forward(params, x, t=None):
        p = cast(params)
        h = p["embed"][x] + p["pos"] if first else x
        for b in p["blocks"]:
            h = train.block(b, h, cfg.heads, cfg.fused_attention)
        if not last:
            return h
        logits = (train.layernorm(h, p["ln_f"]) @ p["head"]).astype("float32")
        return train.next_token_nll(logits, t)

    def fn(acc, params, x, t):
        if last:
            out, grads = jax.value_and_grad(partial(forward, t=t), argnums)(params, x)
        else:
            out, vjp = jax.vjp(partial(forward, x=x) if first else forward,
                               *((params,) if first else (params, x)))
            grads = vjp(t)
        acc = jax.tree.map(jax.numpy.add, acc, grads[0])
        return (acc, *grads[1:], out)

    return fn


# -- a timed run -------------------------------------------------------------------


class Clock:
    """Timestamped progress lines (`[12:00:01 +3.2s] ...`), flushed at once; silent
    when `quiet` (ranks other than 0)."""

    def __init__(self, quiet: bool = False):
        self.start = time.perf_counter()
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        if not self.quiet:
            print(f"[{time.strftime('%H:%M:%S')} +{self.elapsed():.1f}s] {message}",
                  flush=True)


def ready(tree: Any) -> Any:
    """Blocks until every array of `tree` this process holds is computed (jax.Arrays,
    and the held part of `MpmdArray`s); returns `tree`."""
    import jax

    held = []
    for x in jax.tree.leaves(tree):
        if hasattr(x, "first_mpmd_replica"):
            if x.is_partially_addressable:
                held.append(x.first_mpmd_replica)
        else:
            held.append(x)
    jax.block_until_ready(held)
    return tree


def copy_tree(tree: Any) -> Any:
    """A fresh device copy of every array of `tree` (donated arguments are used up)."""
    import jax

    return jax.tree.map(lambda x: x.copy(), tree)


def peak_bytes() -> int | None:
    """The first device's `peak_bytes_in_use` since the process started (None where
    the backend keeps no memory statistics, as on CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None


def median(values: list[float]) -> float:
    """The median of `values` (NaN when empty)."""
    import numpy as np

    return float(np.median(values)) if values else float("nan")


def header(args: argparse.Namespace, part: str) -> dict[str, Any]:
    """The top of a result file: the run's metadata, device, sizes and settings."""
    import jax
    from _common import metadata

    dev = jax.devices()[0]
    return {"benchmark": "gpu", "part": part, **metadata(), "device": dev.device_kind,
            "platform": dev.platform, "quick": args.quick, "sizes": args.sizes,
            "reduced": not args.quick and args.sizes != FULL, "steps": args.steps,
            "fused_attention": args.fused_attention,
            "loss_tolerance": LOSS_TOLERANCE, "complete": False}


def loss_value(x: Any) -> float | None:
    """A scalar result as a float, where this process holds it (else None)."""
    import numpy as np

    if hasattr(x, "first_mpmd_replica"):
        return float(np.asarray(x.first_mpmd_replica)) if x.is_partially_addressable else None
    return float(np.asarray(x))


def counts(program: Any) -> dict[str, Any]:
    """What a program runs per microbatch and per step (`Note: executable counts` in
    jaxpp_mpi/_src/ir/counts.py), JSON-ready."""
    from jaxpp_mpi._src.ir import counts as ir_counts

    return {"executables_per_microbatch": ir_counts.executables_per_microbatch(program),
            "by_kind": ir_counts.executables_per_microbatch_by_kind(program),
            "per_group": ir_counts.group_executables_per_microbatch(program),
            "instructions": ir_counts.instruction_counts(program)}
