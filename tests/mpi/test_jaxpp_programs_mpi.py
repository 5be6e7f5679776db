"""JaxPP's own kinds of programs under mpirun, one rank standing for one JaxPP process,
written as JaxPP's examples, tutorial and tests write them (the import and the mesh
line changed, `jaxpp_mpi.make_mpmd_mesh`), and checked on every rank against `jax.jit`
of the same function (or numpy) in this process:

- examples/basic.py: a step decorated with `mpmd_jit_with_loop`, its loss printed
  on every process with its one-line fix under several processes (`np.array(
  jaxpp.process_allgather(loss))`, Note: reading values in driver/fetch.py: JaxPP's
  `np.array(loss)` reads a value every process holds, here only its group's rank does);
- examples/mpmd_reshard.py: "initialise with SPMD, then run the pipeline": arrays made
  by this rank's `jax.jit` over a spec naming the MPMD axis, given to `compile` and to
  the step, resharded with `compile(...).in_shardings` and back;
- tests/test_reshard_utils.py: `jax.make_array_from_callback` over the MPMD axis, the
  replica's sharding on `mpmd_submesh([0]).jax_mesh`, unused values, tiny batches;
- tests/test_mpmd_array.py, tests/test_mpmd_mesh.py: shardings and submeshes compare
  alike on every rank, `lowering_mesh()`, `unstack`; and, as JaxPP runs them (one
  process holding every group), on each rank alone: a one-process mesh given
  `comm=MPI.COMM_SELF` (2 devices per rank);
- the tutorial's cells: `in_specs`/`out_specs`, `Interleaved1F1B`, `with mesh:`, a
  state with a step counter, `_partially_addressable_arrays`, and `cross_mpmd_stack`,
  `place_with` inside the step.

Runs under `launch/jpprun -n 2`, `-n 3` and `-n 4`, one device per rank or more.
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import jaxpp_mpi.api as jaxpp
from jaxpp_mpi.api import MpmdArray, MpmdSharding

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
K = jax.local_device_count()
LAST = SIZE - 1
RTOL = ATOL = 1e-4


def _everywhere(ok: bool, detail: str = "") -> None:
    results = WORLD.allgather((ok, detail))
    assert all(r[0] for r in results), [r for r in results if not r[0]]


def _close(a, b) -> bool:
    return bool(np.allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL))


def _without(spec: P, axis: str) -> P:
    """`spec` with `axis` taken out of every entry (JaxPP's `filter_axes`), written here."""
    entries = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        kept = tuple(n for n in names if n is not None and n != axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*entries)


# -- examples/basic.py -------------------------------------------------------------------


def _basic_model(pp: int, hidden: int):
    """basic.py's model, dense tanh layers for its decoder blocks: two layers per stage,
    marked where basic.py's `JaxPPBasicModel` marks them."""
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * pp)
    params = [{"w": jax.random.normal(k, (hidden, hidden)) / np.sqrt(hidden),
               "b": jnp.zeros(hidden)} for k in keys]

    def apply(params, x, marks: bool):
        per_stage = len(params) // pp
        for i, layer in enumerate(params):
            x = jnp.tanh(x @ layer["w"] + layer["b"]) + x
            if marks and i > 0 and i % per_stage == 0:
                x = jaxpp.mark_stage_end(x)
        return jaxpp.mark_stage_end(x) if marks else x

    return params, apply


