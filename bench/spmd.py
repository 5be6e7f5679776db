"""Per-device FLOPs of a pipelined step on data / model / data x model groups, vs jax.jit.

Run in one process (local mode, 8 CPU devices forced before JAX starts):

    .venv/bin/python bench/spmd.py --out bench/results/spmd.json

For a Megatron-style MLP and examples/train.py's decoder-only transformer (imported from
it; one block per stage, untied head), 2 pipeline groups and Std1F1B, the step is compiled
with `in_shardings` / `out_shardings` that column-split every first linear over "model"
(`P(None, "model")`: the MLP's `w1`, the transformer's `qkv` and `up`), row-split every
second one (`P("model", None)`: `w2`, `proj`, `down`) and shard the batch's rows over
"data". Per group layout (data=D, model=M; the MPMD mesh is `(2, D, M)` over
("stage", "data", "model")):

- `flops[g]`: group g's per-device FLOPs of one whole step, `compiled.cost_analysis()`;
- `reference`: per-device FLOPs of the same step under plain `jax.jit` on ONE group's
  mesh `(D, M)`, with the same shardings;
- `sum_vs_reference`: (flops[0] + flops[1]) / reference, 1.0 when the pipeline does the
  work jax.jit does on each device;
- `vs_one_device[g]` and `reference_vs_one_device`: the same FLOPs divided by those of
  the 1-device layout (data=1, model=1): ideally 1 / (D * M).

One microbatch: XLA's cost analysis counts a while loop's body once whatever its trip
count, and jax.jit of a treduce step is such a loop when there is more than one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))  # train.py: the transformer

DEVICES = 8
NUM_MICROBATCHES = 1  # see the module docstring: no loop in the jax.jit reference
LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (data, model); (1, 1) is the baseline


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/spmd.json")
    p.add_argument("--models", nargs="+", choices=("mlp", "transformer"),
                   default=["mlp", "transformer"])
    p.add_argument("--width", type=int, default=256, help="MLP width (hidden: 4x)")
    p.add_argument("--rows", type=int, default=64, help="MLP rows per microbatch")
    p.add_argument("--hidden", type=int, default=64, help="transformer width")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--sequences", type=int, default=8,
                   help="transformer sequences per microbatch")
    p.add_argument("--no-out-shardings", action="store_true",
                   help="leave out_shardings unset (both for the pipeline and jax.jit)")
    return p.parse_args(argv)


def mlp(args, stages: int, rng):
    """A residual-free tanh MLP, per stage `tanh(tanh(x @ w1 + b1) @ w2 + b2)`."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxpp_mpi

    d, h = args.width, 4 * args.width
    normal = lambda *shape: (rng.standard_normal(shape) / shape[0] ** 0.5).astype("float32")
    params = [{"w1": normal(d, h), "b1": normal(h), "w2": normal(h, d), "b2": normal(d)}
              for _ in range(stages)]
    specs = [{"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
             for _ in range(stages)]
    batch = (normal(NUM_MICROBATCHES, args.rows, d), normal(NUM_MICROBATCHES, args.rows, d))
    batch_specs = (P(None, "data"), P(None, "data"))

    def loss_fn(params, mb):
        x, y = mb
        for p in params:
            x = jnp.tanh(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"])
            x = jaxpp_mpi.mark_stage_end(x)
        return jnp.mean((x - y) ** 2)

    return params, specs, batch, batch_specs, loss_fn


def transformer(args, stages: int, rng):
    """examples/train.py's LM, one block per stage, its Megatron specs; `rng` unused (only
    shapes matter here: the steps are compiled, not run)."""
    import jax
    import train
    from jax.sharding import PartitionSpec as P

    cfg = train.ModelConfig(vocab=args.vocab, hidden=args.hidden, heads=args.heads,
                            seq=args.seq, layers=stages)
    params = train.init_params(jax.random.PRNGKey(0), cfg)
    batch = train.synthetic_batch(cfg, NUM_MICROBATCHES, args.sequences)
    batch_specs = {k: P(None, "data") for k in batch}
    loss_fn = partial(train.loss_fn, cfg=cfg, num_stages=stages)
    return params, train.param_specs(params), batch, batch_specs, loss_fn


MODELS = {"mlp": mlp, "transformer": transformer}


def measure(args, model: str, data: int, model_axis: int) -> dict:
    """Compiles the model's step pipelined on 2 groups of (data, model_axis) devices and
    under jax.jit on one such group; returns their per-device FLOPs."""
    import jax
    import numpy as np
    import optax
    import train
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpp_mpi
    from jaxpp_mpi.schedules import Std1F1B

    groups = 2
    sched = Std1F1B(groups)
    params, param_specs, batch, batch_specs, loss_fn = MODELS[model](
        args, sched.num_stages, np.random.default_rng(0))
    optimizer = optax.adam(1e-3)
    step = train.make_train_step(loss_fn, sched, optimizer)

    opt_state = optimizer.init(params)
    opt_specs = optax.tree_map_params(optimizer, lambda _, spec: spec, opt_state, param_specs,
                                      transform_non_params=lambda _: P())
    in_specs = (opt_specs, param_specs, batch_specs)
    out_specs = None if args.no_out_shardings else (opt_specs, param_specs, P())
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          (opt_state, params, batch))

    auto = (AxisType.Auto,) * 3
    mesh = jax.make_mesh((groups, data, model_axis), ("stage", "data", "model"),
                         axis_types=auto, devices=jax.devices()[:groups * data * model_axis])
    mpmd_mesh = jaxpp_mpi.MpmdMesh(mesh, "stage")
    pipelined = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh, in_shardings=in_specs,
                                             out_shardings=out_specs).compile(*shapes)
    cost = pipelined.cost_analysis()

    group_mesh = jax.make_mesh((data, model_axis), ("data", "model"), axis_types=auto[1:],
                               devices=jax.devices()[:data * model_axis])
    named = lambda specs: jax.tree.map(lambda s: NamedSharding(group_mesh, s), specs,
                                       is_leaf=lambda x: isinstance(x, P))
    jitted = jax.jit(step, in_shardings=named(in_specs),
                     out_shardings=None if out_specs is None else named(out_specs))
    ref_cost = jitted.lower(*shapes).compile().cost_analysis()
    ref_cost = ref_cost[0] if isinstance(ref_cost, (list, tuple)) else ref_cost
    return {"flops": [c["flops"] for c in cost], "reference": float(ref_cost["flops"]),
            "per_executable": [c["per_executable"] for c in cost]}


