"""The local executor on hand-built programs over a (4, 2) CPU mesh, against plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpp_mpi._src.ir.program import (
    Aval,
    Free,
    GroupProgram,
    Program,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi._src.ir.simulate import verify
from jaxpp_mpi._src.runtime.executor import execute
from jaxpp_mpi._src.runtime.local import LocalExecutor, Transfer, local_order
from jaxpp_mpi._src.timeline.timing import collect_task_times_ms

D = 4  # feature size
B = 8  # batch size
VEC = Aval((B, D), "float32")
MAT = Aval((D, D), "float32")
SCALAR = Aval((), "float32")


@pytest.fixture(scope="module")
def group_meshes() -> list[jax.sharding.Mesh]:
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    return [jax.sharding.Mesh(mesh.devices[g], ("data",)) for g in range(4)]


def _shardings(group_meshes):
    return lambda g, aval: NamedSharding(group_meshes[g], P(*aval.spec))


def _on_group(fns: dict, gmesh: jax.sharding.Mesh) -> dict:
    return {name: jax.jit(fn, out_shardings=NamedSharding(gmesh, P())) for name, fn in fns.items()}


def local_executor(program: Program, executables, shardings, *, check_leaks: bool = True):
    """Verifies a hand-built `program`, as the compiler does, then builds its executor."""
    verify(program, check_leaks=check_leaks)
    return LocalExecutor(program, executables, shardings)


# ----------------------------------------------------------------------------- the model


def stage(w, h):
    return jnp.tanh(h @ w)


def loss(w, h, y):
    return jnp.sum((stage(w, h) - y) ** 2)


def fwd(w, h):
    return (stage(w, h),)


def bwd(w, h, g):
    _, vjp = jax.vjp(stage, w, h)
    return vjp(g)


def bwd_last(w, h, y):
    value, (gw, gh) = jax.value_and_grad(loss, argnums=(0, 1))(w, h, y)
    return value, gw, gh


FNS = {"fwd": fwd, "bwd": bwd, "bwd_last": bwd_last}


def chain_program(n: int) -> Program:
    """n stages, one per group, forward then backward of one microbatch.

    Flat inputs: 0 = x, 1..n = the stages' weights, n+1 = y. Flat outputs: i = the weight
    gradient of stage i, n = the loss. Buffers of group i: %0 w, %1 h_in, %2 h_out,
    %3 loss, %4 gw, %5 gh_in, %6 g_out, %7 y.
    """
    groups = []
    for i in range(n):
        last = i == n - 1
        inputs = [(0, i + 1)] + ([(1, 0)] if i == 0 else []) + ([(7, n + 1)] if last else [])
        instrs: list = [] if i == 0 else [Recv(1, i - 1, 0, VEC)]
        outputs = [(4, i)]
        avals = {0: MAT, 1: VEC, 4: MAT, 5: VEC}
        if last:
            instrs.append(Run("bwd_last", (0, 1, 7), (3, 4, 5), task=f"B0s{i}"))
            outputs.append((3, n))
            avals.update({3: SCALAR, 7: VEC})
        else:
            instrs += [
                Run("fwd", (0, 1), (2,), task=f"F0s{i}"),
                Send(2, i + 1, 0),
                Recv(6, i + 1, 0, VEC),
                Run("bwd", (0, 1, 6), (4, 5), task=f"B0s{i}", donate=(6,)),
                Free((2,)),
            ]
            avals.update({2: VEC, 6: VEC})
        if i > 0:
            instrs.append(Send(5, i - 1, 0))
        instrs.append(Free((0, 1, 5, 7) if last else (0, 1, 5)))
        groups.append(GroupProgram(i, inputs, instrs, outputs, avals))
    return Program(tuple(groups))


def chain_reference(n: int, inputs: list) -> list:
    x, ws, y = inputs[0], inputs[1 : n + 1], inputs[n + 1]
    hs = [x]
    for w in ws[:-1]:
        hs.append(jax.jit(fwd)(w, hs[-1])[0])
    value, gw, g = jax.jit(bwd_last)(ws[-1], hs[-1], y)
    grads = [gw]
    for i in reversed(range(n - 1)):
        gw, g = jax.jit(bwd)(ws[i], hs[i], g)
        grads.insert(0, gw)
    return grads + [value]


def chain_inputs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, D), dtype=np.float32)
    ws = [rng.standard_normal((D, D), dtype=np.float32) / 2 for _ in range(n)]
    y = rng.standard_normal((B, D), dtype=np.float32)
    return [x, *ws, y]


def chain_executor(n: int, group_meshes, fns=FNS) -> LocalExecutor:
    executables = [_on_group(fns, group_meshes[g]) for g in range(n)]
    return local_executor(chain_program(n), executables, _shardings(group_meshes))


def _devices(x: jax.Array) -> set:
    return set(x.sharding.device_set)


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("n", [2, 4])
def test_chain_matches_plain_jax(n, group_meshes):
    ex = chain_executor(n, group_meshes)
    inputs = chain_inputs(n)
    got = ex.run(inputs)
    want = chain_reference(n, inputs)
    assert len(got) == n + 1
    for k, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"output {k}")
    for i in range(n):
        assert _devices(got[i]) == set(group_meshes[i].devices.flat)
    assert _devices(got[n]) == set(group_meshes[n - 1].devices.flat)


def test_inputs_already_placed_are_used_and_outputs_feed_back(group_meshes):
    n = 2
    ex = chain_executor(n, group_meshes)
    sh = _shardings(group_meshes)
    inputs = chain_inputs(n)
    placed = [
        jax.device_put(inputs[0], sh(0, VEC)),
        jax.device_put(inputs[1], sh(0, MAT)),
        jax.device_put(inputs[2], sh(1, MAT)),
        jax.device_put(inputs[3], sh(1, VEC)),
    ]
    first = ex.run(placed)
    # Feed weight gradients back as weights: they already live on the right group.
    second = ex.run([placed[0], first[0], first[1], placed[3]])
    want = chain_reference(n, [inputs[0], np.asarray(first[0]), np.asarray(first[1]), inputs[3]])
    for a, b in zip(second, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def exchange_program() -> Program:
    groups = []
    for g in range(2):
        instrs = (
            Run("prep", (0,), (1,)),
            SendRecv(1, 1 - g, 0, 2, 1 - g, 0, VEC),
            Run("combine", (1, 2), (3,), donate=(1, 2)),
            Free((0,)),
        )
        groups.append(GroupProgram(g, [(0, g)], instrs, [(3, g)], {0: VEC, 1: VEC, 2: VEC, 3: VEC}))
    return Program(tuple(groups))


def test_sendrecv_exchange(group_meshes):
    fns = {"prep": lambda x: (jnp.sin(x),), "combine": lambda a, b: (a * 2 - b,)}
    executables = [_on_group(fns, group_meshes[g]) for g in range(2)]
    ex = local_executor(exchange_program(), executables, _shardings(group_meshes))
    a, b = chain_inputs(1)[0], chain_inputs(1, seed=1)[0]
    got = ex.run([a, b])
    pa, pb = jnp.sin(a), jnp.sin(b)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(pa * 2 - pb))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(pb * 2 - pa))
    assert _devices(got[1]) == set(group_meshes[1].devices.flat)


def test_local_order_matches_every_message_once():
    order = local_order(chain_program(4))
    transfers = [op for _, op in order if isinstance(op, Transfer)]
    assert sorted((t.src, t.dst) for t in transfers) == sorted(
        [(i, i + 1) for i in range(3)] + [(i + 1, i) for i in range(3)]
    )
    pairs = [op for _, op in local_order(exchange_program()) if isinstance(op, Transfer)]
    assert sorted((t.src, t.dst) for t in pairs) == [(0, 1), (1, 0)]


def _final_table(ex: LocalExecutor, inputs: list) -> list:
    table = ex._new_table()
    ex._bind_inputs(table, inputs)
    execute(ex._steps, table)
    return table


def test_free_and_donation_drop_buffers(group_meshes):
    n = 2
    ex = chain_executor(n, group_meshes)
    table = _final_table(ex, chain_inputs(n))
    live = [s for s, x in enumerate(table) if x is not None]
    # Only the outputs stay: group 0's %4 and group 1's %3, %4.
    slot = ex.layout.slot
    assert live == [slot(0, 4), slot(1, 3), slot(1, 4)]


def test_without_frees_buffers_stay(group_meshes):
    program = chain_program(2)
    groups = tuple(
        GroupProgram(
            g.mpmd_idx,
            g.inputs,
            [i for i in g.instrs if not isinstance(i, Free)],
            g.outputs,
            g.avals,
        )
        for g in program.groups
    )
    executables = [_on_group(FNS, group_meshes[g]) for g in range(2)]
    ex = local_executor(Program(groups), executables, _shardings(group_meshes), check_leaks=False)
    table = _final_table(ex, chain_inputs(2))
    slot = ex.layout.slot
    assert table[slot(0, 6)] is None  # donated
    assert table[slot(0, 2)] is not None and table[slot(1, 0)] is not None  # not freed


def test_task_times(group_meshes):
    n = 4
    ex = chain_executor(n, group_meshes)
    inputs = chain_inputs(n)
    ex.run(inputs)  # compile outside the timed block
    with collect_task_times_ms() as times:
        ex.run(inputs)
        ex.run(inputs)
    labels = {f"F0s{i}" for i in range(n - 1)} | {f"B0s{i}" for i in range(n)}
    assert set(times) == labels
    assert all(len(v) == 2 and all(t >= 0 for t in v) for v in times.values())
    ex.run(inputs)  # no longer collecting
    assert all(len(v) == 2 for v in times.values())
    with collect_task_times_ms(enabled=False) as off:
        ex.run(inputs)
    assert off is None


def test_task_times_nest_into_innermost(group_meshes):
    ex = chain_executor(2, group_meshes)
    inputs = chain_inputs(2)
    with collect_task_times_ms() as outer:
        with collect_task_times_ms() as inner:
            ex.run(inputs)
        with collect_task_times_ms(enabled=False):
            ex.run(inputs)
    # The first run goes to the innermost block; a disabled block does not hide `outer`.
    assert set(inner) == {"F0s0", "B0s0", "B0s1"} and set(outer) == set(inner)
    assert all(len(v) == 1 for v in [*inner.values(), *outer.values()])


# ----------------------------------------------------------------------------- errors


def test_missing_executable(group_meshes):
    fns = dict(FNS)
    del fns["bwd"]
    with pytest.raises(ValueError, match="no executable 'bwd'"):
        chain_executor(2, group_meshes, fns)


def test_wrong_number_of_executable_groups(group_meshes):
    with pytest.raises(ValueError, match="executables for 1 groups"):
        local_executor(chain_program(2), [FNS], _shardings(group_meshes))


def test_wrong_step_inputs(group_meshes):
    ex = chain_executor(2, group_meshes)
    inputs = chain_inputs(2)
    with pytest.raises(ValueError, match="expected 4 step inputs, got 3"):
        ex.run(inputs[:3])
    with pytest.raises(ValueError, match="step input 1 is None"):
        ex.run([inputs[0], None, inputs[2], inputs[3]])


def test_output_freed_is_rejected(group_meshes):
    g = GroupProgram(0, [(0, 0)], [Run("prep", (0,), (1,)), Free((1,))], [(1, 0)], {0: VEC, 1: VEC})
    ex_fns = [_on_group({"prep": lambda x: (x,)}, group_meshes[0])]
    with pytest.raises(ValueError, match="output 0"):
        local_executor(Program((g,)), ex_fns, _shardings(group_meshes))


def test_executable_returning_wrong_count(group_meshes):
    fns = dict(FNS, fwd=lambda w, h: (stage(w, h), h))
    ex = chain_executor(2, group_meshes, fns)
    with pytest.raises(ValueError, match="returned 2 values"):
        ex.run(chain_inputs(2))
