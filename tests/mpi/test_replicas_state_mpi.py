"""State around a step with pipeline replicas: checkpoints, reshard, init and traces.

Runs under `launch/jpprun -n 4`: 2 replicas x 2 groups (any even size: 2 x SIZE/2), and
beside it, for "onto one replica", each half of the ranks as a 1 x SIZE/2 job on a
sub-communicator, and for "onto another stage count", all ranks as a 1 x SIZE job. The
model is `mlp` with SIZE layers, two per stage on 2 replicas and one per stage on
SIZE groups. Every check is against `jax.jit` on the global batch or numpy (Note:
Checkpoints with replicas in checkpoint/store.py, Note: Reshard utility in
reshard/cli.py, Note: trace format in timeline/chrome.py).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from models import (
    assert_close_to_reference,
    bits,
    make_step,
    mlp,
    random_array,
    run_steps,
    schedule,
)
from mpi4py import MPI
from trace_schema import check_chrome_trace, program_tasks, task_counts

import jaxpp_mpi
import jaxpp_mpi.trace
from jaxpp_mpi import MpmdSharding, checkpoint
from jaxpp_mpi._src.checkpoint.commit import Ranks
from jaxpp_mpi._src.reshard.cli import convert

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
GROUPS = max(1, SIZE // 2)  # groups of one pipeline
NAMES = ("replica", "stage", "data")


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), [r for r in results if not r[0]]


def _held(tree) -> list[np.ndarray | None]:
    """This rank's value of every leaf (its group's replica), None where not held."""
    return [np.asarray(x.to_mpmd_local_array) if x.is_partially_addressable else None
            for x in jax.tree.leaves(tree)]


def _every_value(tree) -> list[np.ndarray]:
    """Every leaf's value on every rank, taken from the first rank holding it."""
    held = WORLD.allgather(_held(tree))
    return [next(h[i] for h in held if h[i] is not None) for i in range(len(held[0]))]


def _two_layers_per_stage(params, mb):
    """`mlp`'s loss with a stage mark after every second layer (same math, half the
    stages)."""
    x, y = mb
    for i, (w, b) in enumerate(params):
        x = jnp.tanh(x @ w + b)
        if i % 2:
            x = jaxpp_mpi.mark_stage_end(x)
    return jnp.mean((x - y) ** 2), {"max": jnp.max(x)}


def _shared_dir(factory, name: str) -> str:
    """Rank 0's fresh directory, on every rank (one host: one file system)."""
    return WORLD.bcast(str(factory.mktemp(name)) if RANK == 0 else None, root=0)


@pytest.fixture(scope="module")
def meshes():
    # Collective: every rank builds both meshes, in the same order. Each half of the
    # ranks is a one-replica job of its own.
    two = jaxpp_mpi.make_mpmd_mesh((2, GROUPS, K), NAMES, "stage", replica_axis_name="replica")
    half = WORLD.Split(RANK // GROUPS, RANK)
    one = jaxpp_mpi.make_mpmd_mesh((1, GROUPS, K), NAMES, "stage", comm=half,
                                   replica_axis_name="replica")
    return {1: one, 2: two}


@pytest.fixture(scope="module")
def run(meshes, tmp_path_factory):
    """Two adam steps with 2 replicas, saved; the jax.jit reference of three steps."""
    params, batch, _ = mlp(2 * GROUPS, 2 * GROUPS)
    step, opt = make_step(_two_layers_per_stage, schedule("1f1b", GROUPS))
    start = (opt.init(params), params)
    jitted = jax.jit(step)
    reference = {2: run_steps(jitted, *start, batch, steps=2)}
    reference[3] = jitted(*reference[2][:2], batch)
    fn2 = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=meshes[2])
    trained = run_steps(fn2, *start, batch, steps=2)[:2]
    root = _shared_dir(tmp_path_factory, "replica_ckpt")
    checkpoint.save(os.path.join(root, "two"), trained, step=2, mesh=meshes[2])
    return {"step": step, "batch": batch, "start": start, "reference": reference,
            "fn2": fn2, "trained": trained, "root": root}


@pytest.fixture(scope="module")
def restored(meshes, run):
    """The 2-replica save restored onto one replica (each half of the ranks)."""
    fn1 = jaxpp_mpi.mpmd_jit_with_loop(run["step"], mpmd_mesh=meshes[1])
    args, _ = fn1.compile(*run["start"], run["batch"]).in_shardings
    state = checkpoint.restore(os.path.join(run["root"], "two"), run["start"],
                               shardings=tuple(args[:2]))
    return fn1, state


@pytest.mark.mpi(min_size=4)
def test_two_replica_save_restores_bit_exact_onto_one_replica(run, restored):
    _, state = restored
    assert_close_to_reference(run["reference"][2][:2], run["trained"])
    want, got = _held(run["trained"]), _held(state)
    problems = [i for i, (a, b) in enumerate(zip(want, got))
                if (a is None) != (b is None)
                or (a is not None and not np.array_equal(bits(a), bits(b)))]
    _everywhere(not problems and any(a is not None for a in want),
                f"rank {RANK}: leaves {problems} differ")


