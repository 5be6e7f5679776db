"""Whole training steps compiled by `mpmd_jit_with_loop` in local mode (all groups in
one process), checked against the sequential reference: the same step under plain
`jax.jit`, where `treduce` is a plain loop over the microbatches.

Every behavioural test compares the pipelined results with that reference (float32,
rtol 1e-5), never with the library's own output. The program tests read the compiled
`Program` (per-group instruction lists) and the plan's buffer names.
"""

from __future__ import annotations

import functools
import gc
import re
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import assert_tree_close as _assert_tree_close

import jaxpp_mpi as jp
from jaxpp_mpi._src.compiler.lower import live_buffer_profile
from jaxpp_mpi._src.ir.passes import recv_half
from jaxpp_mpi._src.ir.program import Free, Run
from jaxpp_mpi._src.ir.simulate import verify

D = 8  # feature size
ROWS = 2  # rows per microbatch
N = 4  # microbatches, unless a test says otherwise
RTOL, ATOL = 1e-5, 1e-6

# Loop task labels ('F3s1', fused 'F3s1+B1s1') and outer segment labels ('preg0', 'post1g0').
TASK_RE = re.compile(r"([FBIW])(\d+)s(\d+)")
SEGMENT_RE = re.compile(r"(?:pre|post\d+)g(\d+)")


# ----------------------------------------------------------------------------- helpers


@functools.cache
def mpmd_mesh(groups: int) -> jp.MpmdMesh:
    """A local-mode mesh of `groups` MPMD groups of one CPU device each."""
    return jp.MpmdMesh(jax.make_mesh((groups, 1), ("stage", "data")), "stage")


def pipelined(step: Callable, groups: int = 2, **kwargs: Any) -> jp.MpmdFunction:
    return jp.mpmd_jit_with_loop(step, mpmd_mesh=mpmd_mesh(groups), **kwargs)


def rand(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) * scale


def mlp_params(num_stages: int, seed: int = 0) -> list[jax.Array]:
    """One (D, D) weight per stage."""
    return [rand(seed + s, (D, D), 0.5) for s in range(num_stages)]


def make_batch(n: int = N, seed: int = 100) -> tuple[jax.Array, jax.Array]:
    """(inputs, targets), microbatch axis first; every microbatch is different."""
    return rand(seed, (n, ROWS, D)), rand(seed + 1, (n, ROWS, D))


def mlp_loss(params: list[jax.Array], mb: tuple[jax.Array, jax.Array]):
    """One stage per weight, each ending with a mark; aux = the last stage's output."""
    x, y = mb
    for w in params:
        x = jp.mark_stage_end(jnp.tanh(x @ w))
    return jnp.mean((x - y) ** 2), x


def sgd_step(schedule, loss_fn: Callable = mlp_loss, lr: float = 0.1) -> Callable:
    """A plain SGD step: returns (new params, per-microbatch losses, summed grads)."""

    def step(params, batch):
        grad_fn = partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, _), grads = jp.treduce(grad_fn, batch, schedule=schedule)
        new = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return new, losses, grads

    return step


def optax_step(schedule, optimizer, loss_fn: Callable = mlp_loss) -> Callable:
    """The step of the library's README: returns (opt_state, params, losses, grads)."""

    def step(opt_state, params, batch):
        grad_fn = partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, _), grads = jp.treduce(grad_fn, batch, schedule=schedule)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return opt_state, optax.apply_updates(params, updates), losses, grads

    return step


def assert_tree_close(ref: Any, out: Any) -> None:
    """Same pytree structure, every leaf equal to the reference up to float32 noise."""
    _assert_tree_close(ref, out, RTOL, ATOL)

def check_against_reference(step: Callable, *args: Any, groups: int = 2, **kwargs: Any):
    """Runs `step` pipelined and under plain jax.jit; asserts equal results."""
    ref = jax.jit(step)(*args)
    out = pipelined(step, groups, **kwargs)(*args)
    assert_tree_close(ref, out)
    return ref, out


def compile_mlp(schedule, n: int = N) -> jp.MpmdCompiled:
    """The SGD step of an MLP with one weight per stage, compiled for `schedule`."""
    params = mlp_params(schedule.num_stages)
    return pipelined(sgd_step(schedule), schedule.mpmd_dim).compile(params, make_batch(n))


