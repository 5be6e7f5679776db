"""The program cache: entries equal fresh lowerings; damaged or stale ones are rebuilt."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os

import jax
import models
import pytest

import jaxpp_mpi as jp
from jaxpp_mpi._src.compiler import program_cache
from jaxpp_mpi._src.compiler.build import build_step
from jaxpp_mpi._src.compiler.lower import build_program_with_names
from jaxpp_mpi._src.compiler.program_cache import ProgramCache, graph_key, lower_cached
from jaxpp_mpi._src.compiler.task_graph import TaskGraph, TaskNode
from jaxpp_mpi._src.ir.program import (
    AllReduce,
    Aval,
    Free,
    GroupProgram,
    Program,
    Recv,
    Run,
    Send,
    SendRecv,
)
from jaxpp_mpi.schedules import Interleaved1F1B, Std1F1B

ACT = Aval((4, 8), "float32")


def one_f_one_b_graph(num_stages: int, num_microbatches: int) -> TaskGraph:
    """A 1F1B training step: FWD(s, m) -> act, res; BWD(s, m) takes res and the next
    stage's gradient, donates res and gives this stage's gradient."""
    S, M = num_stages, num_microbatches
    tasks = []
    for s in range(S):
        warmup = min(S - 1 - s, M)
        order = [("F", m) for m in range(warmup)]
        for m in range(M - warmup):
            order += [("F", warmup + m), ("B", m)]
        order += [("B", m) for m in range(M - warmup, M)]
        ts = []
        for kind, m in order:
            if kind == "F":
                x = f"x@{m}" if s == 0 else f"act{s - 1}@{m}"
                outs = ((f"act{s}@{m}",) if s < S - 1 else ()) + (f"res{s}@{m}",)
                ts.append(TaskNode(f"F{m}s{s}", s, f"fwd{s}", (x,), outs))
            else:
                ins = (f"res{s}@{m}",) + ((f"grad{s + 1}@{m}",) if s < S - 1 else ())
                outs = (f"grad{s}@{m}",)
                ts.append(TaskNode(f"B{m}s{s}", s, f"bwd{s}", ins, outs, donate=ins[:1]))
        tasks.append(ts)
    inputs = [(f"x@{m}", 0, m) for m in range(M)]
    outputs = [(f"grad0@{m}", m) for m in range(M)]
    values = {v for ts in tasks for t in ts for v in t.outs} | {v for v, _, _ in inputs}
    return TaskGraph(S, tasks, inputs, outputs, {v: ACT for v in values})


def test_entry_equals_a_fresh_lowering(tmp_path):
    graph = one_f_one_b_graph(3, 6)
    cache = ProgramCache(str(tmp_path))
    first, names, hit = lower_cached(graph, None, "blocking", cache)
    assert not hit
    again, again_names, hit = lower_cached(graph, None, "blocking", cache)
    assert hit
    fresh, fresh_names = build_program_with_names(graph)
    assert again == fresh == first and str(again) == str(fresh)
    assert again_names == fresh_names == names


def test_key_covers_graph_times_and_sends():
    graph = one_f_one_b_graph(3, 6)
    keys = {
        graph_key(graph, None, "blocking"),
        graph_key(graph, None, "posted"),
        graph_key(graph, {"F0s0": 1.0}, "blocking"),
        graph_key(one_f_one_b_graph(3, 7), None, "blocking"),
        graph_key(one_f_one_b_graph(4, 6), None, "blocking"),
    }
    assert len(keys) == 5
    assert graph_key(one_f_one_b_graph(3, 6), None, "blocking") == graph_key(
        graph, None, "blocking")


def _damage_flip(data: bytes) -> bytes:
    i = len(data) - 10
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]


def _damage_header(field: str, value):
    def damage(data: bytes) -> bytes:
        line, _, body = data.partition(b"\n")
        header = json.loads(line)
        header[field] = value
        return json.dumps(header).encode() + b"\n" + body
    return damage


@pytest.mark.parametrize("damage", [
    _damage_flip,
    lambda data: data[: len(data) // 2],
    lambda data: b"",
    lambda data: b"not json\n" + data,
    _damage_header("version", "0.0.0-old"),
    _damage_header("format", "jaxpp_mpi-program-0"),
    _damage_header("key", "0" * 64),
], ids=["flipped", "cut", "empty", "header", "version", "format", "key"])
def test_damaged_or_stale_entry_is_rebuilt(tmp_path, damage):
    graph = one_f_one_b_graph(3, 5)
    cache = ProgramCache(str(tmp_path))
    program, names, _ = lower_cached(graph, None, "blocking", cache)
    key = graph_key(graph, None, "blocking")
    path = cache.path(key)
    with open(path, "rb") as f:
        good = f.read()
    with open(path, "wb") as f:
        f.write(damage(good))
    assert cache.load(key) is None
    rebuilt, rebuilt_names, hit = lower_cached(graph, None, "blocking", cache)
    assert not hit and rebuilt == program and rebuilt_names == names
    with open(path, "rb") as f:
        assert f.read() == good  # the rebuilt entry replaced the damaged one
    assert cache.load(key) is not None


def _store(directory: str, num_microbatches: int) -> None:
    graph = one_f_one_b_graph(4, num_microbatches)
    cache = ProgramCache(directory)
    program, names = build_program_with_names(graph)
    for _ in range(5):
        cache.store(graph_key(graph, None, "blocking"), program, names)


def test_writers_of_one_entry_at_once_leave_a_whole_entry(tmp_path):
    ctx = multiprocessing.get_context("spawn")  # no fork of a process running JAX
    procs = [ctx.Process(target=_store, args=(str(tmp_path), 40)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    graph = one_f_one_b_graph(4, 40)
    loaded = ProgramCache(str(tmp_path)).load(graph_key(graph, None, "blocking"))
    assert loaded is not None and loaded[0] == build_program_with_names(graph)[0]
    assert [f for f in os.listdir(tmp_path) if f.endswith(".tmp")] == []


def test_unwritable_directory_is_no_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = ProgramCache(str(blocker / "sub"))  # a directory under a file: cannot exist
    graph = one_f_one_b_graph(2, 2)
    program, _, hit = lower_cached(graph, None, "blocking", cache)
    assert not hit and program == build_program_with_names(graph)[0]


@pytest.mark.parametrize("schedule, groups", [(Std1F1B(2), 2), (Interleaved1F1B(4, 2), 2)],
                         ids=["1f1b", "interleaved"])
def test_step_plan_from_the_cache_equals_a_fresh_one(tmp_path, schedule, groups):
    params, batch, loss_fn = models.mlp(schedule.num_stages, 4, width=4, rows=2)
    step, optimizer = models.make_step(loss_fn, schedule)
    mesh = jp.MpmdMesh(jax.make_mesh((groups, 1), ("stage", "data")), "stage")
    args = (optimizer.init(params), params, batch)
    cache = ProgramCache(str(tmp_path))
    plans = [build_step(step, args, groups, mesh=mesh, program_cache=c)
             for c in (None, cache, cache)]
    assert [p.program_from_cache for p in plans] == [False, False, True]
    assert plans[2].program == plans[0].program and plans[2].buffer_names == plans[0].buffer_names
    assert str(plans[2].program) == str(plans[0].program)


def test_source_digest_is_stable():
    assert program_cache.source_digest() == program_cache.source_digest()
    assert len(program_cache.source_digest()) == 64


def every_instruction_program() -> Program:
    """Two groups using every instruction type, specs and an empty task label."""
    a, b = Aval((4, 8), "float32", ("data",)), Aval((), "int32")
    g0 = GroupProgram(0, {0: 0, 1: 2}, [
        Run("f0", (0, 1), (2, 3), "F0s0", donate=(1,)),
        Send(2, 1, 0),
        SendRecv(3, 1, 1, 4, 1, 0, a),
        AllReduce((4,), "max"),
        Free((0, 2, 3)),
    ], {4: 0}, {0: a, 1: b, 2: a, 3: a, 4: a})
    g1 = GroupProgram(1, (), [
        Recv(0, 0, 0, a),
        Recv(2, 0, 1, a),
        Run("post", (0, 2), (3,)),
        Free((0, 2)),
    ], {3: 1}, {0: a, 2: a, 3: Aval((2,), "bfloat16", ((("data", "model")),))})
    return Program((g0, g1))


def test_compact_form_round_trips_every_instruction():
    program = every_instruction_program()
    names = ({0: "in0", 1: "in2"}, {3: "x"})
    data = program_cache._encode("k", program, names)
    back, back_names, plan, _ = program_cache._decode(data, "k")
    assert back == program and str(back) == str(program) and back_names == names
    assert plan is None


def _rechecksummed(line: bytes, body: bytes) -> bytes:
    header = json.loads(line)
    header.update(sha256=hashlib.sha256(body).hexdigest(), length=len(body))
    return json.dumps(header).encode() + b"\n" + body


@pytest.mark.parametrize("edit", [
    lambda doc: doc["program"]["groups"][0][3].append([9, 1]),
    lambda doc: doc["program"]["groups"][0][3].append([1, 2]),
    lambda doc: doc["program"]["groups"][0][3][0].__setitem__(2, ["%0"]),
    lambda doc: doc["program"]["words"].__setitem__(0, "two words"),
    lambda doc: doc.__setitem__("avals", ["float32[x]"]),
    lambda doc: doc["program"].pop("groups"),
], ids=["code", "fields", "buffer", "name", "aval", "missing"])
def test_malformed_body_with_a_good_checksum_is_ignored(tmp_path, edit):
    cache = ProgramCache(str(tmp_path))
    cache.store("k", every_instruction_program(), ({}, {}))
    with open(cache.path("k"), "rb") as f:
        line, _, body = f.read().partition(b"\n")
    doc = json.loads(body)
    edit(doc)
    with open(cache.path("k"), "wb") as f:
        f.write(_rechecksummed(line, json.dumps(doc).encode()))
    assert cache.load("k") is None