def _basic_train_step(loss_fn, optimizer, num_ubatches, remote_mesh=None):
    """basic.py's `jax_train_step`: `mpmd_jit_with_loop` or `jax.jit` of one step."""
    use_jaxpp = remote_mesh is not None
    decorator = (functools.partial(jaxpp.mpmd_jit_with_loop, mpmd_mesh=remote_mesh)
                 if use_jaxpp else jax.jit)

    @decorator
    def train_step(opt_state, params, batch):
        ubatch_grad = functools.partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        if use_jaxpp:
            (losses, (preds, _)), grad = jaxpp.treduce(
                ubatch_grad, batch, schedule=jaxpp.Std1F1B(remote_mesh.mpmd_dim))
        else:
            grad, losses, preds = None, [], []
            for i in range(num_ubatches):
                (loss, (pred, _)), g = ubatch_grad(batch[i])
                losses.append(loss)
                preds.append(pred)
                grad = g if grad is None else jax.tree.map(jnp.add, grad, g)
        updates, opt_state = optimizer.update(grad, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return opt_state, new_params, jnp.asarray(losses), jnp.asarray(preds)

    return train_step


@pytest.mark.mpi(min_size=2)
def test_basic_example_prints_and_checks_results_on_every_rank(capsys):
    jaxpp_mesh = jaxpp.make_mpmd_mesh((SIZE, 1, K), ("stages", "data", "model"), "stages")
    num_ubatches, hidden = 2 * SIZE, 8
    params, apply = _basic_model(SIZE, hidden)
    hidden_states = jax.random.uniform(jax.random.PRNGKey(1), (num_ubatches, 2, 4, hidden))
    optimizer = optax.adam(learning_rate=0.005)
    opt_state = optimizer.init(params)

    def loss_fn(marks):
        def fn(params, batch):
            res = apply(params, batch, marks)
            return jnp.mean((res - batch) ** 2) / num_ubatches, (res, 4)
        return fn

    jitted = _basic_train_step(loss_fn(False), optimizer, num_ubatches)
    pipelined = _basic_train_step(loss_fn(True), optimizer, num_ubatches, jaxpp_mesh)
    pp_state, pp_params, pp_loss, pp_preds = pipelined(opt_state, params,
                                                       batch=hidden_states)
    # PORT: was print(f"Done first step JAXPP, loss: {np.array(pp_loss)}")
    print(f"Done first step JAXPP, loss: {np.array(jaxpp.process_allgather(pp_loss))}")
    state, new_params, loss, preds = jitted(opt_state, params, hidden_states)
    shown = capsys.readouterr().out  # the values, not a repr, on every rank
    problems = [] if shown.startswith("Done first step JAXPP, loss: [") else [shown]
    results = (pp_state, pp_params, pp_loss, pp_preds)
    whole = jaxpp.process_allgather(results)  # every leaf, on every rank
    for name, ref, got, read in zip(("opt state", "params", "loss", "preds"),
                                    (state, new_params, loss, preds), results, whole):
        for a, b, w in zip(jax.tree.leaves(ref), jax.tree.leaves(got), jax.tree.leaves(read)):
            if not _close(a, w):
                problems.append(name)
            held = b.to_mpmd_local_array  # JaxPP's own check, where held
            if held is not None and not _close(a, held):
                problems.append(f"{name} held here")
            if (held is None) == (RANK in b.mpmd_idxs):  # None elsewhere, as in JaxPP
                problems.append(f"{name} on groups {sorted(b.mpmd_idxs)}: {held!r}")
    for _ in range(2):
        state, new_params, loss, preds = jitted(state, new_params, hidden_states)
        pp_state, pp_params, pp_loss, pp_preds = pipelined(pp_state, pp_params,
                                                           batch=hidden_states)
        if not _close(np.array(loss).sum(), jaxpp.process_allgather(pp_loss).sum()):
            problems.append("training loss")
    _everywhere(not problems, f"rank {RANK}: {problems}")


# -- examples/mpmd_reshard.py ------------------------------------------------------------


@pytest.mark.mpi(min_size=2)
@pytest.mark.filterwarnings("ignore:pipeline_enter_stage is deprecated")
def test_mpmd_reshard_example_initialises_with_spmd_then_runs_the_pipeline():
    # PORT: was spmd_mesh = jax.make_mesh((2, 2, 2), ...); MpmdMesh(spmd_mesh, "stage")
    mpmd_mesh = jaxpp.make_mpmd_mesh((SIZE, K, 1), ("stage", "fsdp", "tensor"), "stage")
    spmd_mesh = mpmd_mesh.jax_mesh
    embed_dim = 8 * K
    num_mb = 2 * SIZE
    shardings = [NamedSharding(spmd_mesh, P(("stage", "fsdp"), "tensor") if i % 2 == 0
                               else P("tensor", ("stage", "fsdp"))) for i in range(SIZE)]
    shardings.append(NamedSharding(spmd_mesh, P("fsdp", None, None)))

    @functools.partial(jax.jit, out_shardings=shardings)
    def init_fn(rng_key):
        keys = jax.random.split(rng_key, SIZE + 1)
        ws = [jax.random.normal(k, (embed_dim, embed_dim)) / np.sqrt(embed_dim)
              for k in keys[:-1]]
        return [*ws, jax.random.normal(keys[-1], (num_mb, 4 * K, embed_dim))]

    @jax.grad
    def forward_fn(weights, x):
        h = x
        for w in weights:
            h = jaxpp.pipeline_enter_stage(h @ w)
        return ((x - h) ** 2).sum()

    @functools.partial(
        jaxpp.mpmd_jit_with_loop, mpmd_mesh=mpmd_mesh,
        in_shardings=(tuple(s.spec for s in shardings[:-1]), shardings[-1].spec,
                      shardings[-1].spec),
        out_shardings=tuple(s.spec for s in shardings[:-1]))
    def accumulation_loop(weights, x, unused):
        return jaxpp.treduce(functools.partial(forward_fn, weights), x,
                             schedule=jaxpp.Std1F1B(mpmd_mesh.mpmd_dim),
                             operation=jaxpp.Add)

    *weights, x = init_fn(jax.random.PRNGKey(0))
    weights = tuple(weights)
    whole = [np.asarray(a) for a in (*weights, x)]  # this rank computed the whole arrays
    expected = [sum(parts) for parts in zip(*(forward_fn(whole[:-1], mb) for mb in whole[-1]))]
    compiled = accumulation_loop.compile(weights, x, x)  # arrays over the MPMD axis
    problems = []
    # Handed straight to the step, they are taken whole, as JaxPP takes them.
    direct = jaxpp.process_allgather(compiled(weights, x, x))
    if not all(_close(e, g) for e, g in zip(expected, direct)):
        problems.append("direct call")
    args_mpmd_shardings, _ = compiled.in_shardings
    resharded = jaxpp.spmd_to_mpmd_reshard(mpmd_mesh, [weights, x, x],
                                           list(args_mpmd_shardings))
    if not all(w.is_deleted() for w in weights) or not x.is_deleted():
        problems.append("inputs not consumed")
    mpmd_weights, mpmd_x, unused = resharded
    for w, sh in zip(mpmd_weights, args_mpmd_shardings[0]):
        if w.is_partially_addressable != (RANK in sh.mesh_ids) or w.shape != (embed_dim,) * 2:
            problems.append(f"placement of {w}")
        if w.is_partially_addressable and w.first_mpmd_replica.sharding.mesh != \
                mpmd_mesh.mpmd_submesh([RANK]).jax_mesh:
            problems.append("replica mesh")
    grads = compiled(mpmd_weights, mpmd_x, unused)
    back = jaxpp.mpmd_to_spmd_reshard(mpmd_mesh, list(grads), shardings[:-1])
    for e, b, sh in zip(expected, back, shardings):
        if not (_close(e, b) and b.sharding == sh):
            problems.append(f"gradient back in {sh.spec}")
    _everywhere(not problems, f"rank {RANK}: {problems}")


# -- tests/test_reshard_utils.py ---------------------------------------------------------


@pytest.fixture(scope="module")
def reshard_mesh():
    # PORT: was Mesh(np.array(jax.devices()).reshape(process_count, 2, -1), ...)
    return jaxpp.make_mpmd_mesh((SIZE, K, 1), ("mpmd", "data", "model"), "mpmd")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("spmd_pspec", [P(("mpmd", "data"), None), P(None, ("model", "mpmd")),
                                        P("model", "data"), P(None, ("model", "data"))])
def test_spmd_to_mpmd_reshard_places_the_whole_array(reshard_mesh, spmd_pspec):
    jax_mesh = reshard_mesh.jax_mesh
    global_data = np.arange(8 * 16, dtype=np.float32).reshape(8, 16)
    spmd_sharding = NamedSharding(jax_mesh, spmd_pspec)
    spmd_array = jax.make_array_from_callback((8, 16), spmd_sharding,
                                              lambda idx: global_data[idx])
    submesh = reshard_mesh.mpmd_submesh([0]).jax_mesh  # on every rank
    target = NamedSharding(submesh, spmd_pspec)
    dist = MpmdSharding(mpmd_mesh=reshard_mesh, mesh_ids={0}, spec=spmd_pspec)
    [mpmd_array] = jaxpp.spmd_to_mpmd_reshard(reshard_mesh, [spmd_array], [dist])
    ok = spmd_array.is_deleted() and mpmd_array.shape == (8, 16)
    filtered = NamedSharding(target.mesh, _without(target.spec, "mpmd"))
    if RANK == 0:
        local = mpmd_array.to_mpmd_local_array
        ok = ok and mpmd_array.is_partially_addressable
        ok = ok and np.array_equal(np.array(local), global_data) and local.sharding == filtered
    else:
        ok = ok and not mpmd_array.is_partially_addressable
        ok = ok and mpmd_array._mpmd_local_sharding.spec == filtered.spec
    [back] = jaxpp.mpmd_to_spmd_reshard(reshard_mesh, [mpmd_array], [spmd_sharding])
    ok = ok and back.sharding == spmd_sharding and np.array_equal(np.asarray(back), global_data)
    _everywhere(ok, f"rank {RANK}: {spmd_pspec}")


@pytest.mark.mpi(min_size=2)
def test_reshard_with_grouping_and_an_unused_value(reshard_mesh):
    spmd_sharding = NamedSharding(reshard_mesh.jax_mesh, P("data", "model"))
    shapes = [(8, 16), (16, 32), (4, 8), (32, 64)]
    datas = [np.arange(np.prod(s), dtype=np.float32).reshape(s) for s in shapes]
    arrays = [jax.make_array_from_callback(s, spmd_sharding, lambda idx, d=d: d[idx])
              for s, d in zip(shapes, datas)]
    dist = [MpmdSharding(reshard_mesh, ids, P("data", "model"))
            for ids in ({0}, set(), {LAST}, set(range(SIZE)))]
    holders = [{0}, {0}, {LAST}, set(range(SIZE))]  # an unused value goes to group 0
    out = jaxpp.spmd_to_mpmd_reshard(reshard_mesh, arrays, dist, threshold=1)
    ok = all(a.is_deleted() for a in arrays)
    for a, d, h in zip(out, datas, holders):
        ok = ok and a.is_partially_addressable == (RANK in h)
        if RANK in h:
            ok = ok and np.array_equal(np.array(a.to_mpmd_local_array), d)
    back = jaxpp.mpmd_to_spmd_reshard(reshard_mesh, out, [spmd_sharding] * 4, threshold=1)
    ok = ok and all(b.shape == d.shape and np.array_equal(np.asarray(b), d)
                    for b, d in zip(back, datas))
    _everywhere(ok, f"rank {RANK}")


# -- tests/test_mpmd_array.py, tests/test_mpmd_mesh.py -----------------------------------


@pytest.fixture(scope="module")
def array_mesh():
    # PORT: was MpmdMesh(jax.make_mesh((3, 2), ("stage", "model")), "stage")
    return jaxpp.make_mpmd_mesh((SIZE, K), ("stage", "model"), "stage")


def _on_own_group(mesh, value):
    sharding = NamedSharding(mesh.mpmd_submesh([RANK]).jax_mesh, P("model"))
    return jax.device_put(value, sharding)


@pytest.mark.mpi(min_size=2)
def test_mpmd_array_shardings_agree_on_every_rank(array_mesh):
    mesh, value = array_mesh, jnp.zeros(2 * K)
    sharding0 = NamedSharding(mesh.mpmd_submesh([0]).jax_mesh, P("model"))  # every rank
    ok = sharding0.spec == P("model")
    one = MpmdArray([_on_own_group(mesh, value)] if RANK == 0 else [],
                    MpmdSharding(mesh, {0}, sharding0.spec), shape=value.shape,
                    dtype=value.dtype)
    ok = ok and not one.is_mpmd_replicated
    ok = ok and one.sharding.mesh == mesh.mpmd_submesh([0]).jax_mesh == sharding0.mesh
    if RANK == 0:
        ok = ok and one.to_mpmd_local_array.sharding.mesh == one.sharding.mesh
    else:
        ok = ok and not one.is_partially_addressable and one.to_mpmd_local_array is None
    ids = {0, LAST}
    two = MpmdArray([_on_own_group(mesh, value)] if RANK in ids else [],
                    MpmdSharding(mesh, ids, P("model")), shape=value.shape, dtype=value.dtype)
    ok = ok and two.is_mpmd_replicated
    ok = ok and two.sharding.mesh == mesh.mpmd_submesh(sorted(ids)).jax_mesh
    ok = ok and dict(two.sharding.mesh.shape) == {"stage": 2, "model": K}
    if RANK in ids:
        ok = ok and two.to_mpmd_local_array.sharding.mesh != two.sharding.mesh
    else:
        ok = ok and two.to_mpmd_local_array is None
    ok = ok and (two.first_mpmd_replica is not None) == (RANK == 0)
    unused = MpmdSharding(mesh, set(), P("model"))
    ok = ok and unused.mesh_ids == () and unused.spec == P("model")
    _everywhere(ok, f"rank {RANK}")


@pytest.mark.mpi(min_size=2)
def test_mpmd_mesh_views(array_mesh):
    mesh = array_mesh
    own = mesh.unstack[RANK]
    ok = mesh.mpmd_axis == 0 and own.axis_names == ("stage", "model")
    ok = ok and own.devices.shape == (1, K) and list(own.devices.flat) == jax.local_devices()
    ok = ok and [mesh.device_coords[d] for d in jax.local_devices()] == [
        (RANK, j) for j in range(K)]
    lowering = mesh.lowering_mesh()  # JaxPP's: the MPMD axis kept, of size 1
    ok = ok and lowering == own == mesh.my_mpmd_group_mesh
    ok = ok and dict(lowering.shape) == {"stage": 1, "model": K}
    shapes = WORLD.allgather([dict(mesh.mpmd_submesh([i]).jax_mesh.shape)
                              for i in range(SIZE)])
    ok = ok and all(s == shapes[0] for s in shapes)
    _everywhere(ok, f"rank {RANK}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(K < 2, reason="a one-process mesh of 2 groups needs 2 devices per rank")
def test_one_process_tests_on_every_rank_sharded_groups():
    """JaxPP's one-process tests (test_mpmd_array.py, test_mpmd_mesh.py: every group's
    devices in one process) under jpprun: each rank is that one process, its mesh line
    given `comm=MPI.COMM_SELF` (local mode inside a job of several ranks)."""
    # PORT: was MpmdMesh(jax.make_mesh((3, 2), ("stage", "model")), "stage")
    devices = jax.local_devices()
    mesh = jaxpp.MpmdMesh(jax.make_mesh((2, K // 2), ("stage", "model"), devices=devices),
                          "stage", comm=MPI.COMM_SELF)
    ok = mesh.is_local and mesh.mpmd_dim == 2
    subs = [mesh.mpmd_submesh([i]).jax_mesh for i in range(2)]
    value = jnp.arange(2.0 * K)
    on = [jax.device_put(value, NamedSharding(m, P("model"))) for m in subs]
    first = MpmdArray([on[0]], MpmdSharding(mesh, {0}, P("model")))
    meta = MpmdArray([], MpmdSharding(mesh, {0}, P("model")), shape=value.shape,
                     dtype=value.dtype)  # test_mpmd_array's "process 1": metadata only
    both = MpmdArray(on, MpmdSharding(mesh, {0, 1}, P("model")))
    ok = ok and first.to_mpmd_local_array.sharding.mesh == first.sharding.mesh == subs[0]
    ok = ok and not meta.is_partially_addressable and meta.to_mpmd_local_array is None
    held = both.to_mpmd_local_array
    ok = ok and isinstance(held, list) and [a.sharding.mesh for a in held] == subs
    ok = ok and both.sharding.mesh == mesh.mpmd_submesh([0, 1]).jax_mesh
    ok = ok and all(m.devices.shape == (1, K // 2) for m in mesh.unstack)
    ok = ok and [list(m.devices.flat) for m in mesh.unstack] == [
        devices[:K // 2], devices[K // 2:K]]
    ok = ok and mesh.device_coords[devices[K // 2]] == (1, 0)

    def step(ws, xs):  # a pipeline of this rank's own, no message to another rank
        def loss(ws, x):
            for w in ws:
                x = jaxpp.mark_stage_end(jnp.tanh(x @ w))
            return jnp.sum(x ** 2)
        return jaxpp.treduce(functools.partial(jax.grad(loss), ws), xs,
                             schedule=jaxpp.Std1F1B(2), operation=jaxpp.Add)

    keys = jax.random.split(jax.random.PRNGKey(RANK), 3)  # each rank its own numbers
    ws = [jax.random.normal(k, (4, 4)) / 2 for k in keys[:2]]
    xs = jax.random.normal(keys[2], (4, 2, 4))
    got = jaxpp.mpmd_jit_with_loop(step, mpmd_mesh=mesh)(ws, xs)
    want = jax.jit(lambda ws, xs: [sum(g) for g in zip(*(jax.grad(
        lambda ws, x: jnp.sum(functools.reduce(lambda h, w: jnp.tanh(h @ w), ws, x) ** 2))(
            ws, x) for x in xs))])(ws, xs)
    ok = ok and all(_close(w, g) for w, g in zip(want, got))  # read here, no message
    _everywhere(ok, f"rank {RANK}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.skipif(K < SIZE, reason="local mode of SIZE groups needs SIZE devices per rank")
def test_mpi_and_local_mode_give_the_same_bits_sharded_groups():
    """basic.py's step (Std1F1B, gradients summed over microbatches, adam) under MPI, one
    group per rank, and in local mode, every group in this process: one program, the
    same bits in every leaf (both in this process's XLA client: its CPU results depend
    on the process's device count); each within the tolerance of `jax.jit`."""
    devices = jax.local_devices()
    local = jaxpp.MpmdMesh(jax.make_mesh((SIZE, 1), ("stage", "model"), devices=devices[:SIZE]),
                           "stage", comm=MPI.COMM_SELF)
    ranks = jaxpp.MpmdMesh(jax.make_mesh((1, 1), ("stage", "model"), devices=devices[:1]),
                           "stage")
    optimizer = optax.adam(learning_rate=0.005)

    def loss(ws, x, marks):
        for w in ws:
            x = jnp.tanh(x @ w)
            x = jaxpp.mark_stage_end(x) if marks else x
        return jnp.mean(x ** 2)

    def train_step(ws, opt_state, xs, schedule):
        if schedule is None:
            parts = [jax.value_and_grad(loss)(ws, x, False) for x in xs]
            losses = sum(p[0] for p in parts)
            grads = jax.tree.map(lambda *g: functools.reduce(jnp.add, g), *(p[1] for p in parts))
        else:
            losses, grads = jaxpp.treduce(
                functools.partial(jax.value_and_grad(loss), ws, marks=True), xs,
                schedule=schedule, operation=jaxpp.Add)
        updates, opt_state = optimizer.update(grads, opt_state, ws)
        return optax.apply_updates(ws, updates), opt_state, losses

    keys = jax.random.split(jax.random.PRNGKey(0), SIZE + 1)  # the same on every rank
    ws = [jax.random.normal(k, (8, 8)) / 3 for k in keys[:-1]]
    xs = jax.random.normal(keys[-1], (2 * SIZE, 4, 8))
    schedule = jaxpp.Std1F1B(SIZE)
    results = [jaxpp.mpmd_jit_with_loop(functools.partial(train_step, schedule=schedule),
                                        mpmd_mesh=mesh)(ws, optimizer.init(ws), xs)
               for mesh in (ranks, local)]
    by_mpi = jax.tree.leaves(jaxpp.process_allgather(results[0]))  # every rank
    by_local = [np.asarray(leaf) for leaf in jax.tree.leaves(results[1])]
    want = jax.jit(functools.partial(train_step, schedule=None))(ws, optimizer.init(ws), xs)
    problems = [i for i, (a, b) in enumerate(zip(by_mpi, by_local)) if not np.array_equal(a, b)]
    problems += [f"jit {i}" for i, (a, b) in enumerate(zip(jax.tree.leaves(want), by_local))
                 if not _close(a, b)]
    _everywhere(not problems and len(by_mpi) == len(jax.tree.leaves(want)),
                f"rank {RANK}: leaves {problems}")


# -- the tutorial's cells ----------------------------------------------------------------


class TrainState(NamedTuple):
    """flax's `TrainState`, the fields the tutorial uses."""

    step: jax.Array
    params: list
    opt_state: optax.OptState


@pytest.mark.mpi(min_size=2)
@pytest.mark.filterwarnings("ignore:.*context manager has been deprecated")
def test_tutorial_cells_with_interleaved_stages():
    num_layers, num_mb, width = 2 * SIZE, 4, 8
    # PORT: was Mesh(np.array(jax.devices())[:NUM_STAGES].reshape(NUM_STAGES, -1), ...)
    mpmd_mesh = jaxpp.make_mpmd_mesh((SIZE, K), ("stage", "fsdp"), "stage")
    mesh = mpmd_mesh.jax_mesh
    unstack_text = repr(mpmd_mesh.unstack)  # the cell that shows the groups' meshes
    tx = optax.adamw(learning_rate=0.001)
    keys = jax.random.split(jax.random.PRNGKey(0), num_layers + 2)
    params = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:-2]]
    state = TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))
    xs = jax.random.normal(keys[-2], (num_mb * 2 * K, width))
    targets = jax.random.normal(keys[-1], (num_mb * 2 * K, width))

    def loss_fn(params, x, targets, marks):
        for w in params:
            x = jnp.tanh(x @ w)
            if marks:
                x = jaxpp.mark_stage_end(x)
        return jnp.mean((x - targets) ** 2)

    def train_step(state, xs, targets, schedule):
        marks = schedule is not None
        grad_fn = jax.value_and_grad(functools.partial(loss_fn, marks=marks))
        mbs = (xs.reshape(num_mb, -1, *xs.shape[1:]),
               targets.reshape(num_mb, -1, *targets.shape[1:]))
        if marks:
            loss_acc, grads = jaxpp.treduce(lambda mb: grad_fn(state.params, *mb), mbs,
                                            schedule=schedule, operation=jaxpp.Add)
            norms = jaxpp.cross_mpmd_stack([jnp.sum(g ** 2) for g in grads])
            loss_acc = jaxpp.place_with(loss_acc, norms)
        else:
            parts = [grad_fn(state.params, mbs[0][i], mbs[1][i]) for i in range(num_mb)]
            loss_acc = sum(p[0] for p in parts)
            grads = jax.tree.map(lambda *g: sum(g), *(p[1] for p in parts))
            norms = jnp.stack([jnp.sum(g ** 2) for g in grads])
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new = TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
        return new, loss_acc, norms

    in_specs = (jax.tree.map(lambda _: P(), state), P("fsdp"), P("fsdp"))
    pp_train_step = jaxpp.mpmd_jit_with_loop(
        functools.partial(train_step, schedule=jaxpp.Interleaved1F1B(
            num_stages=num_layers, mpmd_dim=SIZE)),
        in_specs=in_specs, out_specs=(in_specs[0], P(), P()),
        mpmd_mesh=mpmd_mesh).compile(state, xs, targets)
    reference = jax.jit(functools.partial(train_step, schedule=None))
    want, got = (state, None, None), (state, None, None)
    with mesh:
        for i in range(2):
            want = reference(want[0], xs, targets)
            got = pp_train_step(got[0], xs, targets)
            print(f"Training loss after step {i + 1}: {got[1]}")  # a repr where not held
    problems = [] if "Mesh(" in unstack_text else [unstack_text]
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jaxpp.process_allgather(got))):
        if not _close(a, b):
            problems.append(f"{b} differs")
    step = got[0].step
    held = step._partially_addressable_arrays
    if not isinstance(held, collections.OrderedDict) or list(held) != sorted(
            set(step.mpmd_idxs) & {RANK}):
        problems.append(f"held: {held}")
    if [a.sharding.mesh.devices.size for a in held.values()] != [K] * len(held):
        problems.append("replica meshes")
    if int(jaxpp.process_allgather(step)) != 2:  # every rank reads the counter
        problems.append(f"step {step}")
    _everywhere(not problems, f"rank {RANK}: {problems}")