def all_schedules(groups: int) -> list:
    s = groups
    return [
        jp.GPipe(s),
        jp.Std1F1B(s),
        jp.Eager1F1B(s),
        jp.ZeroBubble(s),
        jp.Interleaved1F1B(2 * s, s),
        jp.Interleaved1F1B(2 * s, s, fuse_steady_state=True),
        jp.KimiK2(2 * s, s),
        jp.DualPipeV(2 * s, s),
    ]


SCHEDULES = [
    pytest.param(sched, id=repr(sched).replace(" ", ""))
    for groups in (2, 4)
    for sched in all_schedules(groups)
]


# ----------------------------------------------------------------------------- 1. Concat / Max


@pytest.mark.parametrize(
    "schedule", [jp.Std1F1B(2), jp.Interleaved1F1B(4, 2)], ids=["Std1F1B", "Interleaved1F1B"]
)
def test_concat_and_max_outputs_in_microbatch_order(schedule):
    """Concat(axis=0), Concat(axis=1) and Max results equal the sequential reference.

    Outputs are reduced on the group of the stage that computes them: the per-microbatch
    predictions on the last stage's group, the stage-0 hidden state on group 0. With
    microbatches running in a schedule's order on several groups, each Concat must still
    put microbatch m at index m of its axis (every microbatch differs, so a permutation
    would show) and each Max is the element-wise max over all microbatches.
    """

    def loss_fn(params, mb):
        x, y = mb
        h0 = jnp.tanh(x @ params[0])  # stage 0's output, before its mark (on group 0)
        x = jp.mark_stage_end(h0)
        for w in params[1:]:
            x = jp.mark_stage_end(jnp.tanh(x @ w))
        aux = {"pred": x, "pred_t": x, "max": jnp.max(x, axis=0), "h0": h0, "h0_max": h0}
        return jnp.mean((x - y) ** 2), aux

    aux_ops = {
        "pred": jp.Concat(0),
        "pred_t": jp.Concat(1),
        "max": jp.Max(),
        "h0": jp.Concat(1),
        "h0_max": jp.Max,
    }

    def step(params, batch):
        grad_fn = partial(jax.value_and_grad(loss_fn, has_aux=True), params)
        (losses, aux), grads = jp.treduce(
            grad_fn, batch, schedule=schedule, operation=((jp.Concat(), aux_ops), jp.Add)
        )
        return losses, aux, grads

    params, batch = mlp_params(schedule.num_stages), make_batch()
    ref, out = check_against_reference(step, params, batch)
    losses, aux, _ = ref
    assert losses.shape == (N,)
    assert aux["pred"].shape == (N, ROWS, D)
    assert aux["pred_t"].shape == (ROWS, N, D)
    assert aux["h0"].shape == (ROWS, N, D)
    # Row 2 of the pipelined losses is microbatch 2's loss, computed on its own.
    alone, _ = loss_fn(params, jax.tree.map(lambda a: a[2], batch))
    np.testing.assert_allclose(np.asarray(out[0])[2], alone, rtol=RTOL)
    last_group = schedule.get_mpmd_idx(schedule.num_stages - 1)
    assert out[1]["pred"].mpmd_idxs == {last_group}
    assert out[1]["h0"].mpmd_idxs == {schedule.get_mpmd_idx(0)}


# ----------------------------------------------------------------------------- 2. pytrees


def test_treduce_over_a_dict_batch():
    """`treduce` slices every leaf of a dict batch per microbatch: losses, predictions and
    gradients match the reference for a batch {'x', 'y', 'scale'} of three arrays."""

    def loss_fn(params, mb):
        x = mb["x"] * mb["scale"][:, None]
        for w in params:
            x = jp.mark_stage_end(jnp.tanh(x @ w))
        return jnp.mean((x - mb["y"]) ** 2), x

    x, y = make_batch()
    batch = {"x": x, "y": y, "scale": rand(7, (N, ROWS))}
    check_against_reference(sgd_step(jp.Std1F1B(2), loss_fn), mlp_params(2), batch)