@pytest.mark.mpi(min_size=4)
def test_restored_state_continues_like_the_two_replica_run(run, restored):
    fn1, state = restored
    one = fn1(*state, run["batch"])
    two = run["fn2"](*run["trained"], run["batch"])
    assert_close_to_reference(run["reference"][3], two)
    assert_close_to_reference(run["reference"][3], one)
    compared = assert_close_to_reference(two, one)
    _everywhere(compared > 0)


@pytest.fixture(scope="module")
def repartitioned(run):
    """The 2-replica save repartitioned by the reshard utility to the placement of the
    same model on 1 replica x SIZE groups (one layer per group), and restored there."""
    mesh = jaxpp_mpi.make_mpmd_mesh((1, SIZE, K), NAMES, "stage", replica_axis_name="replica")
    _, _, one_layer_per_stage = mlp(SIZE, 2 * GROUPS)
    step, _ = make_step(one_layer_per_stage, schedule("1f1b", SIZE))
    fn = jaxpp_mpi.mpmd_jit_with_loop(step, mpmd_mesh=mesh)
    args, _ = fn.compile(*run["start"], run["batch"]).in_shardings
    plan = os.path.join(run["root"], f"plan-{SIZE}.json")
    checkpoint.save_plan(plan, tuple(args[:2]), like=run["start"])
    path = os.path.join(run["root"], f"two-on-{SIZE}")
    moved = convert("repartition", os.path.join(run["root"], "two"), path, plan,
                    Ranks(WORLD, "test repartition"), log=lambda _: None)
    shardings = checkpoint.load_plan(plan).shardings_like(run["start"], mesh)
    state = checkpoint.restore(path, run["start"], shardings=shardings)
    return {"fn": fn, "state": state, "path": path, "moved": moved,
            "expected": jax.tree.leaves(tuple(args[:2]))}


@pytest.mark.mpi(min_size=4)
def test_two_replica_save_repartitions_bit_exact_onto_more_stages(run, repartitioned):
    manifest = checkpoint.read_manifest(repartitioned["path"])
    source = checkpoint.read_manifest(os.path.join(run["root"], "two"))
    expected = repartitioned["expected"]  # the SIZE-group step's own input shardings
    assert manifest.step == 2 and manifest.mpmd_dim == SIZE and source.mpmd_dim == GROUPS
    assert [leaf.placement.mesh_ids for leaf in manifest.leaves] == [
        s.mesh_ids for s in expected]
    assert repartitioned["moved"] == (len(source.leaves),
                                      sum(leaf.nbytes for leaf in source.leaves))
    # Layer i (w, b: the last leaves) of the SIZE layers now lives on group i alone.
    assert len(run["trained"][1]) == SIZE
    assert [s.mesh_ids for s in expected[-2 * SIZE:]] == [
        (i,) for i in range(SIZE) for _ in range(2)]
    want, got = _every_value(run["trained"]), _held(repartitioned["state"])
    problems = [i for i, (a, b, s) in enumerate(zip(want, got, expected))
                if (b is not None) != (RANK in s.mesh_ids)
                or (b is not None and not np.array_equal(bits(a), bits(b)))]
    _everywhere(not problems and any(b is not None for b in got),
                f"rank {RANK}: leaves {problems} differ or are misplaced")


@pytest.mark.mpi(min_size=4)
def test_repartitioned_state_continues_like_jax_jit(run, repartitioned):
    out = repartitioned["fn"](*repartitioned["state"], run["batch"])
    compared = assert_close_to_reference(run["reference"][3], out)
    _everywhere(compared > 0)


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for parent, _, names in os.walk(path):
        for name in names:
            file = os.path.join(parent, name)
            with open(file, "rb") as f:
                out[os.path.relpath(file, path)] = f.read()
    return out


@pytest.mark.mpi(min_size=4)
def test_two_replicas_write_the_files_of_one(meshes, run, restored):
    # The restored state is bit-exact (test above), so a one-replica save of it must
    # give the very same directory: same manifest (there are no timestamps), same files.
    _, state = restored
    one = os.path.join(run["root"], f"one-{RANK // GROUPS}")
    checkpoint.save(one, state, step=2, mesh=meshes[1])
    WORLD.Barrier()
    two = _files(os.path.join(run["root"], "two"))
    assert sorted(two) == sorted(_files(one)) and "manifest.json" in two
    assert _files(one) == two
    # The reshard utility converts it like any per-stage checkpoint (here to whole-model).
    spmd = os.path.join(run["root"], "two-spmd")
    convert("to-spmd", os.path.join(run["root"], "two"), spmd, None,
            Ranks(WORLD, "test conversion"), log=lambda _: None)
    assert checkpoint.read_manifest(spmd).is_whole
    whole = checkpoint.load_whole(spmd, like=run["start"])
    for a, b in zip(_held(run["trained"]), jax.tree.leaves(whole)):
        if a is not None:
            np.testing.assert_array_equal(bits(b), bits(a))