def layout_name(data: int, model_axis: int) -> str:
    parts = [f"data={data}"] * (data > 1) + [f"model={model_axis}"] * (model_axis > 1)
    return " x ".join(parts) or "1 device"


def main(argv=None) -> int:
    args = parse_args(argv)
    flag = f"--xla_force_host_platform_device_count={DEVICES}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    results = []
    for model in args.models:
        rows = {}
        for data, model_axis in LAYOUTS:
            rows[data, model_axis] = measure(args, model, data, model_axis)
        base = rows[1, 1]
        for (data, model_axis), r in rows.items():
            total = sum(r["flops"])
            results.append({
                "model": model, "data": data, "model_axis": model_axis,
                "layout": layout_name(data, model_axis),
                "flops": r["flops"], "reference": r["reference"],
                "share_of_reference": [f / r["reference"] for f in r["flops"]],
                "sum_vs_reference": total / r["reference"],
                "vs_one_device": [f / b for f, b in zip(r["flops"], base["flops"])],
                "sum_vs_one_device": total / sum(base["flops"]),
                "reference_vs_one_device": r["reference"] / base["reference"],
                "per_executable": r["per_executable"],
            })
    sizes = {k: getattr(args, k) for k in ("width", "rows", "hidden", "heads", "seq",
                                            "vocab", "sequences")}
    report = {
        "benchmark": "spmd", "machine": platform.node(), "jax": jax.__version__,
        "groups": 2, "schedule": "Std1F1B(2)", "num_microbatches": NUM_MICROBATCHES,
        "out_shardings": not args.no_out_shardings, "sizes": sizes, "results": results,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print("| model | layout | group 0 FLOPs | group 1 FLOPs | jax.jit FLOPs | sum / jax.jit "
          "| group 0 / 1 dev | group 1 / 1 dev | sum / 1 dev | jax.jit / 1 dev |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['layout']} | {r['flops'][0]:.3g} | {r['flops'][1]:.3g} "
              f"| {r['reference']:.3g} | {r['sum_vs_reference']:.2f} "
              f"| {r['vs_one_device'][0]:.2f} | {r['vs_one_device'][1]:.2f} "
              f"| {r['sum_vs_one_device']:.2f} | {r['reference_vs_one_device']:.2f} |")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