def test_treduce_i_passes_the_microbatch_index():
    """`treduce_i` gives the body the microbatch index: a body that picks its microbatch
    from a closed-over batch and weights its loss by (i + 1) matches the reference, and
    the Concat-ed indexes come back as 0 .. n-1."""
    schedule = jp.Std1F1B(2)

    def step(params, batch):
        def body(i):
            mb = jax.tree.map(lambda a: a[i], batch)
            (loss, pred), grads = jax.value_and_grad(mlp_loss, has_aux=True)(params, mb)
            return (loss * (i + 1).astype(jnp.float32), pred, i), grads

        ops = ((jp.Concat(), jp.Concat(1), jp.Concat()), jp.Add)
        return jp.treduce_i(body, N, schedule=schedule, operation=ops)

    ref, out = check_against_reference(step, mlp_params(2), make_batch())
    np.testing.assert_array_equal(np.asarray(out[0][2]), np.arange(N))
    assert len(set(np.asarray(ref[0][0]).tolist())) == N  # every microbatch differs


# ----------------------------------------------------------------------------- 3. tied weights


def tied_loss(params, mb):
    """Embedding E (V, D) used by stage 0 (x @ E) and by the last stage (h @ E.T).

    `params["E_out"]`, when present, replaces E in the output projection (untied)."""
    x, y = mb
    e_out = params.get("E_out", params["E"])
    h = jp.mark_stage_end(jnp.tanh(x @ params["E"]))
    for w in params["W"][:-1]:
        h = jp.mark_stage_end(jnp.tanh(h @ w))
    logits = jp.mark_stage_end(jnp.tanh(h @ params["W"][-1]) @ e_out.T)
    return jnp.mean((logits - y) ** 2), logits


@pytest.mark.parametrize("groups", [2, 4])
def test_tied_embedding_gradients_and_update(groups):
    """A weight read by the first and the last stage (on different groups) gets the sum of
    both stages' gradient contributions: the gradient, the Adam state and the updated
    params match the reference over two steps."""
    vocab = 12
    params = {
        "E": rand(1, (vocab, D), 0.5),
        "W": [rand(2 + s, (D, D), 0.5) for s in range(groups - 1)],
    }
    batch = (rand(20, (N, ROWS, vocab)), rand(21, (N, ROWS, vocab)))
    # The tie matters: dL/dE differs from the input embedding's share alone.
    grad = jax.grad(lambda p: tied_loss(p, jax.tree.map(lambda a: a[0], batch))[0])
    input_share = grad({**params, "E_out": params["E"]})["E"]
    assert not np.allclose(grad(params)["E"], input_share, rtol=1e-3)
    optimizer = optax.adam(1e-2)
    step = optax_step(jp.Std1F1B(groups), optimizer, tied_loss)
    ref_step, pp_step = jax.jit(step), pipelined(step, groups)
    ref = out = (optimizer.init(params), params)
    for _ in range(2):
        ref = ref_step(*ref[:2], batch)
        out = pp_step(*out[:2], batch)
        assert_tree_close(ref, out)


# ----------------------------------------------------------------------------- 4. clipping


@pytest.mark.parametrize("groups", [2, 4])
def test_global_norm_clip_after_the_loop(groups):
    """`clip_by_global_norm` after the loop needs the norm over the gradients of every
    group (a cross-group sum): the Adam moments (which hold the clipped gradients), the
    params and the grads match the reference, and the clip does trigger."""
    optimizer = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    params, batch = mlp_params(groups), make_batch()
    step = optax_step(jp.Std1F1B(groups), optimizer)
    ref, _ = check_against_reference(step, optimizer.init(params), params, batch, groups=groups)
    grads, mu = ref[3], ref[0][1][0].mu
    norm = optax.tree.norm(grads)
    assert norm > 1.0  # well above the 0.1 threshold
    for g, m in zip(grads, mu):  # Adam's first moment after one step: (1 - b1) * clipped
        np.testing.assert_allclose(m, 0.1 * g * (0.1 / norm), rtol=1e-4, atol=ATOL)


# ----------------------------------------------------------------------------- 5. errors


def _compile_error(step: Callable, *args: Any, groups: int = 2) -> str:
    with pytest.raises(jp.CompileError) as info:
        pipelined(step, groups).compile(*args)
    return str(info.value)


def test_compile_error_is_a_value_error():
    """CompileError is a ValueError, so callers can catch either."""
    assert issubclass(jp.CompileError, ValueError)


def test_error_no_treduce():
    """A step without a treduce loop is rejected, saying the function calls no treduce."""

    def step(params, batch):
        return jax.grad(lambda p: mlp_loss(p, (batch[0][0], batch[1][0]))[0])(params)

    msg = _compile_error(step, mlp_params(2), make_batch())
    assert "calls no treduce" in msg


