"""bench/schedules.py's workload under torch.distributed.pipelining: one process per stage.

Started by bench/_alone.py (`torch_pipelining`), one process per rank of its own gloo
process group (`--rank R --world 2 --port P`), each pinned to `--cores` with one compute
thread; not an MPI job. The same step as bench/schedules.py's: the same numpy weights
and batch (`schedules.make_data`), residual blocks `x + W2 gelu(W1 layernorm(x))` (exact
GELU, LayerNorm eps 1e-5 without scale or offset, no biases), loss MSE / num_microbatches
per microbatch (`scale_grads=False`: torch adds the microbatches' gradients as they are),
the stages splitting the blocks evenly; forward, backward and gradient accumulation, no
optimizer. Each schedule (torch's ScheduleGPipe, Schedule1F1B) is warmed up twice, then
timed `--repeats` times barrier to barrier, the schedules taking turns. The last stage's
process writes `--out`: per schedule the step times (ms) and the step's summed loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/schedules.py

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--cores", required=True, help="comma-separated cores to pin to")
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--microbatches", dest="num_microbatches", type=int, default=8)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def make_stage_module(blocks):
    """A torch module of some of the workload's blocks (numpy weights, `x @ w1` layout)."""
    import torch
    import torch.nn.functional as F

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.ParameterList([torch.from_numpy(b["w1"]) for b in blocks])
            self.w2 = torch.nn.ParameterList([torch.from_numpy(b["w2"]) for b in blocks])

        def forward(self, x):
            for w1, w2 in zip(self.w1, self.w2):
                h = F.layer_norm(x, (x.shape[-1],), eps=1e-5)
                x = x + F.gelu(h @ w1, approximate="none") @ w2
            return x

    return Blocks()


def main() -> None:
    args = parse_args()
    os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import torch.distributed as dist
    from schedules import make_data  # the workload's one home
    from torch.distributed import pipelining

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.world)
    n, per_stage = args.num_microbatches, args.blocks // args.world
    np_params, (x, y) = make_data(args)
    module = make_stage_module(np_params[args.rank * per_stage:(args.rank + 1) * per_stage])
    x = torch.from_numpy(x).reshape(n * args.rows, args.width)
    y = torch.from_numpy(y).reshape(n * args.rows, args.width)
    first, last = args.rank == 0, args.rank == args.world - 1

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target) / n

    runners = {}
    for name in args.schedules.split(","):
        stage = pipelining.PipelineStage(module, args.rank, args.world, torch.device("cpu"))
        runners[name] = getattr(pipelining, SCHEDULES[name])(stage, n, loss_fn=loss_fn,
                                                             scale_grads=False)

    def step(name):
        losses: list = []
        if first:
            runners[name].step(x)
        elif last:
            runners[name].step(target=y, losses=losses)
        else:
            runners[name].step()
        return float(sum(t.item() for t in losses)) if last else None

    def timed(name) -> tuple[float, float | None]:
        module.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        loss = step(name)
        dist.barrier()
        return (time.perf_counter() - start) * 1e3, loss

    names = list(runners)
    loss = {name: [timed(name), timed(name)][-1][1] for name in names}  # warm-up
    steps: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.repeats):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            steps[name].append(timed(name)[0])
    if last:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(),
                       "schedules": {name: {"steps_ms": steps[name], "loss": loss[name]}
                                     for name in names}}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