@pytest.mark.mpi(min_size=4)
def test_find_and_save_errors_agree_over_the_job(meshes, run):
    path = os.path.join(run["root"], "two")
    found = checkpoint.find(path, mesh=meshes[2])
    _everywhere(found is not None and found.step == 2 and found.mpmd_dim == GROUPS)
    with pytest.raises(checkpoint.CheckpointError, match="exists"):
        checkpoint.save(path, run["trained"], step=3, mesh=meshes[2])
    with pytest.raises(checkpoint.CheckpointError, match="newer than the step 1"):
        checkpoint.save(path, run["trained"], step=1, mesh=meshes[2], overwrite=True)
    _everywhere(checkpoint.read_manifest(path).step == 2)


@pytest.mark.mpi(min_size=4)
def test_init_and_reshard_with_replicas_match_numpy_on_every_rank(meshes):
    mesh = meshes[2]
    me = mesh.my_mpmd_axis_index

    def init(key):
        ks = jax.random.split(key, GROUPS + 1)
        return {"layers": [jax.random.uniform(ks[i], (4 * K, 3)) for i in range(GROUPS)],
                "bits": jax.random.bits(ks[-1], (5,))}

    shardings = {"layers": [MpmdSharding(mesh, i, P("data")) for i in range(GROUPS)],
                 "bits": MpmdSharding(mesh, range(GROUPS), P())}
    key = jax.random.PRNGKey(3)
    got = jaxpp_mpi.mpmd_init(init, shardings, key)
    want = jax.tree.map(np.asarray, init(key))  # the whole init, one process
    ok = all(a.is_partially_addressable == (i == me) for i, a in enumerate(got["layers"]))
    ok = ok and np.array_equal(bits(got["layers"][me]), bits(want["layers"][me]))
    ok = ok and np.array_equal(bits(got["bits"]), bits(want["bits"]))

    # SPMD -> MPMD -> SPMD: one value blocked over the groups, one whole.
    values = [random_array(5, (GROUPS * 2 * K, 3), "float32"),
              random_array(6, (3, 2 * K), "bfloat16")]
    spmd_mesh = mesh.mpmd_submesh((me,)).jax_mesh
    rows = values[0].shape[0] // GROUPS
    inputs = [jax.device_put(values[0][me * rows:(me + 1) * rows],
                             NamedSharding(spmd_mesh, P("stage"))),
              jax.device_put(values[1], NamedSharding(spmd_mesh, P()))]
    targets = [MpmdSharding(mesh, range(GROUPS), P("data")),
               MpmdSharding(mesh, GROUPS - 1, P(None, "data"))]
    mpmd = jaxpp_mpi.spmd_to_mpmd_reshard(mesh, inputs, targets, process_local=True)
    for arr, v, t in zip(mpmd, values, targets):
        held = me in t.mesh_ids
        ok = ok and arr.is_partially_addressable == held
        ok = ok and (not held or np.array_equal(bits(arr.to_mpmd_local_array), bits(v)))
    back = jaxpp_mpi.mpmd_to_spmd_reshard(mesh, mpmd, [P("stage"), P()], process_local=True)
    ok = ok and np.array_equal(bits(back[0]), bits(values[0][me * rows:(me + 1) * rows]))
    ok = ok and np.array_equal(bits(back[1]), bits(values[1]))
    _everywhere(ok, f"rank {RANK} (replica {mesh.replica_idx})")


@pytest.mark.mpi(min_size=4)
def test_trace_of_two_replicas_has_every_rank_and_the_allreduces(meshes, run, tmp_path_factory):
    mesh, fn2, batch = meshes[2], run["fn2"], run["batch"]
    with jaxpp_mpi.collect_task_times_ms() as times:
        jax.block_until_ready(fn2(*run["start"], batch))
    with jaxpp_mpi.trace.record() as events:
        jax.block_until_ready(fn2(*run["start"], batch))
    program = fn2.compile(*run["start"], batch).program()
    me = mesh.my_mpmd_axis_index
    mine = program_tasks(program, [me], lambda g: RANK)
    _everywhere(sorted(times) == sorted({label for _, _, label in mine})
                and all(t > 0 for ts in times.values() for t in ts),
                f"rank {RANK}: task times {dict(times)}")
    path = os.path.join(_shared_dir(tmp_path_factory, "replica_trace"), "trace.json")
    trace = jaxpp_mpi.trace.export(path, events, mesh)
    expected = WORLD.gather(mine, root=0)
    if RANK != 0:
        assert trace is None
        return
    tracks = check_chrome_trace(trace)
    assert tracks == {(r, r % GROUPS): f"group {r % GROUPS}" for r in range(SIZE)}
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    assert names == {r: f"rank {r} (replica {r // GROUPS})" for r in range(SIZE)}
    assert task_counts(trace) == sum(expected, start=type(mine)())
    for r in range(SIZE):
        reduces = [e for e in trace["traceEvents"] if e["name"] == "allreduce"
                   and e["pid"] == r]
        assert reduces and all(e["cat"] == "message" and e["args"]["replicas"] == 2
                               and e["args"]["replica"] == r // GROUPS for e in reduces), r
    assert trace["otherData"]["replicas"] == 2