def test_error_two_treduce_loops():
    """Two treduce loops in one step are rejected, naming the count."""
    schedule = jp.Std1F1B(2)

    def step(params, batch):
        grad_fn = partial(jax.value_and_grad(mlp_loss, has_aux=True), params)
        a = jp.treduce(grad_fn, batch, schedule=schedule)
        b = jp.treduce(grad_fn, batch, schedule=schedule)
        return a, b

    msg = _compile_error(step, mlp_params(2), make_batch())
    assert "calls treduce 2 times" in msg


@pytest.mark.parametrize("num_marks", [1, 3])
def test_error_stage_count_differs_from_schedule(num_marks):
    """A body with fewer or more marks than the schedule's num_stages is rejected, naming
    both counts."""
    msg = _compile_error(sgd_step(jp.Std1F1B(2)), mlp_params(num_marks), make_batch())
    assert f"has {num_marks} stage marks" in msg
    assert "schedule has 2 stages" in msg


def test_error_mark_result_not_used():
    """A mark whose returned value is dropped does not reach the last stage: rejected,
    telling the user to use the value mark_stage_end returns."""

    def loss_fn(params, mb):
        x, y = mb
        x = jnp.tanh(x @ params[0])
        jp.mark_stage_end(x)  # the bug: the result is not used
        x = jp.mark_stage_end(jnp.tanh(x @ params[1]))
        return jnp.mean((x - y) ** 2), x

    msg = _compile_error(sgd_step(jp.Std1F1B(2), loss_fn), mlp_params(2), make_batch())
    assert "ending stage 0" in msg
    assert "does not reach" in msg
    assert "x = mark_stage_end(x)" in msg


def test_error_microbatch_count_rejected_by_schedule():
    """Interleaved1F1B(4, 2) runs rounds of equal size, at least mpmd_dim=2 microbatches
    each (one round when n < 4, so 3 is fine): 5 microbatches are rejected, naming the
    count and the schedule's reason."""
    msg = _compile_error(sgd_step(jp.Interleaved1F1B(4, 2)), mlp_params(4), make_batch(5))
    assert "rejects 5 microbatches" in msg
    assert "cannot run 5 microbatches" in msg


def test_error_schedule_mpmd_dim_differs_from_mesh():
    """A schedule built for 4 groups on a 2-group mesh is rejected, naming both."""
    msg = _compile_error(sgd_step(jp.Std1F1B(4)), mlp_params(4), make_batch())
    assert "mpmd_dim=4" in msg
    assert "2 MPMD groups" in msg


# ----------------------------------------------------------------------------- 6. programs


def task_labels(program) -> list[str]:
    return [i.task for i in program.instrs if isinstance(i, Run)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_program_verifies_and_groups_run_only_their_stages(schedule):
    """For every schedule on 2 and 4 groups, the compiled program verifies (no deadlock,
    leak or use after free), every loop task of group g (`F3s1`, fused `F3s1+B1s1`) is of
    a stage s with get_mpmd_idx(s) == g, outer segments (`preg<g>`, `post<l>g<g>`) name
    their own group, each forward runs exactly once per (stage, microbatch), and the
    step's results match the reference."""
    n = 8
    compiled = compile_mlp(schedule, n)
    program = compiled.program()
    verify(program)
    forwards = []
    for g in range(schedule.mpmd_dim):
        for label in task_labels(compiled.program(g)):
            segment = SEGMENT_RE.fullmatch(label)
            if segment:
                assert int(segment[1]) == g, label
                continue
            parts = label.split("+")
            assert all(TASK_RE.fullmatch(p) for p in parts), label
            for kind, m, s in (TASK_RE.fullmatch(p).groups() for p in parts):
                assert schedule.get_mpmd_idx(int(s)) == g, f"{label} on group {g}"
                if kind == "F":
                    forwards.append((int(s), int(m)))
    stages = range(schedule.num_stages)
    assert sorted(forwards) == [(s, m) for s in stages for m in range(n)]
    args = (mlp_params(schedule.num_stages), make_batch(n))
    assert_tree_close(jax.jit(sgd_step(schedule))(*args), compiled(*args))


def is_activation(name: str) -> bool:
    """A per-microbatch value of the loop (not an accumulator, not a microbatch index)."""
    return "@" in name and not name.startswith(("acc", "mb"))


def live_activation_microbatches(program, names: dict[int, str]) -> int:
    """The most microbatches that have an activation buffer live at once on a group."""
    live: set[int] = {b for b, _ in program.inputs if is_activation(names[b])}
    peak = 0
    for instr in program.instrs:
        if isinstance(instr, Run):
            live -= set(instr.donate)
            live |= {b for b in instr.outs if is_activation(names[b])}
        elif isinstance(instr, Free):
            live -= set(instr.bufs)
        elif (received := recv_half(instr)) is not None and is_activation(names[received[0]]):
            live.add(received[0])
        peak = max(peak, len({names[b].rsplit("@", 1)[1] for b in live}))
    return peak


@pytest.mark.parametrize("groups", [2, 4])
def test_1f1b_bounds_live_activations_on_group_0(groups):
    """Activation memory of 1F1B vs GPipe, read off group 0's program (not memory).

    An activation buffer is one holding a per-microbatch value `v<k>@<m>` (accumulators
    `acc<k>@<m>` and microbatch indexes `mb<m>g<g>` excluded). Let K be the number of
    distinct per-microbatch values group 0 ever holds for one microbatch (stage 0's
    saved residuals, its output, the received cotangent). With S groups and 8
    microbatches:
    - Std1F1B(S): activations of at most S microbatches are live at once on group 0
      (exactly S: its S-1 warm-up forwards plus the one in steady state), so the live
      activation buffers never exceed S * K;
    - GPipe(S) runs every forward first: all 8 microbatches are live at once and the live
      buffers exceed S * K, so the bound above is not vacuous.
    """
    n = 8
    one_f_one_b = compile_mlp(jp.Std1F1B(groups), n)
    gpipe = compile_mlp(jp.GPipe(groups), n)
    names = one_f_one_b.plan.buffer_names[0]
    per_mb = {v.rsplit("@", 1)[0] for v in names.values() if is_activation(v)}
    bound = groups * len(per_mb)

    program = one_f_one_b.program(0)
    assert live_activation_microbatches(program, names) == groups
    assert live_buffer_profile(program, names, is_activation) <= bound

    gnames = gpipe.plan.buffer_names[0]
    assert live_activation_microbatches(gpipe.program(0), gnames) == n
    assert live_buffer_profile(gpipe.program(0), gnames, is_activation) > bound


# ----------------------------------------------------------------------------- 7. printing


def test_program_text_is_readable_and_stable():
    """`str(compiled.program(0))` lists `run` instructions with their task labels, and two
    independent compilations of the same step give the same text and hash."""
    schedule = jp.Std1F1B(2)
    args = (mlp_params(2), make_batch())
    first = pipelined(sgd_step(schedule)).compile(*args)
    second = pipelined(sgd_step(schedule)).compile(*args)
    text = str(first.program(0))
    assert text.startswith("group 0\n")
    assert "run " in text
    for label in ("task=F0s0", f"task=F{N - 1}s0", "task=B0s0", f"task=B{N - 1}s0"):
        assert label in text
    assert str(second.program(0)) == text
    assert str(second.program()) == str(first.program())
    assert second.program().hash() == first.program().hash()


# ----------------------------------------------------------------------------- 8. timing


def test_collect_task_times_ms():
    """Inside `collect_task_times_ms()` a pipelined step records a positive wall time for
    every loop task of every group (labels like `F0s0`, `B3s0`, and `F3s1+B3s1` for the
    last stage's pair run as one: `Note: back-to-back tasks`), once per call."""
    schedule = jp.Std1F1B(2)
    args = (mlp_params(2), make_batch())
    step = pipelined(sgd_step(schedule))
    step.compile(*args)
    with jp.collect_task_times_ms() as times:
        jax.block_until_ready(step(*args))
    expected = {f"{k}{m}s0" for k in "FB" for m in range(N)}
    expected |= {f"F{m}s1+B{m}s1" for m in range(N)}
    assert expected <= set(times)
    for label in expected:
        assert len(times[label]) == 1
        assert times[label][0] > 0
    with jp.collect_task_times_ms(enabled=False) as disabled:
        step(*args)
    assert disabled is None


# ----------------------------------------------------------------------------- 9. donation


def donated_inputs(compiled: jp.MpmdCompiled) -> set[str]:
    """Names of the step inputs (`in<k>`) donated by some Run, over all groups."""
    out = set()
    for g, names in enumerate(compiled.plan.buffer_names):
        for instr in compiled.program(g).instrs:
            if isinstance(instr, Run):
                out |= {names[b] for b in instr.donate if names[b].startswith("in")}
    return out


def test_donated_params_and_opt_state_match_reference_over_three_steps():
    """With donate_argnums=(0, 1) (opt state, params) three steps feeding each result back
    match the reference; the program donates step-input buffers to Runs, which it does
    not do without donate_argnums."""
    optimizer = optax.adam(1e-2)
    step = optax_step(jp.Std1F1B(2), optimizer)
    params, batch = mlp_params(2), make_batch()
    ref = (optimizer.init(params), params)
    ref_step = jax.jit(step)
    for _ in range(3):
        ref = ref_step(*ref[:2], batch)

    pp_step = pipelined(step, donate_argnums=(0, 1))
    out = (optimizer.init(mlp_params(2)), mlp_params(2))
    compiled = pp_step.compile(*out, batch)
    for _ in range(3):
        out = pp_step(*out[:2], batch)
    assert_tree_close(ref, out)

    assert any(
        instr.donate
        for g in range(2)
        for instr in compiled.program(g).instrs
        if isinstance(instr, Run) and not TASK_RE.match(instr.task)
    )
    assert donated_inputs(compiled)
    plain = pipelined(step).compile(optimizer.init(params), params, batch)
    assert not donated_inputs(plain)


# ----------------------------------------------------------------------------- 10. shardings


@pytest.mark.parametrize(
    "schedule", [jp.Std1F1B(2), jp.Interleaved1F1B(4, 2)], ids=["Std1F1B", "Interleaved1F1B"]
)
def test_params_live_on_their_stage_group(schedule):
    """`compiled.in_shardings` is a pytree like the arguments of MpmdShardings: the weight
    of stage s (and its Adam moments) lives on get_mpmd_idx(s); the inputs on stage 0's
    group, the targets on the last stage's. `out_shardings` and the returned arrays put
    each updated weight and moment on the same group as its input."""
    optimizer = optax.adam(1e-2)
    step = optax_step(schedule, optimizer)
    params, batch = mlp_params(schedule.num_stages), make_batch()
    opt_state = optimizer.init(params)
    compiled = pipelined(step).compile(opt_state, params, batch)

    ins, kw_ins = compiled.in_shardings  # (args, kwargs), as jax.jit's compiled objects
    assert kw_ins == {}
    assert jax.tree.structure(ins) == jax.tree.structure((opt_state, params, batch))
    assert all(isinstance(s, jp.MpmdSharding) for s in jax.tree.leaves(ins))
    groups = [schedule.get_mpmd_idx(s) for s in range(schedule.num_stages)]
    assert len(set(groups)) == 2
    adam_in, adam_out = ins[0][0], compiled.out_shardings[0][0]
    out = compiled(opt_state, params, batch)
    for s, g in enumerate(groups):
        assert ins[1][s].mesh_ids == (g,), f"param of stage {s}"
        assert adam_in.mu[s].mesh_ids == (g,) and adam_in.nu[s].mesh_ids == (g,)
        assert compiled.out_shardings[1][s].mesh_ids == (g,)
        assert adam_out.mu[s].mesh_ids == (g,) and adam_out.nu[s].mesh_ids == (g,)
        assert out[1][s].mpmd_idxs == {g}
        assert out[0][0].mu[s].mpmd_idxs == {g}
    assert ins[2][0].mesh_ids == (groups[0],)
    assert ins[2][1].mesh_ids == (groups[-1],)
    assert_tree_close(jax.jit(step)(opt_state, params, batch), out)


# --------------------------------------------------------------- compile cache and lifetime


def test_feeding_outputs_back_reuses_the_compiled_step():
    """A training loop passes the step's MpmdArray results back in: the second call has
    the same signature as the first (plain arrays) and compiles nothing new."""
    step = pipelined(sgd_step(jp.Std1F1B(2)))
    params, batch = mlp_params(2), make_batch()
    first = step.compile(params, batch)
    new_params, _, _ = step(params, batch)
    assert all(isinstance(p, jp.MpmdArray) for p in new_params)
    assert step.compile(new_params, batch) is first


def test_a_dropped_compiled_step_is_freed():
    """Nothing global keeps a compiled step (and its loaded executables) alive."""
    step = pipelined(sgd_step(jp.Std1F1B(2)))
    compiled = step.compile(mlp_params(2), make_batch())
    compiled(mlp_params(2), make_batch())
    ref = weakref.ref(compiled)
    del compiled, step
    gc.collect()
    assert ref() is None
